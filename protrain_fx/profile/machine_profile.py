"""TODO docstring."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence

import torch
from torch import fx

from protrain_fx.profile.cache import (
    CACHE_VERSION,
    _granule,
    _median_rate,
    _write_json,
    cache_path,
    device_name,
)
from protrain_fx.profile.device import (
    COPY_BYTES,
    DEVICE_STEP_PARAMS,
    LAYOUT_STEP_CHUNKS,
    _cuda_copy_rates,
    _device_step_bytes_per_s,
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
from protrain_fx.search import problem


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
    (the median of 3 read 2.4x the others once in five on one H200 host, ``bench/cpu_rate_rounds.py``,
    sixteenth session). With ``readings``, the file keeps at least that many readings (more are
    taken, at the time of the call, while it has fewer) and the rate is the fastest.

    Why the chunk's own size: a step streams the chunk's master, moments, gradient and working copy
    through host memory, and the rate fell with the size. On the development CPU (32 MiB L3,
    2026-11-30) 16M parameters stepped at 0.52 G/s and 64M or 128M at 0.42; on the H200's host, B24
    chunks of 100M-230M parameters stepped at 0.51-0.87x the rate measured on 16M (1.0 against
    1.3-2.0 G/s; ``docs/results.md``, seventh session).

    Why the fastest of readings apart in time: a host's CPU can be slow for a while. On one H200
    host (2026-12-02) a fresh 4.2B compile read 0.19 G/s on its 224M chunk, where the same host
    read 1.2 a few minutes later and 0.51 with device steps beside it seconds later; two of the 27
    profiles recorded in sessions 12-19 read under 0.4 once, where their other readings were
    0.87-1.22 (``docs/raw/session1[78]_machine_c3.json``). A rate read too low makes the plan step
    every offloaded chunk on the GPU, so no chunk's CPU step is timed in training and the rate is
    never corrected (``calibrate``); one read too high is, once training's steps are timed. On
    another host the second reading read lower still (0.69, then 0.32): hence also
    :func:`wait_for_quiet_cpus` before each reading."""
    device = torch.device(device)
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
        print(
            f"protrain_fx: measuring the CPU step of a {n / 2**20:.0f}M-parameter chunk on {device_name(device)} "
            f"({'again: the fastest of readings apart in time is kept' if taken else 'once'}, cached in {path})",
            file=sys.stderr,
            flush=True,
        )
        busy = wait_for_quiet_cpus(device, "the CPU step")
        taken.append(_chunk_adam_params_per_s(device.type == "cuda", n, repeat))
        if busy is not None:
            data.setdefault("busy_elsewhere", []).append([f"cpu_adam_by_chunk {n}", busy])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rates[str(n)] = max(taken)
    kept[str(n)] = taken
    _write_json(path, data)
    return max(taken)


