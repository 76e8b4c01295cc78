"""Offloaded chunks sharded over the ranks of a data-parallel training (ZeRO-3 style, per chunk).

Each rank's chunk store (``ChunkStore(shard=(rank, world))``) holds its equal, contiguous part of
every offloaded chunk: the fp32 master, Adam's moments and the working copy, 1/N of a whole store.
Its CPU worker (and its device steps) step that part only. The collectives, on the default process
group, issued by the graph ops in graph order, so every rank issues the same ones in the same order:

* a fetch (``ChunkBufferPool``): the local part copied into its place in the whole chunk buffer,
  then :func:`all_gather` fills the rest, on the pool's copy stream (prefetched like a plain fetch);
* a gradient landing (``OffloadHandle.land_grads``): the chunk's gradients laid out as the whole
  flat chunk, :func:`reduce_scatter_mean` (the sum over ranks, then the division by their number,
  so two ranks give exactly ``(g0 + g1) / 2``), and the rank's part to its store;
* the host memory: each rank's store is checked against its share of the node's
  (:func:`node_share`), and a refusal on one rank is every rank's, naming the node's totals
  (:func:`store_on_every_rank`);
* state dicts: :func:`gather_params` and :func:`gather_optimizer_state` give whole tensors on every
  rank (every rank must call them); loading slices a whole state dict (``slots.piece_of``).

Both ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` exist for NCCL and, in the torch this
package requires, for gloo (the CPU tests use them as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from protrain_fx.runtime.parallel import distributed
from protrain_fx.runtime.store.chunk_store import ChunkStore, ParamSlot
from protrain_fx.runtime.store.host_memory import HostMemoryError, available_host_bytes


def local_part(store: ChunkStore, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole flat chunk tensor (a view)."""
    rank, _ = store.shard
    return whole[rank * store.chunk_numel : (rank + 1) * store.chunk_numel]


def all_gather(store: ChunkStore, whole: torch.Tensor) -> None:
    """Fill ``whole`` (a whole flat chunk whose local part is written) from every rank's part."""
    part = local_part(store, whole)
    with distributed.outside_compile():
        dist.all_gather_into_tensor(whole, part.clone() if whole.device.type == "cpu" else part)


def reduce_scatter_mean(store: ChunkStore, whole: torch.Tensor) -> torch.Tensor:
    """The ranks' mean of ``whole`` (a whole flat chunk gradient), this rank's part only."""
    part = torch.empty(store.chunk_numel, dtype=whole.dtype, device=whole.device)
    with distributed.outside_compile():
        dist.reduce_scatter_tensor(part, whole, op=dist.ReduceOp.SUM)
    return part.div_(store.shard[1])


def whole_gradient(store: ChunkStore, chunk: int, names: Sequence[str], grads: Sequence[torch.Tensor],
                   dtype: torch.dtype) -> torch.Tensor:
    """The chunk's gradients laid out as one flat whole chunk (zeros where none was given)."""
    whole = torch.zeros(store.full_numel, dtype=dtype, device=grads[0].device)
    for name, grad in zip(names, grads):
        s = store.full_slot(name)
        assert s.chunk == chunk, (name, s.chunk, chunk)
        whole[s.offset : s.offset + s.numel].copy_(grad.reshape(-1))
    return whole


