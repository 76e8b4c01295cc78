"""The collectives of data parallelism, timed at a chunk's size on the default process group and cached.

A sharded fetch ends with an all-gather of the whole chunk and a sharded gradient starts with a
reduce-scatter of the whole chunk's gradient (``runtime/parallel/shard.py``); the cost model prices each as
seconds per chunk (``search.problem.Problem.chunk_all_gather_s`` / ``chunk_reduce_scatter_s``).
:func:`collective_times` times ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` of a chunk
of the model's size and dtype on the group, as the runtime issues them, and keeps the result in
the device's profile file (``profile/cache.py``) under ``"collectives"``, per world size, ranks per
node, backend, chunk size and dtype, like the other machine readings. NCCL on GPUs, gloo on CPUs:
measured alike (gloo is just slower).

Every rank calls it at the same point (the planner does, in graph order): the timing is itself a
collective. Rank 0 decides whether to measure (its cache) and its reading is every rank's
(``runtime/parallel/distributed.from_rank0``), so the ranks price, and decide, alike.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from protrain_fx import progress
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.profile import keeps_rng
from protrain_fx.profile.cache import cache_path, read_json, write_json
from protrain_fx.runtime.parallel import distributed

#: Timed rounds of each collective after a warm-up; the median is kept, as training runs them beside
#: compute and copies and a best-of would read the quiet case.
COLLECTIVE_REPEAT = 5


@keeps_rng
def collective_times(
    device: torch.device | str,
    chunk_numel: int,
    dtype: torch.dtype,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    repeat: int = COLLECTIVE_REPEAT,
) -> tuple[float, float]:
    """Seconds of one all-gather and one reduce-scatter of a whole chunk of ``chunk_numel``
    elements of ``dtype`` on ``device`` over the default process group: rank 0's reading on every
    rank, measured once per (world size, ranks per node, backend, size, dtype) and cached in
    ``device``'s profile file. ``(0.0, 0.0)`` with one rank (no collective runs)."""
    group = distributed.active()
    if group is None:
        return 0.0, 0.0
    device = torch.device(device)
    path = cache_path(device, cache)
    key = f"{group.world_size} ranks, {group.local_world_size} a node, {group.backend}|{chunk_numel}|{dtype}"
    data = _read(path)
    kept = data.get("collectives", {}).get(key)
    measure = distributed.from_rank0(refresh or not _valid(kept))  # rank 0's cache decides for every rank
    if not measure:
        return distributed.from_rank0((float(kept[0]), float(kept[1])) if _valid(kept) else None)
    if group.rank == 0:
        progress.note(f"protrain_fx: timing the all-gather and reduce-scatter of a {human_bytes(chunk_numel * dtype.itemsize)} "
                      f"chunk over {group.world_size} ranks ({group.backend}; once, cached in {path})")
    times = distributed.from_rank0(_time_collectives(device, chunk_numel, dtype, group.world_size, repeat))
    if group.local_rank == 0:  # one writer per node's file
        data = _read(path)
        data.setdefault("collectives", {})[key] = list(times)
        write_json(path, data)
    return times


def _time_collectives(device: torch.device, chunk_numel: int, dtype: torch.dtype, world: int,
                      repeat: int) -> tuple[float, float]:
    """Median seconds of ``repeat`` all-gathers and reduce-scatters of a whole chunk (after one
    warm-up of each), each started together on every rank (a barrier before it)."""
    numel = -(-chunk_numel // world) * world
    whole = torch.zeros(numel, dtype=dtype, device=device)
    part = torch.zeros(numel // world, dtype=dtype, device=device)
    cuda = device.type == "cuda"

    def timed(op) -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        op()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def gather() -> None:
        dist.all_gather_into_tensor(whole, part)

    def scatter() -> None:
        dist.reduce_scatter_tensor(part, whole, op=dist.ReduceOp.SUM)

    out = []
    with distributed.outside_compile():  # the planner times them while the compile runs
        for op in (gather, scatter):
            timed(op)  # warm-up: the communicator's buffers and connections
            out.append(statistics.median(timed(op) for _ in range(max(1, repeat))))
    return out[0], out[1]


def _read(path) -> dict:
    try:
        return read_json(path) or {}
    except (OSError, ValueError):
        return {}


def _valid(kept: object) -> bool:
    return (isinstance(kept, list) and len(kept) == 2
            and all(isinstance(x, (int, float)) and 0 <= x < float("inf") for x in kept))
