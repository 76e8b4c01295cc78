"""The chunk store's third tier: a file on local disk for the optimizer state host memory cannot hold.

A *spilled* chunk keeps its working copy (compute dtype) in host memory, where the device fetches it
and its gradient lands, as any chunk's. Its fp32 master and Adam moments live in a :class:`SpillFile`
and come into host memory only while something uses them: the chunk's CPU optimizer step, a read of
its values for a fetch while its working copy holds a gradient, a state dict. :class:`Residency`
holds them in a small pool of host buffers (:data:`SPILL_STAGING` chunks' worth), reads a chunk's
state back ahead of its step on one I/O thread (the chunk the optimizer steps next: the one below in
backward order) and writes it back after. The bytes go to the file and come back unchanged, so
training is exactly what it is with everything in host memory.

The file is made in the spill folder (``offload(spill_dir=...)``, else ``$PROTRAIN_SPILL_DIR``,
else the system's temporary folder, or ``/var/tmp`` where that is in memory: :func:`spill_dir`) and
unlinked as soon as it is open: the operating system removes it when the process ends, however it
ends, and no other run can read it. A folder in host memory (tmpfs) is refused. Its whole size is reserved
up front (``posix_fallocate``), so a disk too small refuses before training, naming the bytes and
where; a write that fails later raises :class:`SpillError` from the step, the state in the file
being that of the last step written whole.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from protrain_fx import settings

log = logging.getLogger("protrain_fx")

__all__ = ["SPILL_STAGING", "Residency", "SpillError", "SpillFile", "check_spill_dir", "filesystem_type", "spill_dir"]

#: Chunks whose spilled state host memory holds at once: the one stepped and the one read ahead (a
#: third would only wait on the same disk).
SPILL_STAGING = 2


class SpillError(OSError):
    """The spill folder cannot serve the chunk store: missing, not writable, too small, or a read or
    write that failed. ``needed_bytes`` / ``path``: what the store needs and where."""

    def __init__(self, message: str, needed_bytes: int = 0, path: str = "") -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.path = path


#: The mount table :func:`filesystem_type` reads.
MOUNTS = Path("/proc/mounts")
#: Filesystems held in host memory: spilling there takes the memory it is meant to save.
IN_MEMORY = ("tmpfs", "ramfs")


def spill_dir(given: str | os.PathLike[str] | None) -> Path:
    """The spill folder: ``given``, else ``$PROTRAIN_SPILL_DIR``, else the system's temporary folder when it
    is on a disk, else ``/var/tmp`` when that is (a ``/tmp`` in memory is common)."""
    if given is not None:
        return Path(given)
    chosen = settings.spill_dir()
    if chosen is not None:
        return chosen
    candidates = [Path(tempfile.gettempdir()), Path("/var/tmp")]
    return next((c for c in candidates if c.is_dir() and filesystem_type(c) not in IN_MEMORY), candidates[0])


def filesystem_type(folder: Path) -> str | None:
    """The type of the filesystem holding ``folder`` (its longest mount point in :data:`MOUNTS`);
    ``None`` where that cannot be read."""
    try:
        text = MOUNTS.read_text()
    except OSError:
        return None
    real = os.path.realpath(folder)
    best, kind = "", None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def check_spill_dir(folder: Path, needed: int) -> None:
    """Refuse a spill folder that is missing, not a folder, not writable, or has less than ``needed``
    bytes free, naming both."""
    need = f"{needed} bytes ({needed / 2**30:.2f} GiB)"
    if not folder.exists():
        raise SpillError(f"the spill folder {folder} does not exist; the chunk store needs {need} there "
                         "(offload(spill_dir=...) or PROTRAIN_SPILL_DIR)", needed, str(folder))
    if not folder.is_dir():
        raise SpillError(f"the spill folder {folder} is not a folder; the chunk store needs {need} in one",
                         needed, str(folder))
    kind = filesystem_type(folder)
    if kind in IN_MEMORY:
        raise SpillError(f"the spill folder {folder} is in host memory ({kind}): spilling there takes the memory it "
                         f"is meant to save; the chunk store needs {need} on a local disk (offload(spill_dir=...) "
                         "or PROTRAIN_SPILL_DIR)", needed, str(folder))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpillError(f"the spill folder {folder} is not writable; the chunk store needs {need} there",
                         needed, str(folder))
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise SpillError(
            f"the spill folder {folder} has {free} bytes ({free / 2**30:.2f} GiB) free; the chunk store needs "
            f"{need} there for the optimizer state host memory cannot hold. Free disk space, give another "
            "folder (offload(spill_dir=...) or PROTRAIN_SPILL_DIR), or use a host with more memory",
            needed, str(folder))


def _buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (what ``os.preadv`` fills)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SpillFile:
    """One unlinked file in ``folder`` of ``sizes[i]`` bytes at ``offsets[i]`` per spilled chunk.

    ``read(i, tensors)`` / ``write(i, tensors)`` move the chunk's bytes (its tensors back to back) in
    full or raise :class:`SpillError`."""

    def __init__(self, folder: Path, sizes: Sequence[int]) -> None:
        total = sum(sizes)
        check_spill_dir(folder, total)
        log.warning("protrain_fx: host memory holds the chunk store only with the optimizer state of %d chunk(s), "
                    "%.2f GiB, in a file in %s: each step reads and writes them there (offload(n_spill=0) refuses "
                    "instead, naming the host memory needed)", len(sizes), total / 2**30, folder)
        self.folder = folder
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = list(sizes)
        try:
            fd, path = tempfile.mkstemp(prefix="protrain_fx-spill-", dir=folder)
        except OSError as e:
            raise SpillError(f"cannot make the spill file in {folder}: {e}", total, str(folder)) from e
        os.unlink(path)  # removed by the OS when the last descriptor closes: at exit, however it comes
        self._fd: int | None = fd
        try:
            if total:
                os.posix_fallocate(fd, 0, total)
        except OSError as e:
            self.close()
            raise SpillError(f"cannot reserve {total} bytes ({total / 2**30:.2f} GiB) for the spill file in "
                             f"{folder}: {e}", total, str(folder)) from e

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def read(self, i: int, tensors: Sequence[torch.Tensor]) -> None:
        self._move(i, tensors, write=False)

    def write(self, i: int, tensors: Sequence[torch.Tensor]) -> None:
        self._move(i, tensors, write=True)

    def _move(self, i: int, tensors: Sequence[torch.Tensor], *, write: bool) -> None:
        if self._fd is None:
            raise SpillError("the spill file is closed", 0, str(self.folder))
        offset = self.offsets[i]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if total > self.sizes[i]:
            raise ValueError(f"spilled chunk {i}: {total} bytes do not fit its {self.sizes[i]}")
        try:
            for t in tensors:
                view = _buffer(t)
                done = 0
                while done < len(view):
                    n = (os.pwrite(self._fd, view[done:], offset + done) if write
                         else os.preadv(self._fd, [view[done:]], offset + done))
                    if n <= 0:
                        raise OSError(f"{'write' if write else 'read'} of the spill file made no progress")
                    done += n
                offset += len(view)
        except OSError as e:
            what = "write to" if write else "read from"
            raise SpillError(f"protrain_fx: the {what} the spill file in {self.folder} failed: {e}",
                             total, str(self.folder)) from e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


class _Held:
    """One chunk's state in host memory: its buffer, who holds it, and the read or write in flight."""

    def __init__(self, buffer: torch.Tensor, job: Future[None]) -> None:
        self.buffer = buffer
        self.holders = 0
        self.dirty = False
        self.job = job  # the read filling ``buffer``; then, once released dirty, the write back
        self.writing = False