def local_grads(store: ChunkStore, part: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Parameter name -> the view of ``part`` (this rank's part of a reduced chunk gradient) that
    its piece here takes, for the parameters of ``names`` with a piece here."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if store.holds(name):
            s = store.slot(name)
            out[s.name] = part[s.offset : s.offset + s.numel].view(s.shape)
    return out


def _gather_flat(store: ChunkStore, flat: torch.Tensor) -> torch.Tensor:
    whole = torch.empty(store.full_numel, dtype=flat.dtype)
    with distributed.outside_compile():
        dist.all_gather_into_tensor(whole, flat.contiguous())
    return whole


def gather_params(store: ChunkStore) -> dict[str, torch.Tensor]:
    """Parameter name -> whole fp32 tensor (tied names share one), gathered from every rank's master."""
    store.wait_writes()
    out: dict[str, torch.Tensor] = {}
    for c in range(store.num_chunks):
        whole = _gather_flat(store, store.flat("master", c))
        for s in store.full_slots:
            if s.chunk == c:
                out.update(dict.fromkeys(s.names, whole[s.offset : s.offset + s.numel].view(s.shape).clone()))
    return out


def gather_optimizer_state(store: ChunkStore, steps: Mapping[ParamSlot, torch.Tensor],
                           index_of: Mapping[ParamSlot, int]) -> dict[int, dict[str, Any]]:
    """The store's parameters' AdamW state by optimizer index, whole (``step``, ``exp_avg``,
    ``exp_avg_sq``), gathered from every rank: a parameter has a state once any piece was stepped."""
    local = {index_of[s]: float(step) for s, step in steps.items()}
    counts: dict[int, float] = {}
    for ranks in _all_objects(local):
        counts.update(ranks)
    full_index = _merge_indices(store, index_of)
    state: dict[int, dict[str, Any]] = {}
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for c in range(store.num_chunks):
        trainable = any(s.trainable and s.chunk == c for s in store.full_slots)
        if not trainable:
            continue
        for kind in ("exp_avg", "exp_avg_sq"):
            flat = store.flat(kind, c) if store.has_buffer(kind, c) else torch.zeros(store.chunk_numel)
            whole = _gather_flat(store, flat)
            for index, s in full_index.items():
                if s.chunk == c and index in counts:
                    moments.setdefault(index, {})[kind] = whole[s.offset : s.offset + s.numel].view(s.shape).clone()
    for index, step in counts.items():
        state[index] = {"step": torch.tensor(step, dtype=torch.float32), **moments[index]}
    return state


def _merge_indices(store: ChunkStore, index_of: Mapping[ParamSlot, int]) -> dict[int, ParamSlot]:
    """Optimizer index -> whole slot of every optimized parameter of the store, this rank's pieces
    or not (every rank learns the others' indices)."""
    local = {i: s.name for s, i in index_of.items()}
    merged: dict[int, ParamSlot] = {}
    for ranks in _all_objects(local):
        merged.update({i: store.full_slot(n) for i, n in ranks.items()})
    return merged


def _all_objects(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    with distributed.outside_compile():
        dist.all_gather_object(values, value)
    return values


def store_on_every_rank(group: distributed.Group | None, make: Callable[[], ChunkStore]) -> ChunkStore:
    """``make()``; data-parallel, a host too small on any rank refuses on every rank, naming what
    the stores of the node's ranks need together and what is available to them (each store is
    checked against its rank's share of the node's memory; the ranks' stores are alike)."""
    if group is None:
        return make()
    store, problem = None, None
    try:
        store = make()
    except HostMemoryError as error:
        problem = (error.needed_bytes, error.available_bytes, str(error))
    problems = [(i, p) for i, p in enumerate(distributed.gather(problem)) if p is not None]
    if problems:
        rank, (needed, available, why) = problems[0]
        n = group.local_world_size
        raise HostMemoryError(
            f"protrain_fx: the host memory of a node cannot hold the chunk stores of its {n} ranks: together they "
            f"need {n * needed} bytes ({n * needed / 2**30:.2f} GiB) and {n * available} bytes "
            f"({n * available / 2**30:.2f} GiB) are available to them; run fewer ranks a node (torchrun "
            f"--nproc_per_node) or see below (ranks {[i for i, _ in problems]} refused; rank {rank}: {why})",
            n * needed, n * available)
    return store


def node_share(group: distributed.Group) -> int | None:
    """The host memory one rank's chunk store may take: what the node has free, shared by its ranks."""
    free = available_host_bytes()
    return None if free is None else free // group.local_world_size
