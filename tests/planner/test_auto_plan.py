"""The automatic activation plan (``protrain_fx/planner/``): ``options={"memory_budget": ...}`` with no
plan by hand, for a model whose parameters stay on the device.

CPU, eager codegen (bit-exact with eager PyTorch), the tiny GPT with 4 blocks. Budgets are derived
from the step's own analysed peak (never hard-coded), through the same headroom rule the backend uses
(``planner_budget.budget_for_peak`` / ``allocated_cap_bytes``). The search restriction is checked against
brute force on synthetic problems (``tests/search/test_cost_search.py``'s generator).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math

import pytest
import torch

import protrain_fx
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.machine import machine_for
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import backend
from protrain_fx.plan import interleaved
from protrain_fx.planner import activations, first_step, rates, reserve, result, verify
from protrain_fx.planner import budget as planner_budget
from protrain_fx.planner import offload as autooffload
from protrain_fx.planner.activations import least_memory_config, search_activation_plan
from protrain_fx.planner.budget import (
    allocated_cap_bytes,
    budget_for_peak,
    budget_verdict,
    device_budget_bytes,
    reachable_bytes,
)
from protrain_fx.planner.first_step import record_first_step
from protrain_fx.planner.result import AutoPlan, PeakCheck
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import block_plan
from protrain_fx.search.search import NoPlanFits, search
from protrain_fx.state import STATE
from tests.search.test_cost_search import brute_force, budgets, make_problem

CONFIG = gpt_config("tiny", n_layer=4)
LABELS = [f"blocks.{i}" for i in range(CONFIG.n_layer)]


def _batch(seq_len: int = 32, seed: int = 1):
    return random_batch(CONFIG, 4, seq_len, generator=torch.Generator().manual_seed(seed))


def _train_graphs():
    return [g for g in protrain_fx.captured_graphs() if g.has_backward]


@pytest.fixture(scope="module")
def no_plan():
    """The step analysed without budget or plan: its peak and per-block saved bytes."""
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})(*_batch()).backward()
    (record,) = _train_graphs()
    result = {
        "peak": record.memory.peak_bytes,
        "saved": {b.block: b.saved_activation_bytes for b in record.memory.blocks},
    }
    torch._dynamo.reset()
    protrain_fx.reset()
    return result


def _compile_and_step(budget, *, verbose: bool = False, steps: int = 2, **more):
    """Train the compiled model and an eager copy side by side; returns the record and whether the
    losses and gradients were equal bit for bit at every step. ``more``: further backend options."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    options = {"codegen": "eager", "verbose": verbose, **more}
    if budget is not None:
        options["memory_budget"] = budget
    compiled = torch.compile(model, backend="protrain", options=options)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    exact = True
    for step in range(steps):
        batch = _batch(seed=step)
        loss, ref_loss = compiled(*batch), reference(*batch)
        loss.backward()
        ref_loss.backward()
        exact &= torch.equal(loss, ref_loss)
        exact &= all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    (record,) = _train_graphs()
    return record, exact


@pytest.fixture
def logged():
    """Records logged to ``protrain_fx`` at INFO and above, through a handler of our own (the suite
    also runs with ``-p no:logging``, which takes pytest's ``caplog`` away)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("protrain_fx")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _no_plan_fits(exc: BaseException | None) -> NoPlanFits | None:
    """The NoPlanFits inside the error Dynamo wraps backend errors in."""
    while exc is not None:
        if isinstance(exc, NoPlanFits):
            return exc
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    return None


# --------------------------------------------------------------------------- the search restriction


def test_activation_only_search_equals_brute_force():
    """``persist_all=True`` = the best of the configs where every chunk persists, and only those."""
    checked = restricted_differs = 0
    for seed in range(12):
        problem = make_problem(seed, n_blocks=2 + seed % 4)
        n = len(problem.chunks)
        table = [row for row in brute_force(problem) if row[0].n_persist == n]
        assert all(cfg.n_buffer == 0 for cfg, *_ in table)
        for budget in budgets(table, 5):
            want = min((t for _, t, peak in table if peak <= budget), default=math.inf)
            for prune in (True, False):
                got = search(problem, budget, persist_all=True, prune=prune)
                assert got.best.n_persist == n and got.best.n_buffer == 0
                assert got.estimate.step_s == want, (seed, budget, prune, got.best)
                assert got.estimate.peak_bytes <= budget
                assert got.evaluated + got.pruned == got.total == len(table)
            assert search_activation_plan(problem, budget).best == search(problem, budget, persist_all=True).best
            restricted_differs += search(problem, budget).best.n_persist < n
            checked += 1
        smallest = min(peak for *_, peak in table)
        with pytest.raises(NoPlanFits) as info:
            search(problem, smallest - 1 + 2**20, reserve_bytes=2**20, persist_all=True)
        assert info.value.min_budget_bytes == smallest + 2**20
        model = CostModel(problem)
        least = least_memory_config(model)
        assert model.estimate(least).peak_bytes == smallest
    assert checked == 60
    assert restricted_differs > 0  # without the restriction, offloading chunks is sometimes faster


# --------------------------------------------------------------------------- the backend


def test_budget_the_step_fits_keeps_no_plan(no_plan, logged, monkeypatch):
    asked = _device_budget(monkeypatch, 2**50)  # a device with more: the user's budget is planned for
    budget = budget_for_peak(no_plan["peak"])
    record, exact = _compile_and_step(budget, steps=1)
    assert exact and asked == [torch.device("cpu")]
    assert record.budget.source == record.auto_plan.budget_source == "user"
    assert "(memory_budget)" in record.auto_plan.table()
    auto = record.auto_plan
    assert isinstance(auto, AutoPlan) and auto.how == "fits as is"
    assert set(auto.plan.blocks) == set(LABELS) and not auto.plan.blocks_with("checkpoint")
    assert not auto.plan.blocks_with("swap") and auto.trials == []
    assert record.plan is None and record.swapped == []
    assert record.memory.peak_bytes == auto.analysed_peak_bytes == no_plan["peak"]
    assert budget_verdict(record.memory.peak_bytes, budget) == "fits"
    assert any("automatic activation plan for graph 0" in r.getMessage() for r in logged)


def test_the_last_compile_dynamo_allows_a_frame_warns_that_further_shapes_run_unplanned(no_plan, logged):
    """A plan is sized for one input shape, so each new length compiles again; at the frame's last
    compile under Dynamo's recompile limit the user learns that further shapes leave the plan."""
    compiled = torch.compile(GPT(CONFIG), backend="protrain",
                             options={"codegen": "eager", "memory_budget": budget_for_peak(2 * no_plan["peak"])})
    with torch._dynamo.config.patch(recompile_limit=2):  # (monkeypatch would delete the entry on undo)
        compiled(*_batch(32)).backward()
        assert not [r for r in logged if "recompile_limit" in r.getMessage()]
        compiled(*_batch(24)).backward()
    (warned,) = [r.getMessage() for r in logged if "recompile_limit" in r.getMessage()]
    assert "compile 2 of the 2 Dynamo allows" in warned and "Pad the inputs to a few fixed lengths" in warned


