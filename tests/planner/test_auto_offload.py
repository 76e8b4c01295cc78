"""Offload with automatic counts (``protrain_fx/planner/offload.py``): ``offload`` without ``n_persist`` /
``n_buffer`` and a ``memory_budget``; the backend chooses the counts and the activation plan at the
first compile, places the chunks, and the model trains exactly like eager AdamW.

CPU stands in for the GPU (``device="cpu"``), fp32, eager codegen, as in ``tests/runtime/test_offload.py``.
The machine's rates are fixed to a GPU-like profile (link 25 GB/s each way, CPU Adam 1 G params/s,
device Adam 100 G params/s) instead of measured, so that the chosen counts do not depend on the
machine running the tests.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.plan import from_counts
from protrain_fx.planner import first_step, verify
from protrain_fx.planner import offload as autooffload
from protrain_fx.planner.budget import allocated_cap_bytes, budget_for_peak
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts, MachineProfile
from protrain_fx.search.search import NoPlanFits
from tests.planner.test_auto_plan import _no_plan_fits, logged  # noqa: F401  (logged: a fixture)
from tests.runtime.test_offload import (
    CHUNK,
    CONFIG,
    _assert_same_params,
    _batch,
    _train_hf_side_by_side,
    _train_side_by_side,
)

#: The tiny GPT's step (batch 2 x 32) peaks at 3.6 MiB with every parameter on the device, no plan;
#: at this budget some chunks stay and the others stream through fewer buffers than they are.
TIGHT = 2_500_000


GPU_LIKE = MachineProfile(h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, duplex_bytes_per_s=40e9,
                          cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e11)


@pytest.fixture(autouse=True)
def _gpu_like_machine(monkeypatch):
    monkeypatch.setattr(autooffload, "offload_machine", lambda device, record, *chunk: GPU_LIKE)


def _setup(budget: int | None, **options):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
    if budget is not None:
        options["memory_budget"] = budget
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", **options})
    return model, reference, opt, ref_opt, handle, compiled


def _train_record():
    """The last training graph captured (an earlier compile may have failed)."""
    return [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1]


def test_chosen_counts_stream_some_chunks_and_train_exactly_like_eager():
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    assert handle.automatic and not handle.configured
    # Before the first compile every parameter is a shell; its values wait aside (state_dict sees them).
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    _assert_same_params(handle, model, reference)
    _train_side_by_side(compiled, reference, opt, ref_opt, 3)
    _assert_same_params(handle, model, reference)
    assert handle.configured and not handle.automatic
    auto = _train_record().auto_plan
    c = auto.config
    n = len(handle.layout.chunks)
    assert auto.offload and 0 < c.n_persist < n and c.n_gpu_optim == 0  # no GPU: no device steps
    assert (handle.n_persist, handle.n_buffer) == (c.n_persist, c.n_buffer)
    assert c.n_buffer < n - c.n_persist  # chunks really stream through fewer buffers
    # The analysis of the rewritten step (chunk buffers included) is under the cap the budget gives.
    assert auto.analysed_peak_bytes <= allocated_cap_bytes(TIGHT) == auto.allocated_cap_bytes
    assert auto.empty_peak_bytes > allocated_cap_bytes(TIGHT)  # all on the device would not fit
    assert "n_persist=" in auto.table()
    # the chunk step's rate measured on this CPU was part of describing the step, within the choice
    assert auto.choose_s >= auto.problem_s > 0 and "chosen in" in auto.table()
    # the CPU device plans at fixed rates; a plan predicted over the host rates' spread (CUDA) says so
    assert auto.rate_spread is None and "the mean over the host rates" not in auto.table()
    spread = dataclasses.replace(auto, rate_spread={"cpu_adam_params_per_s": 0.25})
    at_readings = f"{CostModel(auto.problem).estimate(c).step_s * 1e3:.3f} ms at the readings"
    assert "the mean over the host rates within 25% (cpu_adam_params_per_s)" in spread.table()
    assert at_readings in spread.table()
    host = {name for s in handle.store.slots for name in s.names}
    for name, p in model.named_parameters():
        assert (p.untyped_storage().nbytes() == 0) == (name in host), name


def test_more_budget_keeps_more_chunks_and_enough_keeps_all(monkeypatch):
    # A CPU Adam far slower than the step: a chunk is offloaded only when the budget needs it.
    slow_cpu = dataclasses.replace(GPU_LIKE, cpu_adam_params_per_s=1e4)
    monkeypatch.setattr(autooffload, "offload_machine", lambda device, record, *chunk: slow_cpu)
    persist, step_s = [], []
    for budget in (TIGHT, TIGHT + 400_000, 64 * 2**20):
        torch._dynamo.reset()
        protrain_fx.reset()
        model, reference, opt, ref_opt, handle, compiled = _setup(budget)
        _train_side_by_side(compiled, reference, opt, ref_opt, steps=2)
        _assert_same_params(handle, model, reference)
        persist.append(handle.n_persist)
        auto = _train_record().auto_plan
        assert auto.analysed_peak_bytes <= auto.allocated_cap_bytes
        step_s.append(auto.estimate.step_s)
    assert step_s == sorted(step_s, reverse=True) and step_s[0] > step_s[-1]  # more budget, never slower
    assert persist == sorted(persist)
    assert persist[-1] == len(handle.layout.chunks) and handle.store is None  # nothing left to stream


def test_budget_too_small_names_a_minimum_that_then_trains():
    model, reference, opt, ref_opt, handle, compiled = _setup(600_000)
    with pytest.raises(Exception) as info:
        compiled(*_batch(0))
    error = _no_plan_fits(info.value)
    assert error is not None and "no offload plan fits" in str(error)
    minimum = error.min_budget_bytes
    assert minimum > 600_000 and f"{minimum} bytes" in str(error)
    # Nothing stays placed: the handle waits for the next compile, and the named minimum trains.
    assert handle.automatic and not handle.configured and handle.store is None
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": minimum})
    _train_side_by_side(compiled, reference, opt, ref_opt, steps=2)
    _assert_same_params(handle, model, reference)
    auto = _train_record().auto_plan
    assert auto.analysed_peak_bytes <= auto.allocated_cap_bytes


def test_lean_counts_are_what_the_store_makes_at_every_n_persist():
    from protrain_fx.runtime.store.host_memory import AUTO_HOST_RESERVE, planned_store_bytes

    model = GPT(CONFIG)
    twin = copy.deepcopy(model)
    probe = protrain_fx.offload(twin, torch.optim.AdamW(twin.parameters()), device="cpu", chunk_bytes=CHUNK)
    n, numel = len(probe.layout.chunks), probe.layout.chunk_bytes // 4
    # room for every chunk's store with the last 12 lean (fp32: 4 + 8 bytes each, 4 more unless
    # lean; the 4 landing buffers take back what 4 lean chunks save)
    assert n > 13
    available = planned_store_bytes(numel, [True] * n, 4, 12, 4) + AUTO_HOST_RESERVE
    handle = protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), device="cpu", chunk_bytes=CHUNK,
                                 available_host_bytes=available)
    counts = handle.facts().lean_counts
    assert counts[0] == 12 and counts[-1] == 0 and list(counts) == sorted(counts, reverse=True)
    assert counts[1] == 8 and counts[2] == 0  # a persistent chunk frees 16 bytes per element: fewer lean
    for p in range(n):
        handle.configure(p, 1)
        assert handle.n_lean == counts[p], p
        assert handle.store.lean == frozenset(range(n - p - counts[p], n - p))
    handle.unplace()
    # a fixed n_lean above what a chosen n_persist leaves offloaded: all of those are lean
    other = GPT(CONFIG)
    fixed = protrain_fx.offload(other, torch.optim.AdamW(other.parameters()), device="cpu", chunk_bytes=CHUNK,
                                n_lean=3)
    assert fixed.facts().lean_counts[n - 2:] == (2, 1, 0)
    fixed.configure(n - 1, 1)
    assert fixed.n_lean == 1
    fixed.unplace()


def test_an_offload_with_lean_chunks_gets_them_in_its_problem_and_trains_exactly():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, n_lean=3)
    n = len(handle.layout.chunks)
    assert handle.facts().lean_counts == tuple(min(3, n - p) for p in range(n + 1))
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    _train_side_by_side(compiled, reference, opt, ref_opt, 3)
    _assert_same_params(handle, model, reference)
    problem = _train_record().auto_plan.problem
    assert problem.lean_chunks == handle.facts().lean_counts
    assert all(c.lean_fetch_bytes == handle.layout.chunk_bytes for c in problem.chunks)  # fp32: the master
    assert problem.lean_staging_bytes == 0  # no CUDA: a lean chunk's fetch casts in place
    assert handle.n_lean == 3 and handle.n_persist <= n - 3


def test_a_measured_miss_plans_the_placed_chunks_again_or_names_the_budget_they_need(monkeypatch):
    """The first step measured 50% over its cap (counters driven on the CPU): the graph is compiled
    again at its next call, its activation plan chosen again for the chunks as placed (the counts
    stay: the optimizer state lives in the placed store). On the tiny GPT no activation plan makes
    up the miss, so that call refuses, naming the budget that includes it; that budget then trains,
    exactly like eager."""
    from tests.runtime.test_offload import _batch as batch_of

    state = {"reads": 0, "rise": 0}

    def counters(device):
        state["reads"] += 1
        return (1000, 2000) if state["reads"] % 2 else (1000, 1000 + state["rise"])

    monkeypatch.setattr(first_step, "memory_counters", counters)
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)

    def step(i: int) -> None:
        loss, ref_loss = compiled(*batch_of(i)), reference(*batch_of(i))
        assert torch.equal(loss, ref_loss), i
        newest = _train_record()
        start = sum(newest.memory.timeline.baseline_bytes.values())
        # the first step of the first graph 50% over its cap (more than any activation plan saves on
        # this model: the replan refuses), the others as predicted
        over = newest is first_graph[0] if first_graph else True
        state["rise"] = (int(newest.auto_plan.allocated_cap_bytes * 1.5) if over else newest.memory.peak_bytes) - start
        first_graph.append(newest)
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()

    first_graph: list = []
    step(0)
    first = first_graph[0]
    counts = (handle.n_persist, handle.n_buffer, handle.n_gpu_optim)
    assert first.auto_plan.replan and first.auto_plan.recompile
    outside = first.auto_plan.peak_check.outside_bytes
    with pytest.raises(Exception) as info:
        compiled(*batch_of(1))  # compiled again: nothing runs
    error = _no_plan_fits(info.value)
    assert error is not None and "with the chunks placed at the model's first compile" in str(error)
    assert "measured above the plan in an earlier first step" in str(error)
    assert "the chunk counts stay as placed" in str(error)
    assert (handle.n_persist, handle.n_buffer, handle.n_gpu_optim) == counts
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain",
                             options={"codegen": "eager", "memory_budget": error.min_budget_bytes})
    for i in (1, 2):
        step(i)
    _assert_same_params(handle, model, reference)
    second = _train_record()
    assert second.auto_plan.reserve_bytes == outside and second.auto_plan.reserve_source == "measured"
    assert second.memory.peak_bytes <= second.auto_plan.allocated_cap_bytes
    assert (handle.n_persist, handle.n_buffer, handle.n_gpu_optim) == counts


def test_a_meta_model_is_initialised_when_the_chunks_are_placed():
    with torch.device("meta"):
        model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, init=model.init_parameter)
    with pytest.raises(RuntimeError, match="still on the meta device"):
        handle.state_dict(model)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    losses = []
    for step in range(3):
        loss = compiled(*_batch(0))  # one batch again and again: the loss must fall
        if step == 0:  # compiled and placed, not stepped yet: init's values, in both kinds of chunk
            assert 0 < handle.n_persist < len(handle.layout.chunks)
            state = handle.state_dict(model)
            persistent = {n for n in state if n not in {m for s in handle.store.slots for m in s.names}}
            assert "wte.weight" in persistent and "blocks.3.ln_1.weight" not in persistent
            for name in ("wte.weight", "blocks.3.ln_1.weight", "blocks.3.attn.qkv.weight"):
                assert name in state
            assert state["blocks.3.ln_1.weight"].eq(1).all() and state["blocks.3.ln_1.bias"].eq(0).all()
            assert 0.015 < state["wte.weight"].std() < 0.025  # normal(0, 0.02)
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_what_fits_answers_as_training_chooses_and_leaves_nothing_placed():
    """``what_fits`` places the chunks to check each config, as training does, and removes them;
    its config and plan are the ones training then runs, and the minimum it names for a budget too
    small trains (the cost model's minimum alone did not: 1.03 MB named, 1.84 MB needed)."""
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    report = protrain_fx.what_fits(model, *_batch(0), memory_budget=TIGHT, options={"codegen": "eager"})
    assert report.fits and report.counts["n_chunks"] == len(handle.layout.chunks)
    assert 0 < report.counts["n_persist"] < report.counts["n_chunks"] and report.host_chunk_bytes > 0
    assert report.min_budget_bytes < TIGHT and "n_persist=" in str(report)
    assert handle.automatic and not handle.configured and handle.store is None  # nothing stays placed
    # Too small: no plan, and the smallest budget training keeps.
    small = protrain_fx.what_fits(model, *_batch(0), memory_budget=600_000, options={"codegen": "eager"})
    assert not small.fits and small.plan is None and small.min_budget_bytes > 600_000
    assert small.min_budget_bytes == report.min_budget_bytes  # the least-memory config's, both times
    assert handle.automatic and not handle.configured and handle.store is None
    # Training under the first budget runs the answered config and plan.
    _train_side_by_side(compiled, reference, opt, ref_opt, 1)
    chosen = _train_record().auto_plan
    assert (chosen.config.n_persist, chosen.config.n_buffer, chosen.config.n_gpu_optim) == (
        report.counts["n_persist"], report.counts["n_buffer"], report.counts["n_gpu_optim"])
    assert chosen.plan == report.plan
    with pytest.raises(Exception, match="chosen at its first training compile"):
        protrain_fx.what_fits(model, *_batch(0), memory_budget=TIGHT, options={"codegen": "eager"})


def test_what_fits_on_a_host_too_small_names_the_host_memory_and_places_nothing():
    """A model whose chunk store the host cannot hold (a 13B model on a 24 GiB workstation): what_fits
    answers with the bytes the store needs and the host has, instead of raising, and places nothing."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, available_host_bytes=1000)
    report = protrain_fx.what_fits(model, *_batch(0), memory_budget=TIGHT, options={"codegen": "eager"})
    assert not report.fits and report.plan is None
    assert report.host_available_bytes == 1000 and report.host_needed_bytes > 1000
    assert report.min_budget_bytes > 0 and report.counts["n_persist"] == 0
    assert "does NOT fit this host" in str(report) and f"({report.host_needed_bytes} bytes" in str(report)
    assert report.min_budget_bytes <= report.budget_bytes  # the device budget would do: the head names the host
    assert "the device budget would do, the host memory does not" in str(report).splitlines()[0]
    assert handle.automatic and not handle.configured and handle.store is None
    # training on that host is refused with the same numbers
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    with pytest.raises(MemoryError, match=f"needs {report.host_needed_bytes} bytes"):
        compiled(*_batch(0))


def test_a_restart_loads_the_checkpoint_before_the_first_compile_and_continues_exactly():
    """The restart loop: a new process offloads a fresh model, loads the checkpoint (weights and
    optimizer state) before its first compile, when the counts are not chosen yet, and trains on as the
    uninterrupted run does. The checkpoint has ``model.state_dict()``'s keys, so a plain model loads it
    strictly too."""
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    _train_side_by_side(compiled, reference, opt, ref_opt, 2)
    weights, moments = handle.state_dict(model), handle.optimizer_state_dict()
    assert weights.keys() == reference.state_dict().keys()
    GPT(CONFIG).load_state_dict(weights)  # strict: no missing or unexpected key
    handle.close()
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    resumed = GPT(CONFIG)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    resumed_handle = protrain_fx.offload(resumed, resumed_opt, device="cpu", chunk_bytes=CHUNK)
    resumed_handle.load_state_dict(resumed, weights, moments)
    assert resumed_handle.automatic and not resumed_handle.configured
    compiled = torch.compile(resumed, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    for step in range(2, 4):
        loss, ref_loss = compiled(*_batch(step)), reference(*_batch(step))
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        resumed_opt.step(), ref_opt.step()
        resumed_opt.zero_grad(), ref_opt.zero_grad()
    assert resumed_handle.configured and 0 < resumed_handle.n_persist < len(resumed_handle.layout.chunks)
    _assert_same_params(resumed_handle, resumed, reference)


def test_the_minimum_what_fits_names_trains():
    model, reference, opt, ref_opt, handle, _ = _setup(None)
    small = protrain_fx.what_fits(model, *_batch(0), memory_budget=600_000, options={"codegen": "eager"})
    assert not small.fits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain",
                             options={"codegen": "eager", "memory_budget": small.min_budget_bytes})
    _train_side_by_side(compiled, reference, opt, ref_opt, steps=2)
    _assert_same_params(handle, model, reference)
    # ... and training under a budget too small names the same minimum. (It is the least-memory
    # plans' minimum: a searched plan the analysis puts lower can fit just under it.)
    torch._dynamo.reset()
    protrain_fx.reset()
    model, reference, opt, ref_opt, handle, compiled = _setup(600_000)
    with pytest.raises(Exception) as info:
        compiled(*_batch(0))
    error = _no_plan_fits(info.value)
    assert error is not None and error.min_budget_bytes == small.min_budget_bytes


def test_what_fits_refuses_counts_by_hand_before_anything_runs():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    gathered = []
    original = handle.gather
    handle.gather = lambda chunk: gathered.append(chunk) or original(chunk)
    with pytest.raises(Exception, match="given by hand"):
        protrain_fx.what_fits(model, *_batch(0), memory_budget=TIGHT, options={"codegen": "eager"})
    assert gathered == []  # no graph ran: no chunk was fetched


def test_what_the_automatic_counts_refuse():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="chosen together"):
        protrain_fx.offload(GPT(CONFIG), torch.optim.AdamW(GPT(CONFIG).parameters()), n_persist=1, device="cpu")
    with pytest.raises(ValueError, match="n_gpu_optim=2 with automatic"):
        model = GPT(CONFIG)
        protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), n_gpu_optim=2, device="cpu")
    # On the CPU there is no device budget: one must be given.
    *_, compiled = _setup(None)
    with pytest.raises(Exception, match="needs a memory budget"):
        compiled(*_batch(0))
    torch._dynamo.reset()
    plan = from_counts("checkpoint=all", [f"blocks.{i}" for i in range(CONFIG.n_layer)])
    *_, compiled = _setup(TIGHT, plan=plan)
    with pytest.raises(Exception, match="plan by hand"):
        compiled(*_batch(0))
    torch._dynamo.reset()
    # An inference graph first: the counts are chosen with a training graph.
    *_, compiled = _setup(TIGHT)
    with torch.no_grad(), pytest.raises(Exception, match="run a training step first"):
        compiled(*_batch(0))


class _BreakBeforeTheBlocks(GPT):
    """The GPT with a graph break between its embeddings and its blocks."""

    def forward(self, idx, targets=None):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        torch._dynamo.graph_break()
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def test_a_first_graph_cut_off_before_the_blocks_names_the_break():
    torch.manual_seed(0)
    model = _BreakBeforeTheBlocks(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    with pytest.raises(Exception, match="graph break before them") as info:
        compiled(*_batch(0))
    assert "test_auto_offload.py" in str(info.value) and "by hand" in str(info.value)


def _break_after_every_block(monkeypatch) -> None:
    """A break inside every block (a ``print`` in real code): Dynamo runs the model's loop over the
    blocks eagerly, and compiles each block's frame as its own code."""
    from examples import gpt

    block_forward = gpt.Block.forward

    def forward(self, x):
        x = block_forward(self, x)
        torch._dynamo.graph_break()
        return x

    monkeypatch.setattr(gpt.Block, "forward", forward)


def test_a_graph_break_inside_the_blocks_before_the_counts_are_chosen_names_the_break(monkeypatch):
    """Automatic counts: the first module the eager loop reaches runs before any training graph is
    compiled, so the store holds nothing to copy: refused with the way out and the break, not with a
    step "without backward" nor an offloaded parameter's missing bytes."""
    _break_after_every_block(monkeypatch)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    with pytest.raises(Exception) as info:
        compiled(*_batch(0)).backward()
    handle.close()
    message = str(info.value)
    assert "ran outside the compiled graphs" in message and "graph break" in message, message
    assert "TORCH_LOGS=graph_breaks" in message and "no backward" not in message
    assert "holds no values" in message and "this tensor of 0 bytes" not in message
    assert "chunk counts are not chosen" in message and "by hand" in message, message
    # no graph compiled yet: the frame Dynamo skipped for the break in its loop, and the break
    assert "Dynamo ran forward (" in message and "gpt.py line" in message, message
    # ... and the user's line of the break (here this file's, in the patched forward)
    assert re.search(r"for a graph break in its loop \(Call to `torch\._dynamo\.graph_break\(\)` at "
                     r"\S*test_auto_offload\.py:\d+ in forward\)", message), message


def test_a_graph_break_inside_the_blocks_with_counts_by_hand_trains_like_eager(monkeypatch, caplog):
    """Counts by hand: the modules the eager loop runs get device copies of their parameters
    (``runtime/offload/eager.py``) and the blocks' graphs, each ended at the break, run their own
    chunks: exact against eager, with one warning that names the break and the user's line. Each
    block's frame is its own compiled code: block 0's graph never runs block 1, whose parameters sit
    in other chunks."""
    _break_after_every_block(monkeypatch)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, n_persist=1, n_buffer=2)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        _train_side_by_side(compiled, reference, opt, ref_opt, 2)
    _assert_same_params(handle, model, reference)
    handle.close()
    (message,) = [r.getMessage() for r in caplog.records if "ran outside the compiled graphs" in r.getMessage()]
    assert "the last graph break: Call to `torch._dynamo.graph_break()` at " in message, message
    assert "test_auto_offload.py:" in message and "inside block blocks." in message, message


