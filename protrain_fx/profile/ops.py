"""Measured times of the compute-bound nodes of a graph (matrix products, convolutions, attention).

The roofline (``analysis/estimate.py``) prices a matrix product at its FLOPs over the machine's
peak rate times one assumed efficiency (``Machine.flops_efficiency``). What a GEMM or attention
kernel reaches depends on its shapes, strides and dtype, so one efficiency misprices a model's
products by tens of percent. So these nodes are timed instead: each distinct call
(:func:`op_signature`) once per device and torch version, on inputs of the traced shapes, and the
result is cached as JSON next to the machine profile (``profile/cache.cache_dir``).
Memory-bound nodes (the pointwise groups Inductor fuses) keep the roofline: what they cost depends
on the fusion Inductor will choose, which a single op's timing does not show.

Two ways of timing, each with its own cache file (:func:`ops_cache_path`): calls queued between two
CUDA events, and the same with the device kept busy while they are queued (``prefill``), so the
host's speed at that moment stays out of the reading. The planner uses the second
(``planner/problem.device_op_times``): it reads closer to the step's own kernel time and steadier
between rounds than the first (``docs/results.md#the-compute-estimate``).

The signature captures everything a kernel choice can depend on: the op overload, and per argument
(args and kwargs, through lists and tuples) a tensor's shape, stride, dtype and device type (from
the input node's ``meta["val"]``), or a plain value's ``repr``. Two nodes with one signature cost the
same; a 24-layer model has a handful of distinct signatures, not 24 times that.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.flop_counter import flop_registry

from protrain_fx import meta, progress
from protrain_fx.state import refuse_measuring
from protrain_fx.profile import keeps_rng
from protrain_fx.profile.cache import _write_json, cache_path, device_name

log = logging.getLogger(__name__)

#: Version of the op-time cache file; a file of another version is measured again.
CACHE_VERSION = 2


def op_signature(node: fx.Node) -> str | None:
    """The key of ``node``'s cost: op name and its arguments' shapes, strides, dtypes and values.

    None unless ``node`` calls an ATen ``OpOverload`` with a FLOP formula
    (``torch.utils.flop_counter.flop_registry``); None too when an input node has no ``meta["val"]``.
    """
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace == "protrain" or flop_registry.get(node.target.overloadpacket) is None:
        return None
    try:
        args = ", ".join(_describe(a) for a in node.args)
        kwargs = ", ".join(f"{k}={_describe(v)}" for k, v in node.kwargs.items())
    except _NoValue:
        return None
    return f"{node.target}({args}{'; ' + kwargs if kwargs else ''})"


def distinct_calls(nodes: Iterable[fx.Node]) -> dict[str, fx.Node]:
    """The first node of each :func:`op_signature` among ``nodes``, in their order."""
    first: dict[str, fx.Node] = {}
    for node in nodes:
        sig = op_signature(node)
        if sig is not None:
            first.setdefault(sig, node)
    return first


class _NoValue(Exception):
    """An input node without a traced value: its cost cannot be keyed (nor measured)."""


def _describe(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        if "val" not in arg.meta:
            raise _NoValue(arg.name)
        return _describe(arg.meta["val"])
    if isinstance(arg, torch.Tensor):
        shape = ",".join(str(meta.concrete(s)) for s in arg.shape)
        stride = ",".join(str(meta.concrete(s)) for s in arg.stride())
        return f"T[{shape}]({stride}){str(arg.dtype).removeprefix('torch.')}@{arg.device.type}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_describe(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return repr(_concrete_scalar(arg))
    return repr(arg)


def _concrete_scalar(v: Any) -> Any:
    """A SymInt/SymFloat/SymBool's hint (the value seen when tracing), adding no guard."""
    return meta.concrete(v) if isinstance(v, torch.SymInt) else v.node.hint


def ops_cache_path(
    device: torch.device | str, cache: str | os.PathLike[str] | None = None, *, prefill: bool = False
) -> Path:
    """The JSON file of ``device``'s op times: ``ops-<device name>-torch<version>.json`` next to the
    machine profile (``profile/cache.cache_path``); ``ops-prefilled-...`` for times taken with the device
    kept busy (:func:`time_node`'s ``prefill``), which are not the same readings."""
    machine_file = cache_path(device, cache)
    prefix = "ops-prefilled-" if prefill else "ops-"
    return machine_file.with_name(prefix + machine_file.name.removeprefix("machine-"))