def test_tighter_budget_runs_a_plan_that_fits_exactly_as_eager(no_plan, capfd):
    budget = budget_for_peak(no_plan["peak"]) - 1  # the step as it is no longer fits
    record, exact = _compile_and_step(budget, verbose=True)
    assert exact  # loss and every gradient bit for bit, two steps
    auto = record.auto_plan
    assert auto.how == "searched"
    changed = auto.plan.blocks_with("checkpoint") + auto.plan.blocks_with("swap")
    assert changed
    assert record.plan == auto.plan == block_plan(auto.problem, auto.config)
    # the compiled step is the rewritten one: what the plan drops is no longer saved
    saved = {b.block: b.saved_activation_bytes for b in record.memory.blocks}
    for block in changed:
        assert saved[block] < no_plan["saved"][block], block
    if auto.plan.blocks_with("swap"):
        assert record.swapped
    # the analysed peak fits under the budget with the allocator's headroom; the cost model's, an
    # upper bound of it, may lie above the cap: the search raised by its margin over the analysis
    # (verify.raised_choice) chose the plan
    cap = allocated_cap_bytes(budget)
    assert auto.allocated_cap_bytes == cap < no_plan["peak"]
    assert auto.estimate.peak_bytes == auto.predicted_peak_bytes >= record.memory.peak_bytes
    assert record.memory.peak_bytes == auto.analysed_peak_bytes <= cap
    assert budget_verdict(record.memory.peak_bytes, budget) == "fits"
    assert auto.estimate.step_s >= auto.empty_step_s > 0
    # the table, printed with verbose
    err = capfd.readouterr().err
    assert "automatic activation plan for graph 0" in err and "predicted step" in err
    assert f"n_checkpoint={auto.config.n_checkpoint}" in err and "checkpoint" in auto.table()
    assert "automatic activation plan (searched)" in protrain_fx.step_report().block_table()
    # the time it took: describing the step (no device to profile on the CPU) within the whole choice
    assert auto.choose_s >= auto.problem_s > 0 and "chosen in" in auto.table()


def test_on_the_cpu_the_automatic_plan_checkpoints_instead_of_swapping(no_plan):
    """On the CPU device a swapped value's copy stays in the memory the budget counts
    (``Machine.host_memory_apart``), so a swap frees nothing: a budget the step does not fit is met by
    checkpointing, and the plan's analysed peak, with nothing swapped to leave out of it, fits. Said
    to have its host memory apart, as a card has, the same step swaps at the same budget."""
    budget = budget_for_peak(no_plan["peak"] * 95 // 100)
    record, exact = _compile_and_step(budget, steps=1)
    auto = record.auto_plan
    assert exact and auto.how == "searched"
    assert auto.config.n_swap == 0 and not auto.plan.blocks_with("swap") and record.swapped == []
    assert auto.plan.blocks_with("checkpoint")
    assert record.memory.peak_bytes == auto.analysed_peak_bytes <= allocated_cap_bytes(budget)
    torch._dynamo.reset()
    protrain_fx.reset()
    record, exact = _compile_and_step(budget, steps=1, machine={"host_memory_apart": True})
    assert exact and record.auto_plan.config.n_swap > 0 and record.swapped


def test_below_the_minimum_raises_naming_it_and_the_minimum_works(no_plan):
    torch.manual_seed(0)
    with pytest.raises(Exception) as info:
        torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", "memory_budget": no_plan["peak"] // 2})(
            *_batch()
        )
    error = _no_plan_fits(info.value)
    assert error is not None and isinstance(error, ValueError)
    minimum = error.min_budget_bytes
    assert no_plan["peak"] // 2 < minimum < budget_for_peak(no_plan["peak"])
    message = str(error)
    assert f"at least {minimum} bytes ({human_bytes(minimum)}," in message and "memory_budget" in message

    torch._dynamo.reset()
    protrain_fx.reset()
    with pytest.raises(Exception) as info:
        torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", "memory_budget": minimum - 1})(
            *_batch()
        )
    assert _no_plan_fits(info.value).min_budget_bytes == minimum

    torch._dynamo.reset()
    protrain_fx.reset()
    record, exact = _compile_and_step(minimum, steps=1)
    assert exact
    auto = record.auto_plan
    assert auto.config == least_memory_config(CostModel(auto.problem))
    # the analysis judges: it is what the minimum was named from; the cost model's peak is an upper
    # bound of it and is not asked to fit (on this tiny model it is above the cap)
    assert record.memory.peak_bytes == auto.analysed_peak_bytes <= allocated_cap_bytes(minimum)
    assert auto.predicted_peak_bytes >= record.memory.peak_bytes


def test_the_plans_of_least_memory_are_the_cost_models_and_checkpointing_every_block():
    for seed in range(4):
        model = CostModel(make_problem(seed, n_blocks=5))
        n, N = model.n_chunks, model.n_blocks
        configs = activations.least_memory_configs(model, n, 0)
        assert configs[0] == least_memory_config(model)
        assert configs[-1] == dataclasses.replace(configs[0], n_swap=0, n_checkpoint=N)
        assert len(configs) == len(set(configs))
        offload = autooffload.least_memory_candidates(model)
        assert [(c.n_persist, c.n_buffer) for c in offload] == [(0, model.min_buffers(0))] * len(offload)
        assert (offload[-1].n_swap, offload[-1].n_checkpoint) == (0, N)


def test_checkpointing_every_block_is_tried_for_the_minimum_when_the_cost_model_misjudges_swaps(monkeypatch):
    """The cost model's least config is its own guess. Here it is made wrong (its Problem claims the
    swaps free their blocks at once, where copies that never finish free nothing): it picks a swap
    plan, and checkpointing every block, tried too and judged by the analysis, names the minimum,
    which then trains. (The host is said to be apart, as a card's is, so that the CPU plans swaps.)"""
    real = activations.activation_problem

    def optimistic(record):
        problem = real(record)
        blocks = tuple(dataclasses.replace(b, swap_bytes=b.saved_bytes, swap_parts=()) for b in problem.blocks)
        return dataclasses.replace(problem, blocks=blocks, place_d2h_bytes_per_s=1e30, place_h2d_bytes_per_s=1e30)

    monkeypatch.setattr(activations, "activation_problem", optimistic)
    slow = {"d2h_bytes": 1.0, "h2d_bytes": 1.0, "host_memory_apart": True}
    options = {"codegen": "eager", "machine": slow}

    def analysed(plan) -> int:
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        torch.compile(GPT(CONFIG), backend="protrain", options={**options, "plan": plan})(*_batch()).backward()
        (record,) = _train_graphs()
        return record.memory.peak_bytes

    everything = analysed(interleaved(LABELS, 0, len(LABELS)))
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    with pytest.raises(Exception) as info:
        torch.compile(GPT(CONFIG), backend="protrain", options={**options, "memory_budget": 1_000_000})(*_batch())
    error = _no_plan_fits(info.value)
    assert error is not None
    (record,) = _train_graphs()
    guess = least_memory_config(CostModel(activations.activation_problem(record)))
    assert guess.n_swap > 0  # the cost model's own least swaps ...
    guessed = analysed(interleaved(LABELS, guess.n_swap, guess.n_checkpoint))
    assert guessed > everything  # ... and the analysis puts that above checkpointing every block
    assert error.min_budget_bytes == budget_for_peak(everything)
    assert f"n_swap=0, n_checkpoint={len(LABELS)} of {len(LABELS)} blocks" in str(error)
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    options = {**options, "memory_budget": error.min_budget_bytes}
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options=options)
    compiled(*_batch()).backward()
    (record,) = _train_graphs()
    assert record.auto_plan.how == "least memory" and record.auto_plan.plan == interleaved(LABELS, 0, len(LABELS))
    assert record.memory.peak_bytes == everything


