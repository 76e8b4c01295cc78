"""The plan cache (``protrain_fx/planner/plan_cache.py``): a second compile of the same graph under the
same budget applies the plan kept by the first without planning (no search, one partition), trains
exactly as the first, and says so; another budget or shape, ``PROTRAIN_PLAN_CACHE=0``, a corrupt
file and a measured miss all plan again.

CPU, eager codegen, the tiny GPT of ``tests/planner/test_auto_plan.py`` (activation plans) and of
``tests/planner/test_auto_offload.py`` (automatic offload counts, at its GPU-like fixed rates). Each
"launch" is a fresh process state: ``torch._dynamo.reset()`` and ``protrain_fx.reset()``.
"""

from __future__ import annotations

import json
import math
import logging

import pytest
import torch

import protrain_fx
from examples.gpt import GPT
from protrain_fx import backend
from protrain_fx.planner import activations, first_step, verify
from protrain_fx.planner import offload as autooffload
from protrain_fx.planner.budget import budget_for_peak
from protrain_fx.profile.cache import plan_cache_path
from tests.conftest import use_cache_dir
from tests.planner.test_auto_offload import GPU_LIKE, LONGER, TIGHT, _train_on
from tests.planner.test_auto_offload import _setup as _offload_setup
from tests.planner.test_auto_plan import CONFIG, _batch, _train_graphs, logged, no_plan  # noqa: F401
from tests.runtime.test_offload import _assert_same_params, _train_side_by_side
from protrain_fx import settings


@pytest.fixture(autouse=True)
def _plan_cache_in_tmp(monkeypatch, tmp_path):
    use_cache_dir(monkeypatch, tmp_path)
    monkeypatch.setenv(settings.PLAN_CACHE, "1")


@pytest.fixture
def counted(monkeypatch):
    """Calls of the activation search and partitions of the joint graph, counted."""
    calls = {"search": 0, "partitions": 0}
    search, copy_graph = activations.search_activation_plan, backend._copy_graph_module

    def counting_search(*args, **kwargs):
        calls["search"] += 1
        return search(*args, **kwargs)

    def counting_copy(gm, **kwargs):
        calls["partitions"] += 1
        return copy_graph(gm, **kwargs)

    monkeypatch.setattr(activations, "search_activation_plan", counting_search)
    monkeypatch.setattr(backend, "_copy_graph_module", counting_copy)
    return calls


def _launch(budget, *, steps: int = 3, seq_len: int = 32):
    """A fresh process state, the tiny GPT compiled under ``budget`` and trained ``steps`` steps;
    the training record and the losses."""
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": budget})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = compiled(*_batch(seq_len, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return _train_graphs()[-1], losses


def _tight(no_plan):  # noqa: F811
    return budget_for_peak(no_plan["peak"]) - 1  # the step as it is no longer fits: a searched plan


def _entries() -> dict:
    return json.loads(plan_cache_path("cpu").read_text())["plans"]


def test_a_second_launch_applies_the_kept_plan_without_planning_and_trains_the_same(no_plan, counted, logged):  # noqa: F811
    budget = _tight(no_plan)
    first, first_losses = _launch(budget)
    auto = first.auto_plan
    assert auto.how == "searched" and not auto.from_cache and counted["search"] >= 1 and counted["partitions"] > 1
    path = plan_cache_path("cpu")
    assert auto.cache_file == str(path) and path.exists() and list(_entries()) == [auto.cache_key]
    entry = _entries()[auto.cache_key]
    assert entry["key"]["budget_bytes"] == budget and entry["config"] == auto.config.to_dict()

    counted.update(search=0, partitions=0)
    second, second_losses = _launch(budget)
    cached = second.auto_plan
    assert cached.from_cache and cached.cache_file == str(path)
    assert counted["search"] == 0 and counted["partitions"] == 1  # no search, one partition: the plan's
    assert cached.plan == auto.plan and cached.config == auto.config and second.plan == auto.plan
    assert cached.estimate == auto.estimate and cached.allocated_cap_bytes == auto.allocated_cap_bytes
    assert second.memory.peak_bytes == first.memory.peak_bytes
    assert second_losses == first_losses  # trains exactly as the first launch
    assert f"from the plan cache ({path})" in cached.table()
    assert f"from the plan cache ({path})" in protrain_fx.step_report().block_table()
    assert any("plan from the plan cache" in r.getMessage() for r in logged)


