"""Accumulated gradients added on the host off the thread that lands them.

With ``handle.accumulate()`` every landing after a chunk's first in an optimizer step is an add:
the new gradient goes into the one the chunk already holds on the host (its working buffer, or a
lean chunk's landing buffer). The landing thread drives the device, so it must not wait for the
copy or do the add itself. :class:`PendingAdds` splits a landing in two:

* in the landing thread, the gradient is copied into a staging buffer (page-locked host memory,
  one chunk of the compute dtype), from a GPU asynchronously on the store's D2H stream with an
  event marking the copy's end, on the CPU in place (the graph may reuse the gradient's memory as
  soon as the landing returns);
* on the CPU optimizer's worker thread (``OptimizerWorker.run``, behind the chunk steps queued
  before it, in order), a job waits for that event and for every earlier write into the chunk's
  gradient buffer (the first landing's copy, a fetch reading it, a device step writing it), then
  adds the staged values into the buffer and frees the staging buffer for the next landing.

A landing of the same chunk queued later runs after this one (one worker thread, in order); the
chunk's optimizer step likewise; a read of the gradient elsewhere (clipping's norm, a state dict)
first waits for the chunk's jobs (:meth:`PendingAdds.wait`, through ``ChunkStore.wait_grad``).
Without a worker (a store used on its own) a job runs in the landing thread at once.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch

from protrain_fx.runtime.store.host_memory import AUTO_HOST_RESERVE, available_host_bytes
from protrain_fx.runtime.store.pinned import host_empty

__all__ = ["ACCUMULATING_STAGING_BUFFERS", "ACCUMULATING_STAGING_SHARE", "STAGING_BUFFERS", "PendingAdds"]

#: Staging buffers of accumulated landings: one takes the next chunk's copy from the device while
#: the worker adds the other's (double buffering). More help only while the worker's adds fall
#: behind the landings, which ``PendingAdds.staging_wait_s`` shows. Bounds the host memory they
#: take to two chunks of the compute dtype outside accumulation.
STAGING_BUFFERS = 2

#: Most staging buffers while a handle accumulates micro-batches (:meth:`PendingAdds.accumulating`):
#: every offloaded chunk then lands an add per micro-batch, and with two buffers the backward waits
#: for the worker's adds chunk by chunk; with one per landing chunk, one micro-batch's adds run on
#: beside the next one's forward. 16 bounds their pinned memory to 16 chunks; B24-L's 4.2B step makes 7
#: (``docs/results.md#b24-l-at-42b``).
ACCUMULATING_STAGING_BUFFERS = 16

#: Share of the host memory spare beyond the store's (``host_memory.AUTO_HOST_RESERVE`` kept free,
#: or the store's own limit) that the accumulating staging buffers may take.
ACCUMULATING_STAGING_SHARE = 0.5

Runner = Callable[[Callable[[], None]], "Future[None]"]


def _add(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst += src`` for each pair (the worker's part of a landing; a module function so that a
    test can see which thread runs it)."""
    torch._foreach_add_(dsts, srcs)


