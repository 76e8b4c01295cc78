"""A trial's lowering is the compile's (``protrain_fx/lowering.py``): the planner lowers a plan with the
arguments AOTAutograd gives Inductor, so the compile of the plan chosen hits Inductor's FX graph cache
instead of generating the code again, and the allocation plan a hit cannot read is the one kept.

CPU, Inductor codegen judged by Inductor (``verify="inductor"``), a 2-block tiny GPT, each test with
Inductor's FX graph cache and the allocation plans kept emptied first (the compiled kernels stay: they
take most of a CPU lowering's time)."""

from __future__ import annotations

import logging

import torch
from torch._inductor.codecache import FxGraphCache

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import lowering
from protrain_fx.planner.budget import budget_for_peak
from tests.planner.test_auto_plan import logged  # noqa: F401

CFG = gpt_config("tiny", n_layer=2)
BATCH = random_batch(CFG, 4, 32, generator=torch.Generator().manual_seed(0))


def _step(options: dict):
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.compile(model, backend="protrain", options=options)(*BATCH).backward()
    (record,) = protrain_fx.captured_graphs()
    return record, {n: p.grad.clone() for n, p in model.named_parameters()}


def _cache_counts() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]


def _emptied() -> None:
    FxGraphCache.clear()
    lowering._PLANS.clear()
    for f in (lowering.cache_dir() / "lowered").glob("*.json"):
        f.unlink()


def test_the_compile_of_the_plan_tried_hits_inductors_cache_and_reads_the_plan_kept():
    _emptied()
    plain, grads = _step({"auto_plan": False})  # its own lowering, for the peak and the grads
    budget = budget_for_peak(plain.memory.peak_bytes) * 4  # the step fits as it is
    _emptied()
    hits, misses = _cache_counts()
    judged, judged_grads = _step({"memory_budget": budget, "verify": "inductor"})
    # the trial lowers forward and backward (misses), the compile after it hits both
    assert (_cache_counts()[0] - hits, _cache_counts()[1] - misses) == (2, 2)
    auto = judged.auto_plan
    assert auto.how == "fits as is" and auto.judged_by == "inductor" and auto.trials_run == 1
    # the compile's analysis reads the plan the trial kept: the same peak, the same as an own lowering's
    assert judged.memory.peak_bytes == auto.analysed_peak_bytes == plain.memory.peak_bytes
    for name, g in grads.items():  # (Inductor's CPU embedding backward adds with atomics: not bit-exact run to run)
        torch.testing.assert_close(judged_grads[name], g, msg=name)


def test_a_cache_hit_without_the_plan_kept_lowers_again_to_read_it(logged):  # noqa: F811
    _emptied()
    first, _ = _step({"auto_plan": False})
    lowering._PLANS.clear()  # as at a later launch whose allocation plans were deleted
    for f in (lowering.cache_dir() / "lowered").glob("*.json"):
        f.unlink()
    logged.clear()
    again, _ = _step({"auto_plan": False})
    assert sum("lowered again to read it" in r.getMessage() for r in logged) == 2  # forward and backward
    assert again.memory.peak_bytes == first.memory.peak_bytes
    assert [r for r in logged if r.levelno >= logging.WARNING] == []
