"""Offloaded parameters as shells: device tensors of their shape and dtype that hold no bytes.

Dynamo traces an offloaded model through its parameters, so each keeps a tensor on the device
with a storage of 0 bytes while its values live in the chunk store. This module holds what makes
shells safe: making them and setting parameters (also ``meta`` ones, swapped in place so that the
optimizer's references stay valid), refusing a model offloaded twice, refusing a call outside
``torch.compile`` (forward pre-hooks on the model and on each module owning parameters), refusing a
cast, move or deep copy of the parameters, and printing a shell without reading memory it does not
have.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.offload import chunk_ops


def set_data(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.data = value``, also for a ``meta`` parameter, whose data cannot be set to a real tensor:
    its contents are swapped instead (the same object, so the optimizer's references stay valid)."""
    if not p.is_meta:
        p.data = value
    elif isinstance(p, nn.Parameter):
        torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
    else:
        torch.utils.swap_tensors(p, value.requires_grad_(p.requires_grad))


def is_shell(p: torch.Tensor, device: torch.device) -> bool:
    """``p`` is on ``device`` with a storage of 0 bytes (a shell, or not yet materialised)."""
    return not p.is_meta and p.device == device and p.untyped_storage().nbytes() == 0


def hollow(t: torch.Tensor) -> bool:
    """``t`` has elements but a storage of 0 bytes: an offloaded parameter's shell, wherever it is."""
    return not t.is_meta and t.numel() > 0 and t.untyped_storage().nbytes() == 0


#: What any op reading or writing a shell's data raises (instead of following its null pointer).
SHELL_ACCESS_ERROR = (
    "protrain_fx: this parameter is offloaded (protrain_fx.offload): its values live in the chunk store, not "
    "in this tensor of 0 bytes. Run the model through torch.compile(model, backend='protrain'); read the values "
    "with model.state_dict() or handle.state_dict(model)"
)


def empty_shell(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor shaped, typed and placed like ``p`` whose storage holds no bytes (for tracing). An op
    that reads or writes its data (``p.norm()``, ``p.clone()``, ``p.mul_(2)``, a kernel of an eager
    fallback) raises :data:`SHELL_ACCESS_ERROR` instead of following the storage's null pointer,
    which crashed the process; shape, dtype, device and storage size stay readable."""
    shell = torch.empty(p.shape, dtype=p.dtype, device=device)
    shell.untyped_storage().resize_(0)
    torch._C._set_storage_data_ptr_access_error_msg(shell.untyped_storage()._cdata, SHELL_ACCESS_ERROR)
    return shell


def check_not_offloaded(named: Mapping[str, torch.Tensor]) -> None:
    """Refuse a model offloaded before: its parameters are shells of 0 bytes (their values are in
    the first handle's chunk store), and copying from them would read no memory."""
    for name, p in named.items():
        if chunk_ops.offloaded(p) is not None or chunk_ops.deferred(p) is not None or hollow(p):
            raise ValueError(
                f"offload: this model is already offloaded (parameter {name!r} holds no values: they live in the "
                "chunk store of an earlier offload(...) call). Keep using the handle that call returned, or build "
                "the model again (and its optimizer) to offload it anew"
            )


def refuse_eager_call(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of an offloaded model: a call outside ``torch.compile`` (whose graphs read
    the chunk buffers) would read parameters of 0 bytes."""
    from torch._dynamo.eval_frame import _is_in_optimized_module

    if torch.compiler.is_compiling() or _is_in_optimized_module():
        return None
    raise UnsupportedError(
        f"protrain_fx: this {type(module).__name__} is offloaded (protrain_fx.offload): its offloaded parameters "
        "hold no values outside the compiled graphs, so it runs only through torch.compile(model, "
        "backend='protrain'); call the compiled module (handle.state_dict(model) gives the values, to load into "
        "a plain copy of the model)"
    )


# Called from eager code (a frame Dynamo gave up on: runtime/offload/eager.py), ``hollow`` must run as
# Python: compiled as a frame of its own from a hook, it made a graph of the module's parameters and
# broke at their storage, and that graph's errors named the wrong cause.
torch._dynamo.eval_frame.skip_code(hollow.__code__)


#: A copy of an offloaded model that holds the values: what a refused cast or deep copy suggests.
_PLAIN_COPY = "plain = type(model)(...); plain.load_state_dict(model.state_dict())"


def guard_shells(module: nn.Module, name: str) -> None:
    """Refuse, naming the way out, what would copy a module's shells and crash the process on the
    bytes they lack: ``.to(dtype or device)``, ``.double()``, ``.half()``, ``.cpu()`` and the like
    (``nn.Module._apply``, checked on every parameter before any is converted, so a refused call
    changes nothing; a conversion that leaves the shells' dtype and device as they are runs),
    ``copy.deepcopy`` and pickling (``torch.save(model)``). Instance attributes of ``module``: they
    stay, as the shells do."""
    original = type(module)._apply.__get__(module)
    what = f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"

    def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        for p in module.parameters(recurse=recurse):
            if hollow(p):
                probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                if probe.dtype != p.dtype or probe.device != p.device:
                    raise UnsupportedError(
                        f"protrain_fx: {what} is offloaded: converting its parameters to {probe.dtype} on "
                        f"{probe.device} would copy shells of 0 bytes (their values live in the chunk store). Cast "
                        "and move the model before protrain_fx.offload(...) (its compute_dtype= sets the dtype the "
                        f"graphs compute in), or convert a plain copy: {_PLAIN_COPY}"
                    )
        return original(fn, recurse)

    def __deepcopy__(memo: dict[int, Any]) -> nn.Module:
        raise UnsupportedError(
            f"protrain_fx: copy.deepcopy of {what}, which is offloaded: its offloaded parameters are shells of 0 "
            f"bytes (their values live in the chunk store); copy it as {_PLAIN_COPY}"
        )

    def __reduce_ex__(protocol: int) -> Any:
        raise UnsupportedError(
            f"protrain_fx: pickling {what} (torch.save(model)), which is offloaded: its offloaded parameters are "
            "shells of 0 bytes (their values live in the chunk store); save torch.save(model.state_dict(), path), "
            "which holds the values, and load it into a plain model"
        )

    module.__dict__["_apply"] = _apply
    module.__dict__["__deepcopy__"] = __deepcopy__
    module.__dict__["__reduce_ex__"] = __reduce_ex__


_TORCH_TENSOR_STR: Callable[..., str] | None = None


def install_shell_repr() -> None:
    """Printing an offloaded parameter (a shell of 0 bytes) shows what it is instead of reading
    memory it does not have (which crashes the process): ``torch._tensor_str._str``, which
    ``Tensor.__repr__`` calls, is wrapped once; every other tensor prints as before."""
    global _TORCH_TENSOR_STR
    if _TORCH_TENSOR_STR is not None:
        return
    from torch import _tensor_str

    original = _TORCH_TENSOR_STR = _tensor_str._str

    @functools.wraps(original)
    def _str(self, *, tensor_contents=None):
        try:
            shell = type(self) in (torch.Tensor, nn.Parameter) and hollow(self)
        except Exception:  # noqa: BLE001 -- tensors without a plain storage print as torch prints them
            shell = False
        if shell:
            return (f"tensor(<no values here: offloaded by protrain_fx, they live in the chunk store; "
                    f"handle.state_dict(model) gives them>, size={tuple(self.shape)}, dtype={self.dtype}, "
                    f"device='{self.device}')")
        return original(self, tensor_contents=tensor_contents)

    _tensor_str._str = _str
