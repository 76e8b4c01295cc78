"""The process group a data-parallel training runs in, and agreement between its ranks.

``torchrun`` (or any launcher) initialises the default process group; :func:`current` reads it:
world size, rank, and the ranks of this node (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, which
torchrun sets; without them one node is assumed). Nothing here starts processes or implements a
collective: every exchange is a ``torch.distributed`` call on the default group.

Agreement: every decision that shapes the collectives (counts, chunk size, dtypes, the model, the
captured graph's input shapes, the chosen plan and its re-plans) is checked with :func:`agree`: one
``all_gather_object`` of a plain value per check, compared on every rank, so a disagreement raises
:class:`RankDisagreement` on every rank at once, naming each rank's value, instead of leaving the
ranks in different collectives. Measured inputs of a decision (rates, op times) come from rank 0
(:func:`from_rank0`), so the ranks decide identically and the check only catches what differs on
purpose (options, models, shapes). A check is a collective: every rank reaches it at the same point,
in the same order; an error that one rank raises alone before one (an exception in the user's
code) leaves the others waiting in it until the process group's ``timeout``, as with DDP.

Runtime and planner both import this module (the planner may import the runtime, never the reverse).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

from protrain_fx import settings

T = TypeVar("T")


class RankDisagreement(ValueError):
    """The ranks of a data-parallel training disagree on something they must share (raised on every rank)."""


@dataclass(frozen=True)
class Group:
    """The default process group as the runtime sees it."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    backend: str

    @property
    def sharded(self) -> bool:
        """Whether offloaded chunks are split over ranks (more than one rank)."""
        return self.world_size > 1


def current() -> Group | None:
    """The default process group, or ``None`` when none is initialised (one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world, local_rank = settings.local_ranks(world, rank)
    return Group(world, rank, local_rank, local_world, str(dist.get_backend()))


@contextlib.contextmanager
def outside_compile() -> Iterator[None]:
    """Around a collective that may be issued while a compile runs (the planner's exchanges, the
    chunk store it builds and places): real tensors (the compile's fake mode off) and no Python
    dispatcher. AOTAutograd turns the Python dispatcher on; with it, the calling thread keeps the
    GIL while it queues the collective on the process group, and gloo's worker thread, freeing the
    tensors of the collective before, waits for the GIL while it holds the queue's lock: each waits
    on the other for good (seen on two CPU ranks in about a third of planning runs)."""
    with unset_fake_temporarily(), no_python_dispatcher():
        yield


def active() -> Group | None:
    """:func:`current` when it has more than one rank (only then is anything exchanged)."""
    group = current()
    return group if group is not None and group.world_size > 1 else None


def gather(value: T) -> list[T]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` without a group."""
    group = active()
    if group is None:
        return [value]
    values: list[Any] = [None] * group.world_size
    with outside_compile():
        dist.all_gather_object(values, value)
    return values


def agree(values: Mapping[str, Any], where: str) -> None:
    """Check that every rank passes equal ``values`` (``{what: plain value}``); else raise
    :class:`RankDisagreement` on every rank, naming each differing entry and each rank's value."""
    if active() is None:
        return
    ranks = gather(dict(values))
    differing = [k for k in ranks[0] if any(r.get(k) != ranks[0][k] for r in ranks[1:])]
    differing += sorted({k for r in ranks[1:] for k in r} - set(ranks[0]))
    if differing:
        lines = [f"  {k}: " + ", ".join(f"rank {i}: {r.get(k)!r}" for i, r in enumerate(ranks)) for k in differing]
        raise RankDisagreement(
            f"protrain_fx: the {len(ranks)} ranks of the process group disagree at {where}; data-parallel "
            "training needs the same model, settings and input shapes on every rank (give every rank the "
            "same arguments and a micro-batch of the same shape):\n" + "\n".join(lines)
        )


def raise_together(problem: str | None, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` on every rank when any rank has a ``problem`` (a message), naming the ranks:
    a check that one rank fails alone must not leave the others waiting in the next collective."""
    problems = gather(problem)
    found = [(i, p) for i, p in enumerate(problems) if p is not None]
    if not found:
        return
    if len(problems) == 1:
        raise error(found[0][1])
    raise error("; ".join(f"rank {i}: {p}" for i, p in found))


def from_rank0(value: T) -> T:
    """Rank 0's ``value`` on every rank (a measured input of a decision: each rank then decides alike)."""
    if active() is None:
        return value
    box = [value]
    with outside_compile():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def fingerprint(named: Mapping[str, torch.Tensor]) -> str:
    """A short digest of the parameters' names, shapes, dtypes and ``requires_grad`` (the model's
    structure, not its values), with their count for a readable disagreement."""
    digest = hashlib.sha256()
    for name, p in named.items():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return f"{len(named)} parameters, {sum(p.numel() for p in named.values())} elements, sha256 {digest.hexdigest()[:12]}"


def check_device(device: torch.device) -> Group | None:
    """Refuse, on every rank, a chunk device the process group cannot serve: two ranks on one CUDA
    device of one node; a CUDA device other than the rank's local one; NCCL with CPU chunks or
    gloo with CUDA chunks. Returns :func:`active`."""
    group = active()
    if group is None:
        return None
    problem = None
    backends = _device_backends(group.backend)
    if device.type not in backends:
        other = "gloo" if device.type == "cpu" else "nccl"
        problem = (f"the process group's backend {group.backend!r} has no collectives for {device.type} chunks "
                   f"(device={str(device)!r}); init_process_group({other!r}) for device={device.type!r}, or give the "
                   f"device the backend serves ({', '.join(sorted(backends))})")
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != group.local_rank % max(torch.cuda.device_count(), 1):
            problem = (f"the chunk device is cuda:{index} but this rank's local device is cuda:{group.local_rank} "
                       f"(LOCAL_RANK={group.local_rank}); call torch.cuda.set_device(local_rank) and pass "
                       "device=f'cuda:{local_rank}'")
    raise_together(problem)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        where = gather((socket.gethostname(), index))
        shared = [i for i, w in enumerate(where) if where.count(w) > 1]
        if shared:
            raise ValueError(
                f"protrain_fx: ranks {shared} run on one CUDA device ({where[shared[0]][0]}, cuda:{where[shared[0]][1]}); "
                "one rank per GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before offload(...), and "
                "torchrun --nproc_per_node at most the GPUs of the node"
            )
    return group


def _device_backends(backend: str) -> set[str]:
    """Device types the backend string serves (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    if ":" in backend:
        return {part.split(":")[0] for part in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu"}}.get(backend, {"cpu", "cuda"})


def node_threads(group: Group | None = None) -> int:
    """OpenMP threads one rank may use: the node's cores split between its ranks (``torchrun`` sets
    ``OMP_NUM_THREADS=1`` for every rank, which would leave the CPU optimizer one core); without a
    group, the process' own count."""
    group = group or active()
    if group is None:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(group.local_world_size, 1))
