"""Train a model whose parameters do not all fit on the GPU: parameters in chunks, most of them in
host memory, streamed in by the compiled graphs and updated on the CPU during backward.

    model = GPT(config)                                   # built on the CPU (host memory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    handle = protrain_fx.offload(model, optimizer, n_persist=2, n_buffer=2, device="cuda")
    compiled = torch.compile(model, backend="protrain")
    for x, y in batches:
        compiled(x, y).backward()
        optimizer.step()          # persistent chunks: the GPU AdamW; the others were stepped on the
        optimizer.zero_grad()     # CPU as their gradients arrived in backward
        scheduler.step()          # lr schedulers keep working

The parameters are packed into equal-size chunks (``protrain_fx.chunks``). The first ``n_persist``
chunks move to the device as ordinary parameters, stepped by ``optimizer`` there. The others live in
a host chunk store (fp32 master, compute-dtype copy unless the chunk is lean, Adam states;
``runtime/chunk_store.py``); the
model keeps them as device tensors *without memory* (storage of 0 bytes: shapes for tracing only),
and the backend rewrites every captured graph to read them from ``n_buffer`` device chunk buffers
(``passes/gather.py``). Their gradients go to the store, and a worker thread steps them with the
optimizer's hyper-parameters (``runtime/cpu_adam.py``) while backward goes on; the next forward waits
only for the chunks it needs, in order. A chunk's step takes its group's hyper-parameters as its
gradient lands (a step that runs into the next forward keeps them, whatever a scheduler set since),
so a learning rate set between backward and ``optimizer.step()`` reaches only the persistent chunks.

Use ``handle.accumulate()`` around the backward passes of all but the last micro-batch of a step,
``handle.state_dict()`` / ``handle.optimizer_state_dict()`` for checkpoints (ordinary full tensors),
``handle.load_state_dict(...)`` to resume.

Gradient clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` between
``backward()`` and ``optimizer.step()`` clips over every chunk, exactly as on a plain model
(:meth:`OffloadHandle.clip_grad_norm_`). The chunks' steps then wait for the end of backward, where
the norm is known, instead of overlapping it; the first step waits anyway, to learn whether the
loop clips (``offload(..., grad_clipping=...)`` says it up front). A non-finite norm skips the
step everywhere.

After ``offload`` the model runs only through ``torch.compile(model, backend="protrain")``: its
offloaded parameters hold no bytes, so a plain call is refused with the way out.

Not supported yet (clear errors): optimizers other than Adam/AdamW; a chunk whose parameters are
used by several captured graphs of one step (a graph break inside a block) when its steps do not
wait (``grad_clipping=False``); ``compute_dtype=torch.float16``, which needs ``GradScaler``'s loss
scaling, whose unscaling never reaches the chunks' gradients (fp16 autocast with a ``GradScaler``
cannot be seen here and is wrong the same way: train in bf16).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from protrain_fx.chunks import OUTSIDE, Chunk, ChunkLayout, ParamInfo, choose_layout, dedupe_tied, pack
from protrain_fx.runtime import chunk_ops
from protrain_fx.runtime.buffer_pool import ChunkBufferPool
from protrain_fx.runtime.chunk_store import GRAD_POOL, ChunkStore, auto_lean, available_host_bytes
from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.cpu_adam import ChunkAdamW, OptimizerWorker, _check_optimizer
from protrain_fx.runtime.device_adam import DeviceAdamW

log = logging.getLogger("protrain_fx")

_BLOCK = re.compile(r"^(.*?\.\d+)\.")
#: ``offload(..., n_persist=AUTO, n_buffer=AUTO)``: the backend chooses the counts.
AUTO = "auto"


class OffloadHandle:
    """The state behind one offloaded model (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        n_persist: int | Literal["auto"] = AUTO,
        n_buffer: int | Literal["auto"] = AUTO,
        device: torch.device | str,
        chunk_bytes: int | None = None,
        compute_dtype: torch.dtype | None = None,
        available_host_bytes: int | None = None,
        init: Callable[[str, torch.Tensor], None] | Literal["model"] | None = None,
        n_gpu_optim: int | Literal["auto"] | None = None,
        n_lean: int | Literal["auto"] = "auto",
        grad_pool: int = GRAD_POOL,
        grad_clipping: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("offload: device='cuda' but this machine has no CUDA device (use device='cpu' to try it)")
        if init == "model":  # the model's own initialisation; its meta buffers recomputed on the device
            from protrain_fx.integrations import model_init

            init = model_init(model, self.device)
        named = dict(model.named_parameters(remove_duplicate=False))
        if not named:
            raise ValueError("offload: the model has no parameters")
        _check_not_offloaded(named)
        _check_optimizer(optimizer)  # the backend may offload any chunk: they are stepped by ChunkAdamW
        if compute_dtype == torch.float16:
            raise ValueError(
                "offload: compute_dtype=torch.float16 needs loss scaling (GradScaler), whose unscaling does not reach "
                "the offloaded chunks' gradients (they are stepped from the chunk store, not from .grad); use "
                "compute_dtype=torch.bfloat16"
            )
        if grad_clipping not in (None, True, False):
            raise ValueError(f"offload: grad_clipping must be None (learned at the first step), True or False, "
                             f"got {grad_clipping!r}")
        on_meta = [n for n, p in named.items() if p.is_meta]
        if on_meta and init is None:
            raise ValueError(
                f"offload: {len(on_meta)} parameters (e.g. {on_meta[0]!r}) are on the meta device; give "
                "init=fn, fn(name, tensor) filling tensor in place, to materialise them straight into chunks"
            )
        meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ValueError(
                f"offload: buffer {meta_buffers[0]!r} is on the meta device; materialise buffers before "
                "offload (only parameters are materialised into chunks)"
            )
        auto = [c == AUTO for c in (n_persist, n_buffer)]
        if any(auto) and not all(auto):
            raise ValueError(
                f"offload: n_persist and n_buffer are chosen together: give both, or neither (\"auto\": chosen "
                f"by the backend for its memory_budget); got n_persist={n_persist!r}, n_buffer={n_buffer!r}"
            )
        if all(auto) and n_gpu_optim not in (None, AUTO):
            raise ValueError(
                f"offload: n_gpu_optim={n_gpu_optim!r} with automatic n_persist and n_buffer; the backend "
                "chooses it with them (leave it out), or give all three"
            )
        if not all(auto) and n_gpu_optim == AUTO:
            raise ValueError("offload: n_gpu_optim='auto' needs n_persist and n_buffer 'auto' too")
        self.layout = _layout(named, chunk_bytes)
        self.optimizer = optimizer
        self._named = named
        self._settings = {
            "compute_dtype": compute_dtype,
            "available_host_bytes": available_host_bytes,
            "init": init,
            "n_lean": n_lean,
            "grad_pool": grad_pool,
        }
        self.n_persist: int | None = None
        self.n_buffer: int | None = None
        self.n_gpu_optim: int = 0
        self.store: ChunkStore | None = None
        self.adam: ChunkAdamW | None = None
        self.worker: OptimizerWorker | None = None
        self.device_adam: DeviceAdamW | None = None
        self.pool: ChunkBufferPool | None = None
        self.id: int | None = None
        self._sources: dict[str, torch.Tensor] | None = None  # automatic counts: the values to build from
        #: The backend chose the counts (``offload`` without them): later graphs get activation plans.
        self.counts_chosen = False
        self._built = False
        self._accumulating = False
        self._submitted: set[int] = set()
        self._pending: set[int] = set()  # chunks holding gradients not yet queued for a step
        #: Per chunk, the parameter names whose gradients landed since the last optimizer step.
        self._landed: dict[int, set[str]] = {}
        #: Whether the loop clips gradients (``grad_clipping``; ``None``: not known until the first
        #: optimizer step, whose chunk steps are held until then: see :meth:`clip_grad_norm_`).
        self.grad_clipping: bool | None = grad_clipping
        self._norms = _HeldNorms()
        self._clipped = False  # clip_grad_norm_ ran in this step
        self._released_early = False  # the first step's held chunks were stepped before its end
        #: Optimizer steps whose offloaded chunk steps were skipped (a non-finite gradient norm).
        self.skipped_steps = 0
        self._landed_lean: list[int] = []  # lean chunks queued for a CPU step, oldest first
        #: Seconds the landing thread waited for a lean chunk's landing buffer.
        self.landing_wait_s = 0.0
        for b in model.buffers():
            b.data = b.data.to(self.device)
        self._hooks = (optimizer.register_step_pre_hook(lambda *_: self._before_step()),
                       optimizer.register_step_post_hook(lambda *_: self._after_step()))
        _install_clip_dispatch()
        _install_shell_repr()
        if all(auto):
            self._defer()
        else:
            n_chunks = len(self.layout.chunks)
            if n_persist == n_chunks:
                raise ValueError(
                    f"offload: n_persist={n_persist} keeps all {n_chunks} chunk(s) of this model on the device "
                    f"({sum(c.used_bytes for c in self.layout.chunks) / 2**20:.1f} MiB of parameters in chunks of "
                    f"{self.layout.chunk_bytes / 2**20:.1f} MiB): nothing would be offloaded. Leave n_persist / "
                    "n_buffer out (the backend chooses them for its memory budget), give a smaller chunk_bytes, or "
                    "train without protrain_fx.offload"
                )
            self._build(n_persist, n_buffer, n_gpu_optim or 0)
        # An offloaded parameter holds no bytes outside the compiled graphs: a plain call is refused
        # with the way out, before the first op reads one.
        self._eager_guard = model.register_forward_pre_hook(_refuse_eager_call)

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
        return self._settings["compute_dtype"] or self.param_dtype

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
            _set_data(p, _shell(p, self.device))
        self._sources = {name: sources[id(p)] for name, p in self._named.items()}
        chunk_ops.register_deferred(self, list(dict.fromkeys(self._named.values())))

    def configure(self, n_persist: int, n_buffer: int, n_gpu_optim: int = 0) -> None:
        """Place the chunks with these counts (the backend calls this, before any step of the model
        runs; again to place them otherwise, until :meth:`finalize`)."""
        if self._sources is None:
            raise RuntimeError("offload: the counts were given to offload(...); they cannot be chosen again")
        if self._built:
            self._teardown()
        chunk_ops.unregister_deferred(self)
        self._build(n_persist, n_buffer, n_gpu_optim)

    def unplace(self) -> None:
        """Back to no placement (a compile that chose the counts failed): the next compile chooses again."""
        if self._sources is None:
            return
        if self._built:
            self._teardown()
        chunk_ops.register_deferred(self, list(dict.fromkeys(self._named.values())))

    def finalize(self) -> None:
        """The counts are final: forget the values kept to place the chunks again."""
        if self._built and self._sources is not None:
            self._sources = None
            self.counts_chosen = True

    def _teardown(self) -> None:
        """Undo :meth:`_build` (before any step ran): free the store, persistent parameters back to shells."""
        if self.worker is not None:
            self.worker.close()
        if self.id is not None:
            chunk_ops.unregister(self.id)
        for name in self._persistent_names:
            p = self._named[name]
            if p.untyped_storage().nbytes():
                _set_data(p, _shell(p, self.device))
        self.store = self.adam = self.worker = self.device_adam = self.pool = None
        self.id = None
        self._built = False
        gc.collect()  # the store's pinned buffers go back before the next one is allocated
        if self.device.type == "cuda":
            # The placement's blocks (freed above) go back to the device: the next placement (the
            # backend trying other counts) has other sizes and would take new segments beside the
            # cached ones, and the reserved memory would add both up above the budget.
            torch.cuda.empty_cache()

    def _build(self, n_persist: int, n_buffer: int, n_gpu_optim: int) -> None:
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
        settings = self._settings
        n_lean = settings["n_lean"]
        if self._sources is not None and n_lean != "auto":  # counts chosen by the backend: at most all lean
            n_lean = min(n_lean, len(offloaded))  # as lean_counts() told the cost model
        self.store = ChunkStore(
            host_layout,
            {n: source(n) for n in named if n in host_names},
            compute_dtype=settings["compute_dtype"],
            pin_memory=self.device.type == "cuda",
            available_bytes=settings["available_host_bytes"],
            init=settings["init"],
            n_lean=n_lean,
            grad_pool=settings["grad_pool"],
        ) if offloaded else None
        self.n_persist, self.n_buffer, self.n_gpu_optim = n_persist, n_buffer, n_gpu_optim
        self.adam = ChunkAdamW(self.store, self.optimizer, named) if self.store else None
        self.worker = OptimizerWorker(self.adam.step_chunk, self.adam.hyper) if self.adam else None
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
                slot = self.store.slot(name)
                shells[id(p)] = (p, slot.chunk, slot.offset, slot.name)
                if not _is_shell(p, self.device):
                    _set_data(p, _shell(p, self.device))
            elif src.is_meta:  # a persistent parameter of a meta model: materialised on the device
                value = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                with torch.no_grad():
                    settings["init"](name, value)
                _set_data(p, value)
            elif src is not p or p.device != self.device:
                _set_data(p, src.detach().to(self.device))
        self.id = chunk_ops.register(self, list(shells.values()))
        self._built = True

    # ---- what the rewritten graphs call ------------------------------------------------------

    def gather(self, chunk: int) -> torch.Tensor:
        return self.pool.acquire(chunk)

    def prefetch(self, chunk: int) -> None:
        self.pool.try_prefetch(chunk)

    def release(self, chunk: int) -> None:
        self.pool.release(chunk)

    def land_grads(self, chunk: int, names: list[str], grads: list[torch.Tensor]) -> None:
        landed = self._landed.setdefault(chunk, set())
        if chunk in self._submitted:
            raise UnsupportedError(self._second_landing(chunk, landed, names))
        fresh = not self.store.holds_grad(chunk)
        if (self.grad_clipping is None and not self._accumulating and not self._released_early
                and self.store.is_lean(chunk) and fresh and self.store.landing_full()):
            self._release_early()  # learning: held lean gradients may not take host memory beyond the pool
        hold = self._accumulating or self.grad_clipping is True or (self.grad_clipping is None and not self._released_early)
        on_device = chunk < self.n_gpu_optim and not hold and fresh
        if on_device:
            self.device_adam.make_room()  # bounds the device steps in flight, so their gradients' memory
        if self.device.type == "cuda":
            grads = _staged(grads, self.store.compute_dtype)
        landed.update(names)
        if on_device:
            self.device_adam.step_chunk(chunk, dict(zip(names, grads)))  # its states stream through the GPU
            self._submitted.add(chunk)
            return
        if hold and self.grad_clipping is not False and not self._released_early:  # a clip may follow: its norms
            self._norms.note(self.store, chunk, names, grads, fresh=fresh)
        if self.store.is_lean(chunk) and fresh:
            self._wait_for_landing_buffer()
        self.store.write_grads(dict(zip(names, grads)), accumulate=True)
        if hold:
            self._pending.add(chunk)
        else:
            self._submit(chunk)

    def _release_early(self) -> None:
        """The first step, learning whether the loop clips, cannot hold every chunk's gradient: a lean
        chunk's would take a landing buffer beyond the pool (host memory the store was not sized
        for). The held chunks are stepped now and the rest of this step's as they land; a clip in
        this step is then refused (:meth:`_check_clip`)."""
        self._released_early = True
        for chunk in sorted(self._pending):
            self._submit(chunk)

    def _submit(self, chunk: int, **kwargs: Any) -> None:
        """Queue the chunk's CPU step (``kwargs`` to ``ChunkAdamW.step_chunk``)."""
        self._pending.discard(chunk)
        self._submitted.add(chunk)
        self.worker.submit(chunk, **kwargs)
        if self.store.is_lean(chunk):
            self._landed_lean.append(chunk)

    def _second_landing(self, chunk: int, landed: set[str], names: list[str]) -> str:
        """Why a chunk already stepped in this step got gradients again, and what to do."""
        if landed.intersection(names):
            return (
                f"protrain_fx: the parameters of offloaded chunk {chunk} got a second gradient before "
                "optimizer.step(), but their optimizer step already ran as the first one landed (a second "
                "backward per step: micro-batches). Wrap the backward passes of all but the last micro-batch "
                "in `with handle.accumulate():` (handle = protrain_fx.offload(...)'s return value)"
            )
        return (
            f"protrain_fx: offloaded chunk {chunk} got gradients from two graphs in one step (a graph break "
            "inside the parameters of one chunk, after its first part was stepped); remove the graph break "
            "(protrain_fx.step_report() names it), or pass grad_clipping=True to offload(...), which holds "
            "every chunk's step until the gradients are complete"
        )

    def _wait_for_landing_buffer(self) -> None:
        """While the lean chunks' landing pool is full, wait for the oldest queued CPU step to give
        its buffer back. With none queued (accumulated gradients hold the buffers until
        ``optimizer.step()``) the store makes one more, checking the host memory."""
        start = time.perf_counter()
        while self.store.landing_full() and self._landed_lean:
            self.worker.wait(self._landed_lean.pop(0))
        self.landing_wait_s += time.perf_counter() - start

    def set_gpu_optim(self, n_gpu_optim: int) -> None:
        """Step the first ``n_gpu_optim`` offloaded chunks on the device from the next gradient that
        lands, the others on the CPU (the backend re-plans this from the rates training reached:
        ``protrain_fx.calibrate.replan_gpu_optim``). Nothing moves: both paths read and write the
        optimizer state in the host store, with the same step counts. The steps still queued or
        streaming are waited for first, so no chunk is stepped by both. With 0, the device steps'
        staging goes back to the device's allocator."""
        if not self._built:
            raise RuntimeError("offload: set_gpu_optim before the chunks are placed")
        offloaded = self.store.num_chunks if self.store is not None else 0
        if not 0 <= n_gpu_optim <= offloaded:
            raise ValueError(f"offload: n_gpu_optim must be in [0, {offloaded}] (the offloaded chunks), got {n_gpu_optim}")
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
        try:
            yield
        finally:
            self._accumulating = previous

    def synchronize(self) -> None:
        """Wait for every queued optimizer step of an offloaded chunk (raises a failure of the worker)."""
        if self.worker is not None:
            self.worker.wait_all()
        if self.store is not None:
            self.store.wait_writes()

    def _before_step(self) -> None:
        """``optimizer.step()`` is about to run: the chunks still holding gradients are stepped now
        (accumulated micro-batches; the first step, held to learn whether the loop clips, which it
        does not when it steps without clipping first)."""
        if self._pending and self.grad_clipping is None and not self._clipped:
            self.grad_clipping = False
        for chunk in sorted(self._pending):
            self._submit(chunk)

    def _after_step(self) -> None:
        if self.store is not None:  # forget lean chunks whose steps are over (else it grows every step)
            self._landed_lean = [c for c in self._landed_lean if self.store.holds_grad(c)]
        self._submitted.clear()
        self._landed.clear()
        self._norms.clear()
        self._clipped = False
        self._released_early = False

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``parameters``, offloaded ones included: the norm
        of every gradient, the persistent ones' ``.grad`` scaled in place and the offloaded chunks'
        held steps queued with the same scale. ``torch.nn.utils.clip_grad_norm_`` comes here when
        given parameters of this model (``offload`` installs the dispatch), so the loop is unchanged.

        The offloaded chunks' steps run as their gradients land in backward, before a norm over all
        of them exists; so the handle holds them (``grad_clipping``): always with ``True``; with
        ``None`` (default) at the first step, and from then on when that step clipped. Held steps
        start here, overlapping the optimizer's step of the persistent chunks and the next forward.
        A non-finite norm skips the step everywhere (as ``GradScaler`` does): no offloaded chunk is
        stepped and the persistent gradients are set to ``None``, so ``optimizer.step()`` leaves
        those parameters too; ``error_if_nonfinite=True`` raises instead, as torch does."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        self._check_clip(params)
        norm_type = float(norm_type)
        norms: list[torch.Tensor] = []
        persistent: list[torch.Tensor] = []
        grads = [p.grad for p in params if chunk_ops.offloaded(p) is None and p.grad is not None]
        by_id = dict(zip(map(id, grads), _group_norms(grads, norm_type, foreach)))
        for p in params:
            if chunk_ops.offloaded(p) is not None:
                norm = self._norms.of(self.store, self.store.slot(chunk_ops.offloaded(p)[3]), norm_type)
                if norm is not None:
                    norms.append(norm)
            elif p.grad is not None:
                norms.append(by_id[id(p.grad)])
                persistent.append(p)
        if not norms:
            return torch.tensor(0.0)
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
        finite = bool(torch.isfinite(total))  # (a device sync: the skip below is decided on the host)
        if not finite and error_if_nonfinite:
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, set `error_if_nonfinite=False`"
            )
        self._clipped = True
        if self.grad_clipping is None:
            self.grad_clipping = True
        if not finite:
            self._skip_held_steps(persistent, total)
            return total
        torch.nn.utils.clip_grads_with_norm_(persistent, max_norm, total, foreach)  # as torch scales them
        scale = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0).to("cpu", torch.float32)
        for chunk in sorted(self._pending):
            self._submit(chunk, grad_scale=scale)
        return total

    def _check_clip(self, params: list[torch.Tensor]) -> None:
        """Refuse a clip this handle cannot make exact (see :meth:`clip_grad_norm_`)."""
        fix = ("pass grad_clipping=True to protrain_fx.offload(...), which holds the offloaded chunks' steps "
               "until the norm is known (a loop that clips from its first step needs nothing)")
        stepped = sorted(self._submitted)
        if stepped:
            if self._released_early:
                lean = self.store.num_chunks - min(self.store.lean, default=self.store.num_chunks)
                fix = (f"pass grad_clipping=True to protrain_fx.offload(...): every one of the {lean} lean chunks then "
                       f"holds its gradient in a landing buffer of {self.store.chunk_numel * self.store.compute_dtype.itemsize} "
                       "bytes of host memory until the norm is known")
                why = "at the first step, its lean chunks' gradients could not all wait in the landing pool"
            elif self.grad_clipping is False:
                why = "this model's loop did not clip at its first step, so its chunks are stepped as their gradients land"
            else:
                why = "clip_grad_norm_ already ran in this step"
            raise UnsupportedError(
                f"protrain_fx: clip_grad_norm_ on an offloaded model whose chunks {stepped} were already "
                f"stepped in this step, without clipping ({why}); {fix}"
            )
        given = {chunk_ops.offloaded(p)[3] for p in params if chunk_ops.offloaded(p) is not None}
        held = {n for names in self._landed.values() for n in names}
        missing = sorted(held - {n for name in given for n in self.store.slot(name).names})
        if missing:
            raise UnsupportedError(
                f"protrain_fx: clip_grad_norm_ over part of an offloaded model's parameters ({missing[0]!r} has a "
                "gradient but is not among them): the offloaded chunks are stepped together, with one "
                "scale; clip over every parameter (model.parameters())"
            )

    def _skip_held_steps(self, persistent: list[torch.Tensor], total: torch.Tensor) -> None:
        """A non-finite gradient norm: drop every held gradient, leave the persistent parameters
        without one (``optimizer.step()`` skips them), count and say so."""
        for chunk in sorted(self._pending):
            self.store.finish_step(chunk)  # the working copy back from the master, the gradient gone
            self._submitted.add(chunk)
        self._pending.clear()
        for p in persistent:
            p.grad = None
        self.skipped_steps += 1
        log.warning("protrain_fx: the gradient norm is %s: this optimizer step is skipped (no offloaded chunk is "
                    "stepped and the persistent parameters' gradients were set to None); %d step(s) skipped so far",
                    float(total), self.skipped_steps)

    def host_bytes_per_param(self) -> float:
        """Host bytes per offloaded parameter (chunk buffers; see ``ChunkStore.bytes_per_param``)."""
        return self.store.bytes_per_param() if self.store else 0.0

    @property
    def n_lean(self) -> int:
        """Offloaded chunks without a host working copy (fetched from their fp32 master)."""
        return len(self.store.lean) if self.store else 0

    def lean_counts(self) -> tuple[int, ...]:
        """Per ``n_persist`` in ``0..`` the layout's chunks, how many offloaded chunks the store would
        make lean (its rule, ``runtime/chunk_store.auto_lean``, for the host memory available now;
        ``n_lean=K``: ``K``, or every offloaded chunk when fewer are offloaded). For the cost model,
        before anything is placed."""
        chunks, settings = self.layout.chunks, self._settings
        n_lean = settings["n_lean"]
        if n_lean != "auto":
            return tuple(min(n_lean, len(chunks) - p) for p in range(len(chunks) + 1))
        available = settings["available_host_bytes"]
        if available is None:
            available = available_host_bytes()
        itemsize = self.param_dtype.itemsize
        numel = self.layout.chunk_bytes // itemsize
        trainable = [any(self._named[s.param.names[0]].requires_grad for s in c.slots) for c in chunks]
        compute = self.compute_dtype.itemsize
        return tuple(
            auto_lean(numel, trainable[p:], compute, available, settings["grad_pool"]) for p in range(len(chunks) + 1)
        )

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Model parameters and buffers as ordinary full CPU tensors (loads into a plain model)."""
        self.synchronize()
        host = self.store.param_state_dict() if self.store else {}
        if not self._built:  # automatic counts not chosen yet: the values kept aside
            self._require_values("state_dict")
            host = {n: t.to("cpu", copy=True) for n, t in self._sources.items()}
        out: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            out[name] = host[name] if name in host else p.detach().to("cpu", copy=True)
        for name, b in model.named_buffers():
            out[name] = b.detach().to("cpu", copy=True)
        return out

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict with the host chunks' state filled in (loads into a plain AdamW)."""
        self.synchronize()
        return self.adam.state_dict() if self.adam else self.optimizer.state_dict()

    def load_state_dict(
        self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, Any] | None = None
    ) -> None:
        """Set parameters (and optionally the optimizer state) from ordinary full tensors."""
        self.synchronize()
        if not self._built:  # automatic counts not chosen yet: into the values kept aside
            self._require_values("load_state_dict")
            if optimizer_state is not None:
                raise RuntimeError(
                    "offload: load_state_dict(..., optimizer_state) before the model's first compile: the "
                    "optimizer state goes where the chunks are, chosen at that compile; load it after the "
                    "first compile (or give n_persist / n_buffer by hand)"
                )
            with torch.no_grad():
                for name, t in self._sources.items():
                    t.copy_(state_dict[name])
                for name, b in model.named_buffers():
                    b.copy_(state_dict[name])
            return
        if self.store:
            self.store.load_param_state_dict(state_dict)
        host = {n for s in (self.store.slots if self.store else ()) for n in s.names}
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                if name not in host:
                    p.copy_(state_dict[name])
            for name, b in model.named_buffers():
                b.copy_(state_dict[name])
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
            if self.adam:
                self.adam.load_state_dict(optimizer_state)

    def close(self) -> None:
        self.synchronize()
        if self.worker is not None:
            self.worker.close()
        for hook in (*self._hooks, self._eager_guard):
            hook.remove()
        if self.id is not None:
            chunk_ops.unregister(self.id)
        chunk_ops.unregister_deferred(self)

    def _require_values(self, what: str) -> None:
        if any(t.is_meta for t in self._sources.values()):
            raise RuntimeError(
                f"offload: {what} before the model's first compile: its parameters are still on the meta "
                "device (they are initialised when the backend places the chunks, at the first compile)"
            )