@keeps_rng
def measure_op_times(
    nodes: Iterable[fx.Node],
    device: torch.device | str,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    repeat: int = 5,
    prefill: bool = False,
) -> dict[str, float]:
    """Seconds per :func:`op_signature` of ``nodes`` (those that have one) on ``device``, cached.

    Signatures already in ``ops_cache_path(device, cache)`` are read from it (``refresh=True``
    measures them again); the others are measured, with one progress line to stderr, and added to the
    file. A measurement: real inputs of the traced shapes and strides on ``device`` (small normal
    values for floating dtypes, zeros otherwise; tensors traced on the CPU, such as attention's RNG
    seed and offset, stay there), one warm-up call, then on CUDA (after :data:`CLOCK_WARMUP_S` of
    matrix products) ``repeat`` calls back to back between CUDA events, three times, the median of
    the means; on the CPU the median of ``repeat`` calls (``time.perf_counter``); outside any fake
    mode, autocast and autograd. An op
    that raises (shapes it cannot take, out of memory) is logged at debug level and left out: its
    nodes keep the roofline. With ``prefill`` (CUDA), each op is timed with the device kept busy while
    its calls are queued (:func:`time_node`), into a cache file of its own (:func:`ops_cache_path`).
    """
    device = torch.device(device)
    first = distinct_calls(nodes)
    path = ops_cache_path(device, cache, prefill=prefill)
    cached = {} if refresh else _read(path)
    known = {sig: cached[sig] for sig in first if sig in cached}
    missing = [sig for sig in first if sig not in known]
    if not missing:
        return known
    refuse_measuring(f"{len(missing)} of the model's ops")
    progress.note(f"protrain_fx: timing {len(missing)} matrix/attention ops on {device_name(device)} "
                  f"(once, cached in {path})")
    measured: dict[str, float] = {}
    with progress.phase("ops", "profiling ops", total=len(missing)) as shown, unset_fake_temporarily(), \
            torch.no_grad(), torch.autocast(device.type, enabled=False):
        if device.type == "cuda":
            warm_clocks(device)
        for sig in missing:
            try:
                measured[sig] = time_node(first[sig], device, repeat, prefill=prefill)
            except Exception as exc:  # noqa: BLE001 - any failure: the roofline stays for this op
                log.debug("protrain_fx: could not time %s: %s: %s", sig, type(exc).__name__, exc)
            shown.advance()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the inputs' blocks go back (a compile may measure under a budget)
    if measured:
        _write(path, {**_read(path), **measured}, device)
    return {**known, **measured}


#: GPU clock cycles :func:`time_node` keeps the device busy for (``torch.cuda._sleep``) per call
#: it then queues, with ``prefill``: about 0.2 ms a call at a 2 GHz clock, several times what the
#: host takes to queue one.
PREFILL_CYCLES_PER_CALL = 400_000


def time_node(node: fx.Node, device: torch.device, repeat: int, *, prefill: bool = False) -> float:
    """Seconds of one call of ``node``'s op on fresh inputs of its traced shapes.

    CUDA: ``repeat`` calls back to back between two events (as the kernels of a step run: queued, no
    host round trip between them), three times; the median of the three means. With ``prefill``, the
    device is kept busy while the calls are queued, so the start event does not wait for the first
    call's launch (the host's speed at that moment stays out of the reading). CPU: the median of
    ``repeat`` calls timed one by one."""
    args, kwargs = _real_args((node.args, dict(node.kwargs)), device)
    op = node.target
    out = op(*args, **kwargs)  # warm-up (kernel selection, lazy initialisation)
    times = []
    try:
        if device.type == "cuda":
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if prefill:
                    torch.cuda._sleep(PREFILL_CYCLES_PER_CALL * (repeat + 1))
                start.record()
                for _ in range(repeat):
                    out = op(*args, **kwargs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / repeat)
        else:
            for _ in range(repeat):
                out = None
                t0 = time.perf_counter()
                out = op(*args, **kwargs)
                times.append(time.perf_counter() - t0)
    finally:
        del out, args, kwargs
    return statistics.median(times)


#: Seconds of matrix products run before timing on CUDA, so that the ops are timed at the clocks a
#: training step runs at: an idle GPU lowers its clocks to a fraction of the peak and raises them
#: only after a burst of work, and the compile that measures has left it idle.
CLOCK_WARMUP_S = 0.2


def warm_clocks(device: torch.device) -> None:
    """Keep ``device`` busy with matrix products for :data:`CLOCK_WARMUP_S`, so timings start at its working clocks."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    deadline = time.perf_counter() + CLOCK_WARMUP_S
    while time.perf_counter() < deadline:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(device)
    del a


def _real_args(value: Any, device: torch.device, pool: dict[str, torch.Tensor] | None = None) -> Any:
    """``value`` with every node replaced by a real tensor (or number) like its traced value. With
    ``pool``, tensors of one shape, stride, dtype and device are made once and shared (keyed by
    :func:`_describe`): :func:`compute_load` keeps many ops' inputs at once."""
    if isinstance(value, fx.Node):
        return _real_args(value.meta["val"], device, pool)
    if isinstance(value, torch.Tensor):
        if pool is None:
            return _real_tensor(value, device)
        key = _describe(value)
        if key not in pool:
            pool[key] = _real_tensor(value, device)
        return pool[key]
    if isinstance(value, (list, tuple)):  # plain lists and tuples (fx keeps immutable ones)
        items = [_real_args(v, device, pool) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _real_args(v, device, pool) for k, v in value.items()}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _concrete_scalar(value)
    return value


