"""GPU test of protrain_fx.inspect.measure: record a small training step, compare with the allocator."""

from __future__ import annotations

import gc

import pytest
import torch

from protrain_fx.inspect.measure import (
    PHASE_NAMES,
    mark_phase,
    marker_nbytes,
    record_memory,
)
from protrain_fx.inspect.snapshot import to_memory_snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = 1024  # 1024 x 1024 fp32 = 4 MiB: whole allocator blocks, so requested == allocated bytes
TOLERANCE = 64 * 1024  # the scalar loss (4 B in a 512 B block) and phase markers (< 3 KiB)


def _step(weights: list[torch.Tensor], x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    mark_phase("forward")
    h = x
    for w in weights:
        h = torch.relu(h @ w)
    loss = h.sum()
    mark_phase("backward")
    loss.backward()
    mark_phase("optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark_phase("end")


def test_measured_peak_matches_allocator() -> None:
    gc.collect()  # garbage of earlier tests must not be freed while recording
    device = torch.device("cuda")
    weights = [torch.randn(N, N, device=device, requires_grad=True) for _ in range(4)]
    x = torch.randn(N, N, device=device)
    opt = torch.optim.SGD(weights, lr=1e-3, momentum=0.9)
    _step(weights, x, opt)  # warm-up: cuBLAS workspace, momentum buffers
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated_before = torch.cuda.memory_allocated()

    with record_memory() as rec:
        _step(weights, x, opt)
        torch.cuda.synchronize()
    max_allocated = torch.cuda.max_memory_allocated()
    timeline = rec.timeline()

    assert rec.marks == ["forward", "backward", "optimizer", "end"]
    assert abs(timeline.baseline_bytes["other"] - allocated_before) <= TOLERANCE
    assert abs(timeline.peak_bytes - max_allocated) <= TOLERANCE
    delta = timeline.peak_bytes - timeline.baseline_bytes["other"]
    assert abs(delta - (max_allocated - allocated_before)) <= TOLERANCE
    assert set(timeline.phase_bounds) == {"forward", "backward", "optimizer"}
    fwd, bwd, opt_bounds = (timeline.phase_bounds[p] for p in ("forward", "backward", "optimizer"))
    assert fwd[1] == bwd[0] and bwd[1] == opt_bounds[0]
    forward_allocs = [
        e for e in timeline.events if e.action == "alloc" and fwd[0] <= e.index < fwd[1]
    ]
    assert len(forward_allocs) >= 4 and all(e.nbytes == 4 * N * N for e in forward_allocs[:4])
    matmul_line = _step.__code__.co_firstlineno + 4  # h = torch.relu(h @ w)
    assert forward_allocs[0].source.endswith(f"test_measure_gpu.py:{matmul_line}")
    markers = {marker_nbytes(p) for p in PHASE_NAMES}
    assert not any(e.nbytes in markers for e in timeline.events)
    assert to_memory_snapshot(timeline)["device_traces"][rec.device_index]


def test_mark_phase_is_free_when_not_recording() -> None:
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    mark_phase("forward")
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == before