class Residency:
    """The optimizer state of the store's spilled ``chunks`` (``trains[i]``: whether ``chunks[i]`` has
    moments) in a pool of :data:`SPILL_STAGING` host buffers of ``numel``-element masters and moments.

    While held, a chunk's state shows in the store's ``buffers`` (``"master"``, ``"exp_avg"``,
    ``"exp_avg_sq"``: views of its staging buffer), and not otherwise. :meth:`held` is the only way
    in: it reads the chunk's state back (or waits for the read ahead started by :meth:`prefetch`),
    and at its end writes it back if ``write`` (the last holder's release)."""

    def __init__(self, file: SpillFile, chunks: Sequence[int], numel: int,
                 buffers: dict[str, list[torch.Tensor | None]], trains: Sequence[bool]) -> None:
        self.file = file
        self.chunks = tuple(chunks)  # store chunk ids, in file order
        self._slot = {c: i for i, c in enumerate(self.chunks)}
        self._numel = numel
        self._buffers = buffers
        self._trains = dict(zip(self.chunks, trains))
        self._free = [torch.empty(3 * numel, dtype=torch.float32) for _ in range(min(SPILL_STAGING, len(chunks)))]
        self.buffer_bytes = 3 * numel * 4 * len(self._free)
        self._held: dict[int, _Held] = {}
        self._cond = threading.Condition()
        self._wanted: int | None = None  # a read ahead that found no free buffer: started by the next write's end
        self._io = ThreadPoolExecutor(1, thread_name_prefix="protrain_fx spill")
        #: Seconds and bytes the I/O thread spent reading and writing (the rates training reached).
        self.read_s = self.write_s = 0.0
        self.read_bytes = self.written_bytes = 0
        self._error: BaseException | None = None  # a write-back that failed: the file is behind, nothing goes on
        self._last_step: int | None = None  # the chunk stepped last, and the order of the steps
        self._descending = True

    def _views(self, chunk: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The chunk's master (and moments, where it trains) as views of a staging buffer, in file order."""
        n = self._numel
        return [buffer[i * n : (i + 1) * n] for i in range(3 if self._trains[chunk] else 1)]

    def _install(self, chunk: int, views: list[torch.Tensor] | None) -> None:
        """Show the chunk's held state in the store's buffers (``None``: hide it again)."""
        for i, kind in enumerate(("master", "exp_avg", "exp_avg_sq")):
            self._buffers[kind][chunk] = views[i] if views is not None and i < len(views) else None

    def stats(self) -> dict[str, float]:
        """Seconds and bytes the spill file's reads and writes took so far."""
        return {"read_s": self.read_s, "read_bytes": self.read_bytes, "write_s": self.write_s,
                "written_bytes": self.written_bytes}

    def write_initial(self, chunk: int, tensors: Sequence[torch.Tensor]) -> None:
        """Put the chunk's first state (the fill) in the file, now."""
        self.file.write(self._slot[chunk], tensors)

    # ---- holding --------------------------------------------------------------------------------

    def held(self, chunk: int, *, write: bool) -> AbstractContextManager[None]:
        """The chunk's state in host memory (installed in the store) for the ``with`` block, any store
        chunk (nothing to hold for one not spilled); written back at the end when ``write`` (a step:
        whoever held it last writes what all of them changed). A step also reads ahead the spilled
        chunk the optimizer steps next: the nearest in the order of the last steps (backward's,
        descending, or the clipped steps', ascending)."""
        ahead = None
        if write:
            last = self._last_step
            if last is not None and abs(chunk - last) == 1:  # (a new step's first chunk says nothing)
                self._descending = chunk < last
            self._last_step = chunk
            after = [c for c in self.chunks if (c < chunk if self._descending else c > chunk)]
            ahead = (max(after) if self._descending else min(after)) if after else None
        if chunk not in self._slot:
            if ahead is not None:
                self.prefetch(ahead)
            return nullcontext()
        return self._holding(chunk, write, ahead)

    @contextmanager
    def _holding(self, chunk: int, write: bool, ahead: int | None) -> Iterator[None]:
        entry = self._acquire(chunk)  # (before the read ahead, which must not take the buffer this one needs)
        try:
            if ahead is not None:
                self.prefetch(ahead)
            entry.job.result()  # the read (raises its SpillError)
            yield
        finally:
            self._release(chunk, entry, write)

    def prefetch(self, chunk: int) -> None:
        """Start reading the chunk's state back if a buffer is free (else when the next write-back ends)."""
        with self._cond:
            if chunk in self._held:
                return
            if not self._free:
                self._wanted = chunk
                return
            self._read_locked(chunk)

    def _acquire(self, chunk: int) -> _Held:
        with self._cond:
            while True:
                if self._error is not None:
                    raise SpillError(f"protrain_fx: an earlier write to the spill file failed ({self._error}); "
                                     "the spilled optimizer state is that of the last step written whole") \
                        from self._error
                entry = self._held.get(chunk)
                if entry is not None and not entry.writing:
                    entry.holders += 1
                    return entry
                if entry is not None:  # being written back: read again after it
                    self._cond.wait()
                    continue
                if not self._free and not self._evict_locked():
                    self._cond.wait()
                    continue
                entry = self._read_locked(chunk)
                entry.holders += 1
                return entry

    def _evict_locked(self) -> bool:
        """Drop a chunk read ahead that nobody holds (clean, its read finished) to free its buffer."""
        for c, e in list(self._held.items()):
            if e.holders == 0 and not e.writing and not e.dirty and e.job.done():
                del self._held[c]
                self._install(c, None)
                self._free.append(e.buffer)
                return True
        return False

    def _read_locked(self, chunk: int) -> _Held:
        buffer = self._free.pop()
        tensors = self._views(chunk, buffer)
        slot = self._slot[chunk]

        def read() -> None:
            try:
                start = _clock()
                self.file.read(slot, tensors)
                self.read_s += _clock() - start
                self.read_bytes += sum(t.numel() * t.element_size() for t in tensors)
                self._install(chunk, tensors)
            finally:
                with self._cond:  # a holder waiting for a buffer may evict this one now
                    self._cond.notify_all()

        entry = _Held(buffer, self._io.submit(read))
        self._held[chunk] = entry
        return entry

    def _release(self, chunk: int, entry: _Held, write: bool) -> None:
        with self._cond:
            entry.holders -= 1
            entry.dirty |= write
            if entry.holders:
                return
            if not entry.dirty:
                return  # stays as read: the next holder or a read ahead's eviction takes it
            entry.writing = True
            tensors = self._views(chunk, entry.buffer)
            slot = self._slot[chunk]

            def write_back() -> None:
                try:
                    start = _clock()
                    self.file.write(slot, tensors)
                    self.write_s += _clock() - start
                    self.written_bytes += sum(t.numel() * t.element_size() for t in tensors)
                except BaseException as e:
                    self._error = e
                    raise
                finally:
                    with self._cond:
                        del self._held[chunk]
                        self._install(chunk, None)
                        self._free.append(entry.buffer)
                        wanted, self._wanted = self._wanted, None
                        if wanted is not None and wanted not in self._held:
                            self._read_locked(wanted)
                        self._cond.notify_all()

            entry.job = self._io.submit(write_back)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.file.close()


_clock = time.perf_counter