def offload(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    n_persist: int | Literal["auto"] = AUTO,
    n_buffer: int | Literal["auto"] = AUTO,
    device: torch.device | str = "cuda",
    chunk_bytes: int | None = None,
    compute_dtype: torch.dtype | None = None,
    available_host_bytes: int | None = None,
    init: Callable[[str, torch.Tensor], None] | Literal["model"] | None = None,
    n_gpu_optim: int | Literal["auto"] | None = None,
    n_lean: int | Literal["auto"] = "auto",
    grad_pool: int = GRAD_POOL,
    grad_clipping: bool | None = None,
) -> OffloadHandle:
    """Put ``model``'s parameters into chunks (see the module docstring); call before ``torch.compile``.

    ``n_persist``, ``n_buffer`` and ``n_gpu_optim`` left out (``"auto"``): the backend chooses them,
    with the activation plan, when it compiles the model's first training graph: the fastest counts
    whose predicted peak fits the ``memory_budget`` option (or, on a CUDA device without one, what
    the process can reach there; ``protrain_fx/autooffload.py``). Until then every parameter is a
    device tensor without bytes and its values wait in host memory (or on ``meta``, for ``init``).
    Given by hand: ``n_persist`` and ``n_buffer`` together (``n_gpu_optim`` then defaults to 0).

    A model built on the ``meta`` device is materialised straight into the chunks: ``init(name,
    tensor)`` fills each parameter (first of its names when tied) in place, in the host chunk for
    offloaded ones, on ``device`` for persistent ones. Host memory then peaks at the chunk store,
    never at a whole second copy of the model. ``init="model"``: the model's own initialisation
    (a Hugging Face model's ``_init_weights``, else each module's ``reset_parameters()``), its
    ``meta`` buffers (rotary ``inv_freq``) recomputed on ``device``
    (:mod:`protrain_fx.integrations.model_init`).

    ``n_gpu_optim``: the first that many offloaded chunks (the last of backward, the first of the
    next forward) are stepped on the device instead of the CPU, their fp32 states streamed through
    it (``runtime/device_adam.py``): the CPU steps fewer chunks and forward waits less.

    ``n_lean``: the last that many offloaded chunks keep no compute-dtype copy on the host (12
    instead of 14 bytes per parameter; the device fetches their fp32 master, twice the bytes) and
    land their gradients in ``grad_pool`` shared host buffers. ``"auto"`` (default): none when the
    store fits the host with 8 GiB to spare, else the fewest that fit (``handle.n_lean`` says how
    many); a host too small even then is refused with the bytes needed.

    ``grad_clipping``: whether the training loop calls ``torch.nn.utils.clip_grad_norm_`` (which
    then clips over every chunk: :meth:`OffloadHandle.clip_grad_norm_`). The offloaded chunks'
    steps then wait for the end of backward instead of overlapping it. ``None`` (default): learned
    at the first optimizer step, which waits; ``True``: always wait (a loop that starts clipping
    later); ``False``: never wait, and a clip raises."""
    return OffloadHandle(
        model,
        optimizer,
        n_persist=n_persist,
        n_buffer=n_buffer,
        device=device,
        chunk_bytes=chunk_bytes,
        compute_dtype=compute_dtype,
        available_host_bytes=available_host_bytes,
        init=init,
        n_gpu_optim=n_gpu_optim,
        n_lean=n_lean,
        grad_pool=grad_pool,
        grad_clipping=grad_clipping,
    )