def test_each_input_shape_gets_its_own_plan(no_plan):
    """A new sequence length compiles again (the plan guards on the shapes it was sized for), also
    past the second shape, where Dynamo would otherwise reuse one symbolic graph for every length."""
    budget = budget_for_peak(no_plan["peak"]) - 1  # seq 32 needs a plan, shorter ones fit as they are
    torch.manual_seed(0)
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", "memory_budget": budget})
    for seq_len in (32, 16, 24):
        compiled(*_batch(seq_len)).backward()
    records = _train_graphs()
    assert len(records) == 3
    shapes = [
        {
            tuple(int(s) for s in n.meta["val"].shape)
            for n in r.forward.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor) and n.meta["val"].dtype == torch.int64
        }
        for r in records
    ]
    assert shapes == [{(4, 32)}, {(4, 16)}, {(4, 24)}]  # token ids and targets
    hows = [r.auto_plan.how for r in records]
    assert hows[0] == "searched" and hows[1] == "fits as is"
    peaks = [r.auto_plan.empty_peak_bytes for r in records]
    assert peaks[0] == no_plan["peak"] and peaks[1] < peaks[2] < peaks[0]
    for r in records:
        assert r.memory.peak_bytes <= allocated_cap_bytes(budget)


def test_offloaded_model_keeps_its_hand_settings():
    """A model offloaded with protrain_fx.offload is not planned: the budget is only checked."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=64 * 1024)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": "1MiB"})
    compiled(*_batch()).backward()  # far below any plan's minimum: no NoPlanFits
    (record,) = _train_graphs()
    assert record.auto_plan is None and record.plan is None and record.gathered


# --------------------------------------------------------------------------- no options: the device's budget


def test_reachable_bytes_is_the_cap_bounded_by_what_is_there():
    gib = 2**30
    assert reachable_bytes(100 * gib, 1.0, 30 * gib, 10 * gib) == 40 * gib  # free + own cache
    assert reachable_bytes(100 * gib, 0.25, 30 * gib, 10 * gib) == 25 * gib  # the per-process cap
    assert reachable_bytes(100 * gib, 0.5, 0, 0) == 0
    assert device_budget_bytes("cpu") is None and device_budget_bytes(torch.device("meta")) is None


def _device_budget(monkeypatch, budget):
    """Make ``planner_budget.device_budget_bytes`` report ``budget`` for any device; returns the devices
    it was asked about."""
    asked = []

    def fake(device):
        asked.append(torch.device(device))
        return budget

    monkeypatch.setattr(planner_budget, "device_budget_bytes", fake)
    return asked


def test_device_budget_below_the_peak_chooses_a_plan(no_plan, monkeypatch):
    """With no memory_budget, the step is planned for what the device reports (faked here)."""
    budget = budget_for_peak(no_plan["peak"]) - 1
    asked = _device_budget(monkeypatch, budget)
    record, exact = _compile_and_step(None, steps=1)
    assert exact and asked == [torch.device("cpu")]
    auto = record.auto_plan
    assert auto.how == "searched" and auto.budget_source == record.budget.source == "device"
    assert auto.budget_bytes == record.budget.bytes == budget
    assert record.config.memory_budget_bytes is None  # the user's options stay as given
    assert record.memory.peak_bytes <= auto.allocated_cap_bytes == allocated_cap_bytes(budget)
    assert "(reachable on the device)" in auto.table()
    assert "what this process can reach on the device" in protrain_fx.step_report().block_table()


def test_a_budget_above_what_the_device_has_is_planned_for_the_device(no_plan, monkeypatch, logged):
    """A plan that fits the user's larger number would run out of memory on the device."""
    device_budget = budget_for_peak(no_plan["peak"]) - 1
    _device_budget(monkeypatch, device_budget)
    record, exact = _compile_and_step(10 * device_budget, steps=1)
    assert exact and record.budget.source == "user"
    assert record.auto_plan.budget_bytes == device_budget and record.auto_plan.how == "searched"
    assert record.budget.bytes == device_budget and record.config.memory_budget_bytes == 10 * device_budget
    assert any("more than this process can reach" in r.getMessage() and r.levelno == logging.WARNING for r in logged)


def test_auto_plan_false_turns_planning_off(no_plan, monkeypatch, logged):
    asked = _device_budget(monkeypatch, 1)  # a device budget nothing fits: must not be used
    budget = budget_for_peak(no_plan["peak"])
    for options in ({"auto_plan": False}, {"auto_plan": False, "memory_budget": budget - 1}):
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", **options})(*_batch()).backward()
        (record,) = _train_graphs()
        assert asked == [] and record.auto_plan is None and record.plan is None
        assert record.memory.peak_bytes == no_plan["peak"]  # compiled as written
    assert any("its memory budget" in r.getMessage() for r in logged)  # the user's budget is checked


# --------------------------------------------------------------------------- measured against predicted


def test_peak_check_arithmetic():
    check = PeakCheck(
        predicted_peak_bytes=1000,
        predicted_start_bytes=300,
        measured_peak_bytes=5000 + 800,  # the step rose 800 above its start: 1100 on the predicted start
        measured_start_bytes=5000,  # with 5000 of other memory (no optimizer state yet, workspaces, ...)
        allocated_cap_bytes=1050,
    )
    assert check.step_peak_bytes == 1100 and check.error_pct == pytest.approx(10.0)
    assert check.over and check.outside_bytes == 100  # held above the graph's analysed peak
    under = dataclasses.replace(check, allocated_cap_bytes=1100)
    assert not under.over and under.outside_bytes == 100
    low = dataclasses.replace(check, measured_peak_bytes=5000 + 650)
    assert low.step_peak_bytes == 950 and low.error_pct == pytest.approx(-5.0) and not low.over
    assert low.outside_bytes == 0
    # above the cap by less than the tolerance (noise inside the allocator headroom): not a miss, and said so
    noise = dataclasses.replace(check, allocated_cap_bytes=int(1100 / (1 + result.MISS_TOLERANCE / 2)))
    assert noise.step_peak_bytes > noise.allocated_cap_bytes and not noise.over
    assert "tolerance: not a miss" in noise.line() and "tolerance" not in check.line()
    edge = dataclasses.replace(check, allocated_cap_bytes=int(1100 / (1 + 2 * result.MISS_TOLERANCE)))
    assert edge.over


