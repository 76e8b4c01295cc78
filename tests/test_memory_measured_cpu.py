"""Predicted memory of a whole training step against the CPU allocator, measured.

``record_cpu_memory`` reads every allocation and free of the step from the profiler. The predicted
timeline (graph-level for eager codegen; Inductor's allocation plan for Inductor) must match the
measured bytes above the step's starting point: exactly at the end of each phase, and at each
phase's peak up to the few scalars some kernels allocate inside themselves (nll_loss_backward's
4-byte temporary, fused AdamW's 12 bytes of step bookkeeping), which no graph shows.
"""

from __future__ import annotations

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.measure import mark_phase, record_cpu_memory


def _step(compiled, optimizer, batch, mark=lambda _phase: None):
    mark("forward")
    loss = compiled(*batch)
    mark("backward")
    loss.backward()
    mark("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("end")
    return loss


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_predicted_step_memory_equals_cpu_allocations(codegen):
    torch.manual_seed(0)
    config = gpt_config("tiny")
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model, backend="protrain", options={"codegen": codegen})
    batch = random_batch(config, 4, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # compile, then create the optimizer state
        loss = _step(compiled, optimizer, batch)
    del loss
    with record_cpu_memory() as recording:
        loss = _step(compiled, optimizer, batch, mark_phase)
    measured = recording.timeline()

    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    predicted = record.memory.timeline
    if codegen == "inductor":
        assert set(record.inductor_plans) == {"forward", "backward"}
        assert "Inductor" in predicted.label
    base = sum(predicted.baseline_bytes.values())
    measured_curve = measured.curve()
    assert set(measured.phase_bounds) == set(predicted.phase_bounds) == {"forward", "backward", "optimizer"}
    for phase, (lo, hi) in measured.phase_bounds.items():
        seen = [live for index, live in measured_curve if lo <= index < hi]
        plo, phi = predicted.phase_bounds[phase]
        entries = predicted.entries[plo:phi]
        assert seen[-1] == entries[-1].live_bytes - base, phase
        assert 0 <= max(seen) - (max(e.peak_bytes for e in entries) - base) <= 64, phase
    # Bytes left after the step: the loss the user holds.
    assert measured_curve[-1][1] == loss.untyped_storage().nbytes()
