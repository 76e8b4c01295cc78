"""Judged peaks kept (``planner/judged.py``): a config judged once is not rewritten or lowered again, in
the compile of the same graph after its first step, nor at a later launch through the plan cache.

CPU, eager codegen, the tiny GPT of ``test_auto_plan.py`` with its loss computed outside the graph (the
loop that makes the backend compile the graph again once its first step measured the code around it).
Trials are counted by ``AutoPlan.trials_run`` (each a rewrite and its analysis: on CUDA, a lowering of
both graphs) and ``AutoPlan.trials_kept`` (answered from what was judged before)."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain_fx
from examples.gpt import GPT
from protrain_fx.planner import first_step, judged, reserve, verify
from protrain_fx.planner.budget import budget_for_peak
from protrain_fx.state import STATE
from tests.conftest import use_cache_dir
from tests.planner.test_auto_plan import CONFIG, _batch, _device_budget, _loss_outside, _train_graphs, logged  # noqa: F401
from protrain_fx import settings


#: Every test here compiles a graph again after its first step (conftest.replans).
pytestmark = pytest.mark.usefixtures("replans")

#: The backend plans as on a card, whose swaps free device memory (``Machine.host_memory_apart``): the
#: faster plan the first step's measured reserve lets in is a swap one. With the CPU's own setting
#: (checkpointing only) the plans lie too far apart for the measured reserve to reach the next one.
OPTIONS = {"codegen": "eager", "machine": {"host_memory_apart": True}}

def _bare_peak() -> int:
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    torch.compile(GPT(CONFIG), backend="protrain", options=OPTIONS)(_batch()[0]).sum().backward()
    (bare,) = _train_graphs()
    torch._dynamo.reset()
    protrain_fx.reset()
    return bare.memory.peak_bytes


def _train(monkeypatch, budget: int, steps: int, held_per_logit: int = 4):
    """Train the tiny GPT, loss outside, under ``budget`` (the device's, faked), with the first step's
    memory counters driven so that the code around the graph held ``held_per_logit`` bytes a logit above
    the graph's analysed peak; returns the training records and whether every step matched eager."""
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
    compiled = torch.compile(model, backend="protrain", options=OPTIONS)
    exact = True
    for step in range(steps):
        batch = _batch(seed=step)
        loss = _loss_outside(compiled, batch)
        newest = _train_graphs()[-1]
        state["rise"] = newest.memory.peak_bytes + held_per_logit * batch[0].numel() * CONFIG.vocab_size \
            - sum(newest.memory.timeline.baseline_bytes.values())
        ref_loss = _loss_outside(reference, batch)
        exact &= torch.equal(loss, ref_loss)
        loss.backward(), ref_loss.backward()
        exact &= all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
        for m in (model, reference):
            m.zero_grad()
    return _train_graphs(), exact


def _budget_needing_a_plan_before_and_after() -> int:
    """A budget under which the step needs a plan beside both the estimated reserve and the measured one
    (4 bytes a logit), so that the first step finds a faster plan and the graph is compiled again (the
    first plan the least memory's, the second a searched one)."""
    numel = 4 * 32 * CONFIG.vocab_size
    return budget_for_peak(int(0.88 * _bare_peak()) + 4 * numel)


def test_the_compile_again_after_the_first_step_judges_no_config_twice(monkeypatch):
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)  # the tiny GPT's logits count as large
    budget = _budget_needing_a_plan_before_and_after()
    (first, second), exact = _train(monkeypatch, budget, steps=3)
    assert exact
    assert first.auto_plan.recompile and second.auto_plan.reserve_source == "measured"
    a, b = first.auto_plan, second.auto_plan
    assert (a.how, b.how) == ("least memory", "searched") and a.config != b.config
    assert a.trials_run == len({t.config for t in a.trials}) + 1  # each config once, and the empty plan
    assert b.trials_kept >= 1  # at least the first plan was judged before
    judged_first = {t.config: t.analysed_peak_bytes for t in a.trials}
    for t in b.trials:
        if t.config in judged_first:  # the same answer as the first compile's
            assert t.analysed_peak_bytes == judged_first[t.config]
    # what the second compile ran is exactly what the first had not judged
    new = {t.config for t in b.trials} - set(judged_first)
    assert b.trials_run == len(new)
    assert "judged before" in b.table()


