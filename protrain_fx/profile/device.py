"""Device-side measurements: the pinned copy link and offloaded chunks' optimizer steps on the GPU.

:func:`_cuda_copy_rates` times host <-> device copies one way and both ways at once;
:func:`device_step_spans` steps chunks through ``runtime/optim/device_adam.DeviceAdamW`` as backward
issues them, beside a load from :mod:`protrain_fx.profile.load` and the CPU optimizer, and returns
the spans it timed with CUDA events. Rates are bytes per second each way. Nothing here is cached:
:mod:`protrain_fx.profile.machine_profile` decides what to measure and keeps the results. CUDA only."""

from __future__ import annotations

import functools
import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from protrain_fx.chunks import ParamInfo, pack
from protrain_fx.profile.cache import MiB
from protrain_fx.profile.load import (
    _deep_queue_until,
    _launch_until,
    _matmuls_until,
    _sync_until,
)
from protrain_fx.runtime.store.chunk_store import ChunkStore
from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW, OptimizerWorker
from protrain_fx.runtime.optim.device_adam import DeviceAdamW

#: Default bytes of each timed copy (``measure_machine``'s ``copy_bytes``).
COPY_BYTES = 256 * MiB


#: Parameters per chunk of the measured device steps (:func:`_device_step_bytes_per_s`): 8 of the
#: runtime's staging slices, so the slices' pipeline runs full for most of a step.
DEVICE_STEP_PARAMS = 64 * 2**20


#: Device-stepped chunks per round of :func:`device_step_rate` (the CPU's chunk beside them is one more).
LAYOUT_STEP_CHUNKS = 3


def layout_key(parts: Sequence[int]) -> str:
    """The key of a chunk layout (its parameters' sizes in order) in the profile file: parameters,
    count, and a digest of the sizes."""
    digest = hashlib.sha1(",".join(map(str, parts)).encode()).hexdigest()[:12]
    return f"{sum(parts)}:{len(parts)}:{digest}"


