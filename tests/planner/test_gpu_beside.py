"""On a GPU: a faster plan found at the first step compiles beside training (``protrain_fx/beside.py``),
with the device's own memory counters. Skipped without CUDA; run on the GPU machine with
``python -m pytest -q tests/planner/test_gpu_beside.py``.

A first launch measures what the loop's loss holds around the graph; the second is given a budget
between the step as it is plus that and the step plus the reserve the plan keeps before a first step
measures it (``planner/reserve.py``), so that its first plan checkpoints and its first step finds the
step as it is faster. The plan cache stays off: it would start the second launch from the reserve
the first measured.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import pytest
import torch
import torch.nn.functional as F

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import beside, settings
from protrain_fx.planner import first_step, reserve
from protrain_fx.planner.budget import budget_for_peak
from tests.planner.test_auto_plan import logged  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = gpt_config("125M", n_layer=6, vocab_size=4096)


def _loss_outside(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _step(model, compiled, optimizer, batch) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = _loss_outside(compiled, *batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _train_graphs():
    return [g for g in protrain_fx.captured_graphs() if g.has_backward]


def test_a_faster_plan_compiles_beside_training_and_runs_from_a_later_call(monkeypatch, logged):
    monkeypatch.setattr(first_step, "REPLAN_PAYBACK_STEPS", math.inf)  # a small model's saving repays no compile
    batch = random_batch(CONFIG, 8, CONFIG.block_size, device="cuda", generator=torch.Generator().manual_seed(0))
    numel = batch[0].numel() * CONFIG.vocab_size
    with settings.patch(plan_cache=False, compile_beside=True):
        # first launch, a budget the step fits as is beside the estimated reserve: what the loss holds
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        probe = GPT(CONFIG).cuda()
        compiled = torch.compile(probe, backend="protrain", options={"memory_budget": 60 * 2**30})
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(probe, compiled, torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True), batch)
        (first,) = _train_graphs()
        held = first.auto_plan.peak_check.outside_bytes
        empty = first.auto_plan.empty_peak_bytes
        estimate = reserve.OUTSIDE_BYTES_PER_ELEMENT * numel
        assert 0 < held < estimate, (held, estimate)
        del probe, compiled
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.cuda.empty_cache()

        # second launch, between the two: a plan first, the step as it is once the reserve is measured
        torch.manual_seed(0)
        model = GPT(CONFIG).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        compiled = torch.compile(model, backend="protrain",
                                 options={"memory_budget": budget_for_peak(empty + (held + estimate) // 2)})
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        losses = [_step(model, compiled, optimizer, batch)]  # the first step: a faster plan, compiled beside
        old = _train_graphs()[0]
        assert old.auto_plan.how == "searched" and old.auto_plan.recompile, old.auto_plan.table(old.index)
        beside_calls, deadline, during = 0, time.monotonic() + 300, []
        while beside.compiling_now() or beside.waiting_graphs():  # the last call here switches
            assert time.monotonic() < deadline, "the compile beside training did not end in 300 s"
            compiling = beside.compiling_now()
            beside_calls += compiling  # the plan in force trains while the new one compiles
            start = time.perf_counter()
            losses.append(_step(model, compiled, optimizer, batch))
            if compiling:
                during.append(time.perf_counter() - start)
        # the new plan against eager from the same weights and optimizer state, on a batch not trained
        # on: the one above is learnt by now, and its small gradients leave Adam's steps to rounding
        reference = copy.deepcopy(model)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
        ref_optimizer.load_state_dict(optimizer.state_dict())
        fresh = random_batch(CONFIG, 8, CONFIG.block_size, device="cuda", generator=torch.Generator().manual_seed(1))
        start = time.perf_counter()
        after = [_step(model, compiled, optimizer, fresh) for _ in range(3)]
        logging.getLogger("protrain_fx").info(
            "steps while the compile ran beside: %d, median %.1f ms; after the switch %.1f ms", len(during),
            1e3 * sorted(during)[len(during) // 2] if during else math.nan, 1e3 * (time.perf_counter() - start) / 3)
        eager = [_step(reference, reference, ref_optimizer, fresh) for _ in range(3)]
    old, new = _train_graphs()
    assert old.auto_plan.peak_check.outside_bytes <= (held + estimate) // 2
    assert new.dynamo_code is old.dynamo_code and new.auto_plan.reserve_source == "measured"
    assert new.auto_plan.how == "fits as is"
    check = new.auto_plan.peak_check
    assert check is not None and not check.over, check  # measured on the device after the switch, under its cap
    assert beside_calls >= 1
    warned = [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    assert not warned, warned
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(after), torch.tensor(eager), rtol=2e-2, atol=0)
