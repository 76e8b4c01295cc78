"""The model's own initialisation as ``offload``'s ``init(name, tensor)``, and its ``meta`` buffers.

A model built on the ``meta`` device holds no values. ``offload(model, optimizer, init="model")``
materialises each parameter where the chunk store (or, for a persistent one, the device) keeps it,
with the initialisation the model itself would have run:

* a Hugging Face ``PreTrainedModel`` (``transformers`` already imported by whoever built it;
  :mod:`protrain_fx.integrations.hf`): ``_init_weights(module)`` of the nearest enclosing
  pre-trained model, the function ``post_init`` applies to every module;
* any other ``nn.Module``: the owning module's ``reset_parameters()`` (PyTorch's convention for
  modules built on ``meta`` and materialised with ``to_empty``).

Per parameter: the owning module's parameter is replaced, for the call, by one viewing the
target tensor, so the initialiser writes into the chunk; the module's other parameters stay on
``meta``, where an initialiser's writes cost nothing. A parameter the initialiser leaves unwritten
is refused by name, as is a module with no initialiser. Each parameter is drawn on the CPU from its
own random stream, seeded by its name and one number drawn from the caller's generator when
:func:`model_init` is called: its values do not depend on where the backend places it (host chunk
or device) nor on the order the chunks are filled in, so a model offloaded under two budgets
starts from the same weights.

Buffers: every ``meta`` buffer becomes a tensor on the device and the owning module's initialiser
runs on it (Hugging Face's rotary embeddings recompute ``inv_freq`` from the config there); one
left unwritten is refused by name.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable

import torch
from torch import nn

ModuleInit = Callable[[nn.Module], None]


def model_init(model: nn.Module, device: torch.device | str) -> Callable[[str, torch.Tensor], None]:
    """``init(name, tensor)`` filling ``tensor`` as ``model``'s own initialisation fills parameter
    ``name``, for ``offload(..., init=...)``; ``model``'s ``meta`` buffers are materialised on
    ``device`` first (module docstring)."""
    initializer = _initializer(model)
    materialize_buffers(model, torch.device(device), initializer)
    base = int(torch.randint(0, 2**62, (1,)).item())  # the caller's seed decides every parameter's values

    def init(name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        original = module._parameters[attr]
        target = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        stand_in = nn.Parameter(target, requires_grad=False)  # views target: the initialiser writes into it
        if target.is_floating_point():
            target.fill_(float("nan"))
        module._parameters[attr] = stand_in
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed((base + zlib.crc32(name.encode())) % 2**63)
                initializer(module)
            written = module._parameters[attr]
        finally:
            module._parameters[attr] = original
        if written is not stand_in:  # the initialiser assigned a new tensor rather than writing in place
            target.copy_(written.detach())
        if target is not tensor:
            tensor.copy_(target)
        if _unwritten(target):
            raise ValueError(
                f"offload(init='model'): the initialisation of {type(module).__name__} ({module_name or 'the model'}) "
                f"leaves parameter {name!r} unset; give init=fn, fn(name, tensor) filling it in place"
            )

    return init


def materialize_buffers(model: nn.Module, device: torch.device, initializer: ModuleInit | None = None) -> list[str]:
    """Every ``meta`` buffer of ``model`` as a tensor on ``device``, filled by its module's
    initialiser (``initializer(module)``, default the model's own: module docstring); returns
    their names. Persistence flags stay as they were."""
    initializer = initializer or _initializer(model)
    done = []
    for module_name, module in model.named_modules():
        names = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not names:
            continue
        for n in names:
            b = module._buffers[n]
            fresh = torch.empty(b.shape, dtype=b.dtype, device=device)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))
            module._buffers[n] = fresh
        full = [f"{module_name}.{n}" if module_name else n for n in names]
        why = None
        try:
            with torch.no_grad():
                initializer(module)
        except ValueError as e:  # no initialiser: named for the buffer
            why = e
        for n, name in zip(names, full):
            b = module._buffers[n]
            if why is not None or b is None or b.is_meta or (b.is_floating_point() and _unwritten(b)):
                raise ValueError(
                    f"offload(init='model'): buffer {name!r} is on the meta device and the initialisation of "
                    f"{type(module).__name__} does not recompute it; materialise it before offload"
                ) from why
            done.append(name)
    return done


def _initializer(model: nn.Module) -> ModuleInit:
    """The model's own per-module initialiser (module docstring)."""
    if "transformers" in sys.modules:  # a Hugging Face model needs transformers imported to exist
        import protrain_fx.integrations.hf as hf  # (imports transformers)

        found = hf.module_initializer(model)
        if found is not None:
            return found
    return _reset_parameters


def _reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"offload(init='model'): {type(module).__name__} has no reset_parameters() to initialise its "
            "parameters and buffers with; give init=fn, fn(name, tensor) filling one parameter in place"
        )
    reset()


def _unwritten(t: torch.Tensor) -> bool:
    """Every element still NaN, as :func:`model_init` pre-fills: nothing was written."""
    return t.numel() > 0 and t.is_floating_point() and bool(torch.isnan(t).all())
