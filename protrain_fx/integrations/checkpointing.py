"""A model library's own activation checkpointing, turned off where the backend plans recompute.

Hugging Face models checkpoint their layers with ``torch.utils.checkpoint`` once
``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in newer releases,
and the Trainer's ``gradient_checkpointing`` / ``activation_checkpointing`` arguments) has set each
layer's ``gradient_checkpointing`` flag. Under the backend that is recompute of every layer decided
before the budget is known, and in releases whose layers record their outputs in a context variable
inside the checkpointed function Dynamo cannot trace it at all: every layer's checkpoint breaks the
graph inside the layer loop, and the frame holding the loop runs eagerly, outside any plan. The
backend checkpoints (or swaps) blocks itself when the budget needs it, with the same gradients, so
the library's own checkpointing is switched off, with a warning saying so.

Duck-typed (the ``gradient_checkpointing`` flag and the model's disable method): nothing here
imports ``transformers``.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("protrain_fx")

#: The library's methods that turn its checkpointing off, newest name first.
_DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable")


def library_checkpointing_off(model: nn.Module, why: str) -> bool:
    """Turn off the library activation checkpointing of ``model`` (module docstring); ``True`` when
    it was on. ``why`` names the caller in the warning (``"offload"``, ``"ProTrainTrainer"``)."""
    if not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return False
    owners = [m for m in model.modules() if any(callable(getattr(m, name, None)) for name in _DISABLE)]
    for owner in owners:
        disable = next(getattr(owner, name) for name in _DISABLE if callable(getattr(owner, name, None)))
        disable()
    for m in model.modules():  # a layer whose owner has no disable method (or one that left it on)
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False
    log.warning(
        "protrain_fx (%s): the model's own activation checkpointing (gradient_checkpointing_enable) is turned "
        "off: the backend checkpoints or swaps blocks itself when the memory budget needs it, with the "
        "same gradients", why,
    )
    return True