def test_first_step_bookkeeping_and_a_miss_reserves_what_it_measured(no_plan, monkeypatch, logged):
    budget = budget_for_peak(no_plan["peak"]) - 1
    _device_budget(monkeypatch, budget)
    record, _ = _compile_and_step(None, steps=1)
    auto, memory = record.auto_plan, record.memory
    start = sum(memory.timeline.baseline_bytes.values())
    rise = memory.peak_bytes - start
    del logged[:]

    # the step did not raise the process' peak: unknown, nothing stored
    assert record_first_step(record, (10_000, 10**9), (10_000, 10**9)) is None
    assert auto.peak_check is None and auto.measured_peak_bytes is None
    assert any("not measured" in r.getMessage() for r in logged)

    # as predicted: stored, logged, no warning
    check = record_first_step(record, (10_000, 20_000), (10_000, 10_000 + rise))
    assert auto.peak_check is check and auto.measured_peak_bytes == memory.peak_bytes
    assert check.error_pct == 0 and not auto.replan
    assert not [r for r in logged if r.levelno >= logging.WARNING]
    assert "first step measured peak" in auto.table()
    assert STATE.measured_outside == {memory.device: 0}  # nothing around the graph

    # above the cap inside the tolerance: logged as such, no miss, what it held above is kept
    inside = auto.allocated_cap_bytes + 1
    check = record_first_step(record, (10_000, 20_000), (10_000, 10_000 + inside - start))
    assert not check.over and not auto.replan and "not a miss" in check.line()
    assert not [r for r in logged if r.levelno >= logging.WARNING]
    assert STATE.measured_outside == {memory.device: inside - memory.peak_bytes}

    # above the cap: a warning naming the numbers, the flag, and the next plan keeps what was measured
    over = int(auto.allocated_cap_bytes * (1 + 2 * result.MISS_TOLERANCE))
    check = record_first_step(record, (10_000, 20_000), (10_000, 10_000 + over - start))
    assert check.over and auto.replan and auto.measured_peak_bytes == over
    (warning,) = [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    assert str(over) in warning and str(memory.peak_bytes) in warning and "as measured" in warning
    outside = check.outside_bytes
    assert outside == over - memory.peak_bytes == STATE.measured_outside[memory.device]

    # a device with room for the empty step once the measured bytes are kept: planned again, not as is
    budget = budget_for_peak(no_plan["peak"] + outside // 2)
    assert allocated_cap_bytes(budget) - outside < no_plan["peak"]
    _device_budget(monkeypatch, budget)
    torch._dynamo.reset()
    torch.manual_seed(0)
    torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})(*_batch()).backward()
    (later,) = [g for g in _train_graphs() if g is not record]
    assert later.auto_plan.reserve_bytes == outside and later.auto_plan.reserve_source == "measured"
    assert later.auto_plan.allocated_cap_bytes == allocated_cap_bytes(budget) - outside
    assert later.auto_plan.how != "fits as is"  # without the reserve the step fits as is under this budget
    assert budget_verdict(no_plan["peak"], budget) == "fits"
    assert later.memory.peak_bytes <= later.auto_plan.allocated_cap_bytes
    assert "measured in a first step" in later.auto_plan.table()
    protrain_fx.reset()
    assert STATE.measured_outside == {}


def test_the_first_training_call_is_measured_once_after_its_backward(no_plan, monkeypatch):
    """``watch_first_step`` driven on the CPU: the counters are read when the first forward starts
    and when its backward pass ends, and never again."""
    _device_budget(monkeypatch, budget_for_peak(no_plan["peak"]))  # fits as is: planned, measured
    reads = []
    phase = {"now": "before"}

    def counters(device):
        reads.append((device, phase["now"]))
        return (1000, 2000) if len(reads) == 1 else (1000, 1000 + 12345)

    monkeypatch.setattr(first_step, "memory_counters", counters)
    torch.manual_seed(0)
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})
    phase["now"] = "forward"
    loss = compiled(*_batch())
    phase["now"] = "backward"
    loss.backward()
    phase["now"] = "after"
    (record,) = _train_graphs()
    assert reads == [(torch.device("cpu"), "forward"), (torch.device("cpu"), "backward")]
    assert record.auto_plan.how == "fits as is"
    check = record.auto_plan.peak_check
    assert check.measured_start_bytes == 1000 and check.measured_peak_bytes == 1000 + 12345
    assert check.predicted_peak_bytes == record.memory.peak_bytes
    with torch.no_grad():
        compiled(*_batch())
    compiled(*_batch()).backward()
    assert len(reads) == 2


def test_step_check_arithmetic():
    check = rates.StepCheck(predicted_step_s=0.2, intervals_s=(0.26, 0.25, 0.1, 0.25, 0.3))
    assert check.measured_step_s == 0.25  # the median: one odd interval does not move it
    assert check.error_pct == pytest.approx(-20.0)  # predicted faster than measured
    assert "250.0 ms" in check.line() and "200.0 ms predicted (-20.0%)" in check.line()
    slow = dataclasses.replace(check, predicted_step_s=0.3)
    assert slow.error_pct == pytest.approx(20.0)


def test_the_step_period_is_measured_over_training_calls_3_to_8(no_plan, monkeypatch, logged):
    """The starts of the training calls are timed (a driven clock); calls without grad do not count;
    after the eighth the median interval of calls 3..8 is stored, logged and in the plan table, and
    the clock is not read again."""
    _device_budget(monkeypatch, budget_for_peak(no_plan["peak"]))  # fits as is: planned
    ticks = iter([0.0, 50.0, 100.0, 100.1, 100.3, 100.6, 101.0, 101.5])  # intervals 3..8: .1 .2 .3 .4 .5
    monkeypatch.setattr(first_step, "_clock", lambda: next(ticks))
    torch.manual_seed(0)
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})
    for call in range(8):
        compiled(*_batch()).backward()
        with torch.no_grad():
            compiled(*_batch())
        (record,) = _train_graphs()
        if call < 7:
            assert record.auto_plan.step_check is None, call
    check = record.auto_plan.step_check
    assert check.intervals_s == pytest.approx((0.1, 0.2, 0.3, 0.4, 0.5))
    assert check.measured_step_s == pytest.approx(0.3)
    assert check.predicted_step_s == record.auto_plan.estimate.step_s
    assert any("step period measured 300.0 ms" in r.getMessage() for r in logged)
    assert "step period measured" in record.auto_plan.table()
    compiled(*_batch()).backward()  # the ticks are used up: a ninth read would raise StopIteration


