"""A relaunch loads its planned step from AOTAutograd's cache (``protrain_fx/aot_cache.py``): a second
launch of the same loop under the same budget, whose plan the plan cache keeps, runs neither the
partitioner nor Inductor, says so in its record and trains exactly as the first; another budget, a
plan dropped at a first step, and a compile the cache does not serve (eager codegen, the plan cache
off) compile as before.

CPU, Inductor codegen judging plans by Inductor's allocation plans (``verify="inductor"``: on the CPU the
graph-level analysis can pass a plan that Inductor's code then peaks above), a 4-block MLP whose
saved activations dominate its peak, under a budget that needs a checkpoint plan. Each "launch" is a
fresh process state (``torch._dynamo.reset()``, ``protrain_fx.reset()``) over cache folders of the
test's own: AOTAutograd's cache keeps nothing in memory (``torch._inductor.codecache.GuardedCache``
lists its folder at each lookup), so a launch finds exactly what an earlier one saved there, as a
second process would.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import protrain_fx
from protrain_fx import backend, settings
from protrain_fx.planner.budget import budget_for_peak
from protrain_fx.profile.cache import plan_cache_path
from tests.conftest import use_cache_dir
from tests.planner.test_auto_plan import _train_graphs
from tests.planner.test_plan_cache import _first_step_over_its_cap

WIDTH, ROWS = 64, 4096


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)).square()


class _MLP(nn.Module):
    """Four blocks; each saves a few activations of the batch's size, far more than its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def budget():
    """A budget the step as it is does not fit: a checkpoint plan (from the step's analysed peak)."""
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    torch.compile(_MLP(), backend="protrain", options={"codegen": "eager"})(_batch(0)).backward()
    (record,) = _train_graphs()
    torch._dynamo.reset()
    protrain_fx.reset()
    return int(budget_for_peak(record.memory.peak_bytes) * 0.85)


