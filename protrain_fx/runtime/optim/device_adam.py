"""Adam(W) steps of offloaded chunks run on the device: the states stream through it.

The CPU steps offloaded chunks at about 2.4 G params/s (bf16 compute, ``cpu_adam.py``); the last
chunks of backward -- the first of the next forward -- are stepped last, so forward waits for them.
:class:`DeviceAdamW` steps such a chunk on the GPU instead: its fp32 master and both moments are
copied from the host store in slices into a small set of device staging buffers (on one copy
stream), updated there by torch's fused GPU kernel with the gradient still on the device (on a
second stream), and the new master, moments and working copy are copied back (on a third, so both
directions of the link run at once and a slice's copies out do not wait behind the next slice's
update). That moves 12 bytes per parameter in and 14 out, at the link's speed, and keeps the CPU
free for the chunks it steps.

Why three streams and three sets: the update kernels queue for the SMs behind backward's matrix
products. With the copies out on the update's stream and two sets, every slice's copy out waits
for that queue and the link idles: a step beside matrix products takes half as long again as
beside nothing. On their own stream the copies out start when the slice's update ends, and the
step beside products runs as fast as alone; a high priority for the update's stream helps neither
way (``docs/results.md#device-optimizer-steps``).

Everything is issued from the thread that lands the gradient, without blocking it: the chunk's host
buffers are marked as written until the last copy ends (:meth:`ChunkStore.note_host_write`), which
fetches of the chunk (next forward) wait for on their stream and host readers block on.

On a CPU device the same slices go through CPU staging buffers and torch's fused CPU kernel, with
slice boundaries on the grid of ``cpu_adam.slice_batches``: the same bits as the host path and as
``torch.optim.AdamW(fused=True)`` (tested), so CI checks the bookkeeping exactly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import torch

from protrain_fx.runtime.store.chunk_store import ChunkStore, ParamSlot
from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW, slice_batches

#: Elements per staging slice on a GPU: 3 sets x 8M x 18 bytes (fp32 master, moments, gradient and
#: the compute-dtype working copy) = 432 MiB of device memory, 96 MiB in per slice -- about 2 ms at
#: the link's speed, far above the launch costs of one slice.
DEVICE_SLICE_ELEMS = 1 << 23
#: Staging sets: one being filled, one drained, and one between them whose update may wait for the
#: SMs without stalling the link.
N_SETS = 3
#: Device steps in flight at most: a chunk's gradient buffer lives until its step is done, so the
#: thread landing gradients waits (:meth:`DeviceAdamW.make_room`) before a third one is made. The
#: memory analysis counts exactly that many (``analysis/memory.py``, ``grad_staging``); where the
#: steps keep up with backward, the wait costs nothing.
MAX_IN_FLIGHT = 2


class DeviceAdamW:
    """Steps chunks of ``adam.store`` on ``device`` with ``adam``'s optimizer and step counts."""

    def __init__(
        self, adam: ChunkAdamW, device: torch.device | str, slice_elems: int | None = None, update_priority: int = 0
    ) -> None:
        self.adam = adam
        self.store: ChunkStore = adam.store
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        limit = slice_elems or (DEVICE_SLICE_ELEMS if self.cuda else adam.slice_elems)
        self.slice_elems = min(limit, self.store.chunk_numel)
        self._sets: list[dict[str, torch.Tensor]] | None = None  # allocated at the first step
        self._free: list[torch.cuda.Event | None] = [None] * N_SETS
        self._next = 0
        self._device_steps: dict[ParamSlot, torch.Tensor] = {}
        #: Chunk steps issued so far.
        self.chunk_steps = 0
        #: Seconds the landing thread waited in :meth:`make_room`.
        self.wait_s = 0.0
        self._in_flight: list[torch.cuda.Event] = []
        #: Set to a list to time the steps (CUDA only): each step appends (chunk, start, done) CUDA
        #: timing events, start recorded on the load stream before its first copy, done after its
        #: last copy back. A benchmark reads and clears it; ``None`` (default) records nothing.
        self.timing: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] | None = None
        #: The same, for the rate training reaches (``planner/rates.py``): its own list, so that
        #: a benchmark clearing :attr:`timing` does not take entries from it.
        self.window: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] | None = None
        self._load = torch.cuda.Stream(self.device) if self.cuda else None
        # (``update_priority``: only for the benchmark that measured it did not help.)
        self._work = torch.cuda.Stream(self.device, priority=update_priority) if self.cuda else None
        self._drain = torch.cuda.Stream(self.device) if self.cuda else None

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging sets (held from the first step on)."""
        itemsize = torch.empty(0, dtype=self.store.compute_dtype).element_size()
        return N_SETS * self.slice_elems * (4 * 4 + itemsize)

    def has_room(self) -> bool:
        """Whether :meth:`make_room` would return without waiting."""
        return len(self._in_flight) < MAX_IN_FLIGHT or self._in_flight[0].query()

    def make_room(self) -> None:
        """Block until fewer than :data:`MAX_IN_FLIGHT` issued steps are still running (call before
        making the next chunk's gradient buffer: the caching allocator can then reuse the oldest's)."""
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            event = self._in_flight.pop(0)
            if not event.query():
                start = time.perf_counter()
                event.synchronize()
                self.wait_s += time.perf_counter() - start

    def step_chunk(self, chunk_id: int, grads: Mapping[str, torch.Tensor]) -> None:
        """One step of the chunk's optimized parameters that have a gradient in ``grads`` (name ->
        gradient on the device, compute dtype), its new working copy written to the host.

        The chunk must hold no gradient in the store (those go through the CPU path)."""
        store, adam = self.store, self.adam
        if store.grad_slots(chunk_id):
            raise RuntimeError(f"chunk {chunk_id} holds a gradient on the host; step it on the CPU")
        flat: dict[ParamSlot, torch.Tensor] = {}
        for s, grad in store.grads_by_slot(grads).items():
            if s.chunk != chunk_id:
                raise ValueError(f"parameter {s.name!r} is in chunk {s.chunk}, not {chunk_id}")
            if adam.optimized(s):  # rounded to the compute dtype, as the host path stores it
                flat[s] = grad.detach().reshape(-1).to(store.compute_dtype)
        if not flat:
            if store.shard[1] > 1:  # the chunk's other parts changed: every rank fetches it again alike
                store.note_host_write(chunk_id, store.pending_write(chunk_id))
            return
        if self._sets is None:
            self._sets = [self._new_set() for _ in range(N_SETS)]
        kinds = ("master", "exp_avg", "exp_avg_sq") + (() if store.is_lean(chunk_id) else ("working",))
        host = {k: store.flat(k, chunk_id) for k in kinds}  # a lean chunk has no working copy
        start = self._begin(chunk_id, self._drain)  # a fetch may still be reading the working copy
        if self.cuda:
            for g in flat.values():
                g.record_stream(self._work)
        for group in sorted({adam.group_of(s) for s in flat}):
            slots = [s for s in flat if adam.group_of(s) == group]
            steps = adam.advance(slots)
            fused, hyper = adam.kernel(group)
            owner = {id(step): s for s, step in zip(slots, steps)}  # one step tensor per slot
            for batch in slice_batches(slots, steps, self.slice_elems):
                self._step_slice(batch, owner, flat, host, fused, hyper)
        self._end(chunk_id, start, bounded=True)

    def can_step_held(self, chunk_id: int) -> bool:
        """Whether :meth:`step_held` takes the chunk: a whole chunk (not a shard's part) with a
        working copy on the host, every parameter of it optimized and holding a gradient there."""
        store, adam = self.store, self.adam
        slots = store.chunk_slots(chunk_id)
        return (store.shard[1] == 1 and not store.is_lean(chunk_id) and len(store.grad_slots(chunk_id)) == len(slots)
                and all(adam.optimized(s) for s in slots))

    def step_held(self, chunk_id: int, grad_scale: torch.Tensor | None = None) -> None:
        """One step of a chunk whose gradient the host store holds (a step held for clipping or
        micro-batches, :meth:`can_step_held`): the gradient streams in beside the master and
        moments, slice by slice, is multiplied by ``grad_scale`` (a 0-dim fp32 CPU tensor, as
        ``ChunkAdamW.step_chunk`` multiplies it) and consumed; the new working copy overwrites it
        on the host. Issued without blocking and without bounding the steps in flight: no device
        gradient buffer lives until the step ends, and the staging sets are reused in stream order.
        The next forward's fetch of the chunk waits for its copies back (:meth:`ChunkStore.note_host_write`)."""
        store, adam = self.store, self.adam
        slots = list(store.grad_slots(chunk_id))
        store.wait_grad(chunk_id)  # its landing copies and queued adds, done (the clip read their norms)
        if self._sets is None:
            self._sets = [self._new_set() for _ in range(N_SETS)]
        host = {k: store.flat(k, chunk_id) for k in ("master", "exp_avg", "exp_avg_sq", "working")}
        grad = store.grad_flat(chunk_id)  # the working buffer: overwritten by the new working copy
        scale = None
        if grad_scale is not None:
            scale = grad_scale.to(self.device, non_blocking=self.cuda) if self.cuda else grad_scale
        start = self._begin(chunk_id, self._load)  # a fetch may still be reading the buffer the gradient is in
        for group in sorted({adam.group_of(s) for s in slots}):
            members = [s for s in slots if adam.group_of(s) == group]
            steps = adam.advance(members)
            fused, hyper = adam.kernel(group)
            owner = {id(step): s for s, step in zip(members, steps)}
            for batch in slice_batches(members, steps, self.slice_elems):
                self._step_slice(batch, owner, None, host, fused, hyper, held=(grad, scale))
        store.forget_grad(chunk_id)
        self._end(chunk_id, start, bounded=False)

    def _begin(self, chunk_id: int, read_waiter: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Order a step of ``chunk_id`` (CUDA): the load and work streams after the current one (where
        the gradients and the scale are made), the loads after the chunk's last device step's writes,
        and ``read_waiter`` after a fetch still reading its host buffers; the step's start event when
        the steps are timed. On a CPU device: the host buffers' readers and writers waited for."""
        store = self.store
        if not self.cuda:
            store.before_host_write(chunk_id)
            return None
        current = torch.cuda.current_stream(self.device)
        self._load.wait_stream(current)
        self._work.wait_stream(current)
        if (write := store.pending_write(chunk_id)) is not None:
            self._load.wait_event(write)
        if (read := store.read_event(chunk_id)) is not None:
            read_waiter.wait_event(read)
        if self.timing is None and self.window is None:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(self._load)
        return start

    def _end(self, chunk_id: int, start: torch.cuda.Event | None, *, bounded: bool) -> None:
        """A step of ``chunk_id`` issued: counted, its copies back marked on the chunk (fetches wait for
        them), timed from ``start``; ``bounded``: among the steps in flight :meth:`make_room` bounds."""
        self.chunk_steps += 1
        if not self.cuda:
            self.store.note_host_write(chunk_id, None)
            return
        done = torch.cuda.Event(enable_timing=start is not None)
        done.record(self._drain)
        if start is not None:
            for timed_list in (self.timing, self.window):
                if timed_list is not None:
                    timed_list.append((chunk_id, start, done))
        self.store.note_host_write(chunk_id, done)
        if bounded:
            self._in_flight.append(done)

    def _step_slice(self, batch, owner, flat, host, fused, hyper, held=None) -> None:
        """One slice of a step: its states (and a held gradient, ``held = (host gradient, scale)``)
        in, the fused update, the states and new working copy out."""
        k = self._next
        self._next = (k + 1) % N_SETS
        st = self._sets[k]
        ranges, pos = [], 0  # (host start, host end, staging start, slot)
        for a, b, step in batch:
            ranges.append((a, b, pos, owner[id(step)]))
            pos += b - a
        load, work, drain = self._load, self._work, self._drain
        with _on(load):
            if self.cuda and self._free[k] is not None:
                load.wait_event(self._free[k])  # the set's last slice is drained
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                for a, b, p, _ in ranges:
                    st[kind][p : p + b - a].copy_(host[kind][a:b], non_blocking=self.cuda)
            if held is not None:  # fp32 straight to the gradient's set, the compute dtype to the working one
                into = "grad" if held[0].dtype == torch.float32 else "working"
                for a, b, p, _ in ranges:
                    st[into][p : p + b - a].copy_(held[0][a:b], non_blocking=self.cuda)
        if self.cuda:
            work.wait_stream(load)
        with _on(work):
            grads = []
            if held is not None:
                for a, b, p, _ in ranges:
                    g = st["grad"][p : p + b - a]
                    grads.append(g if held[0].dtype == torch.float32 else g.copy_(st["working"][p : p + b - a]))
                if held[1] is not None:  # as ChunkAdamW scales a held gradient (same bits)
                    torch._foreach_mul_(grads, held[1])
            for a, b, p, s in ([] if held is not None else ranges):
                g = flat[s][a - s.offset : b - s.offset]
                grads.append(g if g.dtype == torch.float32 else st["grad"][p : p + b - a].copy_(g))
            views = {kind: [st[kind][p : p + b - a] for a, b, p, _ in ranges] for kind in ("master", "exp_avg", "exp_avg_sq")}
            fused(
                views["master"],
                grads,
                views["exp_avg"],
                views["exp_avg_sq"],
                [],
                [self._device_step(s, step) for (_, _, step), (_, _, _, s) in zip(batch, ranges)],
                **hyper,
            )
            if "working" in host:
                for a, b, p, _ in ranges:
                    st["working"][p : p + b - a].copy_(st["master"][p : p + b - a])
        if self.cuda:
            drain.wait_stream(work)
        with _on(drain):
            for kind in host:
                for a, b, p, _ in ranges:
                    host[kind][a:b].copy_(st[kind][p : p + b - a], non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(drain)
                self._free[k] = event

    def _device_step(self, slot: ParamSlot, step: torch.Tensor) -> torch.Tensor:
        """The slot's step count as the kernel wants it: the CPU tensor itself on a CPU device, a
        device copy on a GPU (filled on the work stream from the CPU count, no sync)."""
        if not self.cuda:
            return step
        if slot not in self._device_steps:
            self._device_steps[slot] = torch.zeros((), dtype=torch.float32, device=self.device)
        device_step = self._device_steps[slot]
        device_step.fill_(step.item())  # a CPU tensor: no device sync
        return device_step

    def _new_set(self) -> dict[str, torch.Tensor]:
        n, device = self.slice_elems, self.device
        return {
            "master": torch.empty(n, dtype=torch.float32, device=device),
            "exp_avg": torch.empty(n, dtype=torch.float32, device=device),
            "exp_avg_sq": torch.empty(n, dtype=torch.float32, device=device),
            "grad": torch.empty(n, dtype=torch.float32, device=device),
            "working": torch.empty(n, dtype=self.store.compute_dtype, device=device),
        }


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)``, or nothing for ``None`` (a CPU device)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
