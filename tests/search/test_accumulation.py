"""The cost model and the search with gradient accumulation (``Problem.accumulation``): k micro-batches
fetch, compute and land their gradients k times, the optimizer steps once; the step priced is the
whole accumulated step, and the plan chosen is the fastest for it."""

from __future__ import annotations

import dataclasses

import pytest

from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import BlockProfile, ChunkProfile, Counts, MachineProfile, Problem
from protrain_fx.search.search import search
from tests.search.test_cost_search import brute_force, budgets, make_problem

MB = 10**6
ms = 1e-3


def two_blocks(accumulation: int = 1) -> Problem:
    """Two blocks of 10 ms forward, 20 ms backward and 10 ms recompute, one chunk each (100 MB in
    the compute dtype, 50 M parameters); every copy 10 ms (1e10 B/s each way, a duplex rate twice
    that, so a copy never shares the link); CPU Adam 50 ms a chunk, GPU Adam 0.05 ms a chunk. No
    swap moves anything (``swap_bytes`` 0)."""
    block = dict(fwd_s=10 * ms, bwd_s=20 * ms, recompute_s=10 * ms, saved_bytes=1000 * MB,
                 checkpoint_saved_bytes=100 * MB, swap_bytes=0, transient_bytes=0)
    return Problem(
        blocks=[BlockProfile(name="a", chunk_ids=(0,), **block), BlockProfile(name="b", chunk_ids=(1,), **block)],
        chunks=[ChunkProfile(bytes=100 * MB, n_params=50 * MB)] * 2,
        machine=MachineProfile(h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, duplex_bytes_per_s=4e10,
                               cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e12),
        accumulation=accumulation,
    )


@pytest.mark.parametrize("k", [1, 2, 8])
def test_an_accumulated_step_is_k_micro_batches_and_one_optimizer_step(k: int) -> None:
    """Counts (1, 1, 0, 0): chunk 0 stays on the device, chunk 1 goes through the one buffer.

    One micro-batch, by hand: forward, block a (0-10 ms) beside chunk 1's fetch (0-10), block b
    (10-20); backward, block b (20-40; chunk 1 is still in its buffer), its gradient to the host
    (40-50) beside block a (40-60). A micro-batch is 60 ms, 100 MB fetched and 100 MB landed.
    The optimizer step, once: chunk 1's CPU Adam from its landing (50) to 100 ms, and the next
    forward reaches block b (10 ms into its compute) only once chunk 1 is fetched again (100 + 10):
    the step ends at 100 ms, 40 ms after the micro-batch would have; GPU Adam of chunk 0 (0.05 ms)
    runs after backward (60.05), within that."""
    model = CostModel(two_blocks(k))
    e = model.estimate(Counts(1, 1, 0, 0))
    micro, optimizer = 60 * ms, 40 * ms
    assert model.micro_batch_time(1, 1, 0, 0) == pytest.approx(micro)
    assert e.step_s == pytest.approx(k * micro + optimizer)
    assert e.accumulated_s == pytest.approx((k - 1) * micro)
    assert e.step_s == pytest.approx(e.accumulated_s + e.fwd_s + e.bwd_s + e.opt_s)
    assert e.compute_s == pytest.approx(k * 60 * ms)  # forward + backward of both blocks, each micro-batch
    assert (e.h2d_bytes, e.d2h_bytes) == (k * 100 * MB, k * 100 * MB)
    assert e.cpu_adam_s == pytest.approx(50 * ms)  # once a step
    # every chunk on the device: 30 ms forward + 60 ms backward with block b rerun (10 ms), and
    # GPU Adam of both chunks (0.1 ms) once
    e = model.estimate(Counts(2, 0, 0, 1))
    assert e.step_s == pytest.approx(k * 70 * ms + 0.1 * ms) and e.recompute_s == pytest.approx(k * 10 * ms)