def test_kept_judgments_equal_fresh_ones_and_choose_the_same_plan(monkeypatch):
    """The second compile's choice with judgments kept, against the same compile with none kept: the
    same plan, and every config's judged peak equal to the byte. (Both search: the second compile
    does not take the plan its first step promised, ``verify.faster_after_first_step``.)"""
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)
    monkeypatch.setattr(verify, "faster_after_first_step", lambda *args: None)
    budget = _budget_needing_a_plan_before_and_after()
    (_, kept), _ = _train(monkeypatch, budget, steps=2)
    outside = STATE.measured_outside.copy()
    torch._dynamo.reset()
    protrain_fx.reset()
    STATE.measured_outside.update(outside)  # the same measured reserve, nothing judged
    (fresh,), _ = _train(monkeypatch, budget, steps=1)
    assert fresh.auto_plan.trials_kept == 0 and fresh.auto_plan.reserve_source == "measured"
    assert fresh.auto_plan.config == kept.auto_plan.config and fresh.auto_plan.plan == kept.auto_plan.plan
    assert fresh.auto_plan.analysed_peak_bytes == kept.auto_plan.analysed_peak_bytes
    assert fresh.auto_plan.empty_peak_bytes == kept.auto_plan.empty_peak_bytes
    fresh_peaks = {t.config: t.analysed_peak_bytes for t in fresh.auto_plan.trials}
    for t in kept.auto_plan.trials:
        if t.config in fresh_peaks:
            assert t.analysed_peak_bytes == fresh_peaks[t.config]


def test_a_later_launch_at_another_budget_lowers_only_configs_never_judged(monkeypatch, tmp_path):
    """The plan cache keeps the graph's judgments beside its plans: a launch at another budget (a plan
    cache miss) answers the configs judged at the first launch from them."""
    use_cache_dir(monkeypatch, tmp_path)
    monkeypatch.setenv(settings.PLAN_CACHE, "1")
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)
    budget = _budget_needing_a_plan_before_and_after()
    (first, _), _ = _train(monkeypatch, budget, steps=2)
    torch._dynamo.reset()
    protrain_fx.reset()  # a new launch: nothing kept in the process
    assert not judged.KEPT
    (other,), exact = _train(monkeypatch, budget - 1, steps=1)
    assert exact and not other.auto_plan.from_cache
    assert other.auto_plan.trials_kept >= 1  # the empty plan at least: judged at the first launch


def test_a_plan_cache_hit_keeps_its_plan_when_a_grown_reserve_still_leaves_it_room(monkeypatch, tmp_path, logged):  # noqa: F811
    """A relaunch that measured a little more room for the code around the graph than the entry kept
    applies the entry while the plan's judged peak fits the cap that leaves; a reserve grown past that
    is refused and planned again (here nothing fits it)."""
    use_cache_dir(monkeypatch, tmp_path)
    monkeypatch.setenv(settings.PLAN_CACHE, "1")
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)
    budget = _budget_needing_a_plan_before_and_after()
    (_, second), _ = _train(monkeypatch, budget, steps=2)  # the plan kept is chosen with the measured reserve
    auto = second.auto_plan
    device = second.memory.device
    room = auto.allocated_cap_bytes - auto.analysed_peak_bytes  # what the kept plan leaves under its cap
    assert room > 0
    torch._dynamo.reset()
    protrain_fx.reset()
    grown = auto.reserve_bytes + room // 2
    STATE.measured_outside[device] = grown
    (again,), exact = _train(monkeypatch, budget, steps=1)
    assert exact and again.auto_plan.from_cache
    assert again.auto_plan.reserve_bytes == grown
    assert again.auto_plan.allocated_cap_bytes == auto.allocated_cap_bytes + auto.reserve_bytes - grown
    torch._dynamo.reset()
    protrain_fx.reset()
    STATE.measured_outside[device] = auto.reserve_bytes + room + 1
    logged.clear()
    try:
        (again,), _ = _train(monkeypatch, budget, steps=1)
        assert not again.auto_plan.from_cache
    except Exception as e:  # noqa: BLE001 -- Dynamo wraps the planner's refusal
        assert "no activation plan fits" in str(e)
    assert any("plan cache's plan" in r.getMessage() and "is not used" in r.getMessage() for r in logged)