#: A longer input shape than the tests' first one (2 x 48 tokens).
LONGER = random_batch(CONFIG, 2, 48, generator=torch.Generator().manual_seed(7))


def _train_on(batch, compiled, reference, opt, ref_opt, steps: int = 2) -> None:
    """``steps`` training steps of both models on ``batch``; the losses must be equal."""
    for _ in range(steps):
        loss, ref_loss = compiled(*batch), reference(*batch)
        assert torch.equal(loss, ref_loss)
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def test_another_input_shape_gets_its_own_plan_for_the_chunks_as_placed(monkeypatch):
    # Without the raised search the first compile leaves room for the longer shape: with it, the
    # first shape takes that room (more persistent chunks), and the longer one no longer fits.
    monkeypatch.setattr(verify, "MAX_RAISES", 0)
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    _train_side_by_side(compiled, reference, opt, ref_opt, 2)
    counts = (handle.n_persist, handle.n_buffer, handle.n_gpu_optim)
    first = _train_record()
    _train_on(LONGER, compiled, reference, opt, ref_opt)
    _assert_same_params(handle, model, reference)
    second = _train_record()
    assert second is not first and (handle.n_persist, handle.n_buffer, handle.n_gpu_optim) == counts
    auto = second.auto_plan
    assert auto is not None and auto.offload and auto.config.n_persist == counts[0]
    assert auto.analysed_peak_bytes <= auto.allocated_cap_bytes
    # searched, or (when the cost model, an upper bound of the analysis, fits nothing) the plan of
    # least memory, which the analysis puts under the cap
    assert auto.how in ("searched", "least memory")
    assert auto.plan.blocks_with("swap") or auto.plan.blocks_with("checkpoint")
    # A shape that does not fit with the chunks as placed (16x48 tokens: no activation plan brings it
    # under the cap, as the analysis judges it) is refused, naming the budget it would need.
    with pytest.raises(Exception) as info:
        compiled(*random_batch(CONFIG, 16, 48, generator=torch.Generator().manual_seed(8)))
    error = _no_plan_fits(info.value)
    assert error is not None and "placed at the model's first compile" in str(error)
    assert error.min_budget_bytes > TIGHT