def test_a_hit_runs_neither_the_search_nor_its_verification(no_plan, monkeypatch):  # noqa: F811
    budget = _tight(no_plan)
    _launch(budget, steps=1)

    def refuse(*args, **kwargs):
        raise AssertionError("the planner ran on a plan cache hit")

    monkeypatch.setattr(activations, "search_activation_plan", refuse)
    monkeypatch.setattr(verify, "confirmed_choice", refuse)
    monkeypatch.setattr(activations, "choose_plan", refuse)
    record, _ = _launch(budget, steps=1)
    assert record.auto_plan.from_cache


def test_another_budget_or_shape_plans_again(no_plan, counted):  # noqa: F811
    budget = _tight(no_plan)
    first, _ = _launch(budget, steps=1)
    counted.update(search=0)
    record, _ = _launch(budget - 4096, steps=1)
    assert not record.auto_plan.from_cache and counted["search"] >= 1
    record, _ = _launch(budget, steps=1, seq_len=16)  # fits as is: planned (no search needed), not read
    assert not record.auto_plan.from_cache and record.auto_plan.how == "fits as is"
    assert record.auto_plan.cache_key != first.auto_plan.cache_key
    assert len(_entries()) == 3  # each kept under its own key
    record, _ = _launch(budget, steps=1)
    assert record.auto_plan.from_cache  # the first is still there


def test_plan_cache_off_plans_every_time_and_keeps_nothing(no_plan, counted, monkeypatch):  # noqa: F811
    monkeypatch.setenv(settings.PLAN_CACHE, "0")
    budget = _tight(no_plan)
    for _ in range(2):
        counted.update(search=0)
        record, _ = _launch(budget, steps=1)
        assert not record.auto_plan.from_cache and counted["search"] >= 1
        assert not record.auto_plan.cache_file
    assert not plan_cache_path("cpu").exists()


