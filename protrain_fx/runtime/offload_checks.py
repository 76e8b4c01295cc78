"""What :func:`~protrain_fx.runtime.offload.offload` refuses, before anything moves.

Every setting and model state that offloading cannot serve is refused here with a ``ValueError``
(or the optimizer's own refusal) naming the option and the way out, so that a refused call leaves
the model and optimizer as they were. Nothing here allocates or changes the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from protrain_fx.chunks import ChunkLayout
from protrain_fx.config import parse_bytes
from protrain_fx.runtime.cpu_adam import check_optimizer
from protrain_fx.runtime.shells import check_not_offloaded

#: ``offload(..., n_persist=AUTO, n_buffer=AUTO)``: the backend chooses the counts.
AUTO = "auto"


def checked_settings(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
    counts: tuple[Any, Any, Any], compute_dtype: torch.dtype | None, grad_clipping: Any, init: Any,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Refuse what :func:`offload` cannot do, before anything is changed; the model's parameters by
    name and ``init`` resolved (``"model"``: the model's own initialisation, from ``integrations``)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("offload: device='cuda' but this machine has no CUDA device (use device='cpu' to try it)")
    if init == "model":  # the model's own initialisation; its meta buffers recomputed on the device
        from protrain_fx.integrations import model_init

        init = model_init(model, device)
    named = dict(model.named_parameters(remove_duplicate=False))
    if not named:
        raise ValueError("offload: the model has no parameters")
    check_not_offloaded(named)
    check_optimizer(optimizer)  # the backend may offload any chunk: they are stepped by ChunkAdamW
    if compute_dtype == torch.float16:
        raise ValueError(
            "offload: compute_dtype=torch.float16 needs loss scaling (GradScaler), whose unscaling does not reach "
            "the offloaded chunks' gradients (they are stepped from the chunk store, not from .grad); use "
            "compute_dtype=torch.bfloat16"
        )
    if grad_clipping not in (None, True, False):
        raise ValueError(f"offload: grad_clipping must be None (learned at the first step), True or False, "
                         f"got {grad_clipping!r}")
    on_meta = [n for n, p in named.items() if p.is_meta]
    if on_meta and init is None:
        raise ValueError(
            f"offload: {len(on_meta)} parameters (e.g. {on_meta[0]!r}) are on the meta device; give "
            "init=fn, fn(name, tensor) filling tensor in place, or init='model' (the model's own "
            "initialisation), to materialise them straight into chunks"
        )
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(
            f"offload: buffer {meta_buffers[0]!r} is on the meta device; materialise buffers before "
            "offload (only parameters are materialised into chunks), or give init='model'"
        )
    n_persist, n_buffer, n_gpu_optim = counts
    for name, value in (("n_persist", n_persist), ("n_buffer", n_buffer), ("n_gpu_optim", n_gpu_optim)):
        if value not in (AUTO, None) and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
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
    return named, init


def checked_sizes(chunk_bytes: Any, n_lean: Any, grad_pool: Any) -> int | None:
    """Refuse a chunk size, lean count or landing pool that cannot be served; the chunk size in bytes
    (``None``: chosen from the model), read like ``memory_budget`` (``67108864``, ``"64MiB"``)."""
    if n_lean != AUTO and (isinstance(n_lean, bool) or not isinstance(n_lean, int) or n_lean < 0):
        raise ValueError(f"offload: n_lean must be 'auto' or a count of chunks (an int >= 0), got {n_lean!r}")
    if isinstance(grad_pool, bool) or not isinstance(grad_pool, int) or grad_pool < 1:
        raise ValueError(f"offload: grad_pool must be at least 1, got {grad_pool!r} (the host buffers a lean chunk's "
                         "gradient lands in)")
    return None if chunk_bytes is None else parse_bytes(chunk_bytes, option="chunk_bytes")


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