def test_the_step_period_is_split_into_the_graph_the_code_around_it_and_the_optimizer(no_plan, monkeypatch, logged):
    """The loss computed outside the model, clipping and an optimizer step per call: each timed call's
    period is split at its marks (a driven clock, one tick per mark: the call's start, the forward's
    return, the backward reaching the logits, the backward's end, before and after
    ``optimizer.step()``, the next call's start) into forward, loss, backward, optimizer and the
    rest. The cost model's part (forward, backward, optimizer) is set against its prediction, and the
    step predicted with the code around the graph as measured is in the line, and so is the step as
    first predicted, with the loss on the returned logits estimated at the device's memory rate."""
    _device_budget(monkeypatch, 4 * budget_for_peak(no_plan["peak"]))
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)  # the tiny GPT's logits count as large
    ticks = itertools.count()
    monkeypatch.setattr(first_step, "_phase_clock", lambda: float(next(ticks)))
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    for call in range(8):
        idx, targets = _batch()
        logits = compiled(idx)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            compiled(idx)  # not a training call: no mark
        (record,) = _train_graphs()
        if call < 7:
            assert record.auto_plan.step_check is None, call
    check = record.auto_plan.step_check
    assert check.phases == rates.StepPhases(forward_s=1.0, loss_s=1.0, backward_s=1.0, optimizer_s=1.0, rest_s=2.0)
    e = record.auto_plan.estimate
    assert check.predicted_priced_s == pytest.approx(e.fwd_s + e.bwd_s + e.opt_s)
    assert check.priced_error_pct == pytest.approx(100 * (check.predicted_priced_s / 3.0 - 1))
    assert check.with_around_s == pytest.approx(e.step_s + 3.0)
    line = check.line()
    assert "forward 1000.0 ms, loss 1000.0, backward 1000.0, optimizer 1000.0, rest 2000.0" in line
    assert "the graph and the optimizer 3000.0 ms against" in line
    assert any("the code around the graph as measured" in r.getMessage() for r in logged)
    cpu = machine_for(torch.device("cpu"))
    numel = 4 * 32 * CONFIG.vocab_size
    estimated = numel * reserve.OUTSIDE_LOSS_BYTES_PER_ELEMENT / (cpu.hbm_bytes * cpu.hbm_efficiency)
    assert record.auto_plan.around_estimate_s == pytest.approx(estimated) and estimated > 0
    assert check.predicted_around_s == record.auto_plan.around_estimate_s
    assert check.first_estimate_s == pytest.approx(e.step_s + estimated)
    assert f"with it estimated before the first step ({estimated * 1e3:.1f} ms)" in line
    assert f"about {estimated * 1e3:.1f} ms a step estimated" in record.auto_plan.table()
    reads = next(ticks)
    optimizer.step()  # the hooks are removed with the window: no further mark
    compiled(idx).sum().backward()
    assert next(ticks) == reads + 1


def test_with_accumulation_the_plan_is_for_the_accumulated_step_and_one_step_of_calls_is_timed(
        no_plan, monkeypatch, logged):
    """``accumulation_steps=4``: the problem the plan was chosen on prices four micro-batches and one
    optimizer step, and the step period is four training calls from the third (each call a
    micro-batch): their intervals added, whichever micro-batch the window starts at."""
    _device_budget(monkeypatch, budget_for_peak(no_plan["peak"]))
    ticks = iter([0.0, 50.0, 100.0, 100.1, 100.2, 100.3, 101.0])  # intervals 3..7: .1 .1 .1 .7
    monkeypatch.setattr(first_step, "_clock", lambda: next(ticks))
    torch.manual_seed(0)
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager", "accumulation_steps": 4})
    for call in range(7):
        compiled(*_batch()).backward()
        (record,) = _train_graphs()
        if call < 6:
            assert record.auto_plan.step_check is None, call
    auto = record.auto_plan
    assert auto.problem.accumulation == 4
    one = dataclasses.replace(auto.problem, accumulation=1)
    assert auto.estimate.step_s > CostModel(one).estimate(auto.config).step_s  # four micro-batches
    check = auto.step_check
    assert check.calls == (3, 7) and check.calls_per_step == 4
    assert check.intervals_s == pytest.approx((0.1, 0.1, 0.1, 0.7))
    assert check.measured_step_s == pytest.approx(1.0)
    assert check.phases is None  # a call's period holds the optimizer step of one call in four: not split
    compiled(*_batch()).backward()  # the ticks are used up: another read would raise StopIteration
    from protrain_fx.config import parse_options

    for bad in (0, 2.0, "4", True):
        with pytest.raises(ValueError, match="option 'accumulation_steps'"):
            parse_options({"accumulation_steps": bad})


@pytest.mark.parametrize("said", [False, True])
def test_gradients_held_into_a_training_call_are_counted_or_named(no_plan, monkeypatch, logged, said):
    """A loop that accumulates micro-batches: with ``accumulation_steps`` the plan counts the gradients
    held into the second call (``StepGraphs.held_gradients``) and nothing is said; without it, the
    second call finds them, and one warning names their bytes and the option."""
    _device_budget(monkeypatch, budget_for_peak(no_plan["peak"]))
    torch.manual_seed(0)
    model = GPT(CONFIG)
    options = {"codegen": "eager", **({"accumulation_steps": 2} if said else {})}
    compiled = torch.compile(model, backend="protrain", options=options)
    for _ in range(4):
        compiled(*_batch()).backward()
    (record,) = _train_graphs()
    assert record.step.held_gradients is said
    held = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert (record.memory.timeline.baseline_bytes.get("gradient") == held) is said
    warned = [r.getMessage() for r in logged if "holding" in r.getMessage()]
    if said:
        assert not warned
    else:
        (message,) = warned
        assert human_bytes(held) in message and "accumulation_steps" in message


def test_a_measured_miss_compiles_the_graph_again_under_the_lowered_cap(no_plan, monkeypatch, logged):
    """The first step measured 3% over its cap (counters driven on the CPU): the graph is removed
    from Dynamo's cache, its next call compiles it again under the cap lowered by the miss (here a
    searched plan where the step had fitted as is), and training goes on exactly like eager."""
    budget = int(budget_for_peak(no_plan["peak"]) * 1.05)  # the step fits as is; 3% under it a plan does
    _device_budget(monkeypatch, budget)
    state = {"reads": 0, "peak": 0}

    def counters(device):
        state["reads"] += 1
        return (1000, 2000) if state["reads"] % 2 else (1000, 1000 + state["peak"])

    monkeypatch.setattr(first_step, "memory_counters", counters)
    resets = []
    monkeypatch.setattr(first_step, "reset_peak", resets.append)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    for step in range(3):
        batch = _batch(seed=step)
        loss, ref_loss = compiled(*batch), reference(*batch)
        newest = _train_graphs()[-1]
        start = sum(newest.memory.timeline.baseline_bytes.values())
        if step == 0:
            first = newest
            state["peak"] = int(first.auto_plan.allocated_cap_bytes * 1.03) - start  # the step's rise
        else:  # the plan compiled again peaks as predicted
            state["peak"] = newest.memory.peak_bytes - start
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), step
        assert all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters())), step
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        if step == 0:
            assert first.auto_plan.replan and first.auto_plan.recompile
    assert first.auto_plan.how == "fits as is"
    (warning,) = [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    assert "compiled again at its next call (forward)" in warning
    second, = [g for g in _train_graphs() if g is not first]  # compiled once more, then reused
    outside = first.auto_plan.peak_check.outside_bytes
    assert outside == pytest.approx(1.03 * first.auto_plan.allocated_cap_bytes - first.memory.peak_bytes, abs=2)
    assert allocated_cap_bytes(budget) - outside < no_plan["peak"]  # the lowered cap needs a plan
    assert second.auto_plan.reserve_bytes == outside and second.auto_plan.reserve_source == "measured"
    assert second.auto_plan.how == "searched" and second.memory.peak_bytes <= second.auto_plan.allocated_cap_bytes
    assert second.auto_plan.peak_check is not None and not second.auto_plan.replan  # measured under its cap
    # the step that missed made the process' peak: reset once, so that the new plan's step is measured
    assert resets == [torch.device("cpu")]


def test_a_compile_that_raised_the_peak_resets_it_once_before_the_first_step(no_plan, monkeypatch):
    """The compile runs inside the user's first call (machine measurements, trial placements), so
    when it raised the device's peak the backend resets the statistics before the step (else the
    step's peak stays under the compile's and goes unmeasured); a compile that raised nothing
    resets nothing."""
    _device_budget(monkeypatch, budget_for_peak(no_plan["peak"]))
    events = []
    state = {"max": 5000}

    def counters(device):
        events.append("read")
        return 1000, state["max"]

    def reset(device):
        events.append(("reset", device))
        state["max"] = 1000

    monkeypatch.setattr(first_step, "memory_counters", counters)
    monkeypatch.setattr(first_step, "reset_peak", reset)
    for before, resets in ((4000, 1), (5000, 0)):
        events.clear()
        state["max"] = 5000
        monkeypatch.setattr(first_step, "peaks_at_compile_start", lambda: {torch.device("cpu"): before})
        monkeypatch.setattr(backend, "peaks_at_compile_start", lambda: {torch.device("cpu"): before})
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})
        loss = compiled(*_batch())
        state["max"] += 777  # the step's own peak
        loss.backward()
        assert events == ["read"] + [("reset", torch.device("cpu"))] * resets + ["read", "read"]
        (record,) = _train_graphs()
        check = record.auto_plan.peak_check
        # after a reset the step's own rise; without one the peak the process already had
        assert check.measured_peak_bytes == (1000 if resets else 5000) + 777


