"""Exact-size page-locked host memory (``runtime/store/pinned.py``): the chunk store's and swap's buffers."""

from __future__ import annotations

import gc

import pytest
import torch

from protrain_fx.runtime.store.pinned import empty_pinned, host_empty

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_without_pinning_it_is_a_plain_tensor_and_pinning_needs_cuda():
    t = host_empty(1000, torch.bfloat16, pinned=False)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and not t.is_pinned()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            empty_pinned(10, torch.float32)


@cuda
def test_page_locked_tensors_are_exact_size_copy_asynchronously_and_unlock_when_dropped():
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    cached = stats().get("reserved_bytes.current", 0)
    numel = (3 << 20) + 5  # 12 MiB + 20 bytes: the caching host allocator would reserve 16 MiB
    for _ in range(3):  # registered, unregistered when dropped, again
        t = empty_pinned(numel, torch.float32)
        assert t.is_pinned() and t.numel() == numel
        assert t.untyped_storage().nbytes() == numel * 4
        t.copy_(torch.arange(numel, dtype=torch.float32))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            d = t.to("cuda", non_blocking=True)
            back = empty_pinned(numel, torch.float32)
            back.copy_(d * 2, non_blocking=True)
        stream.synchronize()
        assert torch.equal(back, t * 2)
        del t, back, d
        gc.collect()
    # nothing went through PyTorch's caching host allocator
    assert stats().get("reserved_bytes.current", 0) == cached