@pytest.fixture(autouse=True)
def _caches_in_tmp(monkeypatch, tmp_path):
    use_cache_dir(monkeypatch, tmp_path)
    monkeypatch.setenv(settings.PLAN_CACHE, "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


@pytest.fixture
def counted(monkeypatch):
    """Calls of the backend's partitioner and of its Inductor lowerings, counted."""
    calls = {"partitions": 0, "lowerings": 0}
    partition, lower = backend._Partitioner.__call__, backend.lower

    def counting_partition(self, *args, **kwargs):
        calls["partitions"] += 1
        return partition(self, *args, **kwargs)

    def counting_lower(*args, **kwargs):
        calls["lowerings"] += 1
        return lower(*args, **kwargs)

    monkeypatch.setattr(backend._Partitioner, "__call__", counting_partition)
    monkeypatch.setattr(backend, "lower", counting_lower)
    return calls


def _launch(budget, *, steps: int = 3, codegen: str = "inductor"):
    """A fresh process state, the MLP compiled under ``budget`` and trained ``steps`` steps with AdamW;
    the newest training record, the losses and the parameters at the end."""
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    model = _MLP()
    options = {"codegen": codegen, "memory_budget": budget}
    compiled = torch.compile(model, backend="protrain", options={**options, "verify": "inductor"} if
                             codegen == "inductor" else options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = compiled(_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return _train_graphs()[-1], losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _aot() -> dict[str, int]:
    return dict(counters["aot_autograd"])


def _since(before: dict[str, int]) -> dict[str, int]:
    """AOTAutograd's cache counters (hits, misses, saves) moved since ``before``."""
    return {k: v - before.get(k, 0) for k, v in _aot().items() if k.startswith("autograd_cache") and v != before.get(k, 0)}


def _compiled_rows() -> dict:
    return json.loads(plan_cache_path("cpu").read_text()).get("compiled", {})


def test_a_relaunch_loads_the_planned_step_from_aot_autograds_cache_and_trains_the_same(budget, counted):
    before = _aot()
    first, first_losses, first_params = _launch(budget)
    auto = first.auto_plan
    assert auto.plan.blocks_with("checkpoint") and not auto.from_aot_cache and not first.from_aot_cache
    assert (counted["partitions"], counted["lowerings"]) == (1, 2)
    assert _since(before) == {"autograd_cache_miss": 1, "autograd_cache_saved": 1}
    assert list(_compiled_rows().values())[0]["entry"] == auto.cache_key

    counted.update(partitions=0, lowerings=0)
    before = _aot()
    second, losses, params = _launch(budget)
    assert _since(before) == {"autograd_cache_hit": 1}
    assert counted == {"partitions": 0, "lowerings": 0}  # no tracing, no partitioning, no lowering
    assert losses == first_losses  # the step compiled at the first launch, exactly
    assert all(torch.equal(params[n], p) for n, p in first_params.items())

    cached = second.auto_plan
    assert second.from_aot_cache and second.has_backward and second.forward is None and second.passes == []
    assert cached.from_aot_cache and cached.from_cache and cached.cache_key == auto.cache_key
    assert second.plan == cached.plan == auto.plan and cached.config == auto.config
    assert second.budget == first.budget and cached.budget_bytes == budget
    assert second.memory.peak_bytes == first.memory.peak_bytes
    assert second.memory.timeline.baseline_bytes == first.memory.timeline.baseline_bytes
    assert "aot cache" in second.phases and "codegen" not in second.phases and cached.phases is second.phases
    assert "loaded from AOTAutograd's cache" in cached.table()
    report = protrain_fx.step_report()
    assert "loaded from AOTAutograd's cache" in str(report) and report.block_table(second.index)


def test_another_budget_plans_and_compiles_again(budget, counted):
    _launch(budget, steps=1)
    counted.update(partitions=0, lowerings=0)
    before = _aot()
    other, _, _ = _launch(budget - 4096, steps=1)
    assert "autograd_cache_hit" not in _since(before) and counted["partitions"] == 1
    assert not other.from_aot_cache and other.auto_plan.budget_bytes == budget - 4096
    assert len(_compiled_rows()) == 2  # each launch's row under its own key
    before = _aot()
    again, _, _ = _launch(budget, steps=1)  # the first budget still loads its own step
    assert _since(before) == {"autograd_cache_hit": 1} and again.auto_plan.budget_bytes == budget


def test_a_plan_dropped_at_a_first_step_is_planned_again_and_its_step_never_loaded(budget, counted, monkeypatch):
    first, _, _ = _launch(budget, steps=1)
    missed = _first_step_over_its_cap(monkeypatch)  # the next first step measures 1% over its cap
    counted.update(partitions=0, lowerings=0)
    before = _aot()
    _launch(budget, steps=2)  # loaded, missed at its first step, compiled again at the second
    loaded, again = _train_graphs()
    assert missed == [loaded] and loaded.from_aot_cache and loaded.auto_plan.replan and loaded.auto_plan.recompile
    assert not again.from_aot_cache and counted["partitions"] == 1
    assert again.plan != loaded.plan  # a plan for the cap the measured reserve leaves
    assert again.auto_plan.reserve_source == "measured" and not again.auto_plan.from_cache
    assert _since(before) == {"autograd_cache_hit": 1, "autograd_cache_miss": 1, "autograd_cache_saved": 1}
    (row,) = _compiled_rows().values()  # the dropped plan's row went with its entry; the new plan's took it
    assert row["entry"] == again.auto_plan.cache_key
    before = _aot()
    third, _, _ = _launch(budget, steps=1)
    assert _since(before) == {"autograd_cache_hit": 1}
    assert third.plan == again.plan and third.auto_plan.config == again.auto_plan.config


@pytest.mark.parametrize("off", ["eager codegen", "plan cache off"])
def test_a_compile_the_cache_does_not_serve_keeps_it_off(budget, off, monkeypatch):
    if off == "plan cache off":
        monkeypatch.setenv(settings.PLAN_CACHE, "0")
    codegen = "eager" if off == "eager codegen" else "inductor"
    before = _aot()
    for _ in range(2):
        record, _, _ = _launch(budget, steps=1, codegen=codegen)
        assert not record.from_aot_cache and not record.auto_plan.from_aot_cache
    assert _since(before) == {}  # neither looked up nor saved
