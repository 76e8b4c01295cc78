"""The machine profile: the rates the cost model prices a plan with, measured once per machine and cached.

:func:`measure_machine` measures the copy link and the optimizer rates (``device.py``, ``host.py``)
into a :class:`~protrain_fx.search.problem.MachineProfile`; :func:`chunk_adam_rate` and
:func:`device_step_rate` add the CPU step at a model's chunk size and the device steps at its chunk
layout. Each result is kept in the profile file of :mod:`protrain_fx.profile.cache` (one per device
name and torch version), so a later compile, in this process or another, reads it instead of
measuring; ``refresh=True`` measures again. Rates are bytes or parameters per second. The planner
(``planner/offload.py``) calls these; training's own timings later replace what they read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import fx

from protrain_fx import progress
from protrain_fx.machine import Machine, remember_card
from protrain_fx.profile import keeps_rng
from protrain_fx.profile.cache import (
    CACHE_VERSION,
    _granule,
    _median_rate,
    _write_json,
    cache_path,
    card_path,
    device_name,
    pinned_profile,
    read_json,
)
from protrain_fx.profile.device import (
    COPY_BYTES,
    DEVICE_STEP_PARAMS,
    LAYOUT_STEP_CHUNKS,
    _cuda_copy_rates,
    _device_step_bytes_per_s,
    card_rates,
    device_step_spans,
    layout_key,
)
from protrain_fx.profile.host import (
    ADAM_PARAMS,
    _adam_params_per_s,
    _chunk_adam_params_per_s,
    _host_copy_rate,
    _host_memory_bytes,
    wait_for_quiet_cpus,
)
from protrain_fx.profile.ops import compute_load, distinct_calls
from protrain_fx.runtime.store.host_memory import available_host_bytes
from protrain_fx.search import problem
from protrain_fx.state import refuse_measuring

log = logging.getLogger("protrain_fx")


@contextlib.contextmanager
def _timed(seconds: dict, what: str) -> Iterator[None]:
    """Add the seconds the block takes to ``seconds[what]`` (a profile file's ``"seconds"``) and log
    them: the profile is part of a first compile's wait, and its parts are what can be shortened.
    Never on a compile beside training (``state.refuse_measuring``)."""
    refuse_measuring(what)
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        seconds[what] = round(seconds.get(what, 0.0) + took, 3)
        log.info("protrain_fx: measuring %s took %.1f s", what, took)


#: The keys of a card's rates (``profile/device.card_rates``), all required in its file.
CARD_KEYS = ("flops", "hbm_bytes", "h2d_bytes", "d2h_bytes", "duplex_bytes")


@keeps_rng
def card_machine(
    device: torch.device | str,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
) -> Machine | None:
    """The :class:`~protrain_fx.machine.Machine` of the CUDA card ``device`` from its own rates
    (``profile/device.card_rates``: matrix products, device memory, the pinned link), measured once per
    card and torch version with one progress line (about a second) and kept in ``card_path``; handed
    to ``machine.remember_card``, so every later plan of this process prices the card at them.
    ``None`` off CUDA.

    Why measured: the estimate's memory-bound kernels run at the card's bandwidth, and a table keyed
    by name put an H100 at a generic card's (a third of its own), 40-50% off the step
    (``docs/results.md#the-estimate-on-each-card``)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    path = card_path(device, cache)
    data = None
    if not refresh:
        try:
            data = read_json(path)
        except (OSError, ValueError):
            data = None
    rates = data.get("rates") if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None
    if not (isinstance(rates, dict) and all(isinstance(rates.get(k), (int, float)) and rates[k] > 0 for k in CARD_KEYS)):
        progress.note(f"protrain_fx: measuring {device_name(device)} (matrix products, memory and link bandwidth; "
                      f"once, cached in {path})")
        try:
            with _timed({}, "the card's rates"):
                rates = card_rates(device)
        except torch.OutOfMemoryError:  # a budget too tight for it: the table's numbers stand in
            log.info("protrain_fx: %s could not be measured within the memory this process may use; its plans "
                     "use the table's rates", device_name(device))
            return None
        finally:
            torch.cuda.empty_cache()  # the measurement's blocks go back (a compile may be measuring under a budget)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(path, {"version": CACHE_VERSION, "device": device_name(device), "torch": torch.__version__,
                           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "rates": rates})
    return remember_card(device_name(device), rates)


