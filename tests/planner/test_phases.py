"""The phases of a real compile (``protrain_fx/progress.py``, ``CapturedGraph.phases``): measured, in
the plan table and the report, at most the compile's wall time, the progress line shown only when
asked for on a stream that is not a terminal, and a plan-cache hit saying the search and the trial
lowerings were skipped.

CPU, eager codegen, the tiny GPT of ``tests/planner/test_auto_plan.py`` under a budget its step as
written does not fit (a searched plan), and offloaded without counts as in
``tests/planner/test_auto_offload.py`` (at its fixed GPU-like rates).
"""

from __future__ import annotations

import time

import torch

import protrain_fx
from examples.gpt import GPT
from protrain_fx import progress
from protrain_fx.planner import offload as autooffload
from protrain_fx.planner.budget import budget_for_peak
from tests.conftest import use_cache_dir
from tests.planner.test_auto_offload import GPU_LIKE, TIGHT
from tests.planner.test_auto_offload import _setup as _offload_setup
from tests.planner.test_auto_plan import CONFIG, _batch, _train_graphs, no_plan  # noqa: F401
from tests.runtime.test_offload import _batch as _offload_batch
from protrain_fx import settings


def _first_call(budget: int):
    """The tiny GPT compiled under ``budget``; the training record and the wall time of the call
    that compiled it (Dynamo, the backend, the forward)."""
    torch.manual_seed(0)
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", "memory_budget": budget})
    batch = _batch()
    started = time.perf_counter()
    loss = compiled(*batch)
    wall = time.perf_counter() - started
    loss.backward()
    (record,) = _train_graphs()
    return record, wall


def test_a_planned_compile_puts_its_measured_phases_into_the_plan_table(no_plan, monkeypatch, capfd):  # noqa: F811
    monkeypatch.setenv(progress.ENV, "1")  # pytest's stderr is not a terminal: the line is asked for
    record, wall = _first_call(budget_for_peak(no_plan["peak"]) - 1)
    auto = record.auto_plan
    assert auto.how == "searched" and auto.phases is record.phases
    phases = record.phases
    assert list(phases)[:2] == ["capture", "planning"] and {"search", "trial lowerings"} <= set(phases)
    assert all(s >= 0 for s in phases.values()) and phases["capture"] > 0 and phases["trial lowerings"] > 0
    assert sum(phases.values()) <= wall
    line = auto.phases_line()
    assert line.startswith("phases: capture ") and "trial lowerings" in line and "skipped" not in line
    assert auto.trials_run >= 2 and f"({auto.trials_line()})" in line  # the trials run, counted in the table
    assert auto.trials_line() == f"{auto.trials_run} trial rewrites" + (
        f" ({auto.trials_kept} judged before)" if auto.trials_kept else "")
    assert line in auto.table() and line in protrain_fx.step_report().block_table()

    err = capfd.readouterr().err
    assert "\rprotrain_fx: graph 0: trial lowerings 1" in err  # the line, redrawn in place, with the trials counted
    # the line ends as the seconds of each phase (other stderr output, a warning, may come before it)
    ends = [line.rsplit("\r", 1)[-1] for line in err.split("\n") if "\r" in line]
    assert any(end.startswith(f"protrain_fx: graph 0: {progress.seconds_line(phases)}") for end in ends), err


def test_off_when_stderr_is_not_a_terminal(no_plan, capfd):  # noqa: F811
    record, _ = _first_call(budget_for_peak(no_plan["peak"]))
    assert record.auto_plan.how == "fits as is" and "capture" in record.phases
    assert "\r" not in capfd.readouterr().err


def test_a_plan_cache_hit_skips_the_search_and_the_trial_lowerings(no_plan, monkeypatch, tmp_path):  # noqa: F811
    use_cache_dir(monkeypatch, tmp_path)
    monkeypatch.setenv(settings.PLAN_CACHE, "1")
    budget = budget_for_peak(no_plan["peak"]) - 1
    first, _ = _first_call(budget)
    assert not first.auto_plan.from_cache and "search" in first.phases
    torch._dynamo.reset()
    protrain_fx.reset()
    second, wall = _first_call(budget)
    auto = second.auto_plan
    assert auto.from_cache and set(second.phases) == {"capture", "planning"} and sum(second.phases.values()) <= wall
    assert auto.phases_line().endswith("; search and trial lowerings skipped (plan cache)")
    assert auto.phases_line() in auto.table()


def test_an_automatic_offload_times_the_machine_and_the_offload_counts(monkeypatch):
    monkeypatch.setattr(autooffload, "offload_machine", lambda device, record, *chunk: GPU_LIKE)
    *_, compiled = _offload_setup(TIGHT)
    started = time.perf_counter()
    loss = compiled(*_offload_batch(0))
    wall = time.perf_counter() - started
    loss.backward()
    record = [g for g in protrain_fx.captured_graphs() if g.has_backward][-1]
    assert record.auto_plan.offload and record.auto_plan.phases is record.phases
    assert {"capture", "planning", "machine", "offload counts", "trial lowerings"} <= set(record.phases)
    assert all(s >= 0 for s in record.phases.values()) and sum(record.phases.values()) <= wall
