"""A Hugging Face model whose loss type is unset gets the loss it falls back to, named.

``PreTrainedModel.loss_function`` reads ``model.loss_type``, set at construction from the class
name (``LlamaForCausalLM`` -> ``"ForCausalLM"``). Some classes' names match no loss
(``GPT2LMHeadModel``, ``OpenAIGPTLMHeadModel``, ``CTRLLMHeadModel``): their ``loss_type`` is
``None``, and each call logs "loss_type=None ... Using the default loss: ForCausalLMLoss" with
``logger.warning_once``. Dynamo cannot trace a logging call: the graph breaks between the logits and
the loss, so the loss is computed in a second graph and the first hands its logits back, planned
as a loss outside the model (``planner/reserve.py``). Setting ``loss_type = "ForCausalLM"`` selects
the same loss without the warning, and the whole step is one graph.

Duck-typed (a ``loss_type`` attribute of ``None`` and a ``loss_function`` property on the class):
nothing here imports ``transformers``.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("protrain_fx")

#: The loss ``PreTrainedModel.loss_function`` uses when ``loss_type`` names none.
DEFAULT_LOSS_TYPE = "ForCausalLM"


def name_default_loss_type(model: nn.Module) -> list[str]:
    """Set ``loss_type`` to :data:`DEFAULT_LOSS_TYPE` on every module of ``model`` whose loss type is
    unset (module docstring); returns their names (``""`` for the model itself)."""
    named = []
    for name, module in model.named_modules():
        if not isinstance(getattr(type(module), "loss_function", None), property):
            continue
        if getattr(module, "loss_type", "") is None and "_loss_function" not in vars(module):
            module.loss_type = DEFAULT_LOSS_TYPE
            named.append(name)
    if named:
        log.info("protrain_fx: loss_type=%r set on %s (Hugging Face's fallback for an unset loss type, named so "
                 "that its warning does not break the graph before the loss)", DEFAULT_LOSS_TYPE,
                 ", ".join(n or type(model).__name__ for n in named))
    return named