@pytest.mark.parametrize("damage", ["file", "entry"])
def test_a_corrupt_cache_is_ignored_with_a_warning_and_written_over(no_plan, counted, logged, damage):  # noqa: F811
    budget = _tight(no_plan)
    first, first_losses = _launch(budget, steps=2)
    path = plan_cache_path("cpu")
    if damage == "file":
        path.write_text('{"version": 1, "plans": {"abc": [1, 2', encoding="utf-8")
    else:
        data = json.loads(path.read_text())
        data["plans"][first.auto_plan.cache_key]["config"] = {"n_persist": "two"}
        path.write_text(json.dumps(data), encoding="utf-8")
    counted.update(search=0)
    record, losses = _launch(budget, steps=2)
    assert not record.auto_plan.from_cache and counted["search"] >= 1 and losses == first_losses
    warnings = [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    assert any("plan cache" in w and "ignored" in w for w in warnings), warnings
    assert list(_entries()) == [record.auto_plan.cache_key]  # written over with the plan chosen again
    assert _launch(budget, steps=1)[0].auto_plan.from_cache


def test_a_measured_miss_drops_the_entry_and_keeps_the_plan_chosen_again(no_plan, counted, monkeypatch, logged):  # noqa: F811
    budget = int(budget_for_peak(no_plan["peak"]) * 1.05)  # fits as is; 3% under it a plan does
    first, _ = _launch(budget, steps=1)
    key = first.auto_plan.cache_key
    assert first.auto_plan.how == "fits as is"
    state = {"reads": 0, "peak": 0}

    def counters(device):  # (memory_allocated, max_memory_allocated), driven on the CPU
        state["reads"] += 1
        return (1000, 2000) if state["reads"] % 2 else (1000, 1000 + state["peak"])

    monkeypatch.setattr(first_step, "memory_counters", counters)
    monkeypatch.setattr(first_step, "reset_peak", lambda device: None)
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": budget})
    counted.update(search=0)
    for step in range(2):
        loss = compiled(*_batch(seed=step))
        newest = _train_graphs()[-1]
        start = sum(newest.memory.timeline.baseline_bytes.values())
        if step == 0:
            hit = newest
            assert hit.auto_plan.from_cache and counted["search"] == 0
            state["peak"] = int(hit.auto_plan.step_cap_bytes * 1.03) - start  # 3% over its cap: a miss
        else:
            state["peak"] = newest.memory.peak_bytes - start
        loss.backward()
        if step == 0:
            assert hit.auto_plan.replan and key not in _entries()  # dropped at the miss
    again = _train_graphs()[-1]
    assert again is not hit and not again.auto_plan.from_cache and counted["search"] >= 1
    assert again.auto_plan.reserve_source == "measured" and again.auto_plan.how == "searched"
    assert list(_entries()) == [again.auto_plan.cache_key]  # the plan chosen after the miss is kept
    assert _entries()[key]["reserve_source"] == "measured"
    assert any("dropped" in r.getMessage() for r in logged)


@pytest.fixture
def gpu_like_machine(monkeypatch):
    monkeypatch.setattr(autooffload, "offload_machine", lambda device, record, *chunk: GPU_LIKE)


def test_an_offloaded_model_reuses_its_counts(gpu_like_machine, monkeypatch):
    model, reference, opt, ref_opt, handle, compiled = _offload_setup(TIGHT)
    _train_side_by_side(compiled, reference, opt, ref_opt, 2)
    auto = _train_graphs()[-1].auto_plan
    assert auto.offload and not auto.from_cache and auto.cache_key in _entries()
    counts = (handle.n_persist, handle.n_buffer, handle.n_gpu_optim)
    assert 0 < handle.n_persist < len(handle.layout.chunks)

    def refuse(*args, **kwargs):
        raise AssertionError("the offload planner ran on a plan cache hit")

    monkeypatch.setattr(verify, "confirmed_choice", refuse)
    monkeypatch.setattr(autooffload, "prefer_persistent", refuse)
    monkeypatch.setattr(autooffload, "offload_cost_model", refuse)
    torch._dynamo.reset()
    protrain_fx.reset()
    model, reference, opt, ref_opt, handle, compiled = _offload_setup(TIGHT)
    _train_side_by_side(compiled, reference, opt, ref_opt, 3)  # the losses equal eager AdamW's
    _assert_same_params(handle, model, reference)
    cached = _train_graphs()[-1].auto_plan
    assert cached.from_cache and cached.offload and cached.config == auto.config
    assert (handle.n_persist, handle.n_buffer, handle.n_gpu_optim) == counts
    assert handle.configured and not handle.automatic and handle.counts_chosen
    assert "from the plan cache" in cached.table() and "n_persist=" in cached.table()


def test_a_later_input_shape_of_an_offloaded_model_reuses_its_plan_for_the_counts_as_placed(gpu_like_machine,
                                                                                           monkeypatch):
    # The first shape chooses the counts, a longer one its activation plan for them (without the
    # raised search the first leaves it room: tests/planner/test_auto_offload.py). At the next launch
    # of the same loop both come from the cache: neither the counts nor the later plan are searched.
    monkeypatch.setattr(verify, "MAX_RAISES", 0)

    def launch():
        torch._dynamo.reset()
        protrain_fx.reset()
        model, reference, opt, ref_opt, handle, compiled = _offload_setup(TIGHT)
        _train_side_by_side(compiled, reference, opt, ref_opt, 2)
        _train_on(LONGER, compiled, reference, opt, ref_opt)
        _assert_same_params(handle, model, reference)
        first, later = _train_graphs()
        return handle, first.auto_plan, later.auto_plan

    handle, first, later = launch()
    assert not later.from_cache and later.cache_key in _entries() and later.cache_key != first.cache_key
    assert later.plan.blocks_with("swap") or later.plan.blocks_with("checkpoint")
    counts = (handle.n_persist, handle.n_buffer, handle.n_gpu_optim)

    def refuse(*args, **kwargs):
        raise AssertionError("the planner ran on a plan cache hit")

    monkeypatch.setattr(verify, "confirmed_choice", refuse)
    for name in ("prefer_persistent", "offload_cost_model"):
        monkeypatch.setattr(autooffload, name, refuse)
    handle, first_again, later_again = launch()
    assert first_again.from_cache and later_again.from_cache
    assert later_again.config == later.config and later_again.plan == later.plan
    assert (handle.n_persist, handle.n_buffer, handle.n_gpu_optim) == counts


def _driven_first_steps(monkeypatch, peak_of):
    """First steps measured on the CPU: ``memory_counters`` reads ``(1000, 1000)`` at a forward's
    start and ``(1000, 1000 + peak_of(record))`` at its backward's end, for the newest training graph."""
    reads = {"n": 0}

    def counters(device):
        reads["n"] += 1
        if reads["n"] % 2:
            return (1000, 1000)
        record = _train_graphs()[-1]
        return (1000, 1000 + peak_of(record))

    monkeypatch.setattr(first_step, "memory_counters", counters)
    monkeypatch.setattr(first_step, "reset_peak", lambda device: None)


def _first_step_over_its_cap(monkeypatch, over: float = 1.01) -> list:
    """First steps driven as :func:`_driven_first_steps`: the first graph's at ``over`` times its
    cap, every later one at its predicted peak. The graphs measured over it (the first), in a list."""
    missed: list = []

    def peak_of(record):
        start = sum(record.memory.timeline.baseline_bytes.values())
        if not missed:
            missed.append(record)
            return int(record.auto_plan.step_cap_bytes * over) - start
        return record.memory.peak_bytes - start

    _driven_first_steps(monkeypatch, peak_of)
    return missed


def test_the_room_measured_for_the_code_around_the_graph_is_kept_for_later_launches(no_plan, monkeypatch, logged):  # noqa: F811
    budget = 2 * budget_for_peak(no_plan["peak"])
    outside = 12345  # held by the code around the graph at the first step, above the graph's peak
    _driven_first_steps(monkeypatch, lambda r: r.memory.peak_bytes - sum(r.memory.timeline.baseline_bytes.values())
                        + outside)
    first, _ = _launch(budget, steps=1)
    assert first.auto_plan.reserve_source == "" and first.auto_plan.peak_check.outside_bytes == outside
    monkeypatch.setattr(first_step, "memory_counters", lambda device: None)  # later launches measure nothing
    again, _ = _launch(budget, steps=1)  # the kept plan, under the cap the measured reserve leaves
    assert again.auto_plan.from_cache and (again.auto_plan.reserve_bytes, again.auto_plan.reserve_source) == (
        outside, "measured")
    other, _ = _launch(budget - 1, steps=1)  # another budget: planned, with the measured reserve from the start
    assert not other.auto_plan.from_cache
    assert (other.auto_plan.reserve_bytes, other.auto_plan.reserve_source) == (outside, "measured")
    assert any("at a first step of an earlier launch" in r.getMessage() for r in logged)
    monkeypatch.setenv(settings.PLAN_CACHE, "0")
    off, _ = _launch(budget - 2, steps=1)  # the cache off: nothing read
    assert off.auto_plan.reserve_source == ""


def test_the_plan_chosen_again_after_a_first_step_takes_the_dropped_entrys_place(no_plan):  # noqa: F811
    """A first step drops its plan's entry (a miss, or a faster plan found); the graph compiled again
    can have a key of its own (an offloaded model's counts are then placed: ``plan_key``'s "placed"),
    and the plan it chooses is kept under the dropped entry too, so that the next launch, keyed as
    the first compile was, applies it without planning."""
    from protrain_fx.planner import plan_cache

    budget = _tight(no_plan)
    first, _ = _launch(budget, steps=1)
    auto = first.auto_plan
    dropped = auto.cache_key
    parts = _entries()[dropped]["key"]
    plan_cache.drop_after_miss(auto, first.index, "a test")
    assert dropped not in _entries()
    placed = plan_cache.PlanKey(plan_cache_path("cpu"), "f" * 64, {**parts, "placed": {"counts": [1, 0, 0]}}, "cpu")
    plan_cache.store(first, placed, auto)  # the graph compiled again, under its own key
    entries = _entries()
    assert entries["f" * 64]["key"]["placed"] == {"counts": [1, 0, 0]}
    assert entries[dropped]["key"] == parts and entries[dropped]["config"] == auto.config.to_dict()
    again, _ = _launch(budget, steps=1)
    assert again.auto_plan.from_cache and again.auto_plan.cache_key == dropped
    plan_cache.store(first, placed, auto)  # once only: a later store keeps its own key alone
    assert set(_entries()) == {dropped, "f" * 64}




def test_an_offloaded_model_trains_on_after_a_miss_that_leaves_no_plan_under_the_cap(gpu_like_machine, monkeypatch,
                                                                                     logged):
    """A first step 1% over its cap (within the budget, in the allocator's headroom), at a budget
    where the counts chosen leave no activation plan under the cap that measured reserve leaves: the
    graph compiled again applies the plan of least memory (no more than the step that ran), says so
    and the budget that plans within the cap, and trains exactly as eager; it does not stop the run.
    Further over the budget is refused (``tests/planner/test_auto_offload.py``)."""
    missed = _first_step_over_its_cap(monkeypatch)
    model, reference, opt, ref_opt, handle, compiled = _offload_setup(TIGHT)
    _train_side_by_side(compiled, reference, opt, ref_opt, 3)
    _assert_same_params(handle, model, reference)
    first, again = _train_graphs()
    assert first.auto_plan.recompile and again.auto_plan.how == "least memory"
    assert again.auto_plan.analysed_peak_bytes > again.auto_plan.allocated_cap_bytes
    assert again.auto_plan.config.n_persist == first.auto_plan.config.n_persist
    warned = [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    assert any("the plan of least memory" in w and "plans within the cap" in w for w in warned), warned


def test_a_model_at_its_least_budget_trains_on_after_a_miss(no_plan, monkeypatch, logged):  # noqa: F811
    """At the least budget a plan fits (what NoPlanFits names for a budget of 1 byte), a first step
    1% over the cap: the graph compiled again keeps the plan of least memory over the cap, warns, and
    trains exactly like the launch without the miss."""
    torch._dynamo.reset()
    protrain_fx.reset()
    with pytest.raises(Exception) as refused:
        torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", "memory_budget": 1})(*_batch())
    least = refused.value.min_budget_bytes
    _, reference_losses = _launch(least, steps=3)
    missed = _first_step_over_its_cap(monkeypatch)
    monkeypatch.setenv(settings.PLAN_CACHE, "0")
    again, losses = _launch(least, steps=3)
    assert losses == reference_losses
    assert missed and missed[0].auto_plan.recompile and again is not missed[0]
    assert again.auto_plan.how == "least memory" and again.auto_plan.analysed_peak_bytes > again.auto_plan.allocated_cap_bytes
    assert any("plans within the cap" in r.getMessage() for r in logged if r.levelno >= logging.WARNING)


def test_a_relaunch_keeps_its_plan_under_the_reserve_measured_smaller_than_it_kept(monkeypatch):
    """The loss outside the graph: the first launch keeps an estimate for it, its first step measures
    less, and the faster plan that leaves room for is not worth its compile (the payback). The next
    launch takes the kept plan with the measured reserve (seeded from the cache) and does not plan
    again after its first step, however cheap that launch's own compile was."""
    from tests.planner.test_auto_plan import _device_budget, _loss_outside
    from protrain_fx.planner import reserve

    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)  # the tiny GPT's logits count as large
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})(_batch()[0]).sum().backward()
    peak = _train_graphs()[0].memory.peak_bytes
    numel = 4 * 32 * CONFIG.vocab_size
    _device_budget(monkeypatch, budget_for_peak(peak + 4 * numel))  # as it is, beside 4 bytes a logit only
    _driven_first_steps(monkeypatch, lambda r: r.memory.peak_bytes + 4 * numel
                        - sum(r.memory.timeline.baseline_bytes.values()))

    def launch():
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})
        for step in range(2):
            _loss_outside(compiled, _batch(seed=step)).backward()
        return _train_graphs()

    (first,) = launch()  # the tiny model's microseconds never repay a compile
    assert first.auto_plan.reserve_source == "outputs" and first.auto_plan.how == "searched"
    assert first.auto_plan.peak_check.outside_bytes == 4 * numel and not first.auto_plan.recompile
    monkeypatch.setattr(first_step, "REPLAN_PAYBACK_STEPS", math.inf)  # any plan found would repay now
    (again,) = launch()
    auto = again.auto_plan
    assert auto.from_cache and auto.config == first.auto_plan.config and not auto.recompile
    assert (auto.reserve_bytes, auto.reserve_source) == (4 * numel, "measured")
    assert auto.allocated_cap_bytes == first.auto_plan.allocated_cap_bytes + first.auto_plan.reserve_bytes - 4 * numel


def test_the_key_names_a_cuda_device_with_its_index(monkeypatch):
    """An offload made with ``device="cuda"`` keys its plan under ``cuda:N``, the name the memory
    analysis (and the measured reserve kept under it) uses."""
    from protrain_fx.planner import plan_cache

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert plan_cache.device_str("cuda") == plan_cache.device_str(torch.device("cuda")) == "cuda:3"
    assert plan_cache.device_str("cuda:1") == "cuda:1" and plan_cache.device_str("cpu") == "cpu"