@keeps_rng
def chunk_adam_rate(
    device: torch.device | str,
    chunk_params: int,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    repeat: int = 7,
    readings: int = 1,
) -> float:
    """Parameters per second of the offload runtime's CPU step of chunks of ``chunk_params``
    parameters (:func:`_chunk_adam_params_per_s`: on the worker thread, under copy traffic and
    kernel launches on CUDA), at that size rounded up to :data:`CHUNK_RATE_GRANULE`; measured per
    size, with one progress line, and kept in ``device``'s profile file (``"cpu_adam_by_chunk"``;
    each reading in ``"cpu_adam_chunk_readings"``), which :func:`measure_machine` makes first. A
    reading is the median of ``repeat`` steps: 7, as :func:`measure_machine`'s own CPU rate takes
    (the median of 3 reads far above the others now and then). With ``readings``, the file keeps at
    least that many readings (more are taken, at the time of the call, while it has fewer) and the
    rate is the fastest.

    Why the chunk's own size: a step streams the chunk's master, moments, gradient and working copy
    through host memory, and the rate falls with the size (large chunks step at a fraction of a
    small one's rate).

    Why the fastest of readings apart in time: a host's CPU can be slow for a while, and the two
    errors are not alike. A rate read too low makes the plan step every offloaded chunk on the GPU,
    so no chunk's CPU step is timed in training and the rate is never corrected
    (``planner/rates.py``); one read too high is, once training's steps are timed. Hence also
    :func:`wait_for_quiet_cpus` before each reading
    (``docs/results.md#cpu-step-rate-within-and-across-hosts``).

    A pinned profile (``profile.cache.pin_machine_profile``) measures nothing: its CPU rate is every
    chunk size's."""
    device = torch.device(device)
    if (pinned := pinned_profile(device, cache)) is not None:
        return pinned.cpu_adam_params_per_s
    measure_machine(device, cache=cache)  # the file this rate is kept in
    path = cache_path(device, cache)
    n = _granule(chunk_params)
    data = json.loads(path.read_text(encoding="utf-8"))
    rates = data.setdefault("cpu_adam_by_chunk", {})
    kept = data.setdefault("cpu_adam_chunk_readings", {})
    taken = [] if refresh else [float(r) for r in kept.get(str(n), [rates[str(n)]] if str(n) in rates else [])]
    if len(taken) >= max(1, readings):
        return max(taken)
    while len(taken) < max(1, readings):
        progress.note(f"protrain_fx: measuring the CPU step of a {n / 2**20:.3g}M-parameter chunk on {device_name(device)} "
                      f"({'again: the fastest of readings apart in time is kept' if taken else 'once'}, cached in {path})")
        busy = wait_for_quiet_cpus(device, "the CPU step")
        with _timed(data.setdefault("seconds", {}), f"the CPU step of {n}-parameter chunks"):
            taken.append(_chunk_adam_params_per_s(device.type == "cuda", n, repeat))
        if busy is not None:
            data.setdefault("busy_elsewhere", []).append([f"cpu_adam_by_chunk {n}", busy])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rates[str(n)] = max(taken)
    kept[str(n)] = taken
    _write_json(path, data)
    return max(taken)


