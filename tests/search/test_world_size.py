"""The cost model and the search with data parallelism (``Problem.world_size``): each rank copies and
steps its 1/N of every offloaded chunk, and the all-gather of a fetched chunk and the reduce-scatter
of a chunk's gradient run on a collective lane of their own, as does a persistent chunk's gradient
all-reduce. The expected times are derived by hand
in each test's docstring; world size 1 is the one-GPU model (``tests/search`` and the recorded
problems replay unchanged)."""

from __future__ import annotations

import dataclasses

import pytest

from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import BlockProfile, ChunkProfile, Counts, MachineProfile, Problem
from protrain_fx.search.search import search
from tests.search.test_cost_search import all_configs, brute_force, budgets, make_problem

ms = 1e-3
MB = 10**6


def two_blocks(world_size: int = 1, collective_s: float = 0.0) -> Problem:
    """Blocks a and b, each 1 ms forward and 2 ms backward, one chunk each (2 MB in the compute dtype,
    1 M parameters); no outside work, no activations. Copies at 1e10 B/s each way with a duplex rate
    twice that, so a copy never shares the link: a whole chunk's copy takes 0.2 ms. CPU Adam 0.5 G
    params/s (2 ms a whole chunk), GPU Adam 0.1 G params/s (10 ms a chunk: slow, so that offloading
    pays where the copies are cheap). ``collective_s``: the all-gather and the reduce-scatter of a
    chunk, each."""
    block = dict(fwd_s=1 * ms, bwd_s=2 * ms, recompute_s=1 * ms, saved_bytes=0, checkpoint_saved_bytes=0,
                 swap_bytes=0, transient_bytes=0)
    return Problem(
        blocks=[BlockProfile(name="a", chunk_ids=(0,), **block), BlockProfile(name="b", chunk_ids=(1,), **block)],
        chunks=[ChunkProfile(bytes=2 * MB, n_params=1 * MB)] * 2,
        machine=MachineProfile(h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, duplex_bytes_per_s=2e10,
                               cpu_adam_params_per_s=0.5e9, gpu_adam_params_per_s=1e8),
        world_size=world_size,
        chunk_all_gather_s=collective_s,
        chunk_reduce_scatter_s=collective_s,
    )


def test_with_free_collectives_two_ranks_halve_the_copy_and_optimizer_lanes() -> None:
    """Counts (0, 2, 0, 0): both chunks through two buffers, stepped on the CPU. With c the copy of a
    rank's part of a chunk (each way) and a its CPU step, by hand: forward fetches chunk a (ends at
    c) and b (2c); block a runs c..c+1, block b c+1..c+2. Backward: both chunks still resident; block
    b's backward ends at c+4, its gradient lands at c+4+c, its step ends at 2c+4+a; block a's ends
    at c+6, lands at 2c+6, its step ends at 2c+6+a (after b's: 2c+4+a <= 2c+6). The next forward
    needs chunk a at 0 on the reference timeline, fetched in c: the step is 3c + 6 + a.
    One rank: c = 0.2 ms, a = 2 ms: 8.6 ms. Two ranks: c = 0.1, a = 1: 7.3 ms, the 2.6 ms beside
    the 6 ms of compute halved. A rank's link bytes and CPU seconds halve too."""
    config = Counts(0, 2, 0, 0)
    one = CostModel(two_blocks()).estimate(config)
    two = CostModel(two_blocks(world_size=2)).estimate(config)
    assert one.step_s == pytest.approx(8.6 * ms, rel=1e-12)
    assert two.step_s == pytest.approx(7.3 * ms, rel=1e-12)
    assert one.compute_s == two.compute_s == pytest.approx(6 * ms)
    assert (one.h2d_bytes, one.d2h_bytes) == (4 * MB, 4 * MB)
    assert (two.h2d_bytes, two.d2h_bytes) == (2 * MB, 2 * MB)
    assert one.cpu_adam_s == pytest.approx(4 * ms) and two.cpu_adam_s == pytest.approx(2 * ms)
    assert one.peak_bytes == two.peak_bytes  # a rank holds the whole chunks' buffers


