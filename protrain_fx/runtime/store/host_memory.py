"""Host-memory arithmetic of the chunk store: what it will need, what the host has, and the check.

Kept apart from ``chunk_store.py`` so that the planner can price a store (and how many lean chunks
it would make) without building one. Everything here is plain arithmetic over counts and
``/proc/meminfo``; the check raises :class:`HostMemoryError`, naming the bytes, before anything
is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
    chunk_numel: int, trainable: Sequence[bool], itemsize: int, n_lean: int, grad_pool: int
) -> int:
    """Host bytes of a store of ``len(trainable)`` chunks of ``chunk_numel`` elements (``trainable``:
    which hold a trainable parameter, so Adam moments), compute dtype of ``itemsize`` bytes, the last
    ``n_lean`` chunks lean, with ``min(grad_pool, n_lean)`` landing buffers and the scratch: what
    :meth:`ChunkStore.host_bytes` reaches (``runtime/store/chunk_store.py``'s buffer table)."""
    per_chunk = sum(4 + (8 if t else 0) for t in trainable) + itemsize * (len(trainable) - n_lean)
    scratch = 4 if itemsize != 4 and any(trainable) else 0
    landing = itemsize * min(grad_pool, n_lean)
    return chunk_numel * (per_chunk + scratch + landing)


def auto_lean(
    chunk_numel: int, trainable: Sequence[bool], itemsize: int, available: int | None, grad_pool: int
) -> int:
    """``n_lean="auto"``: the fewest last chunks to make lean so the store leaves
    :data:`AUTO_HOST_RESERVE` bytes of ``available`` free (0 when unknown or when it fits as is; all
    when nothing does: the memory check then names the need)."""
    n = len(trainable)
    if available is None:
        return 0
    for k in range(n + 1):
        if planned_store_bytes(chunk_numel, trainable, itemsize, k, grad_pool) + AUTO_HOST_RESERVE <= available:
            return k
    return n


def check_host_memory(needed: int, available: int | None, what: str) -> None:
    """Refuse ``needed`` bytes of host memory when only ``available`` are free (``None``: unknown)."""
    if available is not None and needed > available:
        raise HostMemoryError(
            f"{what} needs {needed} bytes ({needed / GiB:.2f} GiB) of host memory, but only "
            f"{available} bytes ({available / GiB:.2f} GiB) are available (MemAvailable in "
            "/proc/meminfo). Free host memory, use a machine with more, or keep more chunks "
            "on the GPU.",
            needed,
            available,
        )