@keeps_rng
def measure_machine(
    device: torch.device | str,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    copy_bytes: int = COPY_BYTES,
    adam_params: int = ADAM_PARAMS,
    repeat: int = 3,
) -> problem.MachineProfile:
    """Measured rates of ``device`` as a :class:`~protrain_fx.search.problem.MachineProfile`, cached.

    The first call for a (device name, torch version) pair measures, prints one progress line to
    stderr and writes ``cache_path(device, cache)``; later calls (even after a restart) read that
    file. ``refresh=True`` measures again, except a pinned profile (``profile.cache.pin_machine_profile``),
    which is returned as it is.

    What is measured (best of ``repeat`` after a warm-up; the CPU chunk step and the device steps:
    the median of ``2 * repeat + 1``):

    * CUDA: pinned host <-> device copies of ``copy_bytes`` timed with CUDA events (``h2d``, ``d2h``),
      both directions at once on two streams (``duplex``: total bytes over the wall time of both);
      the CPU step of one offloaded chunk of ``adam_params`` parameters as the offload runtime runs
      it (:func:`_chunk_adam_params_per_s`: fused AdamW on the fp32 master plus the new bf16 working
      copy: a plain fused AdamW step on one tensor reads well above this path's rate and above what
      the steps reach in training, and would make the CPU seem to keep up with the GPU when it does
      not), on the runtime's worker thread, on CUDA while pinned copies run
      both ways (:class:`_CopyLoad`, the traffic of training) and this thread launches kernels; a
      ``torch.optim.AdamW(fused=True)`` step on the GPU (the slope between ``adam_params`` and four
      times as many: :func:`_adam_params_per_s`); offloaded chunks' steps streamed through the GPU
      as the runtime runs them, beside the CPU step (:func:`_device_step_bytes_per_s`); ``gpu_bytes``
      = the device's total memory.
    * CPU only (no GPU to copy to): the CPU chunk step is measured as above (fp32, not pinned). The GPU numbers are
      stand-ins, recorded in the cache file's ``"stand_ins"`` list: ``h2d``/``d2h``/``duplex`` = the
      host's own memory-copy rate (one ``copy_`` of ``copy_bytes`` between two host tensors; the
      CPU "device" moves swapped values with such copies, and both directions share one memory bus,
      so duplex = one-way), GPU Adam = the CPU Adam rate (the "device" is the CPU), ``gpu_bytes`` =
      the host's physical memory (0 when unknown). The device step's rate is not measured (0: the
      cost model prices it at the shared copy rate).
    """
    device = torch.device(device)
    if (pinned := pinned_profile(device, cache)) is not None:
        return pinned
    path = cache_path(device, cache)
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") == CACHE_VERSION:
                return problem.MachineProfile.from_dict(data["profile"])
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or stale: measure again
    progress.note(f"protrain_fx: measuring {device_name(device)} (copy bandwidth, fused AdamW; once, cached in {path})")
    # the two rates training pays on every step: medians of more rounds (a median of 3 rounds reads
    # well above training now and then)
    busy = wait_for_quiet_cpus(device, "the CPU step")
    seconds: dict[str, float] = {}
    with _timed(seconds, "the CPU step"):
        cpu_adam = _chunk_adam_params_per_s(device.type == "cuda", adam_params, 2 * repeat + 1)
    stand_ins: list[str] = []
    if device.type == "cuda":
        with _timed(seconds, "the copy rates"):
            h2d, d2h, duplex = _cuda_copy_rates(device, copy_bytes, repeat)
        with _timed(seconds, "the device's AdamW"):
            gpu_adam = _adam_params_per_s(device, adam_params, repeat)
        with _timed(seconds, "the device steps"):
            device_step = _device_step_bytes_per_s(DEVICE_STEP_PARAMS, repeat=2 * repeat + 1)
        gpu_bytes = int(torch.cuda.get_device_properties(device).total_memory)
        torch.cuda.empty_cache()  # the measurement's blocks go back (a compile may be measuring under a budget)
    else:
        h2d = d2h = duplex = _host_copy_rate(copy_bytes, repeat)
        gpu_adam = cpu_adam
        device_step = 0.0
        gpu_bytes = _host_memory_bytes()
        stand_ins = ["h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s", "gpu_adam_params_per_s", "gpu_bytes"]
    profile = problem.MachineProfile(
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        duplex_bytes_per_s=duplex,
        cpu_adam_params_per_s=cpu_adam,
        gpu_adam_params_per_s=gpu_adam,
        gpu_bytes=gpu_bytes,
        device_step_bytes_per_s=device_step,
    )
    data = {
        "version": CACHE_VERSION,
        "device": device_name(device),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "copy_bytes": copy_bytes,
        "adam_params": adam_params,
        "stand_ins": stand_ins,
        "profile": profile.to_dict(),
        # per CPU measurement: what, and the fraction of the host's CPUs busy elsewhere as it started
        "busy_elsewhere": [["machine", busy]] if busy is not None else [],
        "seconds": seconds,  # per measurement, with those of later ones (the profile's share of a first compile)
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, data)
    return profile


@keeps_rng
def kept_device_step_rate(rates: dict, parts: Sequence[int], load_key: str) -> float:
    """The device-step rate a profile file's ``"device_step_by_layout"`` (``rates``) keeps for the
    chunk layout ``parts`` beside the load ``load_key`` (``"matmul"``, or ``"ops:<digest>"`` of a
    model's ops), else 0. For a model's ops, the layout measured beside that model's ops at other sizes
    (another input shape) stands in, the median of those: measured again, it would take seconds of
    every new shape's compile, and device memory beside the chunks the running graph placed (at a
    minimum budget, more than it leaves)."""
    layout = layout_key(parts)
    got = rates.get(f"{layout}|{load_key}")
    if isinstance(got, dict) and (rate := _median_rate([got.get("device_step_bytes_per_s")])):
        return rate
    if not load_key.startswith("ops:"):
        return 0.0
    return _median_rate([v.get("device_step_bytes_per_s") for k, v in rates.items()
                         if k.startswith(f"{layout}|ops:") and isinstance(v, dict)])


