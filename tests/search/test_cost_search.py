"""Cost model (``search/cost.py``) and search (``search/search.py``) on synthetic problems.

Plain data, no graphs, no device. Problems come from :func:`make_problem` (seeded RNG); sizes are in
whole MiB and times in milliseconds so failures read easily.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest

from protrain_fx.plan import interleaved
from protrain_fx.planner.rates import alone_rate
from protrain_fx.search.cost import CostModel, estimate
from protrain_fx.search.spread import expected_estimate, rate_scenarios, steadiest_gpu_optim
from protrain_fx.search.problem import (
    BlockProfile,
    ChunkProfile,
    Counts,
    MachineProfile,
    Problem,
    block_plan,
)
from protrain_fx.search.search import NoPlanFits, search

MiB = 2**20
ms = 1e-3


def make_problem(seed: int, n_blocks: int = 5, *, chunks_per_block: tuple[int, int] = (1, 2), **machine: float) -> Problem:
    """A random step: blocks using 1-2 fresh chunks each (sometimes also the previous block's last),
    chunk 0 = a tied embedding used by the outside work (and sometimes by block 0)."""
    rng = random.Random(seed)
    chained = random.Random(seed + 10**6)  # its own draws: the other fields stay those of the seed
    blocks: list[BlockProfile] = []
    next_chunk = 1
    for i in range(n_blocks):
        ids = [next_chunk - 1] if i > 0 and rng.random() < 0.3 else []
        k = rng.randint(*chunks_per_block)
        ids += range(next_chunk, next_chunk + k)
        next_chunk += k
        if i == 0 and rng.random() < 0.5:
            ids.insert(0, 0)
        saved = rng.randint(50, 400) * MiB
        fwd_s, bwd_s, recompute_s = rng.uniform(1, 5) * ms, rng.uniform(2, 10) * ms, rng.uniform(1, 5) * ms
        blocks.append(
            BlockProfile(
                name=f"blocks.{i}",
                fwd_s=fwd_s,
                bwd_s=bwd_s,
                recompute_s=recompute_s,
                recompute_chained_s=recompute_s * chained.uniform(0.3, 1.0),
                saved_bytes=saved,
                checkpoint_saved_bytes=rng.randint(1, 20) * MiB,
                swap_bytes=saved - rng.randint(0, 10) * MiB,
                transient_bytes=rng.randint(10, 200) * MiB,
                chunk_ids=tuple(ids),
            )
        )
    chunks = [ChunkProfile(bytes=64 * MiB, n_params=32 * MiB - rng.randint(0, 1000)) for _ in range(next_chunk)]
    rates = {
        "h2d_bytes_per_s": rng.uniform(10, 60) * 1e9,
        "d2h_bytes_per_s": rng.uniform(10, 60) * 1e9,
        "duplex_bytes_per_s": rng.uniform(15, 100) * 1e9,
        "cpu_adam_params_per_s": rng.uniform(1, 20) * 1e9,
        "gpu_adam_params_per_s": rng.uniform(50, 500) * 1e9,
        **machine,
    }
    return Problem(
        blocks=blocks,
        chunks=chunks,
        machine=MachineProfile(**rates, gpu_bytes=80 * 2**30),
        outside_fwd_s=rng.uniform(0, 3) * ms,
        outside_bwd_s=rng.uniform(0, 6) * ms,
        outside_peak_bytes=rng.randint(0, 500) * MiB,
        outside_chunk_ids=(0,),
        fixed_bytes=rng.randint(0, 100) * MiB,
        device_step_bytes=rng.randint(0, 300) * MiB,
    )


def all_configs(problem: Problem, *, gpu_optim: bool = False):
    """Every valid config, enumerated independently of the search (minimum buffers included); with
    ``gpu_optim``, every ``n_gpu_optim`` too."""
    n, N = len(problem.chunks), len(problem.blocks)
    steps = [set(b.chunk_ids) for b in problem.blocks] + [set(problem.outside_chunk_ids)]
    for p in range(n + 1):
        need = max(len({c for c in s if c >= p}) for s in steps)
        for b in [0] if p == n else range(max(1, need), n - p + 1):
            for g in range(n - p + 1) if gpu_optim else (0,):
                for s in range(N + 1):
                    for c in range(N + 1 - s):
                        yield Counts(p, b, s, c, g)


def brute_force(problem: Problem, *, gpu_optim: bool = False) -> list[tuple[Counts, float, int]]:
    model = CostModel(problem)
    return [(cfg, (e := model.estimate(cfg)).step_s, e.peak_bytes) for cfg in all_configs(problem, gpu_optim=gpu_optim)]


def best_under(table: list[tuple[Counts, float, int]], cap: int) -> float:
    return min((t for _, t, peak in table if peak <= cap), default=math.inf)


def budgets(table: list[tuple[Counts, float, int]], k: int) -> list[int]:
    """``k`` budgets from the smallest peak to the largest (both ends included)."""
    lo, hi = min(p for *_, p in table), max(p for *_, p in table)
    return [lo + (hi - lo) * i // (k - 1) for i in range(k)]


# --------------------------------------------------------------------------- search


def test_search_equals_brute_force_on_random_problems() -> None:
    checked = 0
    for seed in range(25):
        problem = make_problem(seed, n_blocks=2 + seed % 4)
        table = brute_force(problem)
        for budget in budgets(table, 6):
            want = best_under(table, budget)
            got = search(problem, budget)
            assert got.estimate.step_s == want, (seed, budget, got.best)
            assert got.estimate.peak_bytes <= budget
            assert got.estimate == estimate(problem, got.best)
            assert got.evaluated + got.pruned == got.total == len(table)
            checked += 1
    assert checked == 150


def test_where_a_swap_frees_no_device_memory_the_search_never_swaps() -> None:
    """``MachineProfile.host_memory_apart`` false (the CPU device, whose swap copies stay in the memory
    the budget counts): the search is brute force over the configs with ``n_swap = 0``, down to the
    smallest budget it names; the same problems with their host apart swap at some budgets."""
    swapped = 0
    for seed in range(10):
        apart = make_problem(seed, n_blocks=2 + seed % 4)
        one_memory = dataclasses.replace(apart, machine=dataclasses.replace(apart.machine, host_memory_apart=False))
        table = [row for row in brute_force(one_memory) if row[0].n_swap == 0]
        assert CostModel(one_memory).activation_pairs() == sorted({(c.n_swap, c.n_checkpoint) for c, *_ in table})
        for budget in budgets(table, 5):
            got = search(one_memory, budget)
            assert got.best.n_swap == 0 and got.estimate.step_s == best_under(table, budget), (seed, budget)
            assert got.evaluated + got.pruned == got.total == len(table)
            swapped += search(apart, budget).best.n_swap > 0
        with pytest.raises(NoPlanFits) as info:
            search(one_memory, min(peak for *_, peak in table) - 1)
        assert info.value.min_budget_bytes == min(peak for *_, peak in table)
    assert swapped > 0


def test_pruning_never_drops_the_optimum_and_prunes() -> None:
    pruned_any = False
    for seed in range(100, 115):
        problem = make_problem(seed, n_blocks=6)
        for frac in (0.0, 0.05, 0.2, 0.5, 1.0):
            model = CostModel(problem)
            lo = min(model.static_bytes(p, model.buffer_range(p).start) for p in range(len(problem.chunks) + 1))
            budget = lo + model.activation_peak(0, 0) + int(frac * model.static_bytes(len(problem.chunks), 0))
            full = search(problem, budget, prune=False)
            fast = search(problem, budget)
            assert fast.estimate.step_s == full.estimate.step_s, (seed, frac)
            assert fast.evaluated <= full.evaluated
            pruned_any |= fast.evaluated < full.evaluated
    assert pruned_any


def test_more_budget_never_gives_a_slower_plan() -> None:
    for seed in range(200, 206):
        problem = make_problem(seed, n_blocks=8)
        model = CostModel(problem)
        n = len(problem.chunks)
        lo = min(model.static_bytes(p, model.buffer_range(p).start) for p in range(n + 1))
        hi = model.static_bytes(n, 0) + model.activation_peak(0, 0)
        previous = math.inf
        for budget in range(lo, hi + 64 * MiB, max(1, (hi - lo) // 40)):
            try:
                t = search(problem, budget).estimate.step_s
            except NoPlanFits:
                continue
            assert t <= previous, (seed, budget)
            previous = t
        assert previous < math.inf


def test_huge_budget_keeps_everything_persistent_without_swap_or_checkpoint() -> None:
    problem = make_problem(7, n_blocks=6, gpu_adam_params_per_s=math.inf, cpu_adam_params_per_s=1e8)
    got = search(problem, 2**50)
    assert got.best == Counts(len(problem.chunks), 0, 0, 0)
    e = got.estimate
    assert e.h2d_bytes == e.d2h_bytes == 0 and e.recompute_s == 0
    assert e.step_s == pytest.approx(e.compute_s, rel=1e-12)


def test_no_plan_fits_names_the_minimum_budget() -> None:
    problem = make_problem(3, n_blocks=4)
    smallest = min(peak for *_, peak in brute_force(problem))
    with pytest.raises(NoPlanFits) as info:
        search(problem, smallest - 1)
    assert isinstance(info.value, ValueError)
    assert info.value.min_budget_bytes == smallest
    assert f"at least {smallest} bytes" in str(info.value)
    with pytest.raises(NoPlanFits) as info:
        search(problem, smallest, reserve_bytes=MiB)
    assert info.value.min_budget_bytes == smallest + MiB
    assert search(problem, smallest).estimate.peak_bytes == smallest
    assert search(problem, smallest + MiB, reserve_bytes=MiB).estimate.peak_bytes == smallest
    with pytest.raises(ValueError, match="budget_bytes"):
        search(problem, -1)


def test_search_at_full_scale_prunes_and_fits() -> None:
    """48 blocks, ~100 chunks: the search finishes with a plan that fits and prunes most configs.
    Its speed is a benchmark (bench/search_time.py), not a timed test."""
    problem = make_problem(11, n_blocks=48, chunks_per_block=(2, 2))
    model = CostModel(problem)
    n = len(problem.chunks)
    assert 95 <= n <= 110
    lo = min(model.static_bytes(p, model.buffer_range(p).start) for p in range(n + 1))
    hi = model.static_bytes(n, 0) + model.activation_peak(0, 0)
    for frac in (0.1, 0.5, 1.2):
        budget = int(lo + 2000 * MiB + frac * (hi - lo))
        r = search(problem, budget)
        assert r.estimate.peak_bytes <= budget
        assert r.evaluated < r.total / 4, (frac, r.evaluated, r.total)


# --------------------------------------------------------------------------- cost model properties


def test_time_never_increases_with_bandwidth() -> None:
    for seed in range(300, 310):
        problem = make_problem(seed, n_blocks=5)
        rng = random.Random(seed)
        m = problem.machine
        faster = dataclasses.replace(
            problem,
            machine=dataclasses.replace(
                m,
                h2d_bytes_per_s=m.h2d_bytes_per_s * rng.choice([1, 1.5, 4]),
                d2h_bytes_per_s=m.d2h_bytes_per_s * rng.choice([1, 1.5, 4]),
                duplex_bytes_per_s=m.duplex_bytes_per_s * rng.choice([1, 2, 8]),
            ),
        )
        slow, fast = CostModel(problem), CostModel(faster)
        for cfg in all_configs(problem):
            assert fast.estimate(cfg).step_s <= slow.estimate(cfg).step_s, (seed, cfg)


def test_time_never_increases_with_buffers() -> None:
    for seed in range(400, 410):
        model = CostModel(make_problem(seed, n_blocks=5))
        for cfg in all_configs(model.problem):
            if cfg.n_buffer + 1 in model.buffer_range(cfg.n_persist):
                more = dataclasses.replace(cfg, n_buffer=cfg.n_buffer + 1)
                assert model.step_time(*astuple(more)) <= model.step_time(*astuple(cfg)), (seed, cfg)


@pytest.mark.parametrize("free_gpu_adam", [True, False])
def test_one_more_persistent_chunk_adds_at_most_its_gpu_adam(free_gpu_adam: bool) -> None:
    """With unlimited memory, more n_persist never increases the time when GPU Adam is free; when it
    is not, the time grows at most by the new persistent chunk's GPU Adam step."""
    extra = {"gpu_adam_params_per_s": math.inf} if free_gpu_adam else {}
    for seed in range(500, 510):
        problem = make_problem(seed, n_blocks=5, **extra)
        model = CostModel(problem)
        rate = problem.machine.gpu_adam_params_per_s
        for cfg in all_configs(problem):
            p, b = cfg.n_persist, cfg.n_buffer
            if p == len(problem.chunks):
                continue
            nb = min(b, len(problem.chunks) - p - 1)
            if nb not in model.buffer_range(p + 1):
                continue
            more = dataclasses.replace(cfg, n_persist=p + 1, n_buffer=nb)
            t_more, t = model.step_time(*astuple(more)), model.step_time(*astuple(cfg))
            allowed = problem.chunks[p].n_params / rate
            if free_gpu_adam:
                assert t_more <= t, (seed, cfg)
            else:
                assert t_more <= t + allowed * (1 + 1e-9) + 1e-12, (seed, cfg)


def test_lower_bounds_the_search_prunes_with() -> None:
    for seed in range(600, 610):
        model = CostModel(make_problem(seed, n_blocks=5))
        n = model.n_chunks
        for cfg in all_configs(model.problem, gpu_optim=True):
            p, b, s, c, g = astuple(cfg)
            t = model.step_time(p, b, s, c, g)
            assert t >= model.step_time(p, b, 0, 0, g)
            assert t >= model.step_time(n, 0, s, c, optimizer=False)
            assert t >= model.cpu_adam_time(p, g)
            assert t >= model.device_step_bound(p, g) - 1e-12
            e = model.estimate(cfg)
            assert e.peak_bytes == model.static_bytes(p, b, g) + model.activation_peak(s, c)
            assert t >= e.compute_s + e.recompute_s + e.gpu_adam_s - 1e-12
            assert e.step_s == pytest.approx(e.fwd_s + e.bwd_s + e.opt_s, rel=1e-12)


def test_memory_walk_by_hand() -> None:
    """Two equal blocks, sizes in MiB: swap the first, checkpoint the second."""
    block = {"fwd_s": ms, "bwd_s": 2 * ms, "recompute_s": ms, "saved_bytes": 100 * MiB,
             "checkpoint_saved_bytes": 10 * MiB, "swap_bytes": 90 * MiB, "transient_bytes": 20 * MiB}
    problem = Problem(
        blocks=[BlockProfile(name="a", chunk_ids=(0,), **block), BlockProfile(name="b", chunk_ids=(1,), **block)],
        chunks=[ChunkProfile(bytes=64 * MiB, n_params=32 * MiB)] * 2,
        machine=MachineProfile(h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, duplex_bytes_per_s=1.5e10,
                               cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e11),
        outside_peak_bytes=50 * MiB,
        fixed_bytes=7 * MiB,
    )
    model = CostModel(problem)
    # none/none: backward of b holds a's 100 + b's 100 + 20 transient; end of forward 200 + 50.
    assert model.activation_peak(0, 0) == 250 * MiB
    # swap a, checkpoint b: forward of b = keep_a 10 + swap_a 90 in flight + 20 + 10 = 130;
    # end of forward = 10 + 10 + 90 (a's offload overlaps the outside work) + 50 = 160;
    # backward of b = keep_a 10 + recomputed 100 + its input 10 + a prefetched 90 + 20 = 230.
    assert model.activation_peak(1, 1) == 230 * MiB
    # persistent chunk: working copy + grad (64 + 64 MiB) + fp32 master and two moments (12 B/param).
    assert problem.persistent_bytes(0) == 128 * MiB + 12 * 32 * MiB
    assert model.static_bytes(1, 1) == 7 * MiB + problem.persistent_bytes(0) + 64 * MiB
    e = estimate(problem, Counts(2, 0, 0, 0))
    assert e.step_s == pytest.approx(6 * ms + 2 * 32 * MiB / 1e11)


def _swap_problem(copy_ms: float) -> Problem:
    """Four equal blocks, 4 ms forward and 8 ms backward each on the placement timeline, 100 MiB
    saved and swapped each; a copy either way takes ``copy_ms``."""
    rate = 100 * MiB / (copy_ms * ms)
    blocks = [BlockProfile(name=f"blocks.{i}", fwd_s=4 * ms, bwd_s=8 * ms, recompute_s=4 * ms, saved_bytes=100 * MiB,
                           checkpoint_saved_bytes=10 * MiB, swap_bytes=100 * MiB, transient_bytes=0, chunk_ids=(0,))
              for i in range(4)]
    return Problem(blocks=blocks, chunks=[ChunkProfile(bytes=64 * MiB, n_params=32 * MiB)],
                   machine=MachineProfile(h2d_bytes_per_s=rate, d2h_bytes_per_s=rate, duplex_bytes_per_s=2 * rate,
                                          cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e11))


def test_swapped_bytes_stay_on_the_device_until_the_rewrite_waits_for_their_copy() -> None:
    """passes/swap.py queues the copies out in order and frees each where its copy is placed done;
    reloads are laid out latest first. With 6 ms copies against 4 ms blocks the copies pile up."""
    model = CostModel(_swap_problem(6))
    # copies out: block 0 issued at 4 ms, done 10 (freed before block 3, which starts at 12);
    # block 1 at 8, queued to 10, done 16 (before the outside work at 16); blocks 2, 3 done at 22
    # and 28: past the forward's blocks, freed at its end.
    assert [(i, k) for i, k, _ in model.swap_freed_at(4)] == [(0, 3), (1, 4), (2, 5), (3, 5)]
    # backward starts (placement): block 3 at 0, 2 at 8, 1 at 16, 0 at 24. Reloads latest first:
    # block 0 18..24 (issued in block 1's backward), block 1 10..16 (block 2), block 2 2..8 (block 3),
    # block 3 -6..0 (the outside work, first in backward).
    assert [(i, m) for i, m, _ in model.swap_reloaded_at(4, 0)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # forward of block 2 holds its own 100 and the copies of blocks 0 and 1 still queued: 300 MiB,
    # where "freed one block later" said 200.
    assert model.activation_peak(4, 0) == 300 * MiB
    # copies that fit in one block are freed one block later, as before
    fast = CostModel(_swap_problem(2))
    assert [(i, k) for i, k, _ in fast.swap_freed_at(4)] == [(0, 2), (1, 3), (2, 4), (3, 5)]
    assert fast.activation_peak(4, 0) == 200 * MiB
    # copies that never finish during compute save nothing: every swapped byte is on the device at
    # the forward's end and back before the blocks' backward starts
    slow = CostModel(_swap_problem(100))
    assert all(k == 5 for _, k, _ in slow.swap_freed_at(4))
    assert all(m == 4 for _, m, _ in slow.swap_reloaded_at(4, 0))
    assert slow.activation_peak(4, 0) == slow.activation_peak(0, 0) == 400 * MiB
    # checkpointing keeps its input only, whatever the link
    assert slow.activation_peak(0, 4) < slow.activation_peak(4, 0)


def test_swap_parts_place_each_copy_where_the_rewrite_issues_and_first_uses_it() -> None:
    """A part issued late (a value the next block reads last) joins the queue there; a part used
    late in its block's backward may be reloaded later."""
    base = _swap_problem(2)
    early = dataclasses.replace(base.blocks[0], swap_parts=((4 * ms, 0.0, 100 * MiB),))
    late = dataclasses.replace(base.blocks[0], swap_parts=((2 * ms, 0.0, 50 * MiB), (9 * ms, 7 * ms, 50 * MiB)))
    model_early = CostModel(dataclasses.replace(base, blocks=(early, *base.blocks[1:])))
    model_late = CostModel(dataclasses.replace(base, blocks=(late, *base.blocks[1:])))
    assert [(i, k) for i, k, _ in model_early.swap_freed_at(1)] == [(0, 2)]
    # 50 MiB issued at 2 ms, done 4 (before block 1); 50 MiB issued at 9 ms (in block 2), done 11: before block 3
    assert [(i, k, x) for i, k, x in model_late.swap_freed_at(1)] == [(0, 1, 50 * MiB), (0, 3, 50 * MiB)]
    # backward: block 0 starts at 24; the part first used at 31 is reloaded from 29, inside block 0's
    # own backward; the other, used at 24, from 22, in block 1's
    assert sorted(model_late.swap_reloaded_at(1, 0)) == [(0, 0, 50 * MiB), (0, 1, 50 * MiB)]
    with pytest.raises(ValueError, match="do not add up"):
        dataclasses.replace(base.blocks[0], swap_parts=((0.0, 0.0, 10 * MiB),))


def test_policies_follow_interleaved() -> None:
    for n_blocks in range(8):
        problem = make_problem(n_blocks, n_blocks=max(n_blocks, 1))
        model = CostModel(problem)
        labels = [b.name for b in problem.blocks]
        codes = {"none": 0, "checkpoint": 1, "swap": 2}
        for s, c in itertools.product(range(len(labels) + 1), repeat=2):
            if s + c <= len(labels):
                plan = interleaved(labels, s, c)
                assert model.policies(s, c) == tuple(codes[plan.policy(x)] for x in labels)
                assert block_plan(problem, Counts(len(problem.chunks), 0, s, c)) == plan


def test_a_checkpointed_block_before_another_reruns_its_chained_recompute() -> None:
    """Four blocks, recompute 3 ms alone and 2 ms chained (the next block checkpointed too keeps this
    one's output). Interleaved layouts: c=4 checkpoints all (the last reruns alone, before the outside
    work); c=3 is [ckpt][ckpt][ckpt none]; c=2 is [ckpt none][ckpt none]; c=1 checkpoints the first."""
    blocks = [BlockProfile(name=f"blocks.{i}", fwd_s=4 * ms, bwd_s=8 * ms, recompute_s=3 * ms, recompute_chained_s=2 * ms,
                           saved_bytes=100 * MiB, checkpoint_saved_bytes=10 * MiB, swap_bytes=100 * MiB,
                           transient_bytes=0, chunk_ids=(0,)) for i in range(4)]
    problem = Problem(blocks=blocks, chunks=[ChunkProfile(bytes=64 * MiB, n_params=32 * MiB)],
                      machine=MachineProfile(h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, duplex_bytes_per_s=1.5e10,
                                             cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e11))
    model = CostModel(problem)
    expected = {4: (2, 2, 2, 3), 3: (2, 2, 3, 0), 2: (3, 0, 3, 0), 1: (3, 0, 0, 0), 0: (0, 0, 0, 0)}
    for c, per_block in expected.items():
        assert model.recomputes(0, c) == pytest.approx(tuple(x * ms for x in per_block)), c
        e = model.estimate(Counts(1, 0, 0, c))
        assert e.recompute_s == pytest.approx(sum(per_block) * ms)
        assert e.bwd_s == pytest.approx(model.estimate(Counts(1, 0, 0, 0)).bwd_s + sum(per_block) * ms)
    # with one swapped block the layout starts after it: [swap][ckpt][ckpt][ckpt]
    assert model.recomputes(1, 3) == pytest.approx((0, 2 * ms, 2 * ms, 3 * ms))
    # a dump without the chained field prices it as the alone one
    d = blocks[0].to_dict()
    del d["recompute_chained_s"]
    assert BlockProfile.from_dict(d).recompute_chained_s == 3 * ms


def test_invalid_configs_are_refused() -> None:
    problem = make_problem(1, n_blocks=3, chunks_per_block=(2, 2))
    n = len(problem.chunks)
    for bad, match in [
        (Counts(n, 1, 0, 0), "n_buffer=1"),
        (Counts(0, 0, 0, 0), "n_buffer=0"),
        (Counts(0, 1, 0, 0), "n_buffer=1"),  # a block uses two non-persistent chunks at once
        (Counts(n + 1, 0, 0, 0), "n_persist"),
        (Counts(n, 0, 2, 2), "exceeds the 3 blocks"),
        (Counts(n, 0, -1, 0), "n_swap"),
    ]:
        with pytest.raises(ValueError, match=match):
            estimate(problem, bad)


# --------------------------------------------------------------------------- replay


def test_dumped_problem_replays_to_identical_estimates(tmp_path) -> None:
    for seed in range(700, 705):
        problem = make_problem(seed, n_blocks=4, gpu_adam_params_per_s=math.inf if seed % 2 else 3e11)
        path = tmp_path / f"problem_{seed}.json"
        problem.dump(path)
        loaded = Problem.load(path)
        assert loaded == problem
        assert Problem.from_dict(problem.to_dict()) == problem
        a, b = CostModel(problem), CostModel(loaded)
        for cfg in all_configs(problem):
            assert a.estimate(cfg) == b.estimate(cfg)
            assert Counts.from_dict(cfg.to_dict()) == cfg
        budget = budgets(brute_force(problem), 3)[1]
        assert search(loaded, budget).estimate == search(problem, budget).estimate


def test_problem_json_refuses_unknown_keys_and_versions() -> None:
    d = make_problem(0, n_blocks=2).to_dict()
    with pytest.raises(ValueError, match="version 2"):
        Problem.from_dict({**d, "version": 2})
    with pytest.raises(ValueError, match="unknown keys"):
        Problem.from_dict({**d, "budget": 1})
    with pytest.raises(ValueError, match="chunks \\[1\\] are used by no block"):
        Problem.from_dict({**d, "blocks": d["blocks"][:0], "outside_chunk_ids": [0], "chunks": d["chunks"][:2]})


def astuple(cfg: Counts) -> tuple[int, int, int, int, int]:
    return (cfg.n_persist, cfg.n_buffer, cfg.n_swap, cfg.n_checkpoint, cfg.n_gpu_optim)


# --------------------------------------------------------------------------- chunks stepped on the GPU


def test_search_with_device_steps_equals_brute_force() -> None:
    checked = chose_device = 0
    for seed in range(700, 712):
        # half the problems with a slow CPU, where stepping on the GPU should pay
        cpu = {"cpu_adam_params_per_s": 0.5e9} if seed % 2 else {}
        problem = make_problem(seed, n_blocks=2 + seed % 3, **cpu)
        table = brute_force(problem, gpu_optim=True)
        for budget in budgets(table, 5):
            got = search(problem, budget, gpu_optim=True)
            assert got.estimate.step_s == best_under(table, budget), (seed, budget, got.best)
            assert got.estimate.peak_bytes <= budget
            assert got.evaluated + got.pruned == got.total == len(table)
            assert search(problem, budget, gpu_optim=True, prune=False).estimate.step_s == got.estimate.step_s
            chose_device += got.best.n_gpu_optim > 0
            checked += 1
    assert checked == 60 and chose_device > 0


def test_device_steps_win_when_the_cpu_is_slow_and_lose_when_the_link_is():
    # Plenty of memory, no persistent chunk allowed to help (GPU Adam slow): the chunks must stream.
    slow_cpu = make_problem(9, n_blocks=4, cpu_adam_params_per_s=0.2e9, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9,
                            duplex_bytes_per_s=100e9)
    slow_link = make_problem(9, n_blocks=4, cpu_adam_params_per_s=50e9, h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9,
                             duplex_bytes_per_s=3e9)
    for problem, wins in ((slow_cpu, True), (slow_link, False)):
        model = CostModel(problem)
        n = model.n_chunks
        b = model.buffer_range(0).start
        none, every = model.step_time(0, b, 0, 0, 0), model.step_time(0, b, 0, 0, n)
        assert (every < none) == wins, (none, every)
        e = model.estimate(Counts(0, b, 0, 0, n))
        assert e.device_steps == n and e.cpu_adam_s == 0
        # master and moments in, the same and the working copy out, per chunk
        per_param = 4 + problem.adam_state_bytes_per_param
        assert e.h2d_bytes - model.estimate(Counts(0, b, 0, 0)).h2d_bytes == per_param * sum(
            c.n_params for c in problem.chunks)
        assert e.static_bytes == model.static_bytes(0, b) + problem.device_step_bytes + 2 * problem.buffer_bytes


def test_device_step_bookkeeping_agrees_with_the_runtime() -> None:
    from protrain_fx.runtime.optim.device_adam import MAX_IN_FLIGHT
    from protrain_fx.search.problem import DEVICE_STEPS_IN_FLIGHT

    assert DEVICE_STEPS_IN_FLIGHT == MAX_IN_FLIGHT


def test_device_steps_keep_the_cost_model_monotone_in_bandwidth_and_buffers() -> None:
    for seed in range(800, 806):
        problem = make_problem(seed, n_blocks=4)
        m = problem.machine
        faster = dataclasses.replace(problem, machine=dataclasses.replace(
            m, h2d_bytes_per_s=2 * m.h2d_bytes_per_s, d2h_bytes_per_s=2 * m.d2h_bytes_per_s,
            duplex_bytes_per_s=2 * m.duplex_bytes_per_s))
        slow, fast = CostModel(problem), CostModel(faster)
        for cfg in all_configs(problem, gpu_optim=True):
            t = slow.step_time(*astuple(cfg))
            assert fast.step_time(*astuple(cfg)) <= t, (seed, cfg)
            if cfg.n_buffer + 1 in slow.buffer_range(cfg.n_persist) and cfg.n_persist + cfg.n_gpu_optim <= slow.n_chunks:
                more = dataclasses.replace(cfg, n_buffer=cfg.n_buffer + 1)
                assert slow.step_time(*astuple(more)) <= t, (seed, cfg)


def test_a_measured_device_step_rate_prices_the_device_steps() -> None:
    # Unmeasured (0), the shared link rate prices them; measured, that rate does, and a slower one
    # never makes a step faster (the H200 streamed steps at 38 GB/s where the link gave 48 each way).
    problem = make_problem(9, n_blocks=4, cpu_adam_params_per_s=0.2e9, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9,
                           duplex_bytes_per_s=100e9)
    assert problem.machine.device_step_bytes_per_s == 0

    def with_rate(rate: float) -> CostModel:
        return CostModel(dataclasses.replace(problem, machine=dataclasses.replace(problem.machine,
                                                                                  device_step_bytes_per_s=rate)))

    base, same, slower, slowest = CostModel(problem), with_rate(50e9), with_rate(38e9), with_rate(5e9)
    n = base.n_chunks
    b = base.buffer_range(0).start
    c = problem.chunks[0]
    assert slower.dev_out_s[0] == pytest.approx((c.n_params * 12 + c.bytes) / 38e9)
    assert slower.dev_in_s[0] == pytest.approx(c.n_params * 12 / 38e9)
    for cfg in all_configs(problem, gpu_optim=True):
        t = base.step_time(*astuple(cfg))
        assert same.step_time(*astuple(cfg)) == t
        assert t <= slower.step_time(*astuple(cfg)) <= slowest.step_time(*astuple(cfg))
    assert slower.step_time(0, b, 0, 0, n) > base.step_time(0, b, 0, 0, n)
    # the search prunes with a bound built from the same times
    for cfg in all_configs(problem, gpu_optim=True):
        assert slowest.step_time(*astuple(cfg)) >= slowest.device_step_bound(cfg.n_persist, cfg.n_gpu_optim) - 1e-12
    # replayed from a dump written before the rate existed: not measured
    d = problem.to_dict()
    d["machine"].pop("device_step_bytes_per_s")
    assert Problem.from_dict(d).machine.device_step_bytes_per_s == 0
    with pytest.raises(ValueError, match="device_step_bytes_per_s=-1.0 must be a number >= 0"):
        dataclasses.replace(problem.machine, device_step_bytes_per_s=-1.0)


def test_a_device_step_timed_in_training_is_priced_at_its_own_time() -> None:
    # calibrate.TrainingRates hands the cost model each timed chunk's own device-step seconds
    # (Problem.device_step_s): that chunk's copies take them, the others keep the rate.
    problem = make_problem(11, n_blocks=4, cpu_adam_params_per_s=0.2e9, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9,
                           duplex_bytes_per_s=100e9)
    problem = dataclasses.replace(problem, machine=dataclasses.replace(problem.machine, device_step_bytes_per_s=40e9))
    base = CostModel(problem)
    n = base.n_chunks
    # its own time as the rate prices it: nothing changes
    same = CostModel(dataclasses.replace(problem, device_step_s=[(0, base.dev_out_s[0])]))
    assert same.dev_out_s == base.dev_out_s and same.dev_in_s == pytest.approx(base.dev_in_s)
    # chunk 0 timed at 3x: its copies in and out 3x, the other chunks as before
    slow = CostModel(dataclasses.replace(problem, device_step_s=((0, 3 * base.dev_out_s[0]),)))
    assert slow.dev_out_s[0] == pytest.approx(3 * base.dev_out_s[0])
    assert slow.dev_in_s[0] == pytest.approx(3 * base.dev_in_s[0])
    assert slow.dev_out_s[1:] == base.dev_out_s[1:] and slow.dev_in_s[1:] == base.dev_in_s[1:]
    b = base.buffer_range(0).start
    assert slow.step_time(0, b, 0, 0, n) > base.step_time(0, b, 0, 0, n)
    for cfg in all_configs(problem, gpu_optim=True):
        t = base.step_time(*astuple(cfg))
        p, b, _, _, g = astuple(cfg)
        if g and base._dev_refetch(p, b, g)[0]:  # a timed step has the re-fetches beside it in its seconds
            assert same.step_time(*astuple(cfg)) <= t + 1e-12
        else:
            assert same.step_time(*astuple(cfg)) == pytest.approx(t)
        assert slow.step_time(*astuple(cfg)) >= t - 1e-12
        assert slow.step_time(*astuple(cfg)) >= slow.device_step_bound(cfg.n_persist, cfg.n_gpu_optim) - 1e-12
    # kept in the dump; a dump without it prices every chunk at the rate
    timed = dataclasses.replace(problem, device_step_s=((0, 0.5), (2, 0.25)))
    assert Problem.from_dict(json.loads(json.dumps(timed.to_dict()))) == timed
    d = timed.to_dict()
    d.pop("device_step_s")
    assert Problem.from_dict(d).device_step_s == ()
    for bad, match in (([(n, 0.1)], "out of range"), ([(0, 0.0)], "seconds > 0"), ([(0, 0.1), (0, 0.2)], "twice"),
                       ([(0.5, 0.1)], "not \\(chunk id, seconds\\)")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(problem, device_step_s=bad)


def test_a_device_step_does_not_hold_up_backwards_refetches() -> None:
    # The runtime copies a device step's states on its own streams: backward's re-fetches (on the
    # buffer pool's stream) run beside them. One step (never the in-flight limit): however slow its
    # copies, backward ends when it would with instant copies. (In one FIFO with the fetches, each
    # re-fetch behind the step would wait for all of the step's copies in.)
    seen_refetch = 0
    for seed in range(900, 906):
        problem = make_problem(seed, n_blocks=4, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, duplex_bytes_per_s=100e9)

        def with_rate(rate: float) -> CostModel:
            return CostModel(dataclasses.replace(problem, machine=dataclasses.replace(problem.machine,
                                                                                      device_step_bytes_per_s=rate)))

        slow, instant = with_rate(1e6), with_rate(math.inf)
        b = slow.min_buffers(0)  # the fewest buffers: every run re-fetched that can be
        refetched = slow.estimate(Counts(0, b, 0, 0)).h2d_bytes > sum(c.bytes for c in problem.chunks)
        e_slow, e_fast = slow.estimate(Counts(0, b, 0, 0, 1)), instant.estimate(Counts(0, b, 0, 0, 1))
        assert e_slow.bwd_s == pytest.approx(e_fast.bwd_s, rel=1e-12), seed
        # the step still waits for the update before the next forward uses the chunk
        assert e_slow.step_s > e_fast.step_s + slow.dev_out_s[0] / 2
        seen_refetch += refetched
    assert seen_refetch  # the case this is about happened


def test_a_swap_in_beside_a_device_step_stalls_that_step() -> None:
    # B24 1.3B@16 GiB (6/3/3/21/4, ``docs/results.md#device-steps-beside-re-fetches-and-swap-ins``): the
    # device step in flight while swapped blocks' values come back takes about twice as long as the
    # others; its copies in share the host-to-device link with the swap-ins. Two blocks, chunk 0
    # persistent, chunks 1 and 2 stepped on the GPU; on the reference timeline block 0's swap-in (issued when block 1's backward starts,
    # at 3.5 ms) runs while chunk 2's step (issued when block 1's backward ends, at 5.5 ms) copies.
    # Offloads are instant (a fast device-to-host link), so that only the swap-in differs.
    def problem(swap_mib: int) -> Problem:
        blocks = [BlockProfile(name=f"blocks.{i}", fwd_s=1 * ms, bwd_s=2 * ms, recompute_s=1 * ms,
                               saved_bytes=200 * MiB, checkpoint_saved_bytes=1 * MiB, swap_bytes=swap_mib * MiB,
                               transient_bytes=10 * MiB, chunk_ids=(i + 1,)) for i in range(2)]
        return Problem(blocks=blocks, chunks=[ChunkProfile(bytes=64 * MiB, n_params=16 * MiB)] * 3,
                       machine=MachineProfile(h2d_bytes_per_s=10e9, d2h_bytes_per_s=1e15, duplex_bytes_per_s=2e15,
                                              cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e12,
                                              gpu_bytes=80 * 2**30, device_step_bytes_per_s=10e9),
                       outside_fwd_s=0.5 * ms, outside_bwd_s=1 * ms, outside_peak_bytes=0,
                       outside_chunk_ids=(0,), fixed_bytes=0)

    for swap_mib, stalled in ((100, True), (5, False)):  # swap-in of 10.5 ms, then 0.5 ms (over by 4 ms)
        model = CostModel(problem(swap_mib))
        swap_in = model.rl_d1[0]
        # both blocks' swap-ins (block 1's issued at 2.5 ms) overlap it when long; n_swap=1 swaps block 0
        assert model._pp(1, 2).dev_swap_in == ([[], [], [(0, swap_in), (1, swap_in)]] if stalled else [[], [], []])
        assert model._pp(1, 0).dev_swap_in == [[], [], []]  # no device steps, nothing stalls
        with_swap, without = model.estimate(Counts(1, 2, 1, 0, 2)), model.estimate(Counts(1, 2, 0, 0, 2))
        # The device steps end the step (chunk 1's update, then its fetch, before the next forward
        # uses it). Chunk 2's copies in, 20.1 ms, take 30.6 with the swap-in: 3.8 ms past its copies
        # out (26.8), which chunk 1's step, queued behind, inherits. A short swap-in stalls nothing.
        in_s, out_s = model.dev_in_s[2], model.dev_out_s[2]
        assert out_s > in_s and (in_s + swap_in > out_s) == stalled
        late = in_s + swap_in - out_s if stalled else 0.0
        assert with_swap.step_s - without.step_s == pytest.approx(late, rel=1e-6, abs=1e-12)


def test_a_refetch_beside_a_device_step_lengthens_that_step() -> None:
    # B24 4.2B at 24 GiB (3/3/0/35/11, ``docs/results.md#device-steps-beside-re-fetches-and-swap-ins``):
    # the device steps issued after backward's last re-fetch run at the profiled rate, those beside
    # the re-fetches take longer. Four blocks (1 ms forward, 2 ms backward), chunk 0 the outside
    # work's and persistent, chunks 1-3 stepped on the GPU, chunk 4 on the CPU. A fetch takes 6.7 ms,
    # a step 20.1 ms in and 26.8 out. On the reference timeline backward runs 4.5-13.5 ms; chunk 3's
    # step is issued at 9.5 and runs to 36.3, chunk 2's and chunk 1's queue behind it.
    blocks = [BlockProfile(name=f"blocks.{i}", fwd_s=1 * ms, bwd_s=2 * ms, recompute_s=1 * ms, saved_bytes=200 * MiB,
                           checkpoint_saved_bytes=1 * MiB, swap_bytes=100 * MiB, transient_bytes=10 * MiB,
                           chunk_ids=(i + 1,)) for i in range(4)]
    problem = Problem(blocks=blocks, chunks=[ChunkProfile(bytes=64 * MiB, n_params=16 * MiB)] * 5,
                      machine=MachineProfile(h2d_bytes_per_s=10e9, d2h_bytes_per_s=1e15, duplex_bytes_per_s=2e15,
                                             cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e12,
                                             gpu_bytes=80 * 2**30, device_step_bytes_per_s=10e9),
                      outside_fwd_s=0.5 * ms, outside_bwd_s=1 * ms, outside_peak_bytes=0,
                      outside_chunk_ids=(0,), fixed_bytes=0)
    model = CostModel(problem)
    fetch = model.h_d1[0]
    assert fetch == pytest.approx(6.71 * ms, rel=1e-3)
    assert [(c, round(x / ms, 2), round(y / ms, 2)) for c, x, y in model._pp(1, 3).dev_chain] == [
        (3, 9.5, 36.34), (2, 36.34, 63.19), (1, 63.19, 90.03)]
    # Chunk 1's re-fetch (for block 0) is issued as block 1's backward starts (9.5 ms), beside chunk
    # 3's step. Chunks 2's and 3's are over before the first step is issued (their blocks' backward
    # waits for them). With 4 buffers nothing is re-fetched.
    for b, added in ((1, fetch), (2, fetch), (3, fetch), (4, 0.0)):
        assert model.refetch_beside_steps(Counts(1, b, 0, 0, 3)) == [0.0, 0.0, 0.0, added, 0.0]
    assert model.refetch_beside_steps(Counts(1, 1, 0, 0, 0)) == [0.0] * 5  # no device steps
    # The steps end the step (chunk 1's update, then its fetch, before the next forward uses it), so
    # the step is longer by the re-fetch. Chunk 3 timed in training at its priced seconds: the
    # re-fetch is in them, nothing is added.
    timed = CostModel(dataclasses.replace(problem, device_step_s=((3, model.dev_out_s[3]),)))
    assert timed.refetch_beside_steps(Counts(1, 3, 0, 0, 3)) == [0.0] * 5
    assert model.step_time(1, 3, 0, 0, 3) - timed.step_time(1, 3, 0, 0, 3) == pytest.approx(fetch, rel=1e-9)
    assert model.step_time(1, 4, 0, 0, 3) == pytest.approx(timed.step_time(1, 4, 0, 0, 3), rel=1e-12)
    # the window's rate without the re-fetches: chunk 3 measured with one beside it reads at the rate
    out = model.dev_out_bytes
    seconds = {3: model.dev_out_s[3] + fetch, 2: model.dev_out_s[2], 1: model.dev_out_s[1]}
    assert alone_rate(model, Counts(1, 3, 0, 0, 3), seconds) == pytest.approx(10e9)
    assert sum(out[k] for k in seconds) / sum(seconds.values()) < 0.95 * 10e9  # the spans' own rate: lower


def test_the_forward_waits_for_its_offloads() -> None:
    # The forward graph waits for each swap offload where it is estimated done, by its output at the
    # latest (passes/swap.py): a forward shorter than its offloads ends when the last one does.
    # Block 0's forward takes 1 ms, the rest of the forward 0.2 ms, its offload 1.05 ms (over before
    # backward's swap-ins on the reference timeline, so the link is not otherwise shared).
    blocks = [BlockProfile(name=f"blocks.{i}", fwd_s=f * ms, bwd_s=2 * ms, recompute_s=1 * ms, saved_bytes=200 * MiB,
                           checkpoint_saved_bytes=1 * MiB, swap_bytes=100 * MiB, transient_bytes=10 * MiB,
                           chunk_ids=(i + 1,)) for i, f in enumerate((1.0, 0.1))]
    problem = Problem(blocks=blocks, chunks=[ChunkProfile(bytes=1 * MiB, n_params=16 * MiB)] * 3,  # fetches: 0.1 ms
                      machine=MachineProfile(h2d_bytes_per_s=10e9, d2h_bytes_per_s=100e9, duplex_bytes_per_s=50e9,
                                             cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e12,
                                             gpu_bytes=80 * 2**30),
                      outside_fwd_s=0.1 * ms, outside_bwd_s=1 * ms, outside_peak_bytes=0, outside_chunk_ids=(0,),
                      fixed_bytes=0)
    model = CostModel(problem)
    fetch = model.h_d1[0]
    assert model.so_d1[0] > 0.2 * ms
    assert model.estimate(Counts(1, 2, 1, 0)).fwd_s == pytest.approx(fetch + 1 * ms + model.so_d1[0], rel=1e-9)
    assert model.estimate(Counts(1, 2, 0, 0)).fwd_s == pytest.approx(fetch + 1.2 * ms, rel=1e-9)  # nothing to wait for


def test_invalid_device_step_counts_are_refused() -> None:
    problem = make_problem(3, n_blocks=3)
    n = len(problem.chunks)
    with pytest.raises(ValueError, match=rf"n_gpu_optim={n} with n_persist=1; accepted: 0..{n - 1}"):
        estimate(problem, Counts(1, CostModel(problem).buffer_range(1).start, 0, 0, n))


# --------------------------------------------------------------------------- lean chunks


def with_lean(problem: Problem, lean_at_0: int) -> Problem:
    """``problem`` on a host short of memory: the last ``lean_at_0`` chunks lean with nothing
    persistent, one fewer per persistent chunk (as the store's rule gives: each persistent chunk
    frees a chunk's host bytes); a lean fetch moves the fp32 master, twice the bf16 bytes."""
    n = len(problem.chunks)
    lean = tuple(max(0, min(lean_at_0 - p, n - p)) for p in range(n + 1))
    chunks = [dataclasses.replace(c, lean_fetch_bytes=2 * c.bytes) for c in problem.chunks]
    return dataclasses.replace(problem, chunks=chunks, lean_chunks=lean, lean_staging_bytes=64 * MiB)


def test_lean_chunks_fetch_their_master_and_add_the_staging() -> None:
    # One slow link, no swap: every fetch of a lean chunk takes twice as long, and the estimate's
    # bytes say so; a config with no lean chunk left is priced as without any.
    problem = make_problem(21, n_blocks=4, h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, duplex_bytes_per_s=10e9)
    n = len(problem.chunks)
    lean = with_lean(problem, 3)
    base, model = CostModel(problem), CostModel(lean)
    assert [model.lean_from(p) for p in (0, 1, 2, 3)] == [n - 3, n - 2, n - 1, n]
    for p in (0, 1, 2, 3):
        b = base.buffer_range(p).start
        e0, e = base.estimate(Counts(p, b, 0, 0)), model.estimate(Counts(p, b, 0, 0))
        extra = sum(c.bytes for c in problem.chunks[model.lean_from(p):])  # each lean chunk is fetched at least once
        if p < 3:
            assert e.h2d_bytes >= e0.h2d_bytes + extra and e.step_s > e0.step_s, p
            assert e.static_bytes == e0.static_bytes + 64 * MiB
        else:
            assert e == e0
    # the device step of a lean chunk copies no working copy out
    g = n
    b = base.buffer_range(0).start
    e0, e = base.estimate(Counts(0, b, 0, 0, g)), model.estimate(Counts(0, b, 0, 0, g))
    assert e0.d2h_bytes - e.d2h_bytes == sum(c.bytes for c in problem.chunks[n - 3:])


def test_search_with_lean_chunks_equals_brute_force_and_stays_monotone() -> None:
    checked = 0
    for seed in range(900, 908):
        problem = with_lean(make_problem(seed, n_blocks=2 + seed % 3), 2 + seed % 4)
        table = brute_force(problem, gpu_optim=seed % 2 == 1)
        best = 0.0
        for budget in reversed(budgets(table, 5)):
            got = search(problem, budget, gpu_optim=seed % 2 == 1)
            assert got.estimate.step_s == best_under(table, budget), (seed, budget, got.best)
            assert got.estimate.step_s >= best  # less budget, never faster
            best = got.estimate.step_s
            checked += 1
        model = CostModel(problem)
        for cfg in all_configs(problem, gpu_optim=True):  # the bounds the search prunes with
            t = model.step_time(*astuple(cfg))
            assert t >= model.step_time(cfg.n_persist, cfg.n_buffer, 0, 0, 0, optimizer=False) - 1e-12
            assert t >= model.device_step_bound(cfg.n_persist, cfg.n_gpu_optim) - 1e-12
    assert checked == 40


def test_lean_problems_replay_and_are_checked(tmp_path) -> None:
    problem = with_lean(make_problem(5, n_blocks=3), 2)
    path = tmp_path / "p.json"
    problem.dump(path)
    again = Problem.load(path)
    assert again == problem
    cfg = Counts(0, CostModel(problem).buffer_range(0).start, 1, 1)
    assert estimate(again, cfg) == estimate(problem, cfg)
    d = problem.to_dict()  # a dump from before lean chunks were modelled: none is lean
    d.pop("lean_chunks"), d.pop("lean_staging_bytes")
    for c in d["chunks"]:
        c.pop("lean_fetch_bytes")
    assert Problem.from_dict(d).lean_chunks == ()
    n = len(problem.chunks)
    for lean, msg in (
        ((1,) * n, rf"lean_chunks has {n} entries; one per n_persist in 0..{n} needs {n + 1}"),
        ((0,) * n + (1,), rf"lean_chunks\[{n}\]=1 exceeds the 0 chunks offloaded with n_persist={n}"),
        ((1, 2) + (0,) * (n - 1), r"lean_chunks must not grow with n_persist \(lean_chunks\[1\]=2 > 1\)"),
    ):
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(problem, lean_chunks=lean)
    with pytest.raises(ValueError, match=rf"chunks \[{n - 1}\] can be lean but have no lean_fetch_bytes"):
        dataclasses.replace(make_problem(5, n_blocks=3), lean_chunks=(1,) + (0,) * n)


# ---------------------------------------------------------------- the host rates' spread


def test_rate_scenarios_are_every_combination_of_each_rate_either_side_of_its_reading() -> None:
    problem = make_problem(3, device_step_bytes_per_s=40e9)
    cases = rate_scenarios(problem, {"cpu_adam_params_per_s": 0.25, "device_step_bytes_per_s": 0.1})
    m = problem.machine
    got = sorted((q.machine.cpu_adam_params_per_s / m.cpu_adam_params_per_s,
                  q.machine.device_step_bytes_per_s / m.device_step_bytes_per_s) for q in cases)
    want = sorted((c, d) for c in (0.75, 1, 1.25) for d in (0.9, 1, 1.1))
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in want for x in pair])
    assert cases[len(cases) // 2].machine == m  # the middle case is the reading itself
    for q in cases:  # nothing else moves
        assert q.machine.h2d_bytes_per_s == m.h2d_bytes_per_s and q.blocks == problem.blocks
    assert rate_scenarios(problem, {"cpu_adam_params_per_s": 0.0}) == [problem]


@pytest.mark.parametrize("seed", range(6))
def test_expected_step_is_the_mean_over_the_scenarios_and_memory_is_the_readings(seed: int) -> None:
    problem = make_problem(seed, device_step_bytes_per_s=30e9)
    model = CostModel(problem)
    spread = {"cpu_adam_params_per_s": 0.25, "device_step_bytes_per_s": 0.1}
    for cfg in itertools.islice(all_configs(problem, gpu_optim=True), 0, None, 7):
        plain, expected = model.estimate(cfg), expected_estimate(problem, cfg, spread)
        assert expected.peak_bytes == plain.peak_bytes
        if cfg.n_persist == len(problem.chunks):  # nothing offloaded: no host rate in the step
            assert expected == plain
            continue
        cases = [CostModel(q).estimate(cfg).step_s for q in rate_scenarios(problem, spread)]
        assert expected.step_s == pytest.approx(sum(cases) / len(cases))
        assert expected_estimate(problem, cfg, {}) == plain


@pytest.mark.parametrize("seed", range(6))
def test_steadiest_gpu_optim_is_the_count_of_least_mean_step_within_the_room(seed: int) -> None:
    problem = make_problem(seed, device_step_bytes_per_s=30e9, cpu_adam_params_per_s=2e9)
    model = CostModel(problem)
    spread = {"cpu_adam_params_per_s": 0.25, "device_step_bytes_per_s": 0.1}
    n = len(problem.chunks)
    for p in (0, n // 2):
        b = max(1, model.min_buffers(p))
        for g0 in (0, 1, n - p):
            config = Counts(p, b, 1, 1, g0)
            for room in (0, 10**12):
                got = steadiest_gpu_optim(problem, config, room_bytes=room, spread=spread)
                here = model.static_bytes(p, b, g0)
                allowed = [g for g in range(n - p + 1) if model.static_bytes(p, b, g) - here <= room]
                mean = {g: expected_estimate(problem, dataclasses.replace(config, n_gpu_optim=g), spread).step_s
                        for g in allowed}
                assert got.n_gpu_optim in allowed
                assert mean[got.n_gpu_optim] == pytest.approx(min(mean.values()))
                assert dataclasses.replace(got, n_gpu_optim=g0) == config  # only the count moves
    everything = Counts(n, 0, 0, 0)
    assert steadiest_gpu_optim(problem, everything, room_bytes=10**12) == everything
