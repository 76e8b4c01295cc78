"""Two gloo ranks planning together: the collectives timed at a chunk's size (rank 0's reading on every
rank, cached per world size), and automatic counts chosen on a Problem that knows the world size."""

from __future__ import annotations

import os
import tempfile

import torch

import protrain_fx
from protrain_fx.planner import offload as autooffload
from protrain_fx.profile import collectives
from protrain_fx.search.problem import MachineProfile
from tests.distributed import common
from tests.distributed.ranks import run_ranks
from protrain_fx import settings

#: The tiny GPT's step (batch 2 x 32) with every parameter on the device peaks above this: some
#: chunks must be offloaded (``tests/planner/test_auto_offload.py``'s ``TIGHT``).
TIGHT = 3_000_000

GPU_LIKE = MachineProfile(h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, duplex_bytes_per_s=40e9,
                          cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e11)


def _timed(rank: int, world: int, cache: str) -> dict:
    first = collectives.collective_times("cpu", common.CHUNK // 4, torch.float32, cache=cache)
    measure = collectives._time_collectives

    def refuse(*args):
        raise AssertionError("measured again though cached")

    collectives._time_collectives = refuse
    again = collectives.collective_times("cpu", common.CHUNK // 4, torch.float32, cache=cache)
    collectives._time_collectives = lambda *args: (1.0 + rank, 2.0 + rank)  # each rank reads its own
    refreshed = collectives.collective_times("cpu", common.CHUNK // 4, torch.float32, cache=cache, refresh=True)
    collectives._time_collectives = measure
    return {"first": first, "again": again, "refreshed": refreshed}


def test_collective_times_are_rank_0_s_reading_on_every_rank_and_cached():
    with tempfile.TemporaryDirectory() as cache:
        ranks = run_ranks(_timed, cache)
    assert ranks[0] == ranks[1]
    first, again, refreshed = ranks[0]["first"], ranks[0]["again"], ranks[0]["refreshed"]
    assert all(0 < s < 10 for s in first)  # a 64 KiB chunk over gloo: well under a second
    assert again == first  # read from the cache, not measured
    assert refreshed == (1.0, 2.0)  # measured again: rank 0's reading on both ranks


def _auto(rank: int, world: int, cache: str) -> dict:
    os.environ[settings.CACHE_DIR] = cache
    autooffload.offload_machine = lambda device, record, *chunk: GPU_LIKE
    model, reference, opt, ref_opt = common.models()
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=common.CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    same = []
    for step in range(2):
        loss = compiled(*common.batch(step, rank))
        loss.backward()
        opt.step(), opt.zero_grad()
        same.append(torch.equal(loss.detach(), common.reference_step(reference, ref_opt, step, world)[rank]))
    auto = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1].auto_plan
    params = common.full_params(handle.state_dict(model), reference)
    handle.close()
    return {"problem": auto.problem, "config": auto.config, "losses": same, "params": params}


def test_automatic_counts_are_chosen_on_a_problem_that_knows_the_world_size():
    with tempfile.TemporaryDirectory() as cache:
        ranks = run_ranks(_auto, cache)
    problem = ranks[0]["problem"]
    assert problem == ranks[1]["problem"] and ranks[0]["config"] == ranks[1]["config"]
    assert problem.world_size == 2
    assert problem.chunk_all_gather_s > 0 and problem.chunk_reduce_scatter_s > 0  # timed on the group
    assert ranks[0]["config"].n_persist < len(problem.chunks)  # the budget makes it offload
    for result in ranks:
        assert all(result["losses"]), result["losses"]
        assert all(result["params"].values()), [n for n, ok in result["params"].items() if not ok]