# --------------------------------------------------------------------------- what fits, without training


def test_what_fits_answers_like_training_would_and_runs_nothing(no_plan):
    """The report's plan is the one training runs under the same budget; its minimum is the smallest
    budget training accepts; and nothing ran: no gradient, no parameter changed."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    before = [p.detach().clone() for p in model.parameters()]
    tight = budget_for_peak(no_plan["peak"]) - 1  # the step as it is does not fit
    report = protrain_fx.what_fits(model, *_batch(), memory_budget=tight, options={"codegen": "eager"})
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert report.fits and report.budget_bytes == tight and report.budget_source == "user"
    assert report.plan.blocks_with("checkpoint") or report.plan.blocks_with("swap")
    assert report.min_budget_bytes < tight
    assert str(report).startswith(f"graph {report.graph}: budget")
    protrain_fx.reset()
    record, exact = _compile_and_step(tight, steps=1)
    assert exact and record.auto_plan.plan == report.plan
    # the minimum trains; one byte less is refused, naming the same minimum
    torch._dynamo.reset()
    protrain_fx.reset()
    record, exact = _compile_and_step(report.min_budget_bytes, steps=1)
    assert exact and record.auto_plan is not None
    torch._dynamo.reset()
    protrain_fx.reset()
    short = protrain_fx.what_fits(GPT(CONFIG), *_batch(), memory_budget=report.min_budget_bytes - 1,
                                  options={"codegen": "eager"})
    assert not short.fits and short.plan is None and short.min_budget_bytes == report.min_budget_bytes
    with pytest.raises(Exception) as info:
        _compile_and_step(report.min_budget_bytes - 1, steps=1)
    assert _no_plan_fits(info.value).min_budget_bytes == report.min_budget_bytes


@pytest.mark.parametrize("fits", [True, False])
def test_what_fits_leaves_no_record_and_says_the_peak_training_then_reports(fits):
    """The graphs what_fits captured to answer are not listed by step_report(), and the peak it predicts
    is the one the training compile of the same step, under the same autocast, judges and reports."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bare = protrain_fx.what_fits(model, *_batch(), options={"codegen": "eager"}).predicted_peak_bytes  # no plan
        budget = budget_for_peak(bare) * (2 if fits else 1) - (0 if fits else 1)
        options = {"codegen": "eager", "memory_budget": budget}
        report = protrain_fx.what_fits(model, *_batch(), memory_budget=budget, options={"codegen": "eager"})
        assert protrain_fx.captured_graphs() == []
        loss = torch.compile(model, backend="protrain", options=options)(*_batch())
    loss.backward()
    (record,) = protrain_fx.captured_graphs()
    assert record.index == 0 and (record.auto_plan.how == "fits as is") is fits
    assert report.fits and report.plan == record.auto_plan.plan
    assert report.predicted_peak_bytes == record.auto_plan.analysed_peak_bytes == record.memory.peak_bytes
    assert "DOES NOT FIT" not in str(protrain_fx.step_report())


