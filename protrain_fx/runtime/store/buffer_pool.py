"""Device buffers that stage non-persistent chunks: ``n_buffer`` flat chunk buffers, reused.

A chunk is fetched (host -> device) into a free buffer when first acquired and stays there after
release until its buffer is needed for another chunk, so a chunk still resident when backward
reaches it is not fetched again (ProTrain's ``n_buffer`` knob). A buffer in use -- acquired and not
yet released -- is never overwritten: wanting more chunks at once than there are buffers is an
error, because the plan promised the memory of ``n_buffer`` chunks and no more.

A device copy is current while the store's :meth:`~ChunkStore.version` of its chunk is unchanged;
the optimizer step bumps it, so the next acquire fetches the new values.

A lean chunk (no host working copy, ``ChunkStore.lean``) is fetched from its fp32 master: on CUDA
in slices of :data:`FETCH_SLICE_ELEMS` through one fp32 device staging buffer (made with the pool,
:attr:`ChunkBufferPool.staging_bytes`), each cast into the chunk buffer on the copy stream.

On CUDA, fetches run on a copy stream: :meth:`ChunkBufferPool.prefetch` starts one early,
:meth:`ChunkBufferPool.acquire` makes the current stream wait for it, and
:meth:`ChunkBufferPool.release` records where the current stream stops using the buffer so that the
next fetch into it waits for that point. With ``device="cpu"`` every copy is a plain copy (tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from protrain_fx.runtime.parallel import shard
from protrain_fx.runtime.store.chunk_store import ChunkStore
from protrain_fx.runtime.store.pinned import host_empty

#: Elements per slice of a lean chunk's fp32 fetch: 64 MiB of staging, about 1.2 ms at the link's
#: 55 GB/s, so the cast between two slices is noise.
FETCH_SLICE_ELEMS = 1 << 24


class ChunkBufferPool:
    """``n_buffer`` device buffers of one chunk each (compute dtype) for the chunks of ``store``.

    ``wait_host(chunk_id)`` is called before the pool reads a chunk's host copy or decides its
    device copy is current: it must return once no update of that chunk is pending (pass the
    optimizer worker's ``wait``).
    """

    def __init__(
        self,
        store: ChunkStore,
        n_buffer: int,
        device: torch.device | str,
        *,
        wait_host: Callable[[int], None] | None = None,
    ) -> None:
        if n_buffer < 1:
            raise ValueError(f"n_buffer must be at least 1, got {n_buffer}")
        self.store = store
        self.device = torch.device(device)
        self._wait_host = wait_host or (lambda chunk_id: None)
        self._buffers = [
            torch.empty(
                store.full_numel, dtype=store.compute_dtype, device=self.device
            )
            for _ in range(n_buffer)
        ]
        self._chunk_in: list[int | None] = [None] * n_buffer
        self._version_in = [-1] * n_buffer
        self._users = [0] * n_buffer
        self._last_release = [0] * n_buffer  # for least-recently-used eviction
        self._clock = 0
        self._staging: list[torch.Tensor | None] = [None] * n_buffer
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._fetched: list[torch.cuda.Event | None] = [None] * n_buffer
        self._freed: list[torch.cuda.Event | None] = [None] * n_buffer
        cast = self._cuda and bool(store.lean) and store.compute_dtype != torch.float32
        self._fetch_staging = (
            torch.empty(min(store.chunk_numel, FETCH_SLICE_ELEMS), dtype=torch.float32, device=self.device)
            if cast
            else None
        )
        #: host -> device copies made so far (what "not fetched again" is measured by)
        self.fetches = 0

    @property
    def n_buffer(self) -> int:
        return len(self._buffers)

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the fp32 staging lean chunks are fetched through (0 without any)."""
        s = self._fetch_staging
        return 0 if s is None else s.numel() * s.element_size()

    def resident(self, chunk_id: int) -> bool:
        """Whether a current copy of the chunk is on the device (or on its way there)."""
        return self._current(chunk_id) is not None

    def try_prefetch(self, chunk_id: int) -> bool:
        """:meth:`prefetch` if a buffer is idle or the chunk is resident; else nothing (a hint
        never fails). Returns whether the chunk is now resident or on its way.

        Sharded, the chunk's pending step is waited for first: whether a fetch (an all-gather, which
        every rank must issue alike) starts may not depend on how far this rank's worker got."""
        if self.store.shard[1] > 1:
            self._wait_host(chunk_id)
        if self._current(chunk_id) is None and all(self._users):
            return False
        self.prefetch(chunk_id)
        return True

    def prefetch(self, chunk_id: int) -> None:
        """Start bringing the chunk in, if it is not resident; does not hold the buffer."""
        self._wait_host(chunk_id)
        self._ensure(chunk_id)

    def acquire(self, chunk_id: int) -> torch.Tensor:
        """The chunk's flat device buffer, fetched if needed, held until :meth:`release`
        (several acquires need as many releases). Use it on the current stream only."""
        self._wait_host(chunk_id)
        i = self._ensure(chunk_id)
        if self._fetched[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._fetched[i])
        self._users[i] += 1
        return self._buffers[i]

    def release(self, chunk_id: int) -> None:
        """Done with the chunk for now; it stays resident until its buffer is wanted."""
        i = next(
            (
                i
                for i, c in enumerate(self._chunk_in)
                if c == chunk_id and self._users[i]
            ),
            None,
        )
        if i is None:
            raise RuntimeError(f"chunk {chunk_id} released but not acquired")
        self._users[i] -= 1
        self._clock += 1
        self._last_release[i] = self._clock
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._freed[i] = event

    def _current(self, chunk_id: int) -> int | None:
        version = self.store.version(chunk_id)
        for i, c in enumerate(self._chunk_in):
            if c == chunk_id and self._version_in[i] == version:
                return i
        return None

    def _ensure(self, chunk_id: int) -> int:
        """Index of the buffer holding a current copy of the chunk, fetching it if needed."""
        i = self._current(chunk_id)
        if i is not None:
            return i
        stale = next((i for i, c in enumerate(self._chunk_in) if c == chunk_id), None)
        if stale is not None and self._users[stale]:
            raise RuntimeError(
                f"chunk {chunk_id} changed on the host while its device copy is in use"
            )
        i = stale if stale is not None else self._free_buffer(chunk_id)
        self._fetch(chunk_id, i)
        return i

    def _free_buffer(self, chunk_id: int) -> int:
        """An idle buffer: an empty one, else the least recently released."""
        idle = [i for i in range(self.n_buffer) if not self._users[i]]
        if not idle:
            held = sorted(c for c in self._chunk_in if c is not None)
            raise RuntimeError(
                f"chunk {chunk_id} needs a device buffer, but all {self.n_buffer} buffers "
                f"(n_buffer) hold chunks in use: {held}. Release one first, or plan more buffers."
            )
        return min(
            idle, key=lambda i: (self._chunk_in[i] is not None, self._last_release[i])
        )

    def _fetch(self, chunk_id: int, i: int) -> None:
        source = self.store.params_for_fetch(chunk_id, lambda: self._staging_buffer(i))
        whole = self._buffers[i]
        sharded = self.store.shard[1] > 1  # the local part copied in, then all-gathered (runtime/parallel/shard.py)
        dst = shard.local_part(self.store, whole) if sharded else whole
        if self._cuda:
            if self._freed[i] is not None:
                self._stream.wait_event(
                    self._freed[i]
                )  # compute is done with the old chunk
            if (write := self.store.pending_write(chunk_id)) is not None:
                self._stream.wait_event(write)  # a device step is still writing the values
            with torch.cuda.stream(self._stream):
                if source.dtype == dst.dtype:
                    dst.copy_(source, non_blocking=True)
                else:  # a lean chunk's fp32 master
                    self._fetch_cast(dst, source)
                if sharded:
                    shard.all_gather(self.store, whole)
            event = torch.cuda.Event()
            event.record(self._stream)
            self._fetched[i] = event
            self.store.note_host_read(chunk_id, event)  # harmless when it read staging
        else:
            dst.copy_(source)
            if sharded:
                shard.all_gather(self.store, whole)
        self._chunk_in[i] = chunk_id
        self._version_in[i] = self.store.version(chunk_id)
        self.fetches += 1

    def _fetch_cast(self, dst: torch.Tensor, source: torch.Tensor) -> None:
        """``dst.copy_(source)`` for a host ``source`` of another dtype, slice by slice through the
        device staging buffer (on the current stream, which orders each slice's reuse)."""
        staging = self._fetch_staging
        n = staging.numel()
        for a in range(0, source.numel(), n):
            b = min(a + n, source.numel())
            staging[: b - a].copy_(source[a:b], non_blocking=True)
            dst[a:b].copy_(staging[: b - a])

    def _staging_buffer(self, i: int) -> torch.Tensor:
        """Buffer ``i``'s host staging, free to refill (its last copy out of it is over)."""
        if self._fetched[i] is not None:
            self._fetched[i].synchronize()
        if self._staging[i] is None:
            self._staging[i] = host_empty(self.store.chunk_numel, self.store.compute_dtype, self.store.pinned)
        return self._staging[i]