def _cuda_copy_rates(device: torch.device, nbytes: int, repeat: int) -> tuple[float, float, float]:
    """Pinned H2D, D2H and both-at-once (total) bytes per second, best of ``repeat``."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def one_way(dst: torch.Tensor, src: torch.Tensor) -> float:
        best = float("inf")
        for i in range(repeat + 1):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s1):
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
            end.synchronize()
            if i:
                best = min(best, start.elapsed_time(end) / 1e3)
        return nbytes / best

    h2d = one_way(dev_a, host_a)
    d2h = one_way(host_a, dev_a)
    best = float("inf")
    for i in range(repeat + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)
        torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return h2d, d2h, 2 * nbytes / best


#: Bytes of the device-to-device copy :func:`card_rates` times: large enough to stream from memory, not cache.
CARD_COPY_BYTES = 512 * MiB

#: Side of the bf16 matrix products :func:`card_rates` times (the size the GPU machine's table reads at).
CARD_MATMUL_SIZE = 8192


def card_rates(device: torch.device, repeat: int = 5) -> dict[str, float]:
    """The card's own rates, in the units of ``protrain_fx.machine.Machine``: ``flops`` (bf16
    products of :data:`CARD_MATMUL_SIZE`, best of ``repeat`` after a warm-up, on random data),
    ``hbm_bytes`` (a device-to-device copy of :data:`CARD_COPY_BYTES`, bytes read plus written),
    and the pinned copy link (``h2d_bytes``, ``d2h_bytes``, ``duplex_bytes``: :func:`_cuda_copy_rates`
    of :data:`COPY_BYTES`). About a second; CUDA only."""
    torch.cuda.synchronize(device)
    h2d, d2h, duplex = _cuda_copy_rates(device, COPY_BYTES, 3)
    return {"flops": _matmul_flops(device, repeat), "hbm_bytes": _device_copy_bytes_per_s(device, repeat),
            "h2d_bytes": h2d, "d2h_bytes": d2h, "duplex_bytes": duplex}


def _best_event_s(run: Callable[[], Any], repeat: int) -> float:
    """The least seconds of ``run()`` on the current stream over ``repeat`` calls after a warm-up."""
    best = float("inf")
    for i in range(repeat + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        if i:
            best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _matmul_flops(device: torch.device, repeat: int) -> float:
    n = CARD_MATMUL_SIZE
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / _best_event_s(lambda: torch.mm(a, b), repeat)


def _device_copy_bytes_per_s(device: torch.device, repeat: int) -> float:
    src = torch.empty(CARD_COPY_BYTES, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * CARD_COPY_BYTES / _best_event_s(lambda: dst.copy_(src), repeat)


def _device_step_bytes_per_s(
    n: int, chunks: int = 3, repeat: int = 3, *, parts: Sequence[int] = (), cpu_rates: list[float] | None = None
) -> float:
    """Bytes per second each way of offloaded chunks' optimizer steps streamed through the GPU
    (``runtime/optim/device_adam.DeviceAdamW``): the bytes a step copies out (fp32 master and moments, the
    new working copy: 14 per parameter) over the median span of :func:`device_step_spans` with the
    CPU step and matrix products beside them. On chunks of one large tensor beside stand-in
    products it reads above what training's steps reach; a model's own layout and kernels
    (``machine_profile.device_step_rate``) read closer, and training's own timing replaces both
    (``docs/results.md#device-step-rate-measured-against-training``). ``parts`` and ``cpu_rates``
    as for :func:`device_step_spans`."""
    spans = device_step_spans(n, chunks, repeat, cpu=True, beside="matmul", parts=parts, cpu_rates=cpu_rates)
    return chunks * n * 14 / max(statistics.median(spans), 1e-9)


def device_step_spans(
    n: int, chunks: int = 3, repeat: int = 3, *, cpu: bool = True,
    beside: str | Callable[[Callable[[], bool]], None] | None = "matmul", priority: int = 0,
    parts: Sequence[int] = (), while_waiting: bool = False, cpu_rates: list[float] | None = None,
    step_spans: list[float] | None = None, refetch: bool = False,
) -> list[float]:
    """Seconds, per round, of ``chunks`` chunks of ``n`` fp32 parameters (bf16 working copies, pinned
    store) stepped through :class:`~protrain_fx.runtime.optim.device_adam.DeviceAdamW` one after another,
    as backward issues them: from the first step's first copy in to the last step's last copy out
    (CUDA events), ``repeat`` rounds after a warm-up. Meanwhile, with ``cpu``, the CPU optimizer's
    worker steps another chunk of ``n`` over and over; this thread runs ``beside``: ``"matmul"``
    (:func:`_matmuls_until`, backward's kernels), ``"deep"`` (:func:`_deep_queue_until`: products and
    memory-bound kernels, the queue kept full), ``"deep_kept"`` (the same, its queue left to run when
    it returns), ``"launch"`` (:func:`_launch_until`, the training loop's launches), nothing, or a
    function of the caller's that takes ``done`` and returns once ``done()`` is true (such as a GPT
    block's backward); with ``while_waiting``, also while the issuing thread waits for room for the
    next step (as backward goes on meanwhile; without it, nothing runs beside the first step while
    the third waits for it). ``priority``: the update stream's (``bench/device_step_rate.py``
    compares them). ``parts``: the sizes of each chunk's parameters (summing to ``n``; empty: one
    parameter), as a model's chunk holds its blocks' weights, biases and norms. ``cpu_rates``: a list
    that gets, per timed round, the CPU step's parameters per second over that round (its worker's
    compute, ``ChunkAdamW.computed``). ``step_spans``: a list that gets each timed step's own span
    (its first copy in to its last copy out, as ``runtime/offload/step_window.StepWindow`` times training's steps).
    ``refetch``: before each step, copy ``n`` compute-dtype elements in from pinned memory on a
    stream of their own (backward's re-fetch of the next chunk's working copy). CUDA only."""
    parts = list(parts) or [n]
    if sum(parts) != n or min(parts) <= 0:
        raise ValueError(f"device_step_spans: parts must be positive sizes summing to n={n}, got sum {sum(parts)}")
    names = [[f"w{i}_{k}" for k in range(len(parts))] for i in range(chunks + 1)]  # the last chunk is the CPU's
    store, adam, steps = _step_rig(names, parts, n, priority)
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16, device="cuda")  # read only: views for all
    cpu_grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    fetch = _refetch_copy(n) if refetch else None
    run_beside = beside if callable(beside) else {
        "matmul": _matmuls_until, "deep": _deep_queue_until, "launch": _launch_until,
        "deep_kept": functools.partial(_deep_queue_until, drain=False), None: _sync_until}[beside]
    spans = []
    with OptimizerWorker(adam.step_chunk) as worker:

        def keep_cpu_busy() -> None:
            if cpu and not worker.pending(chunks):
                store.write_grads(_grads_of(names[chunks], parts, cpu_grad))
                store.wait_grad(chunks)
                worker.submit(chunks)

        for i in range(repeat + 1):  # the first allocates the staging sets and warms the pages
            computed, last = _step_round(adam, steps, names, parts, grad, keep_cpu_busy, run_beside,
                                         while_waiting=while_waiting, fetch=fetch)
            if i:
                spans.append(steps.timing[0][1].elapsed_time(last) / 1e3)
                if step_spans is not None:
                    step_spans.extend(start.elapsed_time(end) / 1e3 for _, start, end in steps.timing)
            worker.wait_all()
            seconds, stepped = (a - b for a, b in zip(adam.computed, computed))
            if i and cpu_rates is not None and seconds > 0:
                cpu_rates.append(stepped / seconds)
    torch.cuda.synchronize()  # a re-fetch copy may still be reading
    del steps, grad
    torch.cuda.empty_cache()
    return spans


def _step_rig(names: list[list[str]], parts: list[int], n: int, priority: int) -> tuple[Any, Any, Any]:
    """The measured chunks as the runtime holds them: one chunk of ``n`` fp32 parameters of sizes
    ``parts`` per row of ``names`` in a pinned store with bf16 working copies, its CPU optimizer and
    the device steps through it (timing each step). Returns ``(store, adam, steps)``."""
    params = {w: torch.nn.Parameter(torch.zeros(size, dtype=torch.float32))
              for ws in names for w, size in zip(ws, parts)}
    layout = pack([ParamInfo((w,), 4 * size, f"blocks.{i}", i) for i, ws in enumerate(names)
                   for w, size in zip(ws, parts)], 4 * n)
    store = ChunkStore(layout, params, compute_dtype=torch.bfloat16, pin_memory=True)
    adam = ChunkAdamW(store, torch.optim.AdamW(list(params.values()), lr=1e-3, weight_decay=0.1, fused=True), params)
    steps = DeviceAdamW(adam, "cuda", update_priority=priority)
    steps.timing = []
    return store, adam, steps


def _refetch_copy(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]:
    """Source, destination and stream of a backward re-fetch of ``n`` compute-dtype elements."""
    fetch_src = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    fetch_dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    return fetch_src, fetch_dst, torch.cuda.Stream()


def _grads_of(names: list[str], parts: list[int], source: torch.Tensor) -> dict[str, torch.Tensor]:
    """One chunk's gradients as views of ``source``, in the sizes ``parts``."""
    out, at = {}, 0
    for w, size in zip(names, parts):
        out[w] = source[at : at + size]
        at += size
    return out


def _step_round(
    adam: Any, steps: Any, names: list[list[str]], parts: list[int], grad: torch.Tensor,
    keep_cpu_busy: Callable[[], None], run_beside: Callable[[Callable[[], bool]], None], *,
    while_waiting: bool, fetch: tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream] | None,
) -> tuple[tuple[float, float], torch.cuda.Event]:
    """One round: the device steps of every chunk but the last issued one after another (each after
    its re-fetch, with ``fetch``), ``run_beside`` meanwhile until the last step ends, the CPU step
    kept busy throughout. Returns the CPU optimizer's ``computed`` before the round and the event
    that ends the last step."""
    torch.cuda.synchronize()
    steps.timing.clear()
    computed = adam.computed
    keep_cpu_busy()
    for c in range(len(names) - 1):

        def room(dev: Any = steps) -> bool:
            keep_cpu_busy()
            return dev.has_room()

        if c and while_waiting:
            run_beside(room)
        steps.make_room()
        if fetch is not None:
            fetch_src, fetch_dst, fetch_stream = fetch
            with torch.cuda.stream(fetch_stream):
                fetch_dst.copy_(fetch_src, non_blocking=True)
        steps.step_chunk(c, _grads_of(names[c], parts, grad))
    last = steps.timing[-1][2]

    def done() -> bool:
        keep_cpu_busy()
        return last.query()

    run_beside(done)
    return computed, last
