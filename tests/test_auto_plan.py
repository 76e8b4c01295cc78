"""The automatic activation plan (``protrain_fx.autoplan``): ``options={"memory_budget": ...}`` with no
plan by hand, for a model whose parameters stay on the device.

CPU, eager codegen (bit-exact with eager PyTorch), the tiny GPT with 4 blocks. Budgets are derived
from the step's own analysed peak (never hard-coded), through the same headroom rule the backend uses
(``pipeline.budget_for_peak`` / ``allocated_cap_bytes``). The search restriction is checked against
brute force on synthetic problems (``tests/test_cost_search.py``'s generator).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.autoplan import AutoPlan, least_memory_config, search_activation_plan
from protrain_fx.cost import CostModel, block_plan
from protrain_fx.pipeline import allocated_cap_bytes, budget_for_peak, budget_verdict
from protrain_fx.search import NoPlanFits, search
from tests.test_cost_search import brute_force, budgets, make_problem

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


def _compile_and_step(budget, *, verbose: bool = False, steps: int = 2):
    """Train the compiled model and an eager copy side by side; returns the record and whether the
    losses and gradients were equal bit for bit at every step."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    options = {"codegen": "eager", "memory_budget": budget, "verbose": verbose}
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


def test_budget_the_step_fits_keeps_no_plan(no_plan, caplog):
    budget = budget_for_peak(no_plan["peak"])
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        record, exact = _compile_and_step(budget, steps=1)
    assert exact
    auto = record.auto_plan
    assert isinstance(auto, AutoPlan) and auto.how == "fits as is"
    assert set(auto.plan.blocks) == set(LABELS) and not auto.plan.blocks_with("checkpoint")
    assert not auto.plan.blocks_with("swap") and auto.trials == []
    assert record.config.plan is None and record.swapped == []
    assert record.memory.peak_bytes == auto.analysed_peak_bytes == no_plan["peak"]
    assert budget_verdict(record.memory.peak_bytes, budget) == "fits"
    assert any("automatic activation plan for graph 0" in r.getMessage() for r in caplog.records)


def test_tighter_budget_runs_a_plan_that_fits_exactly_as_eager(no_plan, capfd):
    budget = budget_for_peak(no_plan["peak"]) - 1  # the step as it is no longer fits
    record, exact = _compile_and_step(budget, verbose=True)
    assert exact  # loss and every gradient bit for bit, two steps
    auto = record.auto_plan
    assert auto.how == "searched"
    changed = auto.plan.blocks_with("checkpoint") + auto.plan.blocks_with("swap")
    assert changed
    assert record.config.plan == auto.plan == block_plan(auto.problem, auto.config)
    # the compiled step is the rewritten one: what the plan drops is no longer saved
    saved = {b.block: b.saved_activation_bytes for b in record.memory.blocks}
    for block in changed:
        assert saved[block] < no_plan["saved"][block], block
    if auto.plan.blocks_with("swap"):
        assert record.swapped
    # predicted and analysed peaks fit under the budget with the allocator's headroom
    cap = allocated_cap_bytes(budget)
    assert auto.allocated_cap_bytes == cap < no_plan["peak"]
    assert auto.predicted_peak_bytes <= cap and auto.estimate.peak_bytes == auto.predicted_peak_bytes
    assert record.memory.peak_bytes == auto.analysed_peak_bytes <= cap
    assert budget_verdict(record.memory.peak_bytes, budget) == "fits"
    assert auto.estimate.step_s >= auto.empty_step_s > 0
    # the table, printed with verbose
    err = capfd.readouterr().err
    assert "automatic activation plan for graph 0" in err and "predicted step" in err
    assert f"n_checkpoint={auto.config.n_checkpoint}" in err and "checkpoint" in auto.table()
    assert "automatic activation plan (searched)" in protrain_fx.step_report().block_table()


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
    assert f"at least {minimum} bytes ({minimum / 2**30:.4g} GiB" in message and "memory_budget" in message

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
    assert max(auto.predicted_peak_bytes, record.memory.peak_bytes) <= allocated_cap_bytes(minimum)


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
    assert record.auto_plan is None and record.config.plan is None and record.gathered
