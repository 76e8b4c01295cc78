"""Activation swap ops: copy a saved activation to host memory in forward, back in backward.

``protrain::offload(t)`` returns a host copy of ``t`` (pinned memory when ``t`` is on a GPU);
``protrain::reload(host, device)`` returns a copy of ``host`` on ``device``. Both copy synchronously
in this release: correct everywhere, but the copies do not yet overlap compute (the asynchronous
version with copy streams, a pinned buffer pool and a wait op comes with the GPU work of issue 4).
Callers guarantee that ``t`` is contiguous (the copy is returned contiguous).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("protrain::offload", mutates_args=())
def offload(t: torch.Tensor) -> torch.Tensor:
    """Host copy of ``t`` (on the CPU a separate buffer, so swap semantics are testable there)."""
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


@offload.register_fake
def _offload_fake(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


@torch.library.custom_op("protrain::reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy of ``host`` on ``device``."""
    return host.to(device, copy=True)


@reload.register_fake
def _reload_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)
