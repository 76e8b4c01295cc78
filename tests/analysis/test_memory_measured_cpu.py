"""Predicted memory of a whole training step against the CPU allocator, measured.

``record_cpu_memory`` reads every allocation and free of the step from the profiler. The predicted
timeline (graph-level for eager codegen; Inductor's allocation plan for Inductor) must match the
measured bytes above the step's starting point: exactly at the end of each phase, and at each
phase's peak up to the few scalars some kernels allocate inside themselves (nll_loss_backward's
4-byte temporary, fused AdamW's 12 bytes of step bookkeeping), which no graph shows.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.inspect.measure import mark_phase, record_cpu_memory
from protrain_fx.plan import from_counts


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


@pytest.mark.parametrize(
    ("codegen", "plan"), [("eager", None), ("inductor", None), ("eager", "checkpoint=all"), ("inductor", "checkpoint=all")]
)
def test_predicted_step_memory_equals_cpu_allocations(codegen, plan):
    # With checkpointed blocks the backward graph recomputes forward values: copies of the forward
    # nodes, whose own allocations must not be mistaken for the forward's (mistaken, the eager
    # prediction would keep every recomputed value live from forward to backward).
    torch.manual_seed(0)
    config = gpt_config("tiny")
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    options = {"codegen": codegen}
    if plan:
        options["plan"] = from_counts(plan, [f"blocks.{i}" for i in range(config.n_layer)])
    compiled = torch.compile(model, backend="protrain", options=options)
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


@pytest.mark.parametrize("plan", [None, "checkpoint=all"])
def test_predicted_memory_of_an_offloaded_step_equals_cpu_allocations(plan):
    """An offloaded step: its parameters are read as views of the chunk buffers the graphs gather
    (the pool's bytes, allocated before the step), so no view of a parameter (a weight's transpose)
    allocates anything. Forward and backward, as the eager codegen runs them."""
    torch.manual_seed(0)
    config = gpt_config("tiny")
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # (a checkpointed block holds its chunks from its recompute to its backward: 5 at most here)
    handle = protrain_fx.offload(model, optimizer, device="cpu", n_persist=0, n_buffer=5 if plan else 3,
                                 chunk_bytes=64 * 1024, grad_clipping=False)
    options = {"codegen": "eager"}
    if plan:
        options["plan"] = from_counts(plan, [f"blocks.{i}" for i in range(config.n_layer)])
    compiled = torch.compile(model, backend="protrain", options=options)
    batch = random_batch(config, 4, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = _step(compiled, optimizer, batch)
    handle.synchronize()
    del loss
    with record_cpu_memory() as recording:
        loss = _step(compiled, optimizer, batch, mark_phase)
        handle.synchronize()
    measured = recording.timeline()
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    predicted = record.memory.timeline
    _assert_peaks_rise_as_measured(predicted, measured)
    handle.close()


@pytest.mark.parametrize(("codegen", "offloaded"), [("eager", False), ("inductor", False), ("eager", True)])
def test_accumulated_micro_batches_count_the_held_gradients(codegen, offloaded):
    """``accumulation_steps=2``: the second micro-batch of a step starts with the first one's
    gradients held in ``.grad`` (offloaded: the persistent chunks' parameters'; the offloaded chunks'
    are added on the host), and the new ones the backward returns are added into them. The predicted
    step counts the held gradients before its first node (they are at the peak, beside the
    backward's new ones), and the rest of the step rises as measured."""
    torch.manual_seed(0)
    config = gpt_config("tiny")
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, optimizer, device="cpu", n_persist=2, n_buffer=3, chunk_bytes=64 * 1024,
                                 grad_clipping=False) if offloaded else None
    compiled = torch.compile(model, backend="protrain", options={"codegen": codegen, "accumulation_steps": 2})
    batches = [random_batch(config, 4, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def micro_batch(batch, accumulate, mark=lambda _phase: None):
        mark("forward")
        loss = compiled(*batch)
        mark("backward")
        with handle.accumulate() if handle is not None and accumulate else contextlib.nullcontext():
            loss.backward()
        mark("end")
        if handle is not None:
            handle.synchronize()
        return loss.detach()

    for _ in range(2):  # compile, then create the optimizer state
        micro_batch(batches[0], True)
        micro_batch(batches[1], False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    micro_batch(batches[0], True)
    held = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    assert held > 0
    with record_cpu_memory() as recording:
        loss = micro_batch(batches[1], True, mark_phase)
    measured = recording.timeline()

    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    predicted = record.memory.timeline
    assert predicted.baseline_bytes["gradient"] == held
    _assert_peaks_rise_as_measured(predicted, measured)
    del loss
    if handle is not None:
        handle.close()


def _assert_peaks_rise_as_measured(predicted, measured) -> None:
    """Forward's and backward's peaks above the step's start, predicted against measured: equal up to
    the few scalars some kernels allocate inside themselves (see the module docstring)."""
    base = sum(predicted.baseline_bytes.values())
    measured_curve = measured.curve()
    for phase in ("forward", "backward"):
        lo, hi = measured.phase_bounds[phase]
        seen = [live for index, live in measured_curve if lo <= index < hi]
        plo, phi = predicted.phase_bounds[phase]
        entries = predicted.entries[plo:phi]
        assert 0 <= max(seen) - (max(e.peak_bytes for e in entries) - base) <= 64, phase
