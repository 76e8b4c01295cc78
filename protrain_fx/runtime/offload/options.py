"""The settings of :func:`protrain_fx.offload` as one object, and what offloading refuses, before
anything moves.

:class:`OffloadOptions` holds ``offload()``'s keywords, each refused when made if it cannot be
served (a ``ValueError`` naming the option and the way out). :func:`checked_model` refuses what the
model and optimizer cannot be; a refused call leaves both as they were. Nothing here allocates or
changes the model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from protrain_fx.chunks import ChunkLayout
from protrain_fx.config import is_count, parse_bytes
from protrain_fx.runtime.store.chunk_store import GRAD_POOL
from protrain_fx.runtime.optim.cpu_adam import check_optimizer
from protrain_fx.runtime.offload.shells import check_not_offloaded

#: ``offload(..., n_persist=AUTO, n_buffer=AUTO)``: the backend chooses the counts.
AUTO = "auto"


@dataclass(frozen=True)
class OffloadOptions:
    """``protrain_fx.offload``'s keywords (each documented there), checked when made: ``device`` a
    ``torch.device``, ``chunk_bytes`` bytes or ``None``. What depends on the machine (a CUDA device
    present, the process group) is checked by the handle; ``init="model"`` is resolved there by the
    function the caller hands it (``protrain_fx/api.py``: the integrations' ``model_init``)."""

    n_persist: int | Literal["auto"] = AUTO
    n_buffer: int | Literal["auto"] = AUTO
    device: torch.device | str = "cuda"
    chunk_bytes: int | str | None = None
    compute_dtype: torch.dtype | None = None
    available_host_bytes: int | None = None
    init: Callable[[str, torch.Tensor], None] | Literal["model"] | None = None
    n_gpu_optim: int | Literal["auto"] | None = None
    n_lean: int | Literal["auto"] = AUTO
    grad_pool: int = GRAD_POOL
    grad_clipping: bool | None = None
    n_spill: int | Literal["auto"] = AUTO
    spill_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        _check_counts(self.n_persist, self.n_buffer, self.n_gpu_optim)
        if self.compute_dtype == torch.float16:
            raise ValueError(
                "offload: compute_dtype=torch.float16 needs loss scaling (GradScaler), whose unscaling does not reach "
                "the offloaded chunks' gradients (they are stepped from the chunk store, not from .grad); use "
                "compute_dtype=torch.bfloat16"
            )
        if self.grad_clipping not in (None, True, False):
            raise ValueError(f"offload: grad_clipping must be None (learned at the first step), True or False, "
                             f"got {self.grad_clipping!r}")
        if self.init is not None and self.init != "model" and not callable(self.init):
            raise ValueError(f"offload: init must be fn(name, tensor), 'model' or None, got {self.init!r}")
        n_lean = self.n_lean
        if n_lean != AUTO and not is_count(n_lean):
            raise ValueError(f"offload: n_lean must be 'auto' or a count of chunks (an int >= 0), got {n_lean!r}")
        if self.n_spill != AUTO and not is_count(self.n_spill):
            raise ValueError(f"offload: n_spill must be 'auto' or a count of chunks (an int >= 0), got {self.n_spill!r}")
        if self.spill_dir is not None and not isinstance(self.spill_dir, (str, os.PathLike)):
            raise ValueError(f"offload: spill_dir must be a folder's path, got {self.spill_dir!r}")
        grad_pool = self.grad_pool
        if not is_count(grad_pool, 1):
            raise ValueError(f"offload: grad_pool must be at least 1, got {grad_pool!r} (the host buffers a lean "
                             "chunk's gradient lands in)")
        if self.chunk_bytes is not None:
            object.__setattr__(self, "chunk_bytes", parse_bytes(self.chunk_bytes, option="chunk_bytes"))

    @property
    def automatic(self) -> bool:
        """The backend chooses the counts (``n_persist`` and ``n_buffer`` left out)."""
        return self.n_persist == AUTO

    def replace(self, **changes: Any) -> OffloadOptions:
        return dataclasses.replace(self, **changes)


def _check_counts(n_persist: Any, n_buffer: Any, n_gpu_optim: Any) -> None:
    for name, value in (("n_persist", n_persist), ("n_buffer", n_buffer), ("n_gpu_optim", n_gpu_optim)):
        if value not in (AUTO, None) and not is_count(value):
            raise ValueError(f"offload: {name} must be a count (an int >= 0) or 'auto', got {value!r}")
    auto = [c == AUTO for c in (n_persist, n_buffer)]
    if any(auto) and not all(auto):
        raise ValueError(
            f"offload: n_persist and n_buffer are chosen together: give both, or neither (\"auto\": chosen "
            f"by the backend for its memory_budget); got n_persist={n_persist!r}, n_buffer={n_buffer!r}"
        )
    if all(auto) and n_gpu_optim not in (None, AUTO):
        raise ValueError(
            f"offload: n_gpu_optim={n_gpu_optim!r} with automatic n_persist and n_buffer; the backend "
            "chooses it with them (leave it out), or give all three"
        )
    if not all(auto) and n_gpu_optim == AUTO:
        raise ValueError("offload: n_gpu_optim='auto' needs n_persist and n_buffer 'auto' too")


def check_device_present(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("offload: device='cuda' but this machine has no CUDA device (use device='cpu' to try it)")


def checked_model(model: nn.Module, optimizer: torch.optim.Optimizer, options: OffloadOptions,
                  ) -> dict[str, torch.Tensor]:
    """Refuse a model or optimizer that offloading cannot serve, before anything is changed; the
    model's parameters by name."""
    named = dict(model.named_parameters(remove_duplicate=False))
    if not named:
        raise ValueError("offload: the model has no parameters")
    check_not_offloaded(named)
    check_optimizer(optimizer)  # the backend may offload any chunk: they are stepped by ChunkAdamW
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in owned for p in named.values()):
        raise ValueError("offload: the optimizer holds none of the model's parameters (an optimizer of another "
                         "model, or of this one before it was rebuilt); give offload the optimizer that steps them")
    on_meta = [n for n, p in named.items() if p.is_meta]
    if on_meta and options.init is None:
        raise ValueError(
            f"offload: {len(on_meta)} parameters (e.g. {on_meta[0]!r}) are on the meta device; give "
            "init=fn, fn(name, tensor) filling tensor in place, or init='model' (the model's own "
            "initialisation), to materialise them straight into chunks"
        )
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:  # (init="model" has materialised them by now: OffloadHandle resolves it first)
        raise ValueError(
            f"offload: buffer {meta_buffers[0]!r} is on the meta device; materialise buffers before "
            "offload (only parameters are materialised into chunks), or give init='model'"
        )
    return named


def check_hand_counts(layout: ChunkLayout, n_persist: int) -> None:
    """Refuse counts by hand that offload nothing (a model smaller than its chunks)."""
    n_chunks = len(layout.chunks)
    if n_persist == n_chunks:
        raise ValueError(
            f"offload: n_persist={n_persist} keeps all {n_chunks} chunk(s) of this model on the device "
            f"({sum(c.used_bytes for c in layout.chunks) / 2**20:.1f} MiB of parameters in chunks of "
            f"{layout.chunk_bytes / 2**20:.1f} MiB): nothing would be offloaded. Leave n_persist / "
            "n_buffer out (the backend chooses them for its memory budget), give a smaller chunk_bytes, or "
            "train without protrain_fx.offload"
        )
