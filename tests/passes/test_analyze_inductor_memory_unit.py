"""``analyze_inductor_memory`` on a hand-built inference graph and a hand-written Inductor allocation
plan: the step's memory as the plan allocates it (one fused kernel for ``mm`` and ``relu``), with
the graph-level analysis kept beside it. One 512x512 fp32 value is 1 MiB."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from protrain_fx.analysis.inductor_memory import GraphPlan, PlanRow
from protrain_fx.passes.pipeline import PassContext, analyze_inductor_memory, analyze_memory, run_passes
from tests.passes.graphs import MiB, N, record_for
from protrain_fx import settings


def _record():
    def step(w, x):
        return torch.relu(x @ w).sum()

    graph = make_fx(step, tracing_mode="fake")(torch.randn(N, N), torch.randn(N, N))
    # mm and relu fused into one kernel writing buf0; the sum into buf1, after which buf0 is freed
    plan = GraphPlan(
        phase="inference", inputs=("w_1", "x_1"), outputs=("buf1",),
        rows=[PlanRow("<start>"), PlanRow("relu", [("alloc", "buf0", (MiB, "cpu"))]),
              PlanRow("sum_1", [("alloc", "buf1", (4, "cpu")), ("free", "buf0", None)])])
    return record_for(inference=graph, state_inputs=frozenset({"w_1"}), inductor_plans={"inference": plan})


def test_the_plan_replaces_the_graph_level_analysis():
    record = _record()
    record.rewritten = run_passes([analyze_memory], PassContext(record))
    graph_level = record.memory
    # w and x (1 MiB each), mm and relu both live at relu: 4 MiB
    assert graph_level.peak_bytes == 4 * MiB
    record.rewritten = run_passes([analyze_inductor_memory], PassContext(record))
    assert record.memory_unfused is graph_level
    # w, x and the one fused buffer; then the 4-byte sum while the buffer is still held
    assert record.memory.peak_bytes == 3 * MiB + 4
    assert record.memory.peak_entry.name == "sum_1"
    assert record.passes[-1].name == "analyze_inductor_memory"
    assert record.passes[-1].summary == (
        "predicted peak 3.0 MiB from Inductor's allocation plan (graph-level: 4.0 MiB)")


def test_the_graph_level_analysis_is_kept_once():
    """Run again (the backward graph compiled later): ``memory_unfused`` stays the graph-level one."""
    record = _record()
    record.rewritten = run_passes([analyze_memory, analyze_inductor_memory], PassContext(record))
    graph_level = record.memory_unfused
    record.rewritten = run_passes([analyze_inductor_memory], PassContext(record))
    assert record.memory_unfused is graph_level


def test_a_missing_plan_is_an_error_naming_the_pass():
    record = _record()
    record.rewritten = dataclasses.replace(record.rewritten, inductor_plans={})
    record.rewritten = run_passes([analyze_memory], PassContext(record))
    with pytest.raises(ValueError, match=r"need Inductor plans.*in pass 'analyze_inductor_memory' on graph 0"):
        record.rewritten = run_passes([analyze_inductor_memory], PassContext(record))


def test_nothing_to_do_before_the_graph_level_analysis():
    record = _record()
    record.rewritten = run_passes([analyze_inductor_memory], PassContext(record))
    assert record.memory is None and record.memory_unfused is None and record.passes == []


def test_an_analysis_cannot_be_disabled(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_PASSES, "analyze_inductor_memory")
    with pytest.raises(ValueError, match="analyze_inductor_memory cannot be disabled"):
        run_passes([analyze_inductor_memory], PassContext(_record()))