def device_step_rate(
    device: torch.device | str,
    parts: Sequence[int],
    *,
    load_nodes: Iterable[fx.Node] = (),
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    repeat: int = 5,
) -> float:
    """Bytes per second each way of device steps (``runtime/optim/device_adam.DeviceAdamW``) of chunks laid
    out as a model's: ``parts`` are the sizes, in order, of one chunk's parameters. Measured by
    :func:`device_step_spans` on :data:`LAYOUT_STEP_CHUNKS` such chunks, beside the CPU step and
    the model's own compute-bound kernels (``profile/ops.compute_load`` of ``load_nodes``, the
    captured forward and backward graphs' nodes; 8192^3 matrix products where there are none), as
    each step's 14 bytes a parameter copied out over the median step's own span (first copy in to
    last copy out, as ``runtime/offload/step_window.StepWindow`` times training's steps); once per layout and load
    (:func:`kept_device_step_rate`: another input shape of the model reads its layout's rate), with
    one progress line, kept in ``device``'s profile file (``"device_step_by_layout"``, with the
    round's rate, as :func:`_device_step_bytes_per_s` reads one, and the CPU step's rate beside the
    device steps, for comparison with training's). 0 where there is nothing to measure: not CUDA, no
    parts, or a host whose available memory is under 4x the pinned memory the measurement takes (its
    store of ``LAYOUT_STEP_CHUNKS + 1`` chunks). A size that is not positive raises ``ValueError``.

    Why the layout: the steps' copies and updates run per slice and per parameter, so one large
    tensor reads faster than chunks of a model's many smaller weights, biases and norms. Why the
    load and each step's own span: beside stand-in matrix products the round's rate misses
    training's by a different sign at different layouts, while each step's span beside the model's
    own kernels reads close to training
    (``docs/results.md#device-step-rate-measured-against-training``). The re-fetches that cross
    the link beside a step in training are left out here: the cost model adds them itself
    (``search/cost.CostModel._dev_refetch``), and training's rate is compared without them
    (``planner/rates.alone_rate``). A pinned profile (``profile.cache.pin_machine_profile``)
    measures nothing: its device-step rate is every layout's."""
    device = torch.device(device)
    parts = [int(x) for x in parts]
    if parts and min(parts) <= 0:
        raise ValueError(f"device_step_rate: parameter sizes must be positive, got {min(parts)}")
    if device.type != "cuda" or not parts:
        return 0.0
    if (pinned := pinned_profile(device, cache)) is not None:
        return pinned.device_step_bytes_per_s
    measure_machine(device, cache=cache)  # the file this rate is kept in
    path = cache_path(device, cache)
    load_nodes = list(load_nodes)  # read twice: the key, then the load
    signatures = sorted(distinct_calls(load_nodes))
    load_key = "ops:" + hashlib.sha1("\n".join(signatures).encode()).hexdigest()[:12] if signatures else "matmul"
    data = json.loads(path.read_text(encoding="utf-8"))
    rates = data.setdefault("device_step_by_layout", {})
    key = f"{layout_key(parts)}|{load_key}"
    if not refresh and (rate := kept_device_step_rate(rates, parts, load_key)):
        return rate

    n = sum(parts)
    need = (LAYOUT_STEP_CHUNKS + 1) * n * 18  # fp32 master and moments, working copy, gradient
    available = available_host_bytes()
    if available is not None and 4 * need > available:
        progress.note(f"protrain_fx: not measuring device steps of this chunk layout: it pins {need / 2**30:.1f} GiB and "
                      f"{available / 2**30:.1f} GiB of host memory are available")
        return 0.0
    seconds = data.setdefault("seconds", {})
    with _timed(seconds, "the model's ops as load"):
        load = compute_load(load_nodes, device) if signatures else None
    beside, what = (load[0], f"{len(load[1])} of the model's ops") if load else ("matmul", "matrix products")
    progress.note(f"protrain_fx: measuring device steps of chunks of {n / 2**20:.3g}M parameters in {len(parts)} tensors "
                  f"on {device_name(device)} beside {what} (once per layout, cached in {path})")
    busy = wait_for_quiet_cpus(device, "the device steps beside the CPU step")
    cpu: list[float] = []
    steps: list[float] = []
    with _timed(seconds, f"device steps of the {layout_key(parts)} layout"):
        spans = device_step_spans(n, LAYOUT_STEP_CHUNKS, repeat, cpu=True, beside=beside, parts=parts,
                                  cpu_rates=cpu, step_spans=steps)
    if load is not None and load[0].out_of_memory:
        what += ", until the device ran out of memory"
    del load, beside
    torch.cuda.empty_cache()  # the load's inputs go back (a compile may measure under a budget)
    rate = 14 * n / max(statistics.median(steps), 1e-9)
    rates[key] = {"params": n, "tensors": len(parts), "device_step_bytes_per_s": rate,
                  "round_bytes_per_s": LAYOUT_STEP_CHUNKS * 14 * n / max(statistics.median(spans), 1e-9),
                  "beside": what, "busy_elsewhere": busy,
                  "cpu_adam_params_per_s_beside": statistics.median(cpu) if cpu else 0.0}
    _write_json(path, data)
    return rate
