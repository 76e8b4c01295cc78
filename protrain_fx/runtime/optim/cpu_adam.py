"""CPU Adam(W) for offloaded chunks, driven by the user's own ``torch.optim.AdamW``.

:class:`ChunkAdamW` binds a :class:`~protrain_fx.runtime.store.chunk_store.ChunkStore` to the optimizer
the user built on the model's parameters. The user's optimizer stays the source of truth for the
hyper-parameters: a chunk step takes ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``maximize``
from its ``param_groups`` when it is queued (:meth:`ChunkAdamW.hyper`, in the thread that queues
it: as the chunk's gradient lands in backward, or at ``optimizer.step()`` for accumulated
gradients), as the device steps do, so learning-rate schedulers attached to it keep working. A step
that runs later, overlapping the next forward, still uses its own step's values: read when it ran,
a scheduler stepped after ``optimizer.step()`` reached the chunks still queued (the learning rate of
the next step, one chunk in three of a tiny GPT on the CPU, found by ``tests/runtime/test_offload.py``).
The moments live in the store (not in ``optimizer.state``) and the step is torch's fused CPU kernel
(design.md: as fast as DeepSpeed's CPUAdam) on per-parameter views of the flat master, with the
chunk's gradient converted to fp32.

Why per-parameter views rather than one call on the whole flat chunk: the kernel's vector loop and
scalar tail round differently (1 ulp), so only the same tensors as eager give the same bits --
tested bit-exact against ``torch.optim.AdamW(fused=True)``.

:class:`OptimizerWorker` runs the chunk steps on one background thread, in the order chunks are
submitted (backward order, as their gradients land), so they overlap the rest of backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Self

import torch

from protrain_fx.runtime.parallel import distributed
from protrain_fx.runtime.parallel import shard
from protrain_fx.runtime.store.chunk_store import ChunkStore, ParamSlot, piece_of

#: The clock of ``ChunkAdamW.computed`` (bound once: a test driving ``time.perf_counter`` to time
#: the worker's steps does not drive this one).
_clock = time.perf_counter


class ChunkAdamW:
    """Steps the chunks of ``store`` with the hyper-parameters of ``optimizer``.

    ``named_params`` maps parameter names to the tensors ``optimizer`` was built on (e.g.
    ``dict(model.named_parameters(remove_duplicate=False))``): that is how optimizer entries are
    matched to store slots. A slot absent from the optimizer is not optimized (frozen); an
    optimizer parameter absent from the store is left to ``optimizer`` itself (e.g. chunks kept on
    the GPU). State ``optimizer`` already holds for store parameters (a state dict loaded before
    binding) moves into the store.
    """

    def __init__(
        self,
        store: ChunkStore,
        optimizer: torch.optim.Optimizer,
        named_params: Mapping[str, torch.Tensor],
    ) -> None:
        check_optimizer(optimizer)
        self.store = store
        self.optimizer = optimizer
        stored = _store_names(store)
        slot_of_tensor = {
            id(t): store.slot(n) for n, t in named_params.items() if n in stored
        }
        self._group_of: dict[ParamSlot, int] = {}
        self._index_of: dict[ParamSlot, int] = {}  # position in optimizer.state_dict()
        whole = {id(t) for n, t in named_params.items() if n in {m for s in store.full_slots for m in s.names}}
        #: Optimizer positions of every parameter of the store (sharded: pieces on other ranks too).
        self._stored_indices: set[int] = set()
        index = 0
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                slot = slot_of_tensor.get(id(p))
                if slot is not None:
                    self._group_of[slot] = g
                    self._index_of[slot] = index
                if id(p) in whole:
                    self._stored_indices.add(index)
                index += 1
        # a slot's step count appears at its first step, as in torch
        self._steps: dict[ParamSlot, torch.Tensor] = {}
        self.slice_elems = SLICE_ELEMS
        #: (seconds, parameters) of the chunk steps so far, from each step's gradient landed on the
        #: host to its new working copy written: the CPU rate training reaches
        #: (``planner/rates.py``). One tuple, replaced whole, so another thread reads a pair.
        self.computed: tuple[float, int] = (0.0, 0)
        if any(p in optimizer.state for p in _tensors(named_params, slot_of_tensor)):
            self.load_state_dict(optimizer.state_dict())

    def optimized(self, slot: ParamSlot) -> bool:
        """Whether ``slot`` is in the optimizer (else its values never change)."""
        return slot in self._group_of

    def hyper(self, chunk_id: int) -> dict[int, tuple[Callable[..., None], dict[str, Any]]]:
        """Param group -> :meth:`kernel` of it, read now: what :meth:`step_chunk` of a step queued now
        uses (``OptimizerWorker``'s ``prepare``)."""
        return {g: self.kernel(g) for g in range(len(self.optimizer.param_groups))}

    def step_chunk(
        self,
        chunk_id: int,
        hyper: Mapping[int, tuple[Callable[..., None], dict[str, Any]]] | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """One Adam(W) step of the chunk's parameters that have a gradient, then its new working copy,
        with ``hyper`` (:meth:`hyper` when the step was queued; ``None``: the groups' values now).
        ``grad_scale`` (a 0-dim fp32 CPU tensor): the gradient is multiplied by it first, as
        ``clip_grad_norm_`` multiplies a ``.grad`` (same bits).

        Parameters without a gradient are skipped, as torch skips ``grad is None``."""
        slots = [s for s in self.store.grad_slots(chunk_id) if s in self._group_of]
        store = self.store
        if not slots:
            with store.state_held(chunk_id, write=False):
                store.finish_step(chunk_id, refreshed=slots)
            return
        store.wait_grad(chunk_id)
        store.before_host_write(chunk_id)  # (a fetch may still be reading the working copy)
        with store.state_held(chunk_id):  # (a spilled chunk's state read back from disk, written after)
            start = _clock()
            for g in sorted({self._group_of[s] for s in slots}):
                self._step_group(chunk_id, g, [s for s in slots if self._group_of[s] == g],
                                 None if hyper is None else hyper[g], grad_scale)
            store.finish_step(chunk_id, refreshed=slots)
        seconds, params = self.computed
        self.computed = (seconds + _clock() - start, params + sum(s.numel for s in slots))

    def _step_group(
        self, chunk_id: int, g: int, slots: list[ParamSlot],
        kernel: tuple[Callable[..., None], dict[str, Any]] | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """The fused kernel over slices of at most ``slice_elems`` elements: per slice the
        gradient's fp32 copy (bf16 compute), the update, and the slice's new working copy, while
        the slice is still in the CPU's caches. Slicing gains a few percent over whole-chunk
        passes; the step stays well below torch's fused AdamW on fp32 parameters alone because of
        the bf16<->fp32 conversions, not DRAM passes (``docs/results.md#the-cpu-optimizer``)."""
        store = self.store
        steps = self.advance(slots)
        fused, hyper = self.kernel(g) if kernel is None else kernel
        grad, master = store.grad_flat(chunk_id), store.flat("master", chunk_id)
        working = None if store.is_lean(chunk_id) else store.flat("working", chunk_id)  # == grad
        exp_avg, exp_avg_sq = store.flat("exp_avg", chunk_id), store.flat("exp_avg_sq", chunk_id)
        scratch = store.scratch
        for batch in slice_batches(slots, steps, self.slice_elems):
            ranges = [(a, b) for a, b, _ in batch]
            if scratch is None:  # fp32 compute: the gradient is already fp32
                grads = [grad[a:b] for a, b in ranges]
            else:
                grads = [scratch[a:b].copy_(grad[a:b]) for a, b in ranges]
            if grad_scale is not None:  # (the held gradient is consumed by this step: scaled in place)
                torch._foreach_mul_(grads, grad_scale)
            fused(
                [master[a:b] for a, b in ranges],
                grads,
                [exp_avg[a:b] for a, b in ranges],
                [exp_avg_sq[a:b] for a, b in ranges],
                [],
                [step for _, _, step in batch],
                **hyper,
            )
            if working is not None:  # a lean chunk has no working copy to refresh
                for a, b in ranges:
                    working[a:b].copy_(master[a:b])

    def group_of(self, slot: ParamSlot) -> int:
        """Index of the optimizer's param group holding ``slot``."""
        return self._group_of[slot]

    def advance(self, slots: list[ParamSlot]) -> list[torch.Tensor]:
        """Count one more step for each of ``slots``; their (CPU, fp32) step tensors."""
        steps = [self._step_of(s) for s in slots]
        torch._foreach_add_(steps, 1)
        return steps

    def kernel(self, g: int) -> tuple[Callable[..., None], dict[str, Any]]:
        """torch's fused Adam or AdamW kernel for param group ``g`` and its keyword arguments, read
        from the group now (so schedulers apply)."""
        group = self.optimizer.param_groups[g]
        _check_group(group, g)
        fused = (
            torch._fused_adamw_
            if _decoupled(self.optimizer, group)
            else torch._fused_adam_
        )
        beta1, beta2 = group["betas"]
        hyper = dict(
            amsgrad=False,
            lr=_scalar(group["lr"]),
            beta1=_scalar(beta1),
            beta2=_scalar(beta2),
            weight_decay=_scalar(group["weight_decay"]),
            eps=_scalar(group["eps"]),
            maximize=group.get("maximize", False),
        )
        return fused, hyper

    def _step_of(self, slot: ParamSlot) -> torch.Tensor:
        if slot not in self._steps:
            self._steps[slot] = torch.zeros((), dtype=torch.float32)
        return self._steps[slot]

    # ---- state dicts -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` with the store's parameters' state filled in: the format of a
        plain ``torch.optim.AdamW`` over the user's parameter list (loads into one)."""
        state_dict = self.optimizer.state_dict()
        state = dict(state_dict["state"])
        if self.store.shard[1] > 1:  # whole tensors, gathered from every rank's pieces
            state.update(shard.gather_optimizer_state(self.store, self._steps, self._index_of))
            return {"state": dict(sorted(state.items())), "param_groups": state_dict["param_groups"]}
        for c in sorted({slot.chunk for slot in self._steps}):  # (a spilled chunk's state held once)
            with self.store.state_held(c, write=False):
                for slot, step in self._steps.items():  # only optimized slots take steps
                    if slot.chunk == c:
                        state[self._index_of[slot]] = {
                            "step": step.clone(),
                            "exp_avg": self.store.view("exp_avg", slot).clone(),
                            "exp_avg_sq": self.store.view("exp_avg_sq", slot).clone(),
                        }
        return {
            "state": dict(sorted(state.items())),
            "param_groups": state_dict["param_groups"],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a ``torch.optim.AdamW`` state dict (from :meth:`state_dict` or a plain optimizer):
        hyper-parameters and other parameters' state go to ``optimizer``, the store's into the store."""
        self.optimizer.load_state_dict(self.load_stored(state_dict))

    def load_stored(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The store's parameters' state of ``state_dict`` (a ``torch.optim.AdamW`` state dict) into
        the store; the state dict of the rest (hyper-parameters and the other parameters' state),
        for ``optimizer``."""
        state = state_dict["state"]
        ours = {index: slot for slot, index in self._index_of.items()}
        rest = {
            "state": {k: v for k, v in state.items() if int(k) not in self._stored_indices},
            "param_groups": state_dict["param_groups"],
        }
        self._steps.clear()
        for c in sorted({slot.chunk for slot in ours.values()}):  # (a spilled chunk's state held once)
            with self.store.state_held(c):
                for index, slot in ours.items():
                    if slot.chunk != c:
                        continue
                    entry = state.get(index, state.get(str(index)))
                    for kind in ("exp_avg", "exp_avg_sq"):
                        view = self.store.view(kind, slot)
                        if entry is None:
                            view.zero_()
                        else:
                            view.copy_(piece_of(entry[kind], slot))  # (sharded: this rank's piece)
                    if entry is not None:
                        self._steps[slot] = torch.tensor(
                            float(entry["step"]), dtype=torch.float32
                        )
        return rest


#: Elements per fused call (see :meth:`ChunkAdamW._step_group`): 4 MiB of each fp32 buffer, the
#: best of the sizes measured, by 5% (``docs/results.md#the-cpu-optimizer``).
SLICE_ELEMS = 1 << 20
#: Slices of one parameter start at multiples of this many elements from its start. The fused CPU
#: kernel splits its work in 64-byte units and runs a vector loop with a scalar tail per unit
#: range, so with boundaries on this grid every element takes the path (vector or tail) it takes in
#: one call on the whole parameter: the same bits as ``torch.optim.AdamW(fused=True)`` (tested).
SLICE_ALIGN = 64


def slice_batches(
    slots: list[ParamSlot], steps: list[torch.Tensor], limit: int
) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Batches of ``(start, end, step)`` element ranges of the chunk, at most about ``limit``
    elements a batch; a parameter larger than ``limit`` is split on the :data:`SLICE_ALIGN` grid."""
    piece = max(SLICE_ALIGN, limit // SLICE_ALIGN * SLICE_ALIGN)
    batches: list[list[tuple[int, int, torch.Tensor]]] = [[]]
    size = 0
    for slot, step in sorted(zip(slots, steps), key=lambda x: x[0].offset):
        for a in range(0, slot.numel, piece):
            b = min(a + piece, slot.numel)
            if size and size + (b - a) > limit:
                batches.append([])
                size = 0
            batches[-1].append((slot.offset + a, slot.offset + b, step))
            size += b - a
    return [b for b in batches if b]


#: Cores the worker's OpenMP team leaves to the threads that drive the GPU (the training loop's
#: Python, the autograd engine's device thread) when the process has more than twice as many.
DRIVER_CORES = 2


def worker_threads(process_threads: int | None = None) -> int:
    """OpenMP threads of the CPU optimizer's worker: the process' (``torch.get_num_threads()``; in a
    data-parallel run, the node's cores divided by its ranks, ``distributed.node_threads``: torchrun
    sets ``OMP_NUM_THREADS=1``) less :data:`DRIVER_CORES` (less one on a machine of at most
    ``2 * DRIVER_CORES``), at least one.

    Why: a parallel region waits for its slowest thread, and a team spanning every core shares one
    with the thread launching the GPU's work: beside pinned copies and a thread launching CUDA
    kernels, a team one or two threads short of the cores steps about 30% faster than one on every
    core, and a team of half the cores is slower again (``docs/results.md#the-cpu-optimizer``)."""
    n = distributed.node_threads() if process_threads is None else process_threads
    return max(1, n - (DRIVER_CORES if n > 2 * DRIVER_CORES else 1))


class OptimizerWorker:
    """Runs ``step_chunk(chunk_id)`` on one background thread, in submission order, with an OpenMP
    team of :func:`worker_threads` (the caller's thread count is not changed). With ``prepare``,
    :meth:`submit` calls ``prepare(chunk_id)`` in the caller's thread and the step runs
    ``step_chunk(chunk_id, prepared)`` (``ChunkAdamW.hyper``: the hyper-parameters as of queueing).

    An exception in a step is raised in the caller at the next :meth:`submit`, :meth:`wait` or
    :meth:`wait_all` (with a note naming the chunk), and only once.
    """

    def __init__(self, step_chunk: Callable[..., None], prepare: Callable[[int], Any] | None = None) -> None:
        self._step_chunk = step_chunk
        self._prepare = prepare
        #: OpenMP threads of the worker's steps.
        self.threads = worker_threads()
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="protrain-cpu-adam",
            initializer=torch.set_num_threads,  # per thread: the caller's count stays
            initargs=(self.threads,),
        )
        self._pending: dict[int, Future[None]] = {}
        #: Seconds the thread has spent in chunk steps (for overlap breakdowns).
        self.busy_s = 0.0
        #: Chunk steps run so far.
        self.steps = 0

    def submit(self, chunk_id: int, **kwargs: Any) -> None:
        """Queue the chunk's step. Its gradient must have been written to the store (a copy from
        the GPU may still be in flight: the step waits for it). ``kwargs`` go to ``step_chunk``."""
        self._raise_failure()
        previous = self._pending.get(chunk_id)
        if previous is not None and not previous.done():
            raise RuntimeError(
                f"chunk {chunk_id} submitted again while its last step is still queued or running"
            )
        args = () if self._prepare is None else (self._prepare(chunk_id),)
        self._pending[chunk_id] = self._executor.submit(self._step, chunk_id, *args, **kwargs)

    def run(self, job: Callable[[], None]) -> Future[None]:
        """Queue ``job()`` on the worker's thread, after the steps queued so far and before those
        queued later (the store's accumulated adds: ``runtime/store/grad_adds.py``). Its failure is its
        future's, for whoever waits on it."""
        return self._executor.submit(job)

    def pending(self, chunk_id: int) -> bool:
        """Whether the chunk's step is queued or running."""
        future = self._pending.get(chunk_id)
        return future is not None and not future.done()

    def wait(self, chunk_id: int) -> None:
        """Block until the chunk's queued step (if any) is done."""
        future = self._pending.pop(chunk_id, None)
        if future is not None:
            future.result()
        self._raise_failure()

    def wait_all(self) -> None:
        """Block until every queued step is done."""
        for chunk_id in list(self._pending):
            self._pending[chunk_id].exception()  # wait, without raising yet
        self._raise_failure()
        self._pending.clear()

    def close(self) -> None:
        """Finish every queued step (raising a failure) and stop the thread."""
        try:
            self.wait_all()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing: do not mask that error with a step's
            self._executor.shutdown(wait=True)

    def _step(self, chunk_id: int, *prepared: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            self._step_chunk(chunk_id, *prepared, **kwargs)
        except BaseException as error:
            error.add_note(f"(in the CPU optimizer worker, stepping chunk {chunk_id})")
            raise
        finally:
            self.busy_s += time.perf_counter() - start
            self.steps += 1

    def _raise_failure(self) -> None:
        """Raise the first failed step (in submission order), forgetting it."""
        for chunk_id, future in list(self._pending.items()):
            if future.done() and future.exception() is not None:
                del self._pending[chunk_id]
                raise future.exception()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        raise TypeError(
            f"the CPU chunk optimizer implements Adam and AdamW; got {type(optimizer).__name__}. "
            "Use torch.optim.AdamW (or keep every chunk on the GPU)."
        )
    for g, group in enumerate(optimizer.param_groups):
        _check_group(group, g)


def _check_group(group: Mapping[str, Any], g: int) -> None:
    if group.get("amsgrad", False):
        raise ValueError(
            f"param group {g} sets amsgrad=True, which the CPU chunk optimizer does not support"
        )
    if group.get("differentiable", False):
        raise ValueError(
            f"param group {g} sets differentiable=True, which the CPU chunk optimizer does not support"
        )


def _decoupled(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        group.get("decoupled_weight_decay", False)
    )


def _scalar(value: float | torch.Tensor) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def _store_names(store: ChunkStore) -> set[str]:
    return {n for s in store.slots for n in s.names}


def _tensors(
    named: Mapping[str, torch.Tensor], ids: Mapping[int, ParamSlot]
) -> list[torch.Tensor]:
    return [t for t in named.values() if id(t) in ids]
