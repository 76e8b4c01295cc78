"""A trial's lowering is the compile's (``protrain_fx/lowering.py``): the planner lowers a plan with the
arguments AOTAutograd gives Inductor, so the compile of the plan chosen hits Inductor's FX graph cache
instead of generating the code again, and the allocation plan a hit cannot read is the one kept.

CPU, Inductor codegen judged by Inductor (``verify="inductor"``), a 2-block tiny GPT, each test with
Inductor's FX graph cache and the allocation plans kept emptied first (the compiled kernels stay: they
take most of a CPU lowering's time)."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.codecache import FxGraphCache

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import lowering
from protrain_fx.plan import interleaved
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


def test_a_plan_kept_is_found_under_inductors_own_key_where_ours_tells_the_two_graphs_apart(  # noqa: F811
        monkeypatch, logged):
    """Our key hashes the graph as we see it; where it differs between the trial's graph and the
    compile's while Inductor's key does not (the compile hits the trial's entry), the plan is found
    under Inductor's key: no lowering again."""
    _emptied()
    plain, _ = _step({"auto_plan": False})
    budget = budget_for_peak(plain.memory.peak_bytes) * 4
    _emptied()
    calls = itertools.count()
    ours = lowering.plan_key
    monkeypatch.setattr(lowering, "plan_key", lambda *args: f"{ours(*args)}-{next(calls)}")  # never twice the same
    logged.clear()
    hits = _cache_counts()[0]
    judged, _ = _step({"memory_budget": budget, "verify": "inductor"})
    assert _cache_counts()[0] - hits == 2
    assert not [r for r in logged if "lowered again" in r.getMessage()]
    assert judged.memory.peak_bytes == judged.auto_plan.analysed_peak_bytes == plain.memory.peak_bytes


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


def test_the_partition_saves_a_recomputed_random_ops_state_in_the_form_inductor_caches(monkeypatch):
    """The partitioner runs with the graph-safe RNG functionalization off: the higher-order op it
    makes is refused by Inductor's FX graph cache (a plan that recomputes an attention on CUDA
    would be lowered from scratch at every compile); the other form is cached."""
    from protrain_fx import backend

    seen = []
    partition = backend.min_cut_rematerialization_partition

    def watched(*args, **kwargs):
        seen.append(torch._functorch.config.graphsafe_rng_functionalization)
        return partition(*args, **kwargs)

    monkeypatch.setattr(backend, "min_cut_rematerialization_partition", watched)
    _step({"codegen": "eager", "plan": interleaved(["blocks.0", "blocks.1"], 0, 1)})
    assert seen and not any(seen)
    assert torch._functorch.config.graphsafe_rng_functionalization  # torch's own setting left as it was
    assert not torch._prims.rng_prims.graphsafe_run_with_rng_state.cacheable()  # why: torch 2.11 refuses it
    assert torch._prims.rng_prims.run_with_rng_state.cacheable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the attention's RNG state is CUDA's)")
def test_a_plan_that_recomputes_an_attention_on_cuda_is_served_by_inductors_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config = gpt_config("tiny", n_layer=2)
    batch = [t.cuda() for t in random_batch(config, 4, 64, generator=torch.Generator().manual_seed(0))]
    counts = []
    for _ in range(2):
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        model = GPT(config).cuda()
        before = dict(torch._dynamo.utils.counters["inductor"])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.compile(model, backend="protrain", options={"plan": interleaved(["blocks.0", "blocks.1"], 0, 1)})(*batch)
        loss.backward()
        after = torch._dynamo.utils.counters["inductor"]
        counts.append({k: after[k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                                "fxgraph_cache_bypass")})
    assert counts[0]["fxgraph_cache_bypass"] == 0 and counts[1]["fxgraph_cache_hit"] == 2, counts


def test_a_trial_leaves_no_static_mark_that_would_key_the_next_trial_apart_from_the_compile(monkeypatch):
    """On a GPU Inductor marks the tensors it is told are static (``_is_inductor_static``, on the tensor
    object) and keys them by their storage size. Trials lower the graph's placeholder values, shared by
    every trial, and a backward marks the saved token ids that the next trial's forward reads: the
    forward was then keyed apart from the compile's (a 4.2B offload on an H100 missed Inductor's cache).
    Here the marking is done as the GPU does it, on the CPU: no lowering may start with a mark its own
    static inputs did not put there."""
    import torch._inductor.compile_fx as compile_fx

    seen: list[tuple[str, list[int]]] = []
    original = compile_fx.compile_fx_inner

    def marking(gm, example_inputs, **kwargs):
        static = set(kwargs.get("static_input_idxs") or ())
        stray = [i for i, t in enumerate(example_inputs)
                 if isinstance(t, torch.Tensor) and hasattr(t, "_is_inductor_static") and i not in static]
        seen.append(("backward" if kwargs.get("is_backward") else "forward", stray))
        for i in static:  # what compile_fx_inner does to GPU inputs
            if isinstance(example_inputs[i], torch.Tensor):
                example_inputs[i]._is_inductor_static = True
        return original(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", marking)
    # (Inductor's caches kept: compile_fx_inner is called, and marks, on a hit too)
    record, _ = _step({"memory_budget": 2_700_000, "verify": "inductor"})  # a plan, after several trials
    trials = [p for p in seen if p[0] == "forward"]
    assert len(trials) >= 2, seen  # at least two trials' forwards after a backward
    assert all(not stray for _, stray in seen), seen




def test_an_inductor_compile_mode_out_of_this_process_leaves_our_lowerings_in_it(monkeypatch):
    """``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess`` moves Inductor's codegen to a child process, where
    the hooks of :func:`lowering.lowering_patches` do not go (chunk buffers kept from reuse, the
    allocation plan read): the graphs the backend lowers are lowered in this process all the same,
    and the step is eager's. (A 4-block model with the loss outside: Inductor sends its graphs to
    the child; the 2-block tiny one it keeps in the process.)"""
    from torch._inductor import compile_fx

    monkeypatch.setattr(compile_fx, "fx_compile_mode", compile_fx.FxCompileMode.SUBPROCESS)
    stats = type(compile_fx.FxCompile._compile_stats)(compile_fx.FxCompile._compile_stats.default_factory)
    monkeypatch.setattr(compile_fx.FxCompile, "_compile_stats", stats)  # codegens per kind of compile
    _emptied()
    torch._dynamo.reset()
    protrain_fx.reset()
    cfg = gpt_config("small", n_layer=4)
    idx, targets = random_batch(cfg, 2, 64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": 2**30})
    loss = F.cross_entropy(compiled(idx).view(-1, cfg.vocab_size), targets.view(-1))
    loss.backward()
    (record,) = protrain_fx.captured_graphs()
    assert set(record.rewritten.inductor_plans) == {"forward", "backward"}
    assert list(stats) == [compile_fx._InProcessFxCompile]
    eager = F.cross_entropy(reference(idx).view(-1, cfg.vocab_size), targets.view(-1))
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