#: The GPT of the verify="inductor" test: 3 blocks, the fewest with which the search swaps (with 2 it
#: checkpoints, and Inductor compiles a checkpointed or plain block below the graph-level analysis, a
#: swapped one above it). At its budget the first plan tried swaps all 3 blocks: analysed at 1.68 MB,
#: under the 1.85 MB cap; Inductor's plan of it is 2.19 MB.
VERIFY_CONFIG = gpt_config("tiny", n_layer=3)
VERIFY_BUDGET = 2_000_000


def test_verify_inductor_refuses_a_plan_inductor_compiles_above_the_cap(caplog, monkeypatch):
    # With Inductor codegen, the graph-level judge lets through a plan (3 swapped blocks) that
    # Inductor's own allocation plan puts above the cap; verify="inductor" judges every plan tried by
    # that plan (each plan it would keep lowered as the compile lowers it), so the step it keeps
    # compiles to what it read. Each lowered plan's graph-level peak is read beside the peak that
    # judged it (no verify="graph" compile).
    original = verify.judged_peak
    judged = []  # (graph-level peak, the peak it was judged by) of each plan lowered

    def spy(record, lower=True):
        graph_level = record.memory.peak_bytes
        peak, by_inductor = original(record, lower)
        if lower:
            judged.append((graph_level, peak))
        return peak, by_inductor

    monkeypatch.setattr(verify, "judged_peak", spy)
    cap = allocated_cap_bytes(VERIFY_BUDGET)
    torch.manual_seed(0)
    model = GPT(VERIFY_CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": VERIFY_BUDGET, "verify": "inductor"})
    compiled(*random_batch(VERIFY_CONFIG, 2, 32, generator=torch.Generator().manual_seed(0))).backward()
    opt.step()
    rec = _train_record()
    auto = rec.auto_plan
    assert auto.judged_by == "inductor" and all(t.by_inductor for t in auto.trials)
    assert [peak for _, peak in judged] == [t.analysed_peak_bytes for t in auto.trials]
    # the first plan tried: the graph-level judge lets it through (analysed under the cap), Inductor's plan
    # of it is above the cap, and it is refused
    (graph_level, _), refused = judged[0], auto.trials[0]
    assert graph_level <= cap < refused.analysed_peak_bytes and refused.config != auto.config
    kept = next(t for t in auto.trials if t.config == auto.config)
    assert rec.memory.peak_bytes == kept.analysed_peak_bytes == auto.analysed_peak_bytes <= cap
    # another shape (compiled with dynamic sizes): the chunks as placed
    x, y = random_batch(VERIFY_CONFIG, 2, 16, generator=torch.Generator().manual_seed(1))
    compiled(x, y).backward()
    opt.step()
    again = _train_record()
    assert again is not rec and again.auto_plan.judged_by == "inductor"
    assert again.memory.peak_bytes == again.auto_plan.analysed_peak_bytes <= cap
    assert not any("lowering a plan with Inductor" in r.message for r in caplog.records)


def test_a_plan_the_graph_level_judge_lets_through_over_the_budget_as_compiled_is_refused():
    """verify="graph" with Inductor codegen: the plan judged under the cap by the graph-level analysis
    compiles to a peak above the budget (the case above). It is refused at the compile, before its first
    step's forward runs,
    naming the smallest budget for it and the option that judges by the compiled code, instead of a
    warning and a run over the budget."""
    torch.manual_seed(0)
    model = GPT(VERIFY_CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": VERIFY_BUDGET, "verify": "graph"})
    with pytest.raises(NoPlanFits, match=r"as compiled peaks at .*'verify': 'inductor'") as refused:
        compiled(*random_batch(VERIFY_CONFIG, 2, 32, generator=torch.Generator().manual_seed(0)))  # both lowered
    rec = _train_record()
    assert rec.auto_plan.judged_by == "graph" and rec.auto_plan.analysed_peak_bytes <= allocated_cap_bytes(VERIFY_BUDGET)
    assert refused.value.min_budget_bytes == budget_for_peak(rec.memory.peak_bytes) > VERIFY_BUDGET


def test_steadier_gpu_optim_chooses_the_count_of_least_expected_step_and_records_its_memory():
    from protrain_fx.planner.offload import steadier_gpu_optim
    from protrain_fx.planner.verify import Trial
    from protrain_fx.search.cost import CostModel
    from protrain_fx.search.spread import expected_estimate
    from protrain_fx.search.problem import Counts
    from tests.search.test_cost_search import make_problem

    spread = {"cpu_adam_params_per_s": 0.25, "device_step_bytes_per_s": 0.1}
    changed = 0
    for seed in range(8):
        model = CostModel(make_problem(seed, device_step_bytes_per_s=30e9, cpu_adam_params_per_s=2e9))
        config = Counts(0, max(1, model.min_buffers(0)), 0, 0, 0)
        kept = Trial(config, model.estimate(config).peak_bytes, 10**9)
        trials = [kept]
        got = steadier_gpu_optim(model, kept, cap=10**13, trials=trials, spread=spread)
        best = min(expected_estimate(model.problem, Counts(0, config.n_buffer, 0, 0, g), spread).step_s
                   for g in range(model.n_chunks + 1))
        assert expected_estimate(model.problem, got, spread).step_s == pytest.approx(best)
        if got == config:
            assert trials == [kept]
            continue
        changed += 1
        added = model.static_bytes(0, config.n_buffer, got.n_gpu_optim) - model.static_bytes(0, config.n_buffer, 0)
        assert trials[-1] == Trial(got, model.estimate(got).peak_bytes, 10**9 + added, False)
        # no room under the cap for the device steps' staging: the count stays
        none = steadier_gpu_optim(model, kept, cap=10**9, trials=[kept], spread=spread)
        assert none == config
    assert changed  # the random steps include ones where stepping on the device is expected faster


def _opt(seed: int = 0):
    """A tiny Hugging Face OPT (3 layers over 11 chunks of 64 KiB; the first chunk past the embedding
    holds the positions, the final layer norm and layer 0's first weight), offloaded without counts
    with fused AdamW, and a plain copy."""
    transformers = pytest.importorskip("transformers")
    config = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                                    max_position_embeddings=64, word_embed_proj_dim=64, vocab_size=256,
                                    dropout=0.0, use_cache=False)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(config)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=64 * 1024)
    return model, reference, opt, ref_opt, handle