def test_collectives_run_on_their_own_lane_after_each_copy() -> None:
    """Two ranks, an all-gather and a reduce-scatter of 20 ms each, c = 0.1 ms, a = 1 ms, by hand.

    (0, 2, 0, 0): chunk a's copy ends at 0.1, its all-gather at 20.1; chunk b's copy ends at 0.2,
    its all-gather waits for the lane: 40.1. Block a 20.1..21.1, block b 40.1..41.1. Backward: b's
    ends 43.1, its reduce-scatter 63.1, landed 63.2, stepped 64.2; a's ends 45.1, reduce-scatter
    83.1, landed 83.2, stepped 84.2. The next forward needs chunk a at 0, fetched (copy and
    all-gather) in 20.1: the step is 104.3 ms.
    (1, 1, 0, 0): chunk a stays. Chunk b fetched by 20.1; block a 0..1, block b 20.1..21.1;
    backward: b's ends 23.1, reduce-scatter 43.1, landed 43.2, stepped 44.2; a's ends 25.1, and the
    all-reduce of persistent chunk a (a reduce-scatter and an all-gather: 40 ms) waits for the lane:
    43.1..83.1. Backward ends with it, then a's GPU Adam (10 ms): 93.1. Chunk b is used 1 ms into
    the next forward: 44.2 + 20.1 - 1 = 63.3 ms, below.
    (2, 0, 0, 0): backward b 2..4, its chunk's all-reduce 4..44; a 4..6, its all-reduce 44..84;
    then two GPU Adam steps: 104 ms."""
    model = CostModel(two_blocks(world_size=2, collective_s=20 * ms))
    assert model.estimate(Counts(0, 2, 0, 0)).step_s == pytest.approx(104.3 * ms, rel=1e-12)
    assert model.estimate(Counts(1, 1, 0, 0)).step_s == pytest.approx(93.1 * ms, rel=1e-12)
    assert model.estimate(Counts(2, 0, 0, 0)).step_s == pytest.approx(104 * ms, rel=1e-12)


def test_a_persistent_chunk_s_all_reduce_hides_behind_backward_but_the_last() -> None:
    """(2, 0, 0, 0) at 0.1 ms collectives: chunk b's all-reduce (0.2 ms) runs 4..4.2, beside block a's
    backward (4..6); chunk a's, the last, 6..6.2 is exposed: 6.2 ms and two GPU Adam steps, 26.2 ms
    (one rank: 26). A micro-batch that accumulates reduces nothing: 6 ms of compute."""
    fast = CostModel(two_blocks(world_size=2, collective_s=0.1 * ms))
    assert fast.estimate(Counts(2, 0, 0, 0)).step_s == pytest.approx(26.2 * ms, rel=1e-12)
    assert CostModel(two_blocks()).estimate(Counts(2, 0, 0, 0)).step_s == pytest.approx(26 * ms, rel=1e-12)
    accumulated = CostModel(dataclasses.replace(two_blocks(world_size=2, collective_s=20 * ms), accumulation=2))
    assert accumulated.micro_batch_time(2, 0, 0, 0) == pytest.approx(6 * ms, rel=1e-12)
    assert accumulated.estimate(Counts(2, 0, 0, 0)).step_s == pytest.approx(110 * ms, rel=1e-12)


def test_slow_collectives_keep_more_chunks_persistent() -> None:
    """Memory is no object here: the search takes the fastest config. Free collectives: offloading
    both chunks (7.3 ms, first test) beats keeping them (26 ms: their GPU Adam is slow). At 20 ms a
    collective, offloading both takes 104.3 ms, keeping both 104 (two all-reduces on the lane) and
    keeping one 93.1 (second test): one chunk stays."""
    budget = 1 << 40
    free = search(two_blocks(world_size=2), budget)
    slow = search(two_blocks(world_size=2, collective_s=20 * ms), budget)
    assert free.best.n_persist == 0 and free.estimate.step_s == pytest.approx(7.3 * ms, rel=1e-12)
    assert slow.best.n_persist == 1 and slow.estimate.step_s == pytest.approx(93.1 * ms, rel=1e-12)


