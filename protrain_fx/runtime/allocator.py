"""The CUDA caching allocator's mode: expandable segments, so that reserved memory follows allocated.

A plan fits the budget by its *allocated* peak, with ``planner.budget.ALLOCATOR_HEADROOM`` for what
the caching allocator reserves beyond it. An offloaded step allocates and frees chunk-sized blocks
(fetch buffers, gradient staging, the device optimizer's slices) on several streams; in the
allocator's default mode each large block gets a segment of its own size, a freed one can only be
split, and reserved memory runs far above allocated until a chunk-sized request finds no block and
the capped process runs out of memory with gigabytes reserved but free
(``docs/results.md#allocator-headroom``). With expandable segments the allocator maps one growing
segment per stream and frees coalesce, which is PyTorch's own remedy for this fragmentation.

The backend and :func:`~protrain_fx.runtime.offload.handle.offload` switch it on for CUDA work, once per
process, unless the user chose the allocator's configuration (``PYTORCH_CUDA_ALLOC_CONF`` or
``PYTORCH_ALLOC_CONF`` naming ``expandable_segments``): an explicit choice is kept. Segments made
before the switch stay as they are; later ones expand.
"""

from __future__ import annotations

import logging

import torch

from protrain_fx import settings

log = logging.getLogger("protrain_fx")

#: The environment variables through which PyTorch reads the allocator's configuration.
ALLOC_CONF_VARS = settings.ALLOC_CONF

#: Process-wide, as the allocator setting it records: ``state.reset()`` leaves it, the allocator stays switched.
_switched = False


def user_chose_segments() -> bool:
    """Whether the environment already says ``expandable_segments`` (either way)."""
    return "expandable_segments" in settings.allocator_conf()


def expandable_segments(device: torch.device | str | None) -> bool:
    """Switch the caching allocator to expandable segments when ``device`` is CUDA; returns whether
    this call switched it (``False`` for CPU, a user's own choice, or when already switched)."""
    global _switched
    if device is None or torch.device(device).type != "cuda" or _switched or user_chose_segments():
        return False
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    _switched = True
    log.info(
        "protrain_fx: CUDA caching allocator set to expandable segments (fragmentation would eat the budget's "
        "headroom); set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False to keep the default"
    )
    return True
