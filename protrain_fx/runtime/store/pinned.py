"""Page-locked host tensors of exactly the size asked for.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
every request up to a power of two (``CachingHostAllocator.h``, torch 2.11) and keeps freed blocks
for reuse. For the chunk store that costs up to a third more host RAM than the store's buffers hold
(chunks of 824 or 919 MB in 1 GiB blocks), and the host RAM is what bounds the largest model
(``docs/results.md#largest-model-that-trains``).

:func:`empty_pinned` maps anonymous memory of the exact size and page-locks it with
``cudaHostRegister``: copies from and to it run asynchronously like from any pinned memory
(``Tensor.is_pinned()`` says True), and when the last tensor using it goes the pages are unlocked
and unmapped.
"""

from __future__ import annotations

import mmap

import torch


class _Mapping(mmap.mmap):
    """Anonymous memory, page-locked while it lives (``__del__`` runs before the unmapping)."""

    registered = 0

    def __del__(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = 0


def empty_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled 1-D host tensor of ``numel`` elements in page-locked memory.

    Needs CUDA. Rounded up to whole pages only (4 KiB), never to a power of two. The pages are
    touched (zeroed) on every intra-op thread before they are page-locked: ``cudaHostRegister``
    would fault them in one by one on the calling thread."""
    if not torch.cuda.is_available():
        raise RuntimeError("page-locked host memory needs a CUDA device")
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, pin_memory=True)
    torch.cuda.init()
    region = _Mapping(-1, nbytes)
    tensor = torch.frombuffer(region, dtype=dtype, count=numel)  # keeps ``region`` alive
    tensor.zero_()  # first touch, in parallel (the mapping reads as zeros already)
    ptr = tensor.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)} ({err})")
    region.registered = ptr
    return tensor


def host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """:func:`empty_pinned` when ``pinned``, else a plain (pageable) ``torch.empty``."""
    return empty_pinned(numel, dtype) if pinned else torch.empty(numel, dtype=dtype)


def host_zeros(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """:func:`empty_pinned` (zeros already) when ``pinned``, else ``torch.zeros``: no second pass
    over page-locked bytes that are zero."""
    return empty_pinned(numel, dtype) if pinned else torch.zeros(numel, dtype=dtype)
