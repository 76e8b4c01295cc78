"""Hugging Face ``transformers`` models: their own weight initialisation, module by module.

Imported only for a model whose class derives from ``transformers.PreTrainedModel``
(:mod:`protrain_fx.integrations.model_init` checks that ``transformers`` is already imported).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import PreTrainedModel


def module_initializer(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """``init(module)`` running ``_init_weights(module)`` of the pre-trained model nearest above
    ``module`` in ``model`` (what ``post_init`` / ``initialize_weights`` dispatch to, composite
    models included: a vision tower keeps its own rule); ``None`` when ``model`` holds no
    ``PreTrainedModel``. ``_init_weights`` writes parameters with ``transformers.initialization``'s
    functions and recomputes rotary ``inv_freq`` buffers from the config."""
    owners = {id(m): m for m in model.modules() if isinstance(m, PreTrainedModel)}
    if not owners:
        return None
    owner_of: dict[int, PreTrainedModel] = {}

    def walk(module: nn.Module, owner: PreTrainedModel | None) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if owner is not None:
            owner_of[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)

    def init(module: nn.Module) -> None:
        owner = owner_of.get(id(module))
        if owner is None:
            raise ValueError(
                f"offload(init='model'): {type(module).__name__} is not inside a transformers PreTrainedModel; "
                "give init=fn"
            )
        owner._init_weights(module)

    return init
