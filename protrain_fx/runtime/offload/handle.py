"""The handle behind ``protrain_fx.offload(model, optimizer, ...)`` (``protrain_fx/api.py``): train a
model whose parameters do not fit the GPU.

    handle = protrain_fx.offload(model, optimizer, device="cuda")   # before torch.compile
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": "24GiB"})

The parameters are packed into equal-size chunks. The first ``n_persist`` stay on the device as
ordinary parameters, stepped by ``optimizer``; the others live in a host chunk store and reach the
compiled graphs through ``n_buffer`` device buffers. Their gradients go to the host as backward
produces them, and a CPU AdamW steps each chunk while backward goes on (or, for ``n_gpu_optim``
chunks, the device). ``clip_grad_norm_`` over ``model.parameters()`` clips exactly over every
chunk; a non-finite norm skips the step everywhere. ``handle.accumulate()`` around all but the
last micro-batch's backward accumulates gradients. The model then runs only compiled: its
offloaded parameters are shells of 0 bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import re
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from protrain_fx.chunks import (
    OUTSIDE,
    Chunk,
    ChunkLayout,
    ParamInfo,
    choose_layout,
    dedupe_tied,
    pack,
)
from protrain_fx.errors import UnsupportedError
from protrain_fx.handoffs import ChunkFacts, Placement
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.parallel import distributed, shard
from protrain_fx.runtime.allocator import expandable_segments
from protrain_fx.runtime.store.buffer_pool import ChunkBufferPool
from protrain_fx.runtime.offload.state_dict import StateDicts, install_state_hooks
from protrain_fx.runtime.store.chunk_store import ChunkStore
from protrain_fx.runtime.optim.clipping import (
    HeldNorms,
    clip_grad_norm,
    install_clip_dispatch,
    lean_chunks_clip_warning,
)
from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW, OptimizerWorker
from protrain_fx.runtime.optim.device_adam import DeviceAdamW
from protrain_fx.runtime.parallel.grad_sync import GradAverager
from protrain_fx.runtime.store.host_memory import auto_tiers, available_host_bytes
from protrain_fx.runtime.store.spill import spill_dir
from protrain_fx.runtime.offload.eager import EagerModules
from protrain_fx.runtime.offload.landing import Landing
from protrain_fx.runtime.offload.options import (
    OffloadOptions,
    check_device_present,
    check_hand_counts,
    checked_model,
)
from protrain_fx.runtime.offload.shells import (
    empty_shell,
    guard_shells,
    install_shell_repr,
    is_shell,
    refuse_eager_call,
    set_data,
)

log = logging.getLogger("protrain_fx")


_BLOCK = re.compile(r"^(.*?\.\d+)\.")


class OffloadHandle(StateDicts, Landing):
    """The state behind one offloaded model (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: OffloadOptions,
                 model_init: Callable[[nn.Module, torch.device], Callable[[str, torch.Tensor], None]] | None = None,
                 explain_breaks: Callable[[], str] = str) -> None:
        """``model_init(model, device)``: the function ``init="model"`` stands for (it materialises
        the model's ``meta`` buffers), called once the device is known to serve. ``explain_breaks()``:
        the graph breaks seen so far, for the refusal of a module run outside the compiled graphs."""
        self.device = options.device
        #: The process group when data-parallel (more than one rank), else ``None``.
        self.group = distributed.check_device(self.device)
        check_device_present(self.device)
        if options.init == "model":
            assert model_init is not None, "init='model' needs the caller's model_init (protrain_fx/api.py)"
            options = options.replace(init=model_init(model, self.device))
        #: ``offload()``'s settings, checked (:class:`~protrain_fx.runtime.offload.options.OffloadOptions`).
        self.options = options
        named = checked_model(model, optimizer, options)
        auto = options.automatic
        self.layout = _layout(named, options.chunk_bytes, self.group)
        distributed.agree({
            "counts (n_persist, n_buffer, n_gpu_optim, n_lean)": (
                options.n_persist, options.n_buffer, options.n_gpu_optim, options.n_lean),
            "chunk_bytes": (options.chunk_bytes, self.layout.chunk_bytes),
            "compute_dtype": str(options.compute_dtype),
            "model (parameter names, shapes, dtypes)": distributed.fingerprint(named),
            "grad_clipping, grad_pool": (options.grad_clipping, options.grad_pool),
        }, "protrain_fx.offload(...)")
        if not auto and self.group is None:  # data-parallel: every chunk on the device is a use of its own
            check_hand_counts(self.layout, options.n_persist)
        if self.group is not None and options.available_host_bytes is None:
            self.options = options = options.replace(available_host_bytes=shard.node_share(self.group))
        self.optimizer = optimizer
        self._named = named
        #: Parameters frozen at offload: the store keeps no optimizer state for them.
        self._frozen = frozenset(name for name, p in named.items() if not p.requires_grad)
        expandable_segments(self.device)  # before the chunks' buffers are allocated
        self._init_placement()
        self._init_step_state(options.grad_clipping)
        if auto:
            self._defer()
        else:  # (refused counts raise before anything moves)
            self._build(options.n_persist, options.n_buffer, options.n_gpu_optim or 0)
        # Only once the chunks are placed (or deferred) do the model and the optimizer get their hooks:
        # a refused offload(...) leaves both as they were.
        self._attach(model, optimizer)
        # An offloaded parameter holds no bytes outside the compiled graphs: a plain call is refused
        # with the way out, before the first op reads one. A module that a frame Dynamo gave up on runs
        # eagerly inside the compiled call gets device copies of its parameters for the call, or is
        # refused naming the break where the store cannot serve them (runtime/offload/eager.py).
        self.eager = EagerModules(self, explain_breaks)
        self._eager_guards = [model.register_forward_pre_hook(refuse_eager_call)]
        for name, module in model.named_modules(remove_duplicate=True):
            if name and module._parameters:
                before, after = self.eager.hooks(name)
                self._eager_guards += [module.register_forward_pre_hook(before),
                                       module.register_forward_hook(after, always_call=True)]
        # and a cast, move or deep copy of the parameters, which would read the shells' missing bytes
        # (kept after close(): the parameters stay shells)
        for name, module in model.named_modules():
            if module._parameters or not name:
                guard_shells(module, name)

    def _init_placement(self) -> None:
        """The counts and runtime parts, all empty until :meth:`_build` places the chunks."""
        self.n_persist: int | None = None
        self.n_buffer: int | None = None
        self.n_gpu_optim: int = 0
        self.store: ChunkStore | None = None
        self.adam: ChunkAdamW | None = None
        self.worker: OptimizerWorker | None = None
        self.device_adam: DeviceAdamW | None = None
        self.pool: ChunkBufferPool | None = None
        self.grad_sync: GradAverager | None = None
        #: Data-parallel on CUDA: the stream gradients are reduce-scattered on, and its last reduction.
        self._reduce_stream: torch.cuda.Stream | None = None
        self._reduced: torch.cuda.Event | None = None
        self.id: int | None = None
        self._sources: dict[str, torch.Tensor] | None = None  # automatic counts: the values to build from
        #: Automatic counts: an optimizer state loaded before the chunks are placed, applied at each
        #: placement (the store holds the offloaded chunks' moments) until the counts are final.
        self._optimizer_state_aside: Mapping[str, Any] | None = None
        #: The backend chose the counts (``offload`` without them): later graphs get activation plans.
        self.counts_chosen = False
        self._built = False
        self._filled = False  # the placement's store holds its values (configure's fill)

    def _init_step_state(self, grad_clipping: bool | None) -> None:
        """What one optimizer step tracks: chunks landed, queued and stepped, and clipping."""
        self._accumulating = False
        self._submitted: set[int] = set()
        self._pending: set[int] = set()  # chunks holding gradients not yet queued for a step
        #: Per chunk, the parameter names whose gradients landed since the last optimizer step.
        self._landed: dict[int, set[str]] = {}
        #: Whether the loop clips gradients (``grad_clipping``; ``None``: not known until the first
        #: optimizer step, whose chunk steps are held until then: see :meth:`clip_grad_norm_`).
        self.grad_clipping: bool | None = grad_clipping
        self._said_lean = False  # the warning that a clipping loop must say so was given
        self._norms = HeldNorms()
        self._clipped = False  # clip_grad_norm_ ran in this step
        #: The clip's scale of the held gradients, applied when optimizer.step() steps them.
        self._held_scale: torch.Tensor | None = None
        self._stepped = False  # a chunk step was queued or issued since the last optimizer.step()
        self._released_early = False  # the first step's held chunks were stepped before its end
        #: A chunk's gradients landed in parts (a graph break between its parameters): every chunk's
        #: step waits for optimizer.step() (``Landing``).
        self._split_chunks = False
        self._init_holding()  # (``Landing``)
        #: Optimizer steps whose offloaded chunk steps were skipped (a non-finite gradient norm).
        self.skipped_steps = 0
        self._landed_lean: list[int] = []  # lean chunks queued for a CPU step, oldest first
        #: Seconds the landing thread waited for a lean chunk's landing buffer.
        self.landing_wait_s = 0.0

    def _attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The model's buffers to the device, the optimizer's step hooks, and the process-wide
        ``clip_grad_norm_`` dispatch and shell printing (installed once)."""
        for b in model.buffers():
            b.data = b.data.to(self.device)
        self._hooks = (optimizer.register_step_pre_hook(lambda *_: self._before_step()),
                       optimizer.register_step_post_hook(lambda *_: self._after_step()),
                       # the loop's own state_dict / load_state_dict calls read and write the chunks
                       *install_state_hooks(self, model, optimizer))
        zero_grad = optimizer.zero_grad  # torch has no zero_grad hook: the instance's method wraps it

        def zero_grad_of_offloaded(*args: Any, **kwargs: Any) -> None:
            self._on_zero_grad()
            zero_grad(*args, **kwargs)

        optimizer.zero_grad = zero_grad_of_offloaded
        self._zero_grad = zero_grad_of_offloaded
        install_clip_dispatch()
        install_shell_repr()

    # ---- automatic counts: chosen by the backend when it compiles the first training graph ---------

    @property
    def automatic(self) -> bool:
        """The counts are the backend's to choose (``offload`` without ``n_persist`` / ``n_buffer``)."""
        return self._sources is not None

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype (the fp32 master's and the persistent chunks')."""
        return next(iter(self._named.values())).dtype

    @property
    def chunk_params(self) -> int:
        """Parameters one chunk holds (its bytes in the parameters' dtype)."""
        return self.layout.chunk_bytes // torch.empty(0, dtype=self.param_dtype).element_size()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the chunk buffers the graphs read (``compute_dtype``, else the parameters')."""
        return self.options.compute_dtype or self.param_dtype

    @property
    def configured(self) -> bool:
        """The chunks are placed: given by hand, or chosen by the backend."""
        return self._built

    def _defer(self) -> None:
        """Every parameter becomes a device tensor without bytes (what Dynamo traces); its values are
        kept aside (moved to host memory, or still on ``meta`` to be initialised) until :meth:`configure`."""
        sources: dict[int, torch.Tensor] = {}
        for p in self._named.values():
            if id(p) in sources:
                continue
            value = torch.empty_like(p, device="meta") if p.is_meta else p.data.to("cpu")
            sources[id(p)] = value.requires_grad_(p.requires_grad)  # the store tells frozen ones by it
            set_data(p, empty_shell(p, self.device))
        self._sources = {name: sources[id(p)] for name, p in self._named.items()}
        chunk_ops.register_deferred(self, list(dict.fromkeys(self._named.values())))

    def configure(self, n_persist: int, n_buffer: int, n_gpu_optim: int = 0, *, fill: bool = True) -> None:
        """Place the chunks with these counts (the backend calls this, before any step of the model
        runs; again to place them otherwise, until :meth:`finalize`). ``fill=False``: the host store
        is laid out and checked but holds no values until :meth:`finalize` (the planner's trial
        placements: rewriting and analysing a step needs the placement's sizes, not its bytes,
        and allocating and initialising the store took most of a 7B model's planning)."""
        if self._sources is None:
            raise RuntimeError("offload: the counts were given to offload(...); they cannot be chosen again")
        if self._built:
            self._teardown()
        chunk_ops.unregister_deferred(self)
        self._build(n_persist, n_buffer, n_gpu_optim, fill)

    def unplace(self) -> None:
        """Back to no placement (a compile that chose the counts failed): the next compile chooses again."""
        if self._sources is None:
            return
        if self._built:
            self._teardown()
        chunk_ops.register_deferred(self, list(dict.fromkeys(self._named.values())))

    def finalize(self) -> None:
        """The counts are final: the store gets its values (:meth:`configure`'s ``fill``), and the
        values kept to place the chunks again are forgotten. The store fills on a thread of its own,
        beside the compile that follows (``ChunkStore.fill``); the first step waits for it."""
        if self._built and self._sources is not None:
            self._fill(background=True)
            self._sources = None
            self._optimizer_state_aside = None
            self.counts_chosen = True

    def _teardown(self) -> None:
        """Undo :meth:`_build` (before any step ran): free the store, persistent parameters back to shells."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # a fill of a placement given up: its error no longer matters
                self.store.wait_filled()
        if self.worker is not None:
            self.worker.close()
        if self.id is not None:
            chunk_ops.unregister(self.id)
        for name in self._persistent_names:
            p = self._named[name]
            if p.untyped_storage().nbytes():
                set_data(p, empty_shell(p, self.device))
        if self.grad_sync is not None:
            self.grad_sync.close()
        self.store = self.adam = self.worker = self.device_adam = self.pool = self.grad_sync = None
        self.id = None
        self._built = self._filled = False
        gc.collect()  # the store's pinned buffers go back before the next one is allocated
        if self.device.type == "cuda":
            # The placement's blocks (freed above) go back to the device: the next placement (the
            # backend trying other counts) has other sizes and would take new segments beside the
            # cached ones, and the reserved memory would add both up above the budget.
            torch.cuda.empty_cache()

    def _build(self, n_persist: int, n_buffer: int, n_gpu_optim: int, fill: bool = True) -> None:
        assert fill or self._sources is not None, "an unfilled store is filled from the values kept aside"
        named, sources = self._named, self._sources
        source = (lambda name: sources[name]) if sources is not None else (lambda name: named[name])
        n_chunks = len(self.layout.chunks)
        if not 0 <= n_persist <= n_chunks:
            raise ValueError(f"offload: n_persist must be in [0, {n_chunks}] ({n_chunks} chunks), got {n_persist}")
        offloaded = self.layout.chunks[n_persist:]
        if offloaded and n_buffer < 1:
            raise ValueError(f"offload: {len(offloaded)} chunks live on the host and need n_buffer >= 1, got {n_buffer}")
        if not 0 <= n_gpu_optim <= len(offloaded):
            raise ValueError(
                f"offload: n_gpu_optim must be in [0, {len(offloaded)}] (the offloaded chunks), got {n_gpu_optim}"
            )
        host_layout = ChunkLayout(
            self.layout.chunk_bytes, tuple(Chunk(i, c.slots) for i, c in enumerate(offloaded))
        )
        host_names = {n for c in offloaded for s in c.slots for n in s.param.names}
        options = self.options
        n_lean = options.n_lean
        n_spill = options.n_spill
        if self._sources is not None:  # counts chosen by the backend: as tier_counts() told the cost model
            n_lean, n_spill = self.tier_counts()[n_persist]
        self.store = shard.store_on_every_rank(self.group, lambda: ChunkStore(
            host_layout,
            {n: source(n) for n in named if n in host_names},
            compute_dtype=options.compute_dtype,
            pin_memory=self.device.type == "cuda",
            available_bytes=options.available_host_bytes,
            init=options.init,
            n_lean=n_lean,
            grad_pool=self._landing_pool(),
            n_spill=n_spill,
            spill_dir=options.spill_dir,
            shard=(self.group.rank, self.group.world_size) if self.group is not None else None,
            fill=fill,  # (counts by hand: filled from the parameters before they become shells below)
        )) if offloaded else None
        n_gpu_optim = self._steppable_on_device(n_gpu_optim, by_hand=self._sources is None)
        if not self._said_lean and (warning := lean_chunks_clip_warning(self.store, self.grad_clipping)):
            log.warning(warning)
            self._said_lean = True  # (once: a re-placed store would say it again for nothing)
        self.n_persist, self.n_buffer, self.n_gpu_optim = n_persist, n_buffer, n_gpu_optim
        self.adam = ChunkAdamW(self.store, self.optimizer, named) if self.store else None
        self.worker = OptimizerWorker(self.adam.step_chunk, self.adam.hyper) if self.adam else None
        if self.worker is not None:  # accumulated gradients are added there, in order with the steps
            self.store.adds.run = self.worker.run
        self.device_adam = DeviceAdamW(self.adam, self.device) if self.adam and n_gpu_optim else None
        self.pool = (
            ChunkBufferPool(self.store, n_buffer, self.device, wait_host=self.worker.wait) if self.store else None
        )
        # Model state: persistent parameters to the device, host chunks to empty shells.
        shells: dict[int, tuple[torch.Tensor, int, int, str]] = {}
        self._persistent_names = [n for n in named if n not in host_names]
        placed: set[int] = set()  # tied parameters: placed at their first name
        for name, p in named.items():
            if id(p) in placed:
                continue
            placed.add(id(p))
            src = source(name)
            if name in host_names:
                slot = self.store.full_slot(name)
                shells[id(p)] = (p, slot.chunk, slot.offset, slot.name)
                if not is_shell(p, self.device):
                    set_data(p, empty_shell(p, self.device))
            elif src.is_meta:  # a persistent parameter of a meta model: materialised on the device
                value = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                with torch.no_grad():
                    options.init(name, value)
                set_data(p, value)
            elif src is not p or p.device != self.device:
                set_data(p, src.detach().to(self.device))
        self.id = chunk_ops.register(self, list(shells.values()))
        #: The parameter behind each offloaded slot the graphs land gradients for.
        self._param_of_slot = {name: p for p, _, _, name in shells.values()}
        if self.group is not None:  # replicated parameters: their gradients averaged in backward
            self.grad_sync = GradAverager([named[n] for n in self._persistent_names], self.group.world_size,
                                          lambda: self._accumulating)
        self._built = True
        if fill:
            self._fill()

    def _fill(self, background: bool = False) -> None:
        """The store's values, and an optimizer state loaded before the placement (once a placement)."""
        if self._filled:
            return
        if self.store is not None:
            self.store.fill(background=background)
        self._filled = True
        if self._optimizer_state_aside is not None:
            self._load_optimizer_state(self._optimizer_state_aside)

    # ---- what the rewritten graphs call ------------------------------------------------------

    def gather(self, chunk: int) -> torch.Tensor:
        return self.pool.acquire(chunk)

    def prefetch(self, chunk: int) -> None:
        self.pool.try_prefetch(chunk)

    def release(self, chunk: int) -> None:
        self.pool.release(chunk)

    def _steppable_on_device(self, n_gpu_optim: int, *, by_hand: bool) -> int:
        """``n_gpu_optim``, at most the chunks before the spilled ones (whose optimizer state is on
        disk, stepped on the CPU as it is read back): refused when given by hand, else lowered."""
        store = self.store
        most = min(store.spilled) if store is not None and store.spilled else n_gpu_optim
        if n_gpu_optim <= most:
            return n_gpu_optim
        if by_hand:
            raise ValueError(
                f"offload: n_gpu_optim={n_gpu_optim} would step chunks whose optimizer state is spilled to disk "
                f"(chunks {min(store.spilled)}.. of the offloaded ones, n_spill={len(store.spilled)}); give at most "
                f"{most}")
        log.info("protrain_fx: n_gpu_optim lowered from %d to %d: the chunks after those are spilled to disk",
                 n_gpu_optim, most)
        return most

    @property
    def n_spill(self) -> int:
        """Offloaded chunks whose fp32 master and Adam moments live in the spill file (``runtime/store/spill.py``)."""
        return len(self.store.spilled) if self.store else 0

    def set_gpu_optim(self, n_gpu_optim: int) -> None:
        """Step the first ``n_gpu_optim`` offloaded chunks on the device from the next gradient that
        lands, the others on the CPU (the backend re-plans this from the rates training reached:
        ``planner.rates.replan_gpu_optim``). Nothing moves: both paths read and write the
        optimizer state in the host store, with the same step counts. The steps still queued or
        streaming are waited for first, so no chunk is stepped by both. With 0, the device steps'
        staging goes back to the device's allocator."""
        if not self._built:
            raise RuntimeError("offload: set_gpu_optim before the chunks are placed")
        offloaded = self.store.num_chunks if self.store is not None else 0
        if not 0 <= n_gpu_optim <= offloaded:
            raise ValueError(f"offload: n_gpu_optim must be in [0, {offloaded}] (the offloaded chunks), got {n_gpu_optim}")
        n_gpu_optim = self._steppable_on_device(n_gpu_optim, by_hand=False)
        if n_gpu_optim == self.n_gpu_optim:
            return
        self.synchronize()  # the CPU steps queued, and every device step's copies back
        if n_gpu_optim and self.device_adam is None:
            self.device_adam = DeviceAdamW(self.adam, self.device)
        elif not n_gpu_optim and self.device_adam is not None:
            self.device_adam = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.n_gpu_optim = n_gpu_optim

    # ---- user API ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside add their gradients without stepping (micro-batches of one step)."""
        previous, self._accumulating = self._accumulating, True
        if self.store is not None:  # each micro-batch adds every offloaded chunk's gradient on the host
            self.store.adds.accumulating(len(self.layout.chunks) - self.n_persist, self.options.available_host_bytes,
                                         self.store.host_bytes)
        try:
            yield
        finally:
            self._accumulating = previous

    def synchronize(self) -> None:
        """Wait for every queued optimizer step and gradient add of an offloaded chunk (raises a
        failure of the worker)."""
        if self.worker is not None:
            self.worker.wait_all()
        if self.store is not None:
            self.store.adds.wait_all()
            self.store.wait_writes()

    def _before_step(self) -> None:
        """``optimizer.step()`` is about to run: the chunks still holding gradients are stepped now
        (accumulated micro-batches; a clipped step; the first step, held to learn whether the loop
        clips, which it does not when it steps without clipping first), each side in the next
        forward's order: the CPU worker's chunks queued first, then the first ``n_gpu_optim``
        streamed through the device (``DeviceAdamW.step_held``), which this thread issues slice by
        slice once each chunk's gradient has landed on the host; queued before, the CPU steps run
        meanwhile instead of after. A clipped step is bound by the link's copies, not by this issuing
        (``docs/results.md#the-users-42b-loop-loss-and-clipping``)."""
        self._check_unfrozen()
        self.check_hyper()
        if self._pending and self.grad_clipping is None and not self._clipped:
            self.grad_clipping = False
        chunks = sorted(self._pending)  # clipped: each stepped with the clip's scale
        on_device = [c for c in chunks if c < self.n_gpu_optim and self.device_adam is not None
                     and self.device_adam.can_step_held(c)]
        for chunk in chunks:
            if chunk not in on_device:
                self._submit(chunk, **({} if self._held_scale is None else {"grad_scale": self._held_scale}))
        for chunk in on_device:
            self._pending.discard(chunk)
            self._submitted.add(chunk)
            self._stepped = True
            self.device_adam.step_held(chunk, self._held_scale)

    def drop_held_grads(self) -> None:
        """Forget the gradients the offloaded chunks hold without stepping them (a skipped step)."""
        for chunk in sorted(self._pending):
            with self.store.state_held(chunk, write=False):
                self.store.finish_step(chunk)  # the working copy back from the master, the gradient gone
        self._pending.clear()

    def _on_zero_grad(self) -> None:
        """``optimizer.zero_grad()``. After ``optimizer.step()`` nothing is held. Between a backward
        and its step the loop skips the step (a loss spike, a bad batch): the held gradients are
        dropped as ``zero_grad`` drops ``.grad``. Chunks already stepped as their gradients landed
        cannot be un-stepped: refused, naming the setting that holds them."""
        if self._stepped:
            raise UnsupportedError(
                "protrain_fx: optimizer.zero_grad() after a backward whose optimizer.step() was skipped: the "
                "offloaded chunks were already stepped as their gradients landed (their steps overlap "
                "backward), so the step cannot be skipped. A loop that may skip optimizer.step() after a "
                "backward holds the chunk steps until optimizer.step(): pass grad_clipping=True to "
                "protrain_fx.offload(...) (for loops that do not clip too)"
            )
        if self._pending or self._landed:
            self.drop_held_grads()
            self._after_step()

    def _check_unfrozen(self) -> None:
        """Refuse a step after a parameter frozen at ``offload`` was set to require a gradient: the
        store keeps no optimizer state for it, and graphs compiled while it was frozen compute no
        gradient for it (Dynamo does not recompile when a parameter's ``requires_grad`` changes),
        so it would silently stay as it is."""
        woken = [name for name in self._frozen if self._named[name].requires_grad]
        if woken:
            raise UnsupportedError(
                f"protrain_fx: {len(woken)} parameter(s) frozen when the model was offloaded now require a "
                f"gradient ({', '.join(sorted(woken)[:3])}{', ...' if len(woken) > 3 else ''}); offloaded chunks "
                "keep optimizer state only for the parameters trainable at protrain_fx.offload(...). Set "
                "requires_grad before offload: save handle.state_dict(model), build and offload the model again "
                "with these parameters trainable, and load it"
            )

    @property
    def placed(self) -> bool:
        """The chunks are placed for good and the store holds their values (counts given by hand, or
        chosen by the backend and final)."""
        return self.store is not None and self._sources is None

    def _after_step(self) -> None:
        self.eager.after_step()
        if self.store is not None:  # forget lean chunks whose steps are over (else it grows every step)
            self._landed_lean = [c for c in self._landed_lean if self.store.holds_grad(c)]
        self._submitted.clear()
        self._landed.clear()
        self._next_step_landing()
        self._norms.clear()
        self._clipped = False
        self._held_scale = None
        self._stepped = False
        self._released_early = False

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every chunk of this model, offloaded ones included
        (:func:`protrain_fx.runtime.optim.clipping.clip_grad_norm`, where the holding of chunk steps is told)."""
        return clip_grad_norm(self, parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    def host_bytes_per_param(self) -> float:
        """Host bytes per offloaded parameter (chunk buffers; see ``ChunkStore.bytes_per_param``)."""
        return self.store.bytes_per_param() if self.store else 0.0

    @property
    def n_lean(self) -> int:
        """Offloaded chunks without a host working copy (fetched from their fp32 master)."""
        return len(self.store.lean) if self.store else 0

    def tier_counts(self) -> tuple[tuple[int, int], ...]:
        """Per ``n_persist`` in ``0..`` the layout's chunks, ``(n_lean, n_spill)`` the store would make
        (its rule, ``runtime/store/host_memory.auto_tiers``, for the host memory available now;
        ``n_lean=K``: ``K``, or every offloaded chunk when fewer are offloaded). For the cost model
        (:meth:`facts`), before anything is placed, and for each placement the backend makes."""
        chunks, options = self.layout.chunks, self.options
        n_lean, n_spill = options.n_lean, options.n_spill
        if n_lean != "auto" and n_spill != "auto":
            return tuple((min(n_lean, len(chunks) - p), min(n_spill, max(0, len(chunks) - p - n_lean)))
                         for p in range(len(chunks) + 1))
        available = options.available_host_bytes
        if available is None:
            available = available_host_bytes()
        numel, trainable, compute = self._store_shape()
        counts = []
        for p in range(len(chunks) + 1):
            offloaded = len(chunks) - p
            lean = n_lean if n_lean == "auto" else min(n_lean, offloaded)
            spill = 0 if self.group is not None else n_spill if n_spill == "auto" \
                else min(n_spill, offloaded - (0 if lean == "auto" else lean))
            counts.append(auto_tiers(numel, trainable[p:], compute, available, self._landing_pool(), lean, spill))
        return tuple(counts)

    def facts(self) -> ChunkFacts:
        """What the planner prices this offload by, as data (``handoffs.ChunkFacts``), read now: the
        store's tiers at every ``n_persist`` for the host memory available now (:meth:`tier_counts`),
        and the counts placed once the backend chose them."""
        _, trainable, _ = self._store_shape()
        g = self.group
        return ChunkFacts(
            layout=self.layout, param_dtype=self.param_dtype, compute_dtype=self.compute_dtype, device=self.device,
            grad_clipping=self.grad_clipping, tiers=self.tier_counts(), trainable=tuple(trainable),
            landing_pool=self._landing_pool(), spill_dir=spill_dir(self.options.spill_dir),
            ranks=(g.world_size, g.local_world_size, g.backend) if g is not None else None,
            placed=Placement(self.n_persist, self.n_buffer, self.n_gpu_optim) if self.counts_chosen else None)

    def _landing_pool(self) -> int:
        """Landing buffers the store plans for its lean chunks' gradients: ``grad_pool``, or one per
        chunk when the loop clips (``grad_clipping=True``): each lean chunk's gradient then waits in a
        buffer of its own until the norm is known, so the tiers are chosen with those buffers counted
        (a lean chunk then saves no host memory, and spilling does the saving)."""
        pool = self.options.grad_pool
        return max(pool, len(self.layout.chunks)) if self.grad_clipping is True else pool

    def _store_shape(self) -> tuple[int, list[bool], int]:
        """Elements of a chunk, which chunks train, and the compute dtype's bytes: what the store's
        arithmetic needs (``runtime/store/host_memory.py``)."""
        numel = self.layout.chunk_bytes // self.param_dtype.itemsize
        trainable = [any(self._named[s.param.names[0]].requires_grad for s in c.slots) for c in self.layout.chunks]
        return numel, trainable, self.compute_dtype.itemsize

    def close(self) -> None:
        self.synchronize()
        if self.worker is not None:
            self.worker.close()
        for hook in (*self._hooks, *self._eager_guards):
            hook.remove()
        if vars(self.optimizer).get("zero_grad") is self._zero_grad:
            del self.optimizer.zero_grad
        if self.id is not None:
            chunk_ops.unregister(self.id)
        if self.grad_sync is not None:
            self.grad_sync.close()
        chunk_ops.unregister_deferred(self)
        if self.store is not None and self.store.residency is not None:
            self.store.residency.close()  # the spill file's last writes, then the file goes


def own_forward_code(model: nn.Module) -> None:
    """Bind to ``model`` a copy of its ``forward`` with a code object of its own. Dynamo keys compiled
    code by code object and tells the instances of a class apart only by guards, which cannot see
    which chunk store holds a parameter: every offloaded instance gets its own compiled graphs this
    way (they name their handle's chunks), and so does every block of one model that Dynamo compiles
    as a frame of its own (after a graph break inside the blocks; the blocks' parameters sit in other
    chunks, persistent or not). A ``forward`` that is not a method is left as it is (a graph of other
    parameters' chunks then refuses to run: ``chunk_ops.check_shell``)."""
    bound = model.forward
    if not isinstance(bound, types.MethodType) or not isinstance(bound.__func__, types.FunctionType):
        return
    f = bound.__func__
    code = f.__code__.replace(co_firstlineno=f.__code__.co_firstlineno)  # equal, but another object
    twin = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    twin.__kwdefaults__ = dict(f.__kwdefaults__) if f.__kwdefaults__ else None
    functools.update_wrapper(twin, f)  # name, docstring, signature (__wrapped__) as the original's
    model.forward = types.MethodType(twin, model)


def _layout(named: Mapping[str, torch.Tensor], chunk_bytes: int | None,
            group: distributed.Group | None = None) -> ChunkLayout:
    """Chunks in registration order (the order a transformer uses its parameters), blocks together;
    data-parallel, each chunk's size padded to a whole number of equal shards, one per rank
    (:data:`SHARD_ALIGN` elements each at least)."""
    rows = []
    for i, (name, p) in enumerate(named.items()):
        m = _BLOCK.match(name)
        rows.append((name, id(p), p.numel() * p.element_size(), m.group(1) if m else OUTSIDE, i))
    infos: list[ParamInfo] = dedupe_tied(rows)
    layout = pack(infos, chunk_bytes) if chunk_bytes else choose_layout(infos)
    if group is None:
        return layout
    unit = group.world_size * SHARD_ALIGN * next(iter(named.values())).element_size()
    return dataclasses.replace(layout, chunk_bytes=-(-layout.chunk_bytes // unit) * unit)


#: A shard of a chunk (data-parallel) is a multiple of this many elements: the CPU optimizer's
#: slices of a parameter (``cpu_adam.SLICE_ALIGN``) then start on its grid wherever a shard
#: boundary cuts a parameter placed on that grid.
SHARD_ALIGN = 64
