"""Host-memory arithmetic of the chunk store: what it will need, what the host has, and the check.

Kept apart from ``chunk_store.py`` so that the planner can price a store (and how many lean chunks
it would make) without building one. Everything here is plain arithmetic over counts and
``/proc/meminfo``; the check raises :class:`HostMemoryError`, naming the bytes, before anything
is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from protrain_fx.runtime.store.spill import SPILL_STAGING

GiB = 2**30


#: Host bytes ``n_lean="auto"`` leaves free for everything else the process needs (the Python
#: process, CUDA's context, compile workers).
AUTO_HOST_RESERVE = 8 * GiB


class HostMemoryError(MemoryError):
    """The host cannot hold the chunk store; raised before anything is allocated.
    ``needed_bytes`` / ``available_bytes``: what the store needs and what the host has free."""

    def __init__(self, message: str, needed_bytes: int = 0, available_bytes: int = 0) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of ``meminfo`` in bytes (``None`` where there is no such file, e.g. macOS)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    return None


def planned_store_bytes(
    chunk_numel: int, trainable: Sequence[bool], itemsize: int, n_lean: int, grad_pool: int, n_spill: int = 0,
) -> int:
    """Host bytes of a store of ``len(trainable)`` chunks of ``chunk_numel`` elements (``trainable``:
    which hold a trainable parameter, so Adam moments), compute dtype of ``itemsize`` bytes, the last
    ``n_lean`` chunks lean and the ``n_spill`` before them spilled (their working copy only, and
    :data:`~protrain_fx.runtime.store.spill.SPILL_STAGING` chunks' state in flight), with
    ``min(grad_pool, n_lean)`` landing buffers and the scratch: what :meth:`ChunkStore.host_bytes`
    reaches (``runtime/store/chunk_store.py``'s buffer table)."""
    n = len(trainable)
    spilled = range(n - n_lean - n_spill, n - n_lean)
    per_chunk = sum(itemsize if i in spilled else 4 + (8 if t else 0) for i, t in enumerate(trainable))
    per_chunk += itemsize * (n - n_lean - n_spill)
    scratch = 4 if itemsize != 4 and any(trainable) else 0
    landing = itemsize * min(grad_pool, n_lean)
    staging = 12 * min(SPILL_STAGING, n_spill)
    return chunk_numel * (per_chunk + scratch + landing + staging)


def spill_bytes(chunk_numel: int, trainable: Sequence[bool], n_lean: int, n_spill: int) -> int:
    """Bytes of the spill file: the fp32 master, and the moments where a chunk trains, of the
    ``n_spill`` chunks before the ``n_lean`` last."""
    n = len(trainable)
    return sum(chunk_numel * (4 + (8 if trainable[i] else 0)) for i in range(n - n_lean - n_spill, n - n_lean))


def auto_lean(
    chunk_numel: int, trainable: Sequence[bool], itemsize: int, available: int | None, grad_pool: int,
    n_spill: int = 0,
) -> int:
    """``n_lean="auto"``: the fewest last chunks to make lean so the store leaves
    :data:`AUTO_HOST_RESERVE` bytes of ``available`` free (0 when unknown or when it fits as is; all
    not spilled when nothing does: the memory check then names the need)."""
    n = len(trainable) - n_spill
    if available is None:
        return 0
    for k in range(n + 1):
        if planned_store_bytes(chunk_numel, trainable, itemsize, k, grad_pool, n_spill) + AUTO_HOST_RESERVE <= available:
            return k
    return n


def auto_tiers(
    chunk_numel: int, trainable: Sequence[bool], itemsize: int, available: int | None, grad_pool: int,
    n_lean: int | str = "auto", n_spill: int | str = "auto",
) -> tuple[int, int]:
    """``(n_lean, n_spill)`` for the counts given as ``"auto"``: no chunk spilled while host memory holds
    the store with lean chunks (:func:`auto_lean`); else the fewest spilled that let it, the others
    lean as few as then fit. Counts given as ints stay."""
    n = len(trainable)
    if n_spill != "auto":
        assert isinstance(n_spill, int)
        lean = auto_lean(chunk_numel, trainable, itemsize, available, grad_pool, n_spill) if n_lean == "auto" else n_lean
        return int(lean), n_spill
    if available is None:
        return (0 if n_lean == "auto" else int(n_lean)), 0

    def fits(lean: int, spill: int) -> bool:
        need = planned_store_bytes(chunk_numel, trainable, itemsize, lean, grad_pool, spill)
        return need + AUTO_HOST_RESERVE <= available

    most_lean = lambda spill: n - spill if n_lean == "auto" else int(n_lean)  # noqa: E731
    for spill in range(n - (0 if n_lean == "auto" else int(n_lean)) + 1):
        if fits(most_lean(spill), spill):
            lean = auto_lean(chunk_numel, trainable, itemsize, available, grad_pool, spill) if n_lean == "auto" \
                else int(n_lean)
            return lean, spill
    # nothing fits: every chunk not lean spilled, whose need the memory check names
    return (0 if n_lean == "auto" else int(n_lean)), n - (0 if n_lean == "auto" else int(n_lean))


def store_tiers(
    chunk_numel: int, trainable: Sequence[bool], itemsize: int, available: int | None, grad_pool: int,
    n_lean: int | str, n_spill: int | str, world: int = 1,
) -> tuple[int, int]:
    """The chunk store's ``(n_lean, n_spill)`` (:func:`auto_tiers` for those given as ``"auto"``),
    checked: counts in range, no spilling when sharded over ``world`` ranks, and the host holding
    the store (:func:`check_host_memory`, naming what spilling every chunk would need)."""
    n = len(trainable)
    for name, count in (("n_lean", n_lean), ("n_spill", n_spill)):
        if count != "auto" and (isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= n):
            raise ValueError(f"{name} must be 'auto' or in [0, {n}] (the chunks), got {count!r}")
    if n_spill == "auto" and world > 1:
        n_spill = 0  # (sharded, every rank's store is a part)
    if n_lean == "auto" or n_spill == "auto":
        n_lean, n_spill = auto_tiers(chunk_numel, trainable, itemsize, available, grad_pool, n_lean, n_spill)
    assert isinstance(n_lean, int) and isinstance(n_spill, int)
    if n_lean + n_spill > n:
        raise ValueError(f"n_lean={n_lean} and n_spill={n_spill} are more than the {n} chunks")
    if n_spill and world > 1:
        raise ValueError("spilling optimizer state to disk (n_spill) is not supported with data parallelism; "
                         "use more hosts' memory (more ranks) or a host with more memory")
    needed = planned_store_bytes(chunk_numel, trainable, itemsize, n_lean, grad_pool, n_spill)
    what = f"the chunk store ({n} chunks, {n_lean} of them lean{f', {n_spill} spilled to disk' if n_spill else ''})"
    other_way = ""
    if n_spill < n and available is not None and needed > available:
        least = planned_store_bytes(chunk_numel, trainable, itemsize, 0, grad_pool, n)
        other_way = (f"With every chunk's optimizer state spilled to disk (n_spill={n}) it would need {least} "
                     f"bytes ({least / GiB:.2f} GiB).")
    check_host_memory(needed, available, what, other_way)
    return n_lean, n_spill


def check_host_memory(needed: int, available: int | None, what: str, other_way: str = "") -> None:
    """Refuse ``needed`` bytes of host memory when only ``available`` are free (``None``: unknown);
    ``other_way``: a sentence naming a setting that needs less."""
    if available is not None and needed > available:
        raise HostMemoryError(
            f"{what} needs {needed} bytes ({needed / GiB:.2f} GiB) of host memory, but only "
            f"{available} bytes ({available / GiB:.2f} GiB) are available (MemAvailable in "
            f"/proc/meminfo).{' ' + other_way if other_way else ''} Free host memory, use a machine with more, "
            "or keep more chunks on the GPU.",
            needed,
            available,
        )