def _layout(named: Mapping[str, torch.Tensor], chunk_bytes: int | None) -> ChunkLayout:
    """Chunks in registration order (the order a transformer uses its parameters), blocks together."""
    rows = []
    for i, (name, p) in enumerate(named.items()):
        m = _BLOCK.match(name)
        rows.append((name, id(p), p.numel() * p.element_size(), m.group(1) if m else OUTSIDE, i))
    infos: list[ParamInfo] = dedupe_tied(rows)
    return pack(infos, chunk_bytes) if chunk_bytes else choose_layout(infos)


def _staged(grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients copied, in ``dtype``, into one fresh device buffer on the current stream.

    The copies to the host read this buffer after the graph has gone on; the graph's own gradient
    buffers are free as soon as this returns (Inductor may reuse them at once, which it could not
    if the host copies read them), and the staging buffer is the caching allocator's, held until
    the copy stream is done with it (``record_stream``)."""
    flat = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device)
    views, start = [], 0
    for g in grads:
        view = flat[start : start + g.numel()].view(g.shape)
        view.copy_(g)
        views.append(view)
        start += g.numel()
    return views


def _set_data(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.data = value``, also for a ``meta`` parameter, whose data cannot be set to a real tensor:
    its contents are swapped instead (the same object, so the optimizer's references stay valid)."""
    if not p.is_meta:
        p.data = value
    elif isinstance(p, nn.Parameter):
        torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
    else:
        torch.utils.swap_tensors(p, value.requires_grad_(p.requires_grad))


def _is_shell(p: torch.Tensor, device: torch.device) -> bool:
    """``p`` is on ``device`` with a storage of 0 bytes (a shell, or not yet materialised)."""
    return not p.is_meta and p.device == device and p.untyped_storage().nbytes() == 0


def _shell(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor shaped, typed and placed like ``p`` whose storage holds no bytes (for tracing)."""
    shell = torch.empty(p.shape, dtype=p.dtype, device=device)
    shell.untyped_storage().resize_(0)
    return shell


def _check_not_offloaded(named: Mapping[str, torch.Tensor]) -> None:
    """Refuse a model offloaded before: its parameters are shells of 0 bytes (their values are in
    the first handle's chunk store), and copying from them would read no memory."""
    for name, p in named.items():
        if chunk_ops.offloaded(p) is not None or chunk_ops.deferred(p) is not None or (
            not p.is_meta and p.numel() and p.untyped_storage().nbytes() == 0
        ):
            raise ValueError(
                f"offload: this model is already offloaded (parameter {name!r} holds no values: they live in the "
                "chunk store of an earlier offload(...) call). Keep using the handle that call returned, or build "
                "the model again (and its optimizer) to offload it anew"
            )


class _HeldNorms:
    """Per-parameter gradient norms of held chunks, for :meth:`OffloadHandle.clip_grad_norm_`:
    the 2-norm taken where a chunk's gradient first lands (on the device, beside the copy to the
    host), or, for a chunk whose held gradient was added to since (micro-batches, a chunk split by
    a graph break) or another norm type, read back from the host store."""

    def __init__(self) -> None:
        self._norms: dict[Any, torch.Tensor] = {}
        self._stale: set[int] = set()

    def note(self, store: ChunkStore, chunk: int, names: list[str], grads: list[torch.Tensor], *,
             fresh: bool) -> None:
        if not fresh:
            self._stale.add(chunk)
            return
        by_slot = store.grads_by_slot(dict(zip(names, grads)))
        values = [g.detach() for g in by_slot.values()]
        wide = any(v.dtype != torch.float32 for v in values)  # bf16 gradients: summed in fp32
        norms = torch._foreach_norm(values, 2.0, dtype=torch.float32) if wide else torch._foreach_norm(values, 2.0)
        self._norms.update(zip(by_slot, norms))

    def of(self, store: ChunkStore, slot: Any, norm_type: float) -> torch.Tensor | None:
        """The norm of ``slot``'s held gradient; ``None`` when it holds none (skipped, as torch
        skips a ``.grad`` of ``None``)."""
        if slot not in store.grad_slots(slot.chunk):
            return None
        if norm_type == 2.0 and slot.chunk not in self._stale and slot in self._norms:
            return self._norms[slot]
        store.wait_grad(slot.chunk)
        view = store.grad_flat(slot.chunk)[slot.offset : slot.offset + slot.numel]
        if view.dtype != torch.float32:
            return torch.linalg.vector_norm(view, norm_type, dtype=torch.float32)
        return torch._foreach_norm([view], norm_type)[0]  # as clip_grad_norm_ takes a CPU gradient's

    def clear(self) -> None:
        self._norms.clear()
        self._stale.clear()


def _group_norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each gradient's norm, computed as ``torch.nn.utils.get_total_norm`` computes it (foreach per
    device and dtype where supported), in the order given."""
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )

    out: list[torch.Tensor | None] = [None] * len(grads)
    if not grads:
        return []
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    for (device, _), ([tensors], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
            norms = torch._foreach_norm(tensors, norm_type)
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        for i, n in zip(indices, norms):
            out[i] = n
    return out  # type: ignore[return-value]


_TORCH_CLIP_GRAD_NORM: Callable[..., torch.Tensor] | None = None


def _install_clip_dispatch() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` to :meth:`OffloadHandle.clip_grad_norm_` when it is
    given an offloaded model's parameters (their gradients are in the chunk store, not in
    ``.grad``); any other call goes to torch's own function unchanged. Installed once, by the first
    ``offload``; a name bound before it (``from torch.nn.utils import clip_grad_norm_``) still holds
    torch's, which sees only the persistent chunks' gradients."""
    global _TORCH_CLIP_GRAD_NORM
    if _TORCH_CLIP_GRAD_NORM is not None:
        return
    from torch.nn.utils import clip_grad

    original = _TORCH_CLIP_GRAD_NORM = clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        handles = {}
        for p in params:
            found = chunk_ops.offloaded(p)
            if found is not None:
                handles[found[0]] = chunk_ops.handle(found[0])
        if not handles:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if len(handles) > 1:
            raise UnsupportedError("protrain_fx: clip_grad_norm_ over the parameters of several offloaded models; "
                                   "clip each model's parameters on their own")
        (handle,) = handles.values()
        return handle.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad.clip_grad_norm_ = clip_grad_norm_


def _refuse_eager_call(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of an offloaded model: a call outside ``torch.compile`` (whose graphs read
    the chunk buffers) would read parameters of 0 bytes."""
    from torch._dynamo.eval_frame import _is_in_optimized_module

    if torch.compiler.is_compiling() or _is_in_optimized_module():
        return None
    raise UnsupportedError(
        f"protrain_fx: this {type(module).__name__} is offloaded (protrain_fx.offload): its offloaded parameters "
        "hold no values outside the compiled graphs, so it runs only through torch.compile(model, "
        "backend='protrain'); call the compiled module (handle.state_dict(model) gives the values, to load into "
        "a plain copy of the model)"
    )


_TORCH_TENSOR_STR: Callable[..., str] | None = None


def _install_shell_repr() -> None:
    """Printing an offloaded parameter (a shell of 0 bytes) shows what it is instead of reading
    memory it does not have (which crashes the process): ``torch._tensor_str._str``, which
    ``Tensor.__repr__`` calls, is wrapped once; every other tensor prints as before."""
    global _TORCH_TENSOR_STR
    if _TORCH_TENSOR_STR is not None:
        return
    from torch import _tensor_str

    original = _TORCH_TENSOR_STR = _tensor_str._str

    @functools.wraps(original)
    def _str(self, *, tensor_contents=None):
        try:
            hollow = (type(self) in (torch.Tensor, nn.Parameter) and not self.is_meta and self.numel() > 0
                      and self.untyped_storage().nbytes() == 0)
        except Exception:  # noqa: BLE001 -- tensors without a plain storage print as torch prints them
            hollow = False
        if hollow:
            return (f"tensor(<no values here: offloaded by protrain_fx, they live in the chunk store; "
                    f"handle.state_dict(model) gives them>, size={tuple(self.shape)}, dtype={self.dtype}, "
                    f"device='{self.device}')")
        return original(self, tensor_contents=tensor_contents)

    _tensor_str._str = _str
