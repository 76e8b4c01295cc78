"""Host side of the parameter chunks: per chunk, flat host buffers with the layout's offsets.

========== ============= ==================================================================
buffer     dtype         holds
========== ============= ==================================================================
working    compute dtype the values the device fetches; between the chunk's backward and its
                         optimizer step, its gradient (the master is authoritative meanwhile)
master     fp32          the authoritative parameter values
exp_avg    fp32          Adam's first moment (chunks with a trainable parameter)
exp_avg_sq fp32          Adam's second moment (idem)
========== ============= ==================================================================

*Lean* chunks have no working copy: the device fetches the fp32 master, and their gradients land
in a pool of ``grad_pool`` compute-dtype buffers given back by the chunk's optimizer step
(:meth:`ChunkStore.finish_step`). Tied parameters are stored once; frozen ones refuse gradients.
The store lives as long as its offload handle. On CUDA, gradients arrive on a side stream with an
event (:meth:`ChunkStore.wait_grad`), and device reads of a buffer are noted
(:meth:`ChunkStore.note_host_read`) so that no host write overtakes a copy in flight. A gradient
added to one the chunk holds (micro-batches) is staged and added on the CPU optimizer's worker
thread (``runtime/store/grad_adds.py``); :meth:`ChunkStore.wait_grad` waits for those adds too.

*Spilled* chunks (a host short of memory even with every chunk lean) keep only their working copy in
host memory: their master and moments live in a file on local disk and are held in host memory only
while used (:meth:`ChunkStore.state_held`; ``runtime/store/spill.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import ContextManager, Literal

import torch

from protrain_fx.chunks import ChunkLayout
from protrain_fx.runtime.store.host_memory import (
    available_host_bytes,
    planned_store_bytes,
    spill_bytes,
    store_tiers,
)
from protrain_fx.runtime.store.spill import Residency, SpillFile, check_spill_dir
from protrain_fx.runtime.store.spill import spill_dir as spill_dir_of
from protrain_fx.runtime.store.grad_adds import PendingAdds
from protrain_fx.runtime.store.landing_pool import LandingPool
from protrain_fx.runtime.store.pinned import host_empty, host_zeros
from protrain_fx.runtime.store.slots import (
    ParamSlot,
    _layout_itemsize,
    _pieces,
    _slot_view,
    _slots,
    grads_by_slot,
    piece_of,
)

__all__ = ["GRAD_POOL", "BufferKind", "ChunkStore", "ParamSlot", "piece_of"]

#: Gradient landing buffers of the lean chunks (see the module docstring), unless told otherwise.
GRAD_POOL = 4


#: What the store can show per parameter (see the module table).
BufferKind = Literal["working", "master", "exp_avg", "exp_avg_sq"]


class ChunkStore:
    """Flat host buffers of every chunk of ``layout``, filled from the model's ``params``.

    ``params`` maps every parameter name (tied names included, e.g.
    ``dict(model.named_parameters(remove_duplicate=False))``) to its tensor; the layout must
    name each of them exactly once. ``compute_dtype`` is the working copy's dtype (default: the
    parameters'). ``available_bytes`` overrides ``/proc/meminfo`` for the up-front memory check.
    ``n_lean``: how many chunks, counted from the last, are lean (no working copy; see the module
    docstring), or ``"auto"``: the fewest that fit. ``grad_pool``: landing buffers of the lean chunks.
    ``n_spill``: how many chunks before the lean ones keep their optimizer state in a file in
    ``spill_dir`` (``runtime/store/spill.py``), or ``"auto"``: none while host memory holds the store,
    else the fewest that let it.
    ``shard=(rank, world_size)``: the store holds only that rank's equal part of every chunk (its
    buffers, slots and optimizer state; ``runtime/parallel/shard.py`` gathers and scatters the rest).
    ``fill=False``: nothing is allocated until :meth:`fill` (the layout and the host check are done).
    """

    _filling: Future[None] | None = None  # a fill on a thread of its own (fill)
    fill_s: float | None = None  # seconds the fill took

    def __init__(
        self,
        layout: ChunkLayout,
        params: Mapping[str, torch.Tensor],
        *,
        compute_dtype: torch.dtype | None = None,
        pin_memory: bool = True,
        available_bytes: int | None = None,
        init: Callable[[str, torch.Tensor], None] | None = None,
        n_lean: int | Literal["auto"] = 0,
        grad_pool: int = GRAD_POOL,
        n_spill: int | Literal["auto"] = 0,
        spill_dir: str | os.PathLike[str] | None = None,
        shard: tuple[int, int] | None = None,
        fill: bool = True,
    ) -> None:
        if [c.index for c in layout.chunks] != list(range(len(layout.chunks))):
            raise ValueError("chunk indices must be 0, 1, ... in layout order")
        itemsize = _layout_itemsize(layout, params)
        self.layout = layout
        #: Elements of one whole chunk (the device buffers'), and of what this store holds of each.
        self.full_numel = layout.chunk_bytes // itemsize
        rank, world = shard or (0, 1)
        if self.full_numel % world:
            raise ValueError(f"a chunk of {self.full_numel} elements does not split into {world} equal shards")
        self.shard = (rank, world)
        self.chunk_numel = self.full_numel // world
        #: Every parameter's whole slot in the chunk layout (offsets into the whole chunk).
        self.full_slots = _slots(layout, params, itemsize)
        self._full_slot_of = {name: s for s in self.full_slots for name in s.names}
        self.slots = _pieces(self.full_slots, rank * self.chunk_numel, self.chunk_numel) if world > 1 else self.full_slots
        self.compute_dtype = compute_dtype or next(iter(params.values())).dtype
        self.pinned = pin_memory and torch.cuda.is_available()
        self._slot_of = {name: s for s in self.slots for name in s.names}
        self._chunk_slots = tuple(tuple(s for s in self.slots if s.chunk == c.index) for c in layout.chunks)
        if grad_pool < 1:
            raise ValueError(f"grad_pool must be at least 1, got {grad_pool}")
        if available_bytes is None:
            available_bytes = available_host_bytes()
        n = len(layout.chunks)
        n_lean, n_spill = store_tiers(self.chunk_numel, self._trainable_chunks(), self.compute_dtype.itemsize,
                                      available_bytes, grad_pool, n_lean, n_spill, world)
        #: Chunks without a host working copy (the last ``n_lean``).
        self.lean = frozenset(range(n - n_lean, n))
        #: Chunks whose master and moments live in the spill file (the ``n_spill`` before the lean ones).
        self.spilled = frozenset(range(n - n_lean - n_spill, n - n_lean))
        self.grad_pool = min(grad_pool, n_lean)
        self._spill_dir = spill_dir_path = spill_dir_of(spill_dir) if self.spilled else None
        #: Bytes of the spill file (0: nothing spilled).
        self.spill_bytes = spill_bytes(self.chunk_numel, self._trainable_chunks(), n_lean, n_spill)
        if spill_dir_path is not None:
            check_spill_dir(spill_dir_path, self.spill_bytes)
        self._residency: Residency | None = None
        self._init = init
        if init is None:
            meta = next((s.name for s in self.slots if params[s.name].is_meta), None)
            if meta is not None:
                raise ValueError(
                    f"parameter {meta!r} is on the meta device and has no values: give an init "
                    "function (offload(..., init=fn), fn(name, tensor) fills tensor in place)"
                )
        self._buffers: dict[BufferKind, list[torch.Tensor | None]] = {
            "working": [],
            "master": [],
            "exp_avg": [],
            "exp_avg_sq": [],
        }
        self._scratch: torch.Tensor | None = None
        self._params: Mapping[str, torch.Tensor] | None = params  # what fill() reads, then forgotten
        if fill:
            self.fill()
        # which slots hold a gradient since the chunk's last step (empty: the working copy is valid)
        self._grad_slots: list[set[ParamSlot]] = [set() for _ in layout.chunks]
        self._versions = [0] * len(layout.chunks)
        self._grad_events: list[torch.cuda.Event | None] = [None] * len(layout.chunks)
        self._read_events: list[torch.cuda.Event | None] = [None] * len(layout.chunks)
        # copies from the device into the chunk's host buffers still in flight (a device step)
        self._write_events: list[torch.cuda.Event | None] = [None] * len(layout.chunks)
        self._d2h_streams: dict[torch.device, torch.cuda.Stream] = {}
        # gradient landing buffers of lean chunks: held (chunk -> buffer) and free; the optimizer's
        # thread gives them back
        self._landing = LandingPool(self.grad_pool, self.chunk_numel * self.compute_dtype.itemsize,
                                    lambda: self._empty(self.compute_dtype))
        #: Accumulated landings, added off the landing thread (its ``run``: the optimizer's worker).
        self.adds = PendingAdds(len(layout.chunks), self.chunk_numel, self.compute_dtype, self.pinned)

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        return len(self._chunk_slots)

    @property
    def has_trainable(self) -> bool:
        return any(s.trainable for s in self.slots)

    def chunk_slots(self, chunk_id: int) -> tuple[ParamSlot, ...]:
        """The parameters of chunk ``chunk_id``, in layout order."""
        return self._chunk_slots[chunk_id]

    def slot(self, name: str) -> ParamSlot:
        """The slot of parameter ``name`` (any of a tied parameter's names); sharded, its piece here."""
        try:
            return self._slot_of[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in the chunk store") from None

    def holds(self, name: str) -> bool:
        """Whether this store holds (a piece of) parameter ``name``."""
        return name in self._slot_of

    def full_slot(self, name: str) -> ParamSlot:
        """Parameter ``name``'s whole slot in its chunk (offsets into the whole chunk)."""
        try:
            return self._full_slot_of[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in the chunk store") from None

    def host_bytes(self) -> int:
        """Bytes of host memory the store holds (chunk padding, the scratch and the landing and
        staging buffers made so far included)."""
        return self._chunk_bytes() + self._fixed_bytes()

    def bytes_per_param(self) -> float:
        """Host bytes per stored parameter element, padding included and the buffers shared by all
        chunks (scratch, landing buffers) excluded: 14 for bf16 compute, 12 for a lean chunk."""
        return self._chunk_bytes() / sum(s.numel for s in self.slots)

    def _chunk_bytes(self) -> int:
        self.wait_filled()
        buffers = [b for kind, bs in self._buffers.items() for c, b in enumerate(bs)
                   if b is not None and (kind == "working" or c not in self.spilled)]  # (held state: staging)
        return sum(b.numel() * b.element_size() for b in buffers)

    def _fixed_bytes(self) -> int:
        """The scratch, and the landing and staging buffers made so far."""
        itemsize = self.compute_dtype.itemsize
        self.wait_filled()
        scratch = 0 if self._scratch is None else self._scratch.numel() * 4
        spill = 0 if self._residency is None else self._residency.buffer_bytes
        return scratch + self._landing.made * self.chunk_numel * itemsize + self.adds.staging_bytes + spill

    def planned_bytes(self) -> int:
        """What ``host_bytes`` will be, computed before allocating anything, with the pool's
        landing buffers all made."""
        return planned_store_bytes(
            self.chunk_numel, self._trainable_chunks(), self.compute_dtype.itemsize, len(self.lean),
            self.grad_pool, len(self.spilled),
        )

    def _trainable_chunks(self) -> list[bool]:
        return [any(s.trainable for s in slots) for slots in self._chunk_slots]

    # ---- allocation --------------------------------------------------------------------------

    @property
    def filled(self) -> bool:
        """Whether the buffers exist and hold the parameters' values (:meth:`fill`; waits for one
        in the background)."""
        self.wait_filled()
        return self._params is None

    def fill(self, *, background: bool = False) -> None:
        """Allocate every chunk's buffers and fill them from ``params`` (materialising the ones on
        ``meta`` with ``init``). A store made with ``fill=False`` has its layout, sizes and host
        check only: what the planner's trial placements need, without the bytes.

        ``background=True``: on a thread of its own (the backend's, beside Inductor's compile); every
        read of a buffer waits for it (:meth:`wait_filled`) and raises its error. ``init`` runs on
        that thread: it draws what it would on the caller's while nothing else draws meanwhile."""
        if self._params is None or self._filling is not None:
            return
        if not background:
            self._fill_now()
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="protrain_fx chunk store fill")
        self._filling = pool.submit(self._fill_now)
        pool.shutdown(wait=False)  # its thread ends with the fill

    def _fill_now(self) -> None:
        params = self._params
        assert params is not None
        started = time.monotonic()
        if self.spilled:
            trainable = self._trainable_chunks()
            spilled = sorted(self.spilled)
            assert self._spill_dir is not None
            sizes = [self.chunk_numel * 4 * (3 if trainable[c] else 1) for c in spilled]
            self._residency = Residency(SpillFile(self._spill_dir, sizes), spilled, self.chunk_numel,
                                        self._buffers, [trainable[c] for c in spilled])
        for c, slots in enumerate(self._chunk_slots):
            self._allocate_chunk(slots, params, lean=c in self.lean, spilled=c in self.spilled)
        needs_scratch = self.compute_dtype != torch.float32 and self.has_trainable
        self._scratch = self._empty(torch.float32) if needs_scratch else None
        self._params = None
        self.fill_s = time.monotonic() - started

    def wait_filled(self) -> None:
        """Wait for a background :meth:`fill` (nothing to wait for otherwise); raise its error, at
        every call, so that nothing goes on with what a failed fill left half-made."""
        if self._filling is not None:
            self._filling.result()

    @property
    def filling(self) -> bool:
        """Whether a background :meth:`fill` is still running."""
        return self._filling is not None and not self._filling.done()

    def _empty(self, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(self.chunk_numel, dtype, self.pinned)  # exact size: no power-of-two rounding

    def _zeros(self, dtype: torch.dtype) -> torch.Tensor:
        return host_zeros(self.chunk_numel, dtype, self.pinned)

    def _allocate_chunk(
        self, slots: tuple[ParamSlot, ...], params: Mapping[str, torch.Tensor], *, lean: bool, spilled: bool = False,
    ) -> None:
        # zero padding: finite if ever read
        master = torch.zeros(self.chunk_numel, dtype=torch.float32) if spilled else self._zeros(torch.float32)
        for s in slots:
            source = params[s.name]
            target = master[s.offset : s.offset + s.numel]
            if source.is_meta:  # materialised here, straight into the chunk
                self._materialize(s, target)
            else:
                target.copy_(source.detach().reshape(-1)[s.start : s.start + s.numel])
        working = None
        if not lean:
            working = self._empty(self.compute_dtype)
            working.copy_(master)
        trainable = any(s.trainable for s in slots)
        self._buffers["working"].append(working)
        if spilled:  # the state goes to the file: master, then zero moments
            assert self._residency is not None
            zeros = torch.zeros(self.chunk_numel, dtype=torch.float32) if trainable else None
            self._residency.write_initial(len(self._buffers["working"]) - 1,
                                          [master] + ([zeros, zeros] if zeros is not None else []))
            master = None
        self._buffers["master"].append(master)
        for kind in ("exp_avg", "exp_avg_sq"):
            self._buffers[kind].append(self._zeros(torch.float32) if trainable and not spilled else None)

    def _materialize(self, slot: ParamSlot, target: torch.Tensor) -> None:
        """Fill ``target`` (the slot's flat fp32 master) with ``init(name, tensor)``'s values (the
        constructor refused a meta parameter without ``init``)."""
        assert self._init is not None
        whole = self._full_slot_of[slot.name]  # a piece: the whole parameter is initialised, then sliced
        if slot.dtype == torch.float32 and whole.numel == slot.numel:
            value = target.view(slot.shape)
        else:
            value = torch.empty(whole.shape, dtype=slot.dtype)
        with torch.no_grad():
            self._init(slot.name, value)
        if value.data_ptr() != target.data_ptr():
            target.copy_(value.reshape(-1)[slot.start : slot.start + slot.numel])

    # ---- views -------------------------------------------------------------------------------

    def flat(self, kind: BufferKind, chunk_id: int) -> torch.Tensor:
        """The flat ``kind`` buffer of a chunk (``exp_avg*`` of a chunk with nothing to train: error)."""
        self.wait_filled()
        if self._params is not None:
            raise RuntimeError("protrain_fx: the chunk store was laid out for planning and holds no values yet (fill())")
        buffer = self._buffers[kind][chunk_id]
        if buffer is None and chunk_id in self.spilled and kind != "working":
            if kind == "master" or self._trainable_chunks()[chunk_id]:
                raise RuntimeError(f"protrain_fx: chunk {chunk_id}'s {kind} is in the spill file; hold it in "
                                   "host memory with ChunkStore.state_held first")
        if buffer is None and kind == "working":
            raise ValueError(
                f"chunk {chunk_id} is lean: it has no host working copy (its values are the master's, "
                "its gradient is in grad_flat)"
            )
        if buffer is None:
            raise ValueError(f"chunk {chunk_id} has no trainable parameter, so no {kind}")
        return buffer

    def has_buffer(self, kind: BufferKind, chunk_id: int) -> bool:
        """Whether the chunk has a ``kind`` buffer here (no moments where nothing here trains)."""
        self.wait_filled()
        if chunk_id in self.spilled and kind != "working":
            return kind == "master" or self._trainable_chunks()[chunk_id]
        return self._buffers[kind][chunk_id] is not None

    def state_held(self, chunk_id: int, *, write: bool = True) -> ContextManager[None]:
        """For the ``with`` block, the chunk's master and moments in host memory: a spilled chunk's
        are read back from the spill file (or waited for, read ahead) and, with ``write`` (a step),
        written back after (``Residency.held``, which also reads ahead the one stepped next). Nothing
        to hold for a chunk not spilled."""
        if self._residency is None:
            return nullcontext()
        return self._residency.held(chunk_id, write=write)

    @property
    def residency(self) -> Residency | None:
        """The spilled chunks' state in host memory and the spill file (``None``: nothing spilled)."""
        return self._residency

    def view(self, kind: BufferKind, slot: ParamSlot) -> torch.Tensor:
        """``slot``'s parameter-shaped view of its chunk's ``kind`` buffer."""
        return _slot_view(self.flat(kind, slot.chunk), slot)

    def views(self, kind: Literal["working", "master"]) -> dict[str, torch.Tensor]:
        """Every parameter name -> its view of ``kind`` (tied names: one view object).

        The working views show a gradient while their chunk holds one (:meth:`holds_grad`)."""
        return self._named(lambda s: self.view(kind, s))

    def unflatten(self, chunk_id: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter name -> view of ``flat``, any chunk-shaped tensor (e.g. a GPU buffer of chunk ``chunk_id``)."""
        if flat.shape != (self.chunk_numel,):
            raise ValueError(f"a flat chunk has {self.chunk_numel} elements, got shape {tuple(flat.shape)}")
        views = {}
        for s in self._chunk_slots[chunk_id]:
            view = _slot_view(flat, s)
            views.update(dict.fromkeys(s.names, view))
        return views

    def _named(
        self, value: Callable[[ParamSlot], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        named = {}
        for s in self.slots:
            named.update(dict.fromkeys(s.names, value(s)))
        return named

    # ---- gradients ---------------------------------------------------------------------------

    def is_lean(self, chunk_id: int) -> bool:
        """Whether the chunk has no host working copy (see the module docstring)."""
        return chunk_id in self.lean

    def grad_flat(self, chunk_id: int) -> torch.Tensor:
        """The flat buffer holding the chunk's gradient (compute dtype): its working buffer, or a
        lean chunk's landing buffer (which it must hold: see :meth:`holds_grad`)."""
        if chunk_id not in self.lean:
            return self.flat("working", chunk_id)
        held = self._landing.held(chunk_id)
        if held is None:
            raise ValueError(f"lean chunk {chunk_id} holds no gradient")
        return held

    def landing_full(self) -> bool:
        """Whether every landing buffer of the pool is held (the next lean chunk to take one would
        get a new one: wait for an optimizer step first, if one is coming)."""
        return self._landing.full()

    @property
    def landing_buffers(self) -> int:
        """Landing buffers made so far (``grad_pool``, more only when a caller could not wait)."""
        return self._landing.made

    def _grad_target(self, chunk_id: int) -> torch.Tensor:
        """Where the chunk's gradient lands: :meth:`grad_flat`, or a landing buffer for a lean chunk."""
        return self._landing.take(chunk_id) if chunk_id in self.lean else self.grad_flat(chunk_id)

    def holds_grad(self, chunk_id: int) -> bool:
        """Whether the chunk's working buffer holds a gradient (its values are then in the master only)."""
        return bool(self._grad_slots[chunk_id])

    def grad_slots(self, chunk_id: int) -> tuple[ParamSlot, ...]:
        """The chunk's parameters that received a gradient since its last step, in layout order."""
        return tuple(s for s in self._chunk_slots[chunk_id] if s in self._grad_slots[chunk_id])

    def write_grad(
        self, chunk_id: int, flat: torch.Tensor, *, accumulate: bool = False
    ) -> None:
        """Land a chunk's whole flat gradient (what a chunk's backward produces, any device).

        ``accumulate=True`` adds it to the gradient the chunk already holds (micro-batches of one
        step; queued, see :attr:`adds`); with no gradient yet, or ``accumulate=False``, it is
        written as is. Every trainable parameter of the chunk then counts as having a gradient.
        """
        slots = self._chunk_slots[chunk_id]
        trainable = {s for s in slots if s.trainable}
        if not trainable:
            raise ValueError(f"chunk {chunk_id} has no trainable parameter to take a gradient")
        if flat.shape != (self.chunk_numel,):
            raise ValueError(f"a flat chunk gradient has {self.chunk_numel} elements, got shape {tuple(flat.shape)}")
        held = self._grad_slots[chunk_id]
        add = accumulate and bool(held)
        target = self._grad_target(chunk_id)
        if add:
            # parameters without a gradient yet still hold values (or garbage) there: start them from zero
            self._before_host_write(chunk_id)
            for s in trainable - held:
                _slot_view(target, s).zero_()
            self._land_adds(chunk_id, [target], [flat.reshape(target.shape)])
        else:
            self._land(chunk_id, target, flat)
        held.update(trainable)

    def write_grads(
        self, grads: Mapping[str, torch.Tensor], *, accumulate: bool = False
    ) -> list[int]:
        """Land gradients by parameter name (e.g. eager autograd's ``p.grad``); returns the chunks
        touched, in layout order. ``accumulate`` as in :meth:`write_grad`, per parameter: a chunk's
        adds are one job (:attr:`adds`)."""
        by_slot = self.grads_by_slot(grads)
        adds: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for s, grad in by_slot.items():
            held = self._grad_slots[s.chunk]
            target = _slot_view(self._grad_target(s.chunk), s)
            if accumulate and s in held:
                dsts, srcs = adds.setdefault(s.chunk, ([], []))
                dsts.append(target)
                srcs.append(grad.reshape(target.shape))
            else:
                self._land(s.chunk, target, grad)
            held.add(s)
        for chunk_id, (dsts, srcs) in adds.items():
            self._land_adds(chunk_id, dsts, srcs)
        return sorted({s.chunk for s in by_slot})

    def grads_by_slot(self, grads: Mapping[str, torch.Tensor]) -> dict[ParamSlot, torch.Tensor]:
        """Gradients by parameter name -> by slot (``runtime/store/slots.grads_by_slot``)."""
        return grads_by_slot(self.slot, grads)

    def wait_grad(self, chunk_id: int) -> None:
        """Block until the chunk's gradient copies (from a GPU) have arrived and its queued adds are done."""
        self.adds.wait(chunk_id)
        _synchronize(self._grad_events[chunk_id])
        self._grad_events[chunk_id] = None

    def grad_fp32(self, chunk_id: int) -> torch.Tensor:
        """The chunk's gradient as a flat fp32 tensor: the scratch (shared: valid until the next
        call) or, with fp32 compute, the buffer holding it (:meth:`grad_flat`)."""
        self.wait_grad(chunk_id)
        grad = self.grad_flat(chunk_id)
        if self._scratch is None:
            return grad
        return self._scratch.copy_(grad)

    @property
    def scratch(self) -> torch.Tensor | None:
        """The fp32 gradient scratch of one chunk (``None`` with fp32 compute)."""
        self.wait_filled()
        return self._scratch

    def finish_step(self, chunk_id: int, refreshed: Iterable[ParamSlot] = ()) -> None:
        """After the chunk's optimizer step: rebuild its working copy from the master (frozen and
        un-stepped parameters included) and forget its gradient. ``refreshed``: slots whose
        working copy the optimizer already rewrote from the new master. A lean chunk gives its
        landing buffer back instead. Sharded, the version is bumped even when this rank's part
        holds no gradient (the chunk's other parts changed: every rank fetches it again alike)."""
        if not self._grad_slots[chunk_id]:
            if self.shard[1] > 1:
                self._versions[chunk_id] += 1
            return
        self._before_host_write(chunk_id)
        done = set(refreshed)
        if chunk_id in self.lean:
            self._landing.give_back(chunk_id)
        elif not done:
            self.flat("working", chunk_id).copy_(self.flat("master", chunk_id))
        else:
            for s in self._chunk_slots[chunk_id]:  # a flat gradient covered frozen ones too
                if s not in done:
                    self.view("working", s).copy_(self.view("master", s))
        self._grad_slots[chunk_id].clear()
        self._versions[chunk_id] += 1

    def forget_grad(self, chunk_id: int) -> None:
        """The chunk's held gradient was consumed by a device step that rewrites every slot's working
        copy (``DeviceAdamW.step_held``): forget it without touching the host buffers, which that
        step's copies still write (:meth:`note_host_write` bumps the version)."""
        self._grad_slots[chunk_id].clear()

    def _land(self, chunk_id: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into host ``dst``; from a GPU asynchronously, on a side stream."""
        src = src.detach().reshape(dst.shape)
        if src.device.type != "cuda":
            self._before_host_write(chunk_id)
            dst.copy_(src)
            return
        stream = self._d2h_stream(src.device)
        stream.wait_stream(
            torch.cuda.current_stream(src.device)
        )  # the gradient is made there
        if (read := self._read_events[chunk_id]) is not None:
            stream.wait_event(read)  # a fetch may still be reading this buffer
        if (write := self._write_events[chunk_id]) is not None:
            stream.wait_event(write)  # a device step may still be writing it
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(
            stream
        )  # the allocator must not reuse ``src`` before the copy ends
        event = torch.cuda.Event()
        event.record(stream)
        self._grad_events[chunk_id] = event

    def _land_adds(self, chunk_id: int, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Queue ``dst += src`` into the chunk's host gradient (:attr:`adds`), after every write
        into it still in flight: a landing's copy, a fetch reading it, a device step writing it."""
        after = (self._grad_events[chunk_id], self._read_events[chunk_id], self._write_events[chunk_id])
        device = srcs[0].device
        stream = self._d2h_stream(device) if device.type == "cuda" else None
        self.adds.add(chunk_id, dsts, srcs, after, stream)

    def _d2h_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._d2h_streams:
            self._d2h_streams[device] = torch.cuda.Stream(device=device)
        return self._d2h_streams[device]

    def before_host_write(self, chunk_id: int) -> None:
        """The CPU is about to write the chunk's host buffers: no copy may still be using them."""
        self._before_host_write(chunk_id)

    def _before_host_write(self, chunk_id: int) -> None:
        """The CPU is about to write the chunk's host buffers: no copy may still be using them."""
        _synchronize(self._read_events[chunk_id])
        self._read_events[chunk_id] = None
        self.wait_grad(chunk_id)
        self.wait_writes(chunk_id)

    # ---- device steps (``runtime/optim/device_adam.py``) -------------------------------------------

    def note_host_write(self, chunk_id: int, event: torch.cuda.Event | None) -> None:
        """Copies from the device into the chunk's host buffers end at ``event``: fetches wait for
        it on their stream, host reads and writes with :meth:`wait_writes`. The chunk's values
        changed: its version is bumped (device copies are stale)."""
        self._write_events[chunk_id] = event
        self._versions[chunk_id] += 1

    def pending_write(self, chunk_id: int) -> torch.cuda.Event | None:
        """The event of the chunk's host writes still in flight, if any."""
        return self._write_events[chunk_id]

    def wait_writes(self, chunk_id: int | None = None) -> None:
        """Block until the device's copies into the chunk's (default: every chunk's) host buffers end."""
        for c in range(self.num_chunks) if chunk_id is None else (chunk_id,):
            _synchronize(self._write_events[c])
            self._write_events[c] = None

    def read_event(self, chunk_id: int) -> torch.cuda.Event | None:
        """The event of the last GPU copy reading the chunk's host buffers (see :meth:`note_host_read`)."""
        return self._read_events[chunk_id]

    # ---- what the GPU buffer pool needs ------------------------------------------------------

    def version(self, chunk_id: int) -> int:
        """Bumped whenever the chunk's parameter values change (step, load): a device copy fetched
        at an older version is stale."""
        return self._versions[chunk_id]

    def params_for_fetch(
        self, chunk_id: int, staging: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The host tensor to copy the chunk's current values from: its working buffer, or, while
        that holds a gradient, a buffer from ``staging()`` (compute dtype, chunk size) filled
        from the master; a lean chunk's fp32 master (the device casts it)."""
        if chunk_id in self.lean:
            return self.flat("master", chunk_id)
        if not self._grad_slots[chunk_id]:
            return self.flat("working", chunk_id)
        self.wait_writes(chunk_id)  # the CPU reads the master: a device step may still be writing it
        with self.state_held(chunk_id, write=False):
            return staging().copy_(self.flat("master", chunk_id))

    def note_host_read(self, chunk_id: int, event: torch.cuda.Event) -> None:
        """A GPU copy reading the chunk's host buffer finishes at ``event``: later writes wait for it."""
        self._read_events[chunk_id] = event

    # ---- state dicts -------------------------------------------------------------------------

    def param_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name -> full fp32 tensor (a copy of the master; tied names share one tensor).

        Loads into the plain model with ``load_state_dict`` (which casts to the model's dtype)."""
        self.wait_writes()
        values: dict[ParamSlot, torch.Tensor] = {}
        for c in range(self.num_chunks):
            with self.state_held(c, write=False):
                values.update((s, self.view("master", s).clone()) for s in self._chunk_slots[c])
        return self._named(values.__getitem__)

    def load_param_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Set every parameter from ``state_dict`` (a model's ``state_dict()`` or :meth:`param_state_dict`);
        ``strict=False``: those it has an entry for, the others keep their values.

        A tied parameter needs one of its names; entries that are not parameters (buffers) are
        ignored. The gradients held by the chunks set are dropped."""
        found: dict[ParamSlot, torch.Tensor] = {}
        for s in self.slots:  # everything checked before anything is written
            name = next((n for n in s.names if n in state_dict), None)
            if name is None:
                if strict:
                    raise KeyError(f"state_dict has no entry for parameter {s.name!r}")
                continue
            value, whole = state_dict[name], self._full_slot_of[s.name]
            if tuple(value.shape) != whole.shape:
                raise ValueError(f"{name!r} has shape {tuple(value.shape)} in the state_dict, expected {whole.shape}")
            found[s] = value
        for c in sorted({s.chunk for s in found}):
            self._before_host_write(c)
            with self.state_held(c):
                for s in self._chunk_slots[c]:
                    if s in found:
                        self.view("master", s).copy_(piece_of(found[s], s))
                if c in self.lean:
                    self._landing.give_back(c)
                else:
                    self.flat("working", c).copy_(self.flat("master", c))
            self._grad_slots[c].clear()
            self._versions[c] += 1


def _synchronize(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()
