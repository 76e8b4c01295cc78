"""The spill folder's disk: its read and write rates, measured once and kept beside the machine profiles.

The planner prices a chunk whose optimizer state is spilled to disk (``runtime/store/spill.py``) by
these rates. They are measured the way the store moves its bytes (buffered ``pwrite`` / ``preadv``
of chunk-sized pieces), with the written bytes flushed to the disk before the write is timed as done
and dropped from the page cache before the read, so neither is the speed of memory. One JSON file
per filesystem (the folder's device number) under the cache folder; :func:`pin_disk_rates` sets
them by hand (tests, a fleet that must plan alike), and :func:`note_disk_rates` replaces measured ones
with the rates training reached (the spill file's reads and writes over the backend's rate window),
as the CPU optimizer's are: the probe's flushed and uncached bytes are not what a running store
sees (the page cache takes its writes: ``docs/results.md#past-host-memory-optimizer-state-on-disk``).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from protrain_fx.profile.cache import cache_dir, read_json, write_json

#: Bytes the measurement writes and reads back: enough to pass the disk's own cache, a second or so.
MEASURE_BYTES = 256 * 2**20
#: Bytes per write or read call (a chunk's state is moved in calls of about this size).
PIECE_BYTES = 16 * 2**20


def _path(folder: Path, cache: str | os.PathLike[str] | None) -> Path:
    return cache_dir(cache) / f"disk-{os.stat(folder).st_dev}.json"


def pin_disk_rates(folder: str | os.PathLike[str], read_bytes_per_s: float, write_bytes_per_s: float, *,
                   cache: str | os.PathLike[str] | None = None) -> None:
    """Keep these rates for ``folder``'s filesystem, as if measured; training never replaces them."""
    write_json(_path(Path(folder), cache), {"read_bytes_per_s": read_bytes_per_s, "write_bytes_per_s": write_bytes_per_s,
                                            "pinned": True})


def note_disk_rates(folder: str | os.PathLike[str], read_bytes_per_s: float, write_bytes_per_s: float, *,
                    cache: str | os.PathLike[str] | None = None) -> Path | None:
    """Keep the rates a store's spill file reached in training for ``folder``'s filesystem, where each
    is measured (> 0) and the kept ones are not pinned; the other direction stays as kept. Returns the
    file written, else ``None`` (also for a folder gone since: nothing to keep them for)."""
    try:
        path = _path(Path(folder), cache)
    except OSError:
        return None
    try:
        kept = read_json(path) or {}
    except (OSError, ValueError):
        kept = {}
    if kept.get("pinned") or (read_bytes_per_s <= 0 and write_bytes_per_s <= 0):
        return None
    rates = {"read_bytes_per_s": read_bytes_per_s if read_bytes_per_s > 0 else kept.get("read_bytes_per_s", 0.0),
             "write_bytes_per_s": write_bytes_per_s if write_bytes_per_s > 0 else kept.get("write_bytes_per_s", 0.0)}
    if not (rates["read_bytes_per_s"] > 0 and rates["write_bytes_per_s"] > 0):
        return None  # one direction neither kept nor measured: the probe measures both at the next plan
    # the probe's own readings stay beside them (the first training's note keeps what was measured)
    probe = kept.get("probe") or {k: kept[k] for k in ("read_bytes_per_s", "write_bytes_per_s") if k in kept}
    write_json(path, {**rates, "source": "training", "probe": probe})
    return path


def disk_rates(folder: str | os.PathLike[str], *, cache: str | os.PathLike[str] | None = None,
               nbytes: int = MEASURE_BYTES) -> tuple[float, float]:
    """``(read, write)`` bytes per second of ``folder``'s disk: kept ones, else measured now and kept."""
    folder = Path(folder)
    path = _path(folder, cache)
    try:
        kept = read_json(path)
    except (OSError, ValueError):  # unreadable or corrupt: measured again and written over
        kept = None
    if kept and kept.get("read_bytes_per_s", 0) > 0 and kept.get("write_bytes_per_s", 0) > 0:
        return float(kept["read_bytes_per_s"]), float(kept["write_bytes_per_s"])
    read, write = measure_disk(folder, nbytes)
    write_json(path, {"read_bytes_per_s": read, "write_bytes_per_s": write, "measured_bytes": nbytes})
    return read, write


def measure_disk(folder: Path, nbytes: int = MEASURE_BYTES) -> tuple[float, float]:
    """Write ``nbytes`` to an unlinked file in ``folder`` (flushed to the disk), drop them from the
    page cache, read them back: ``(read, write)`` bytes per second."""
    piece = bytes(min(PIECE_BYTES, nbytes)) or b"\0"
    fd, name = tempfile.mkstemp(prefix="protrain_fx-disk-rate-", dir=folder)
    os.unlink(name)
    try:
        start = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, piece[: nbytes - done], done)
        os.fdatasync(fd)
        write_s = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, done, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(len(piece))
        start = time.perf_counter()
        got = 0
        while got < done:
            n = os.preadv(fd, [memoryview(buffer)[: done - got]], got)
            if n <= 0:
                break
            got += n
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
    return got / max(read_s, 1e-9), done / max(write_s, 1e-9)