def test_the_chosen_plan_changes_with_the_accumulation() -> None:
    """Under 2.9 GB, both chunks stay on the device only with a block checkpointed (2.7 GB);
    offloading chunk 1 leaves room to keep every activation (2.9 GB). Keeping chunk 1 saves its
    CPU Adam (paid once a step); checkpointing costs a recompute (paid every micro-batch). One
    micro-batch a step: 70.1 ms against 100 ms, keep both chunks. Eight: 8 x 70 + 0.1 = 560.1 ms
    against 7 x 60 + 100 = 520 ms, offload chunk 1."""
    budget = 2900 * MB
    chosen = {}
    for k in (1, 8):
        problem = two_blocks(k)
        found = search(problem, budget)
        best = min((t for cfg, t, peak in brute_force(problem) if peak <= budget))
        assert found.estimate.step_s == pytest.approx(best)
        chosen[k] = (found.best.n_persist, found.best.n_checkpoint)
    assert chosen == {1: (2, 1), 8: (1, 0)}


def test_search_with_accumulation_equals_brute_force_on_random_problems() -> None:
    """The search's pruning stays exact: its bounds hold for the accumulated step too (each
    micro-batch and the last step are each no faster than their bounds)."""
    for seed in range(6):
        problem = dataclasses.replace(make_problem(seed, n_blocks=3), accumulation=3)
        for gpu_optim in (False, True):
            table = brute_force(problem, gpu_optim=gpu_optim)
            for budget in budgets(table, 4):
                found = search(problem, budget, gpu_optim=gpu_optim)
                best = min(t for _, t, peak in table if peak <= budget)
                assert found.estimate.step_s == pytest.approx(best, rel=1e-12)
                assert found.estimate.peak_bytes <= budget


def test_device_steps_keep_their_memory_and_move_nothing_under_accumulation() -> None:
    """After accumulated micro-batches the runtime steps every offloaded chunk on the CPU
    (``OffloadHandle.land_grads``): ``n_gpu_optim`` prices as 0 and still holds its staging."""
    problem = dataclasses.replace(make_problem(3, n_blocks=3), accumulation=4)
    model = CostModel(problem)
    with_steps, without = model.estimate(Counts(0, 3, 0, 0, 2)), model.estimate(Counts(0, 3, 0, 0, 0))
    assert with_steps.step_s == without.step_s and with_steps.device_steps == 0
    assert with_steps.peak_bytes == without.peak_bytes + model.device_step_bytes


def test_accumulation_is_validated_and_replays(tmp_path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="accumulation"):
            dataclasses.replace(two_blocks(), accumulation=bad)
    old = two_blocks().to_dict()
    del old["accumulation"]  # a problem recorded before the field: one micro-batch a step
    assert Problem.from_dict(old) == two_blocks()
    path = tmp_path / "p.json"
    two_blocks(8).dump(path)
    assert Problem.load(path).accumulation == 8


def test_held_steps_wait_for_the_norm_then_step_in_the_next_forwards_order() -> None:
    """Clipping holds every offloaded chunk's step until backward's last gradient has landed
    (``Problem.held_steps``). Counts (1, 1, 0, 0), by hand: backward ends at 60 ms (chunk 1's
    gradient landed at 50); chunk 1's CPU Adam runs 60-110 instead of 50-100, and the next forward
    reaches block b (10 ms in) once chunk 1 is fetched again: the step ends at 110 ms, 10 later than
    unheld. Stepped on the device (n_gpu_optim 1): its master and moments (600 MB) and held gradient
    (100 MB) in, master, moments and working copy out (700 MB), 70 ms each way at 1e10 B/s: updated
    at 130, the step ends at 130."""
    held = CostModel(dataclasses.replace(two_blocks(), held_steps=True))
    assert CostModel(two_blocks()).estimate(Counts(1, 1, 0, 0)).step_s == pytest.approx(100 * ms)
    e = held.estimate(Counts(1, 1, 0, 0))
    assert e.step_s == pytest.approx(110 * ms) and e.cpu_adam_s == pytest.approx(50 * ms)
    assert e.bwd_s + e.fwd_s == pytest.approx(60 * ms)
    assert held.estimate(Counts(1, 1, 0, 0, 1)).step_s == pytest.approx(130 * ms)
    assert Problem.from_dict(held.problem.to_dict()).held_steps  # kept with the plan