def test_device_steps_wait_for_the_reduce_scatter_and_move_a_rank_s_part() -> None:
    """(0, 2, 0, 0, 1): chunk a is stepped on the device. Its step copies in the rank's part of the
    fp32 master and moments (1 M / 2 x 12 B = 6 MB at the shared 1e10 B/s: 0.6 ms) and out the same
    plus the working copy's part (7 MB: 0.7 ms). Two ranks, 20 ms collectives: block a's backward ends
    at 45.1 (second test), its reduce-scatter (behind b's, 63.1) ends at 83.1; the step's copies
    start there and end at 83.8; the next forward needs chunk a at 0, fetched in 20.1: 103.9 ms.
    Chunk b's CPU step (ends 64.2) and its fetch (needed at 1 ms) give 83.3: below."""
    problem = two_blocks(world_size=2, collective_s=20 * ms)
    e = CostModel(problem).estimate(Counts(0, 2, 0, 0, 1))
    assert e.step_s == pytest.approx(103.9 * ms, rel=1e-12)
    assert e.h2d_bytes == 2 * MB + 6 * MB  # two fetched parts, one device step's states in
    assert e.d2h_bytes == 1 * MB + 7 * MB  # chunk b's gradient part, the device step's states out


def test_world_size_one_refuses_collective_times_and_round_trips() -> None:
    with pytest.raises(ValueError, match="chunk_all_gather_s=0.5 with world_size=1"):
        dataclasses.replace(two_blocks(), chunk_all_gather_s=0.5)
    with pytest.raises(ValueError, match="world_size=0 must be an int >= 1"):
        two_blocks(world_size=0)
    problem = two_blocks(world_size=4, collective_s=3 * ms)
    assert Problem.from_dict(problem.to_dict()) == problem
    d = two_blocks().to_dict()
    for key in ("world_size", "chunk_all_gather_s", "chunk_reduce_scatter_s"):  # a problem recorded before
        del d[key]
    assert Problem.from_dict(d) == two_blocks()


def _data_parallel(seed: int) -> Problem:
    """A random problem at 2 or 4 ranks, collectives about a chunk's copy long."""
    problem = make_problem(seed, n_blocks=2 + seed % 3)
    copy_s = problem.chunks[0].bytes / problem.machine.h2d_bytes_per_s
    return dataclasses.replace(problem, world_size=2 + 2 * (seed % 2), chunk_all_gather_s=copy_s * (1 + seed % 3),
                               chunk_reduce_scatter_s=copy_s * (2 - seed % 2))


def test_search_equals_brute_force_and_stays_monotone_with_ranks() -> None:
    """The search's pruning rests on the model's properties (``docs/DESIGN.md#the-cost-model``); with
    collectives they hold as they do without: the search equals brute force, the time never grows
    with buffers, and slower collectives never make a step faster."""
    for seed in range(8):
        problem = _data_parallel(seed)
        table = brute_force(problem)
        for budget in budgets(table, 4):
            want = min((t for _, t, peak in table if peak <= budget), default=None)
            assert search(problem, budget).estimate.step_s == want, (seed, budget)
        model = CostModel(problem)
        slower = CostModel(dataclasses.replace(problem, chunk_all_gather_s=2 * problem.chunk_all_gather_s,
                                               chunk_reduce_scatter_s=2 * problem.chunk_reduce_scatter_s))
        for cfg in all_configs(problem):
            t = model.step_time(*dataclasses.astuple(cfg))
            assert slower.step_time(*dataclasses.astuple(cfg)) >= t, (seed, cfg)
            if cfg.n_buffer + 1 in model.buffer_range(cfg.n_persist):
                more = dataclasses.replace(cfg, n_buffer=cfg.n_buffer + 1)
                assert model.step_time(*dataclasses.astuple(more)) <= t, (seed, cfg)