def _real_tensor(fake: torch.Tensor, device: torch.device) -> torch.Tensor:
    shape = [meta.concrete(s) for s in fake.shape]
    stride = [meta.concrete(s) for s in fake.stride()]
    dev = torch.device("cpu") if fake.device.type == "cpu" else device
    dtype = fake.dtype
    # One flat buffer covering the strided extent, then a strided view: fills stride-0 (expanded)
    # tensors too, which an in-place fill of the view itself refuses.
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    if dtype.is_floating_point or dtype.is_complex:
        if dtype.itemsize >= 2:
            flat = torch.empty(extent, dtype=dtype, device=dev).normal_().mul_(0.02)
        else:  # float8: no normal_ kernel
            flat = torch.empty(extent, device=dev).normal_().mul_(0.02).to(dtype)
    else:
        flat = torch.zeros(extent, dtype=dtype, device=dev)
    return flat.as_strided(shape, stride)


#: Most bytes of inputs :func:`compute_load` keeps on the device (its ops' outputs come and go).
LOAD_MAX_BYTES = 1 << 30


def compute_load(
    nodes: Iterable[fx.Node], device: torch.device | str, *, max_bytes: int = LOAD_MAX_BYTES
) -> tuple[Callable[[Callable[[], bool]], None], list[str]] | None:
    """A stand-in for a model's own kernels, to run beside a measurement: ``(load, signatures)``,
    where ``load(done)`` runs each distinct compute-bound call of ``nodes`` (:func:`op_signature`:
    matrix products, attention, convolutions) once, in the order of the nodes, on real inputs of
    the traced shapes (made once, inputs of one shape shared, at most ``max_bytes`` of them), over and
    over until ``done()``, waiting for the device after each pass; ``signatures`` are the calls it
    runs. ``None`` when no call can run (none has a signature, or each raised when tried once here,
    as out of memory would). Should the device run out of memory while ``load`` runs (the
    measurement beside it allocates too), it stops loading, waits for ``done()`` and sets
    ``load.out_of_memory``. ``load.calls``: the ``(op, args, kwargs)`` it runs, in order.

    Why: the device steps of offloaded chunks (``profile/machine_profile.device_step_rate``) share
    the GPU with backward's kernels, and how long they take depends on those kernels' sizes: beside
    a model's own kernels they read close to training, beside stand-in products often below
    (``docs/results.md#device-step-rate-measured-against-training``)."""
    device = torch.device(device)
    first = distinct_calls(nodes)
    pool: dict[str, torch.Tensor] = {}
    calls: list[tuple[Any, tuple, dict]] = []
    names: list[str] = []
    with unset_fake_temporarily(), torch.no_grad(), torch.autocast(device.type, enabled=False):
        for sig, node in first.items():
            kept = dict(pool)
            try:
                args, kwargs = _real_args((node.args, dict(node.kwargs)), device, pool)
                if sum(t.untyped_storage().nbytes() for t in pool.values()) > max_bytes:
                    pool = kept  # this call's new inputs would pass the limit: left out
                    continue
                node.target(*args, **kwargs)  # once: it runs (and warms its kernel selection)
            except Exception as exc:  # noqa: BLE001 - any failure: this call is left out of the load
                log.debug("protrain_fx: load leaves out %s: %s: %s", sig, type(exc).__name__, exc)
                pool = kept
                continue
            calls.append((node.target, args, kwargs))
            names.append(sig)
    if not calls:
        return None

    def load(done: Callable[[], bool]) -> None:
        with unset_fake_temporarily(), torch.no_grad(), torch.autocast(device.type, enabled=False):
            while not load.out_of_memory and not done():
                try:
                    for op, args, kwargs in load.calls:
                        op(*args, **kwargs)
                except torch.OutOfMemoryError:
                    log.info("protrain_fx: the load of %d ops ran out of device memory; it stops", len(load.calls))
                    load.out_of_memory = True
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        while load.out_of_memory and not done():  # nothing beside the measurement from here on
            time.sleep(1e-3)

    load.calls = calls  # (op, args, kwargs), in the order it runs them
    load.out_of_memory = False
    return load, names


def _read(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") == CACHE_VERSION:
            return {str(k): float(v) for k, v in data["times"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # missing, unreadable or stale: measure again
    return {}


def _write(path: Path, times: dict[str, float], device: torch.device) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, {
        "version": CACHE_VERSION,
        "device": device_name(device),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "times": dict(sorted(times.items())),
    })


__all__ = ["compute_load", "distinct_calls", "measure_op_times", "op_signature", "ops_cache_path"]