def test_what_fits_with_inductors_code_on_the_cpu_says_the_peak_the_training_report_gives():
    """On the CPU a plan is judged by the graph-level analysis, while the compile's report gives the peak
    of Inductor's allocation plan (values it fuses away, buffers it reuses): what_fits lowers the plan it
    chose once and says that peak, the one ``step_report()`` then shows. Three blocks, not the module's
    four (a lowering of each fewer): a plan is still needed and the two peaks still differ (with two, no
    plan fits a budget one byte under the bare step's)."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bare = protrain_fx.what_fits(model, *_batch(), options={"codegen": "eager"}).predicted_peak_bytes
        budget = budget_for_peak(bare) - 1  # a plan is needed
        report = protrain_fx.what_fits(model, *_batch(), memory_budget=budget)
        assert protrain_fx.captured_graphs() == []
        loss = torch.compile(model, backend="protrain", options={"memory_budget": budget})(*_batch())
    loss.backward()
    (record,) = protrain_fx.captured_graphs()
    assert record.auto_plan.judged_by == "graph" and record.memory_unfused is not None  # judged without lowering
    assert record.memory.peak_bytes != record.memory_unfused.peak_bytes  # the two analyses differ here
    assert report.fits and report.plan == record.auto_plan.plan
    assert report.predicted_peak_bytes == record.memory.peak_bytes == protrain_fx.step_report().predicted_peak_bytes


def test_what_fits_without_a_budget_names_the_minimum_and_refuses_plans_by_hand(no_plan):
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    trained = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})
    trained(*_batch()).backward()
    report = protrain_fx.what_fits(GPT(CONFIG), *_batch(), options={"codegen": "eager"})
    trained(*_batch()).backward()  # another compiled model keeps its graph: nothing captured again
    assert len(_train_graphs()) == 1  # its own: the query's graph is forgotten
    assert report.budget_bytes is None and report.fits
    assert not report.plan.blocks_with("checkpoint") and not report.plan.blocks_with("swap")  # the step as it is
    assert report.least_memory_plan.blocks_with("checkpoint")
    assert report.min_budget_bytes < budget_for_peak(no_plan["peak"])  # checkpointing saves memory
    assert "no memory budget given" in str(report)
    with pytest.raises(ValueError, match="must choose the plan"):
        protrain_fx.what_fits(GPT(CONFIG), *_batch(), options={"auto_plan": False})


def _raise_fixture(outcomes: dict, steps: dict):
    """``search_at`` and ``run`` over plain numbers for :func:`verify.raised_choice`: a cap of 100,
    the search returns config ``"fast"`` when the cap is raised by at least 10, else ``"slow"``;
    ``outcomes`` maps a config's n_persist to (predicted, analysed) peaks; ``steps`` to its step."""
    from protrain_fx.search.problem import Counts, Estimate
    from protrain_fx.search.search import SearchResult

    def result(p: int) -> SearchResult:
        est = Estimate(steps[p], outcomes[p][0], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        return SearchResult(Counts(p, 0, 0, 0), est, 1, 0, 0, 1, 0.0)

    runs: list[int] = []
    trials: list[verify.Trial] = []

    def search_at(lowered: int) -> SearchResult:
        return result(2 if lowered <= -10 else 1)

    def run(config) -> verify.Trial:
        runs.append(config.n_persist)
        t = verify.Trial(config, *outcomes[config.n_persist])
        trials.append(t)
        return t

    first = result(1)
    return first, run(first.best), search_at, run, runs, trials


def test_raised_search_keeps_a_faster_plan_only_when_the_analysis_fits():
    # The config that fitted was predicted at 100 but analysed at 80: the search runs again with the
    # cap raised by 20 and finds a faster config, analysed under the cap: it is kept.
    first, fitted, search_at, run, runs, trials = _raise_fixture({1: (100, 80), 2: (115, 95)}, {1: 1.0, 2: 0.5})
    kept = verify.raised_choice(search_at, run, first, fitted, trials, 100)
    assert kept.best.n_persist == 2 and runs == [1, 2]  # no third try: the same config comes back
    # Analysed above the cap: the config that fitted is applied again (the record holds its graphs).
    first, fitted, search_at, run, runs, trials = _raise_fixture({1: (100, 80), 2: (115, 101)}, {1: 1.0, 2: 0.5})
    kept = verify.raised_choice(search_at, run, first, fitted, trials, 100)
    assert kept.best.n_persist == 1 and runs == [1, 2, 1]
    # Predicted less than RAISE_MIN_GAIN faster: not worth a rewrite and an analysis.
    first, fitted, search_at, run, runs, trials = _raise_fixture({1: (100, 80), 2: (115, 95)}, {1: 1.0, 2: 0.99})
    kept = verify.raised_choice(search_at, run, first, fitted, trials, 100)
    assert kept.best.n_persist == 1 and runs == [1]
    # The raise is the fitted config's ratio, not its difference: analysed at 37, predicted 8 above,
    # a config predicted up to 100 * 45 / 37 = 121.6 analyses under the cap of 100 if the ratio holds
    # (the fixture finds the faster config from a raise of 10 on; a raise of 8 would not reach it).
    first, fitted, search_at, run, runs, trials = _raise_fixture({1: (45, 37), 2: (115, 95)}, {1: 1.0, 2: 0.5})
    assert verify.raised_choice(search_at, run, first, fitted, trials, 100).best.n_persist == 2 and runs == [1, 2]
    # No margin (the analysis at or above the cost model): no raise.
    first, fitted, search_at, run, runs, trials = _raise_fixture({1: (100, 100), 2: (115, 95)}, {1: 1.0, 2: 0.5})
    assert verify.raised_choice(search_at, run, first, fitted, trials, 100).best.n_persist == 1 and runs == [1]


def test_a_raised_config_above_the_cap_is_left_out_and_the_search_runs_again_under_it():
    # B24 4.2B at 24 GiB in miniature (``docs/results.md#the-raised-search``): raised from 3/3/0/35/11
    # the search can pick a config analysed over the cap while one predicted just under it fits. Here
    # the config that fitted (1) was predicted 20 above its analysis: raised by 25, the search finds 3 (predicted
    # 119, analysed over the cap); under 119 (a raise of 18) it finds 2, which fits and is kept. The
    # raise from 2 finds 3 again, tried: done, with 2's graphs in the record.
    from protrain_fx.search.problem import Counts, Estimate
    from protrain_fx.search.search import SearchResult

    def fixture(outcomes):
        runs, trials = [], []

        def result(p):
            return SearchResult(Counts(p, 0, 0, 0), Estimate(1.0 / p, outcomes[p][0], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                                1, 0, 0, 1, 0.0)

        def search_at(lowered):
            return result(3 if -lowered >= 20 else 2 if -lowered >= 10 else 1)

        def run(config):
            runs.append(config.n_persist)
            trials.append(verify.Trial(config, *outcomes[config.n_persist]))
            return trials[-1]

        first = result(1)
        return verify.raised_choice(search_at, run, first, run(first.best), trials, 100), runs

    kept, runs = fixture({1: (100, 80), 2: (115, 95), 3: (119, 101)})
    assert kept.best.n_persist == 2 and runs == [1, 3, 2]
    # 2 over the cap too: under 115 (a raise of 14) the search finds 2 again, tried; 1 is applied again
    kept, runs = fixture({1: (100, 80), 2: (115, 101), 3: (119, 101)})
    assert kept.best.n_persist == 1 and runs == [1, 3, 2, 1]
    # the lowered cap would be at or under the cap itself: no search under it
    kept, runs = fixture({1: (100, 80), 2: (115, 95), 3: (100, 101)})
    assert kept.best.n_persist == 1 and runs == [1, 3, 1]


def test_after_an_overshoot_the_next_raise_is_where_the_line_through_both_trials_meets_the_cap():
    # B24 4.2B at 40 GiB in miniature (``docs/results.md#the-raised-search``): every config is predicted 20 above
    # its analysis. From 1 (100, 80) the ratio's raise of 25 finds 5 (125, 105), over the cap of 100.
    # One step under it would find 4 (124, 104) and 3 (122, 102), both over, and the raises would run
    # out; the line through (100, 80) and (125, 105) meets the cap at a predicted 120, where the
    # search finds 2 (120, 100), which fits.
    from protrain_fx.search.problem import Counts, Estimate
    from protrain_fx.search.search import SearchResult

    outcomes = {1: (100, 80), 2: (120, 100), 3: (122, 102), 4: (124, 104), 5: (125, 105)}
    runs, trials = [], []

    def result(p):
        return SearchResult(Counts(p, 0, 0, 0), Estimate(1.0 / p, outcomes[p][0], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                            1, 0, 0, 1, 0.0)

    def search_at(lowered):  # the fastest config predicted at most 100 - lowered
        return result(max(p for p, (pred, _) in outcomes.items() if pred <= 100 - lowered))

    def run(config):
        runs.append(config.n_persist)
        trials.append(verify.Trial(config, *outcomes[config.n_persist]))
        return trials[-1]

    first = result(1)
    kept = verify.raised_choice(search_at, run, first, run(first.best), trials, 100)
    assert kept.best.n_persist == 2 and runs == [1, 5, 2]
    # the line alone: never at or above the overshooting config's own prediction
    fitted, over = verify.Trial(Counts(1, 0, 0, 0), 100, 80), verify.Trial(Counts(5, 0, 0, 0), 125, 105)
    assert verify.lowered_raise(fitted, over, 100) == 20
    just_over = verify.Trial(Counts(5, 0, 0, 0), 125, 101)  # the line meets the cap at 100 + 20 * 25 / 21
    assert verify.lowered_raise(fitted, just_over, 100) == 23
    lower = verify.Trial(Counts(5, 0, 0, 0), 99, 101)  # predicted under the fitted config: no line, and no raise
    assert verify.lowered_raise(fitted, lower, 100) == -2


def test_widened_moves_a_negative_reserve_into_the_budget():
    assert verify.widened(100, 10) == (100, 10)
    assert verify.widened(100, -10) == (110, 0)
    assert verify.widened(100, 0) == (100, 0)


def test_verify_inductor_judges_plans_by_inductors_own_allocation_plan():
    # A step whose loss Inductor computes without storing the fp32 logits-sized values the graph
    # analysis counts (8192-token vocabulary): at a budget between the two peaks, verify="inductor"
    # keeps the step as it is, with the peak it then compiles to, and the graph-level judge refuses.
    cfg = gpt_config("tiny", n_layer=2, vocab_size=8192, block_size=128)
    batch = random_batch(cfg, 4, 128, generator=torch.Generator().manual_seed(0))

    def step(options):
        protrain_fx.reset()
        torch.manual_seed(0)
        model = GPT(cfg)
        loss = torch.compile(model, backend="protrain", options=options)(*batch)
        loss.backward()
        (rec,) = protrain_fx.captured_graphs()
        return rec, {n: p.grad for n, p in model.named_parameters()}

    plain, grads = step({"auto_plan": False})
    inductor_peak, graph_peak = plain.memory.peak_bytes, plain.memory_unfused.peak_bytes
    budget = planner_budget.budget_for_peak(inductor_peak)
    assert graph_peak > planner_budget.allocated_cap_bytes(budget) >= inductor_peak

    counters = torch._dynamo.utils.counters["inductor"]
    hits, misses = counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]
    judged, judged_grads = step({"memory_budget": budget, "verify": "inductor"})
    # the analysis puts the step as it is far over the cap: the plan it would choose is lowered first (its
    # two graphs: two misses), comes out far below its analysis, and the step as it is is lowered then. That
    # trial lowers the graphs the plain compile lowered, with the arguments AOTAutograd gives Inductor:
    # Inductor's cache holds them (with the allocation plans kept beside), and the compile after the trial
    # hits the cache too (protrain_fx/lowering.py)
    assert (counters["fxgraph_cache_hit"] - hits, counters["fxgraph_cache_miss"] - misses) == (4, 2)
    assert judged.auto_plan.how == "fits as is" and judged.probe_inductor is None
    assert judged.auto_plan.judged_by == "inductor" and judged.auto_plan.analysed_peak_bytes == inductor_peak
    assert "in Inductor's allocation plan" in judged.auto_plan.table()
    assert judged.memory.peak_bytes == inductor_peak  # the compile's own plan: what the check read
    for name, g in grads.items():
        torch.testing.assert_close(judged_grads[name], g, rtol=0, atol=0, msg=name)

    # the graph-level judge refuses that budget: even its plan of least memory is above the cap; the
    # refusal names the judge that can fit it
    with pytest.raises(Exception, match=r"no activation plan fits(?s:.*)\{'verify': 'inductor'\} judges by "
                                        r"Inductor's own allocation plan") as refused:
        step({"memory_budget": budget})
    assert refused.value.min_budget_bytes > budget  # NoPlanFits itself, not Dynamo's wrapper


def test_verify_accepts_auto_graph_and_inductor_only_and_auto_lowers_with_inductor_on_cuda_only():
    from protrain_fx.config import parse_options

    assert parse_options(None).verify == "auto"
    assert parse_options({"verify": "inductor"}).verify == "inductor"
    with pytest.raises(ValueError, match="option 'verify': got 'fx'; accepted: 'auto', 'graph', 'inductor'"):
        parse_options({"verify": "fx"})
    auto, eager = parse_options(None), parse_options({"codegen": "eager"})
    assert auto.verify_for("cuda:0") == auto.verify_for(torch.device("cuda", 1)) == "inductor"
    assert auto.verify_for("cpu") == auto.verify_for(torch.device("cpu")) == "graph"
    assert eager.verify_for("cuda:0") == "graph"  # what runs is the graph as analysed
    assert parse_options({"verify": "graph"}).verify_for("cuda:0") == "graph"
    assert parse_options({"verify": "inductor"}).verify_for("cpu") == "inductor"
    with pytest.raises(ValueError, match="but codegen is 'eager'; use codegen='inductor' or verify='graph'"):
        parse_options({"verify": "inductor", "codegen": "eager"})


# --------------------------------------------------------------------------- the code around the graph


def _loss_outside(compiled, batch):
    """The nanoGPT-trainer / torchtitan loop: logits from the compiled model, the loss in eager code."""
    idx, targets = batch
    logits = compiled(idx)
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("repaid", [True, False], ids=["repaid", "not-repaid"])
def test_a_loss_outside_the_graph_is_reserved_measured_and_planned_for(monkeypatch, logged, repaid):
    """The graph returns logits; the loss on them runs in the user's code. The first plan keeps an
    estimate for that code under its cap and names the output; the first step measures what it
    really held (counters driven on the CPU); with that, a faster plan fits, and the graph is
    compiled once more with the measured reserve when what the plan saves repays the compile
    (``repaid``: it does whatever it costs; else the tiny model's microseconds never repay it, and
    the plan stays, with a line that says why). Every step stays exact against eager."""
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)  # the tiny GPT's logits count as large
    if repaid:
        monkeypatch.setattr(first_step, "REPLAN_PAYBACK_STEPS", math.inf)
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})(_batch()[0]).sum().backward()
    (bare,) = _train_graphs()
    peak = bare.memory.peak_bytes
    torch._dynamo.reset()
    protrain_fx.reset()
    numel = 4 * 32 * CONFIG.vocab_size
    budget = budget_for_peak(peak + 4 * numel)  # fits as it is beside 4 bytes a logit, not beside the estimate
    _device_budget(monkeypatch, budget)
    state = {"reads": 0, "rise": 0}

    def counters(device):
        state["reads"] += 1
        return (1000, 2000) if state["reads"] % 2 else (1000, 1000 + state["rise"])

    monkeypatch.setattr(first_step, "memory_counters", counters)
    monkeypatch.setattr(first_step, "reset_peak", lambda device: None)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    for step in range(3):
        batch = _batch(seed=step)
        loss = _loss_outside(compiled, batch)
        newest = _train_graphs()[-1]
        # the user's code held 4 bytes per logit above the graph's analysed peak
        state["rise"] = newest.memory.peak_bytes + 4 * batch[0].numel() * CONFIG.vocab_size \
            - sum(newest.memory.timeline.baseline_bytes.values())
        ref_loss = _loss_outside(reference, batch)
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        assert all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters())), step
        for m in (model, reference):
            m.zero_grad()
    if not repaid:
        (first,) = _train_graphs()
        assert first.auto_plan.reserve_source == "outputs" and not first.auto_plan.recompile
        assert any("not compiled: it would repay" in r.getMessage() for r in logged)
        return
    first, second = _train_graphs()  # compiled once more, then reused
    auto = first.auto_plan
    assert [o.shape for o in auto.returned] == [(4, 32, CONFIG.vocab_size)]
    assert auto.reserve_source == "outputs" and auto.reserve_bytes == reserve.OUTSIDE_BYTES_PER_ELEMENT * numel
    assert auto.how == "searched" and first.memory.peak_bytes <= auto.allocated_cap_bytes
    assert "returned to your code: output 0 (4x32x128 float32" in auto.table()
    assert auto.peak_check.outside_bytes == 4 * numel and not auto.peak_check.over and auto.recompile
    assert second.auto_plan.reserve_source == "measured" and second.auto_plan.reserve_bytes == 4 * numel
    assert second.auto_plan.how == "fits as is"  # the measured 4 bytes a logit leave room for the step as it is
    assert not second.auto_plan.recompile
    assert not [r for r in logged if r.levelno >= logging.WARNING]