class PendingAdds:
    """Accumulated landings of the chunks of one store (see the module docstring): staging buffers of
    ``numel`` elements of ``dtype`` (page-locked when ``pinned``), jobs by chunk."""

    def __init__(self, num_chunks: int, numel: int, dtype: torch.dtype, pinned: bool) -> None:
        self._numel, self._dtype, self._pinned = numel, dtype, pinned
        #: Queues a job on the CPU optimizer's worker thread (``OptimizerWorker.run``); ``None``: jobs
        #: run in the landing thread.
        self.run: Runner | None = None
        # staging buffers, oldest use first, each with the job that reads it (None: free)
        self._staging: collections.deque[tuple[torch.Tensor, Future[None] | None]] = collections.deque()
        self._made = 0
        self._jobs: list[list[Future[None]]] = [[] for _ in range(num_chunks)]
        self._lock = threading.Lock()
        #: Adds queued so far.
        self.queued = 0
        #: Seconds the landing thread waited for a staging buffer (the worker's adds behind).
        self.staging_wait_s = 0.0
        #: Seconds the adds themselves took (on the worker, after their copies ended).
        self.add_s = 0.0
        #: Staging buffers made at most (raised once by :meth:`accumulating`).
        self.limit = STAGING_BUFFERS
        self._widened = False

    def accumulating(self, landing_chunks: int, limit_bytes: int | None, used_bytes: Callable[[], int]) -> None:
        """Allow one staging buffer per chunk that lands an add each micro-batch (``landing_chunks``),
        at most :data:`ACCUMULATING_STAGING_BUFFERS` and :data:`ACCUMULATING_STAGING_SHARE` of the
        host memory spare: ``limit_bytes - used_bytes()`` where the store has a limit, else what the
        host has available beyond ``AUTO_HOST_RESERVE``. Never fewer than :data:`STAGING_BUFFERS`;
        decided once (the buffers are made as landings need them)."""
        if self._widened:
            return
        self._widened = True
        if limit_bytes is not None:
            spare = limit_bytes - used_bytes()
        else:
            spare = (available_host_bytes() or 0) - AUTO_HOST_RESERVE
        fit = int(ACCUMULATING_STAGING_SHARE * max(0, spare)) // (self._numel * self._dtype.itemsize)
        self.limit = max(self.limit, min(ACCUMULATING_STAGING_BUFFERS, landing_chunks, fit))

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging buffers made so far (at most :data:`STAGING_BUFFERS`)."""
        return self._made * self._numel * self._dtype.itemsize

    def add(
        self,
        chunk_id: int,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        after: Sequence[torch.cuda.Event | None],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Queue ``dst += src`` for each pair (host ``dsts`` of the chunk's gradient buffer, ``srcs``
        of the same shapes on one device, at most ``numel`` elements together). The job waits for
        the events of ``after`` (earlier writes into ``dsts``) first. From a GPU, ``stream`` is the
        D2H stream the staging copy runs on."""
        assert sum(s.numel() for s in srcs) <= self._numel, "more gradient than one chunk"
        buffer = self._take()
        views, start = [], 0
        for src in srcs:
            views.append(buffer[start : start + src.numel()].view(src.shape))
            start += src.numel()
        events = [e for e in after if e is not None]
        srcs = [s.detach() for s in srcs]
        if srcs and srcs[0].device.type == "cuda":
            assert stream is not None, "a copy from a GPU needs the D2H stream"
            stream.wait_stream(torch.cuda.current_stream(srcs[0].device))  # the gradient is made there
            with torch.cuda.stream(stream):
                for view, src in zip(views, srcs):
                    view.copy_(src, non_blocking=True)
            for src in srcs:
                src.record_stream(stream)  # the allocator must not reuse ``src`` before the copy ends
            copied = torch.cuda.Event()
            copied.record(stream)
            events.append(copied)
        else:
            torch._foreach_copy_(views, srcs)
        dsts = list(dsts)

        def job() -> None:
            try:
                for event in events:
                    event.synchronize()
                start = time.perf_counter()
                _add(dsts, views)
                self.add_s += time.perf_counter() - start  # (jobs run one at a time, in one thread)
            except BaseException as error:
                error.add_note(f"(adding an accumulated gradient into chunk {chunk_id} on the host)")
                raise

        future = self._submit(job)
        self._staging.append((buffer, future))
        with self._lock:
            self._jobs[chunk_id].append(future)
        self.queued += 1

    def wait(self, chunk_id: int) -> None:
        """Block until the chunk's queued adds are done (raising a failure of one)."""
        with self._lock:
            jobs, self._jobs[chunk_id] = self._jobs[chunk_id], []
        for future in jobs:
            future.result()

    def wait_all(self) -> None:
        """Block until every queued add is done."""
        for chunk_id in range(len(self._jobs)):
            self.wait(chunk_id)

    def pending(self, chunk_id: int) -> bool:
        """Whether an add of the chunk is queued or running."""
        with self._lock:
            return any(not f.done() for f in self._jobs[chunk_id])

    def _submit(self, job: Callable[[], None]) -> Future[None]:
        if self.run is not None:
            return self.run(job)
        future: Future[None] = Future()
        try:
            job()
        except Exception as error:  # noqa: BLE001 -- raised where the chunk's adds are waited for, as from the worker
            future.set_exception(error)
        else:
            future.set_result(None)
        return future

    def _take(self) -> torch.Tensor:
        """A free staging buffer: a new one while fewer than :attr:`limit` exist, else the oldest
        once its add is done (the worker is then behind the landings)."""
        if self._made < self.limit and not (self._staging and _idle(self._staging[0][1])):
            self._made += 1
            return host_empty(self._numel, self._dtype, self._pinned)
        buffer, future = self._staging.popleft()
        if future is not None and not future.done():
            start = time.perf_counter()
            wait_futures([future])  # (a failure is raised where the chunk's adds are waited for)
            self.staging_wait_s += time.perf_counter() - start
        return buffer


def _idle(future: Future[None] | None) -> bool:
    return future is None or future.done()