def test_a_plan_whose_rewrite_holds_more_chunks_than_its_buffers_is_placed_again_with_them(monkeypatch, caplog):
    """OPT with every layer checkpointed and as many buffers as a layer has chunks: the final layer
    norm's backward (outside the layers, in a chunk of its own) runs while layer 2's recompute holds
    that layer's chunks, so the rewritten step holds one chunk more than the cost model counts. The
    planner places such a trial again with the buffers it holds; before, the gather pass's
    ValueError reached the user (here as the least-memory plan, the search left out)."""
    def least(model):
        return [Counts(0, model.min_buffers(0), 0, model.n_blocks, 0)]

    def no_search(*args, **kwargs):
        raise NoPlanFits("searched plans left out: the least-memory plan is the case", min_budget_bytes=1)

    monkeypatch.setattr(autooffload, "least_memory_candidates", least)
    monkeypatch.setattr(autooffload, "prefer_persistent", no_search)
    model, reference, opt, ref_opt, handle = _opt()
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": 10**9})
    with caplog.at_level("INFO", logger="protrain_fx"):
        _train_hf_side_by_side(compiled, reference, opt, ref_opt, 3, model.config.vocab_size)
    auto = protrain_fx.captured_graphs()[-1].auto_plan
    (trial,) = auto.trials
    assert trial.requested is not None and trial.config.n_buffer > trial.requested.n_buffer
    assert trial.config.n_checkpoint == 3 and (auto.config, handle.n_buffer) == (trial.config, trial.config.n_buffer)
    assert "chunk buffers in its rewritten step; placed again with them" in caplog.text
    _assert_same_params(handle, model, reference)
    handle.close()