def measure_machine(
    device: torch.device | str,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    copy_bytes: int = COPY_BYTES,
    adam_params: int = ADAM_PARAMS,
    repeat: int = 3,
) -> problem.MachineProfile:
    """Measured rates of ``device`` as a :class:`~protrain_fx.cost.MachineProfile`, cached.

    The first call for a (device name, torch version) pair measures, prints one progress line to
    stderr and writes ``cache_path(device, cache)``; later calls (even after a restart) read that
    file. ``refresh=True`` measures again.

    What is measured (best of ``repeat`` after a warm-up; the CPU chunk step and the device steps:
    the median of ``2 * repeat + 1``):

    * CUDA: pinned host <-> device copies of ``copy_bytes`` timed with CUDA events (``h2d``, ``d2h``),
      both directions at once on two streams (``duplex``: total bytes over the wall time of both);
      the CPU step of one offloaded chunk of ``adam_params`` parameters as the offload runtime runs
      it (:func:`_chunk_adam_params_per_s`: fused AdamW on the fp32 master plus the new bf16 working
      copy; a plain fused AdamW step on one tensor read about 2x this path's rate on the H200, and
      up to 5x what the steps reached in training, so the cost model used to think the CPU kept up
      with the GPU when it did not), on the runtime's worker thread, on CUDA while pinned copies run
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
    path = cache_path(device, cache)
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") == CACHE_VERSION:
                return problem.MachineProfile.from_dict(data["profile"])
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or stale: measure again
    print(
        f"protrain_fx: measuring {device_name(device)} (copy bandwidth, fused AdamW; once, cached in {path})",
        file=sys.stderr,
        flush=True,
    )
    # the two rates training pays on every step: medians of more rounds (3 rounds read from 1.14 to
    # 1.81 G params/s on H200 machines whose training ran at 1.14 to 1.36)
    busy = wait_for_quiet_cpus(device, "the CPU step")
    cpu_adam = _chunk_adam_params_per_s(device.type == "cuda", adam_params, 2 * repeat + 1)
    stand_ins: list[str] = []
    if device.type == "cuda":
        h2d, d2h, duplex = _cuda_copy_rates(device, copy_bytes, repeat)
        gpu_adam = _adam_params_per_s(device, adam_params, repeat)
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
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, data)
    return profile


def device_step_rate(
    device: torch.device | str,
    parts: Sequence[int],
    *,
    load_nodes: Iterable[fx.Node] = (),
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    repeat: int = 5,
) -> float:
    """Bytes per second each way of device steps (``runtime/device_adam.DeviceAdamW``) of chunks laid
    out as a model's: ``parts`` are the sizes, in order, of one chunk's parameters. Measured by
    :func:`device_step_spans` on :data:`LAYOUT_STEP_CHUNKS` such chunks, beside the CPU step and
    the model's own compute-bound kernels (``opprofile.compute_load`` of ``load_nodes``, the
    captured forward and backward graphs' nodes; 8192^3 matrix products where there are none), as
    each step's 14 bytes a parameter copied out over the median step's own span (first copy in to
    last copy out, as ``calibrate.RateWindow`` times training's steps); once per layout and load, with
    one progress line, kept in ``device``'s profile file (``"device_step_by_layout"``, with the
    round's rate, as :func:`_device_step_bytes_per_s` reads one, and the CPU step's rate beside the
    device steps, for comparison with training's). 0 where there is nothing to measure: not CUDA, no
    parts, or a host whose available memory is under 4x the pinned memory the measurement takes (its
    store of ``LAYOUT_STEP_CHUNKS + 1`` chunks). A size that is not positive raises ``ValueError``.

    Why the layout: the steps' copies and updates run per slice and per parameter, and on the H200
    (2026-12-01, ``bench/device_step_rate.py``) one 64M-parameter tensor read 47.9 GB/s where chunks
    of B24 1.3B's and 4.2B's blocks read 39.9 and 44.4, and their training reached 41.1 and 41.4.
    Why the load and the step's span: beside 8192^3 products, the round's rate read 34.5-35.3 GB/s at
    1.3B's layout on four hosts where training reached 36.6-40.5, and 45.7-46.7 at 4.2B's on five
    hosts of six where it reached 39.2-41.8. In ``bench/device_step_chain.py`` (2026-12-02), each
    step's span beside a GPT block's own kernels read 40.6 and 42.2 where that host's training
    reached 40.3 and 41.1, and 38.8 and 41.7 on another host where it reached 35.3 and 41.9. In the
    compile, on two hosts, this measurement then read 5.7-13.9% above the median span training
    reached (``docs/results.md``, twentieth session). That span includes the copies beside the
    steps, which the cost model now adds itself (``cost.CostModel._dev_refetch``); against
    training's rate without them (``calibrate.alone_rate``) it read +1.5%, +3.3% (one host), -7.4%,
    -2.9% (another) and -14.1% (a third, whose pinned copies both ways also read 10-15% below the
    other hosts' at profile time; twenty-first session)."""
    device = torch.device(device)
    parts = [int(x) for x in parts]
    if parts and min(parts) <= 0:
        raise ValueError(f"device_step_rate: parameter sizes must be positive, got {min(parts)}")
    if device.type != "cuda" or not parts:
        return 0.0
    measure_machine(device, cache=cache)  # the file this rate is kept in
    path = cache_path(device, cache)
    load_nodes = list(load_nodes)  # read twice: the key, then the load
    signatures = sorted(distinct_calls(load_nodes))
    load_key = "ops:" + hashlib.sha1("\n".join(signatures).encode()).hexdigest()[:12] if signatures else "matmul"
    data = json.loads(path.read_text(encoding="utf-8"))
    rates = data.setdefault("device_step_by_layout", {})
    key = f"{layout_key(parts)}|{load_key}"
    got = rates.get(key)
    if not refresh and isinstance(got, dict) and (rate := _median_rate([got.get("device_step_bytes_per_s")])):
        return rate
    from protrain_fx.runtime.host_memory import available_host_bytes

    n = sum(parts)
    need = (LAYOUT_STEP_CHUNKS + 1) * n * 18  # fp32 master and moments, working copy, gradient
    available = available_host_bytes()
    if available is not None and 4 * need > available:
        print(f"protrain_fx: not measuring device steps of this chunk layout: it pins {need / 2**30:.1f} GiB and "
              f"{available / 2**30:.1f} GiB of host memory are available", file=sys.stderr, flush=True)
        return 0.0
    load = compute_load(load_nodes, device) if signatures else None
    beside, what = (load[0], f"{len(load[1])} of the model's ops") if load else ("matmul", "matrix products")
    print(f"protrain_fx: measuring device steps of chunks of {n / 2**20:.0f}M parameters in {len(parts)} tensors "
          f"on {device_name(device)} beside {what} (once per layout, cached in {path})", file=sys.stderr, flush=True)
    busy = wait_for_quiet_cpus(device, "the device steps beside the CPU step")
    cpu: list[float] = []
    steps: list[float] = []
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