@pytest.mark.parametrize("said", [False, True])
def test_accumulating_micro_batches_hold_the_persistent_chunks_gradients_counted_or_named(logged, said):
    """Micro-batches accumulated with ``handle.accumulate()``: the persistent chunks' parameters hold
    their gradients into the next micro-batch. With ``accumulation_steps`` the chosen plan counts them
    (the analysis' held gradients); without it, one warning names their bytes and the option. The
    updates stay exactly eager's either way."""
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT, **({"accumulation_steps": 2} if said else {}))
    for step in range(2):
        for micro in range(2):
            idx, targets = _batch(2 * step + micro)
            loss, ref_loss = compiled(idx, targets), reference(idx, targets)
            assert torch.equal(loss, ref_loss), (step, micro)
            with handle.accumulate() if micro == 0 else contextlib.nullcontext():
                (loss / 2).backward()
            (ref_loss / 2).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _assert_same_params(handle, model, reference)
    record = _train_record()
    assert 0 < handle.n_persist and record.step.held_gradients is said
    persistent = sum(p.untyped_storage().nbytes() for p in model.parameters() if p.requires_grad)
    assert (record.memory.timeline.baseline_bytes.get("gradient") == persistent) is said
    warned = [r.getMessage() for r in logged if "holding" in r.getMessage()]
    assert len(warned) == (0 if said else 1)
    if not said:
        assert human_bytes(persistent) in warned[0] and "accumulation_steps" in warned[0]
