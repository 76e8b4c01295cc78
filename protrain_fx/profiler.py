"""The profiler: fills a :class:`protrain_fx.cost.Problem` from a captured training step and the machine.

Two halves:

* :func:`measure_machine` measures the machine's rates (copy bandwidths, fused AdamW throughput) into a
  :class:`~protrain_fx.cost.MachineProfile`, once per device and torch version: the result is cached
  as JSON under ``~/.cache/protrain_fx`` (or ``$PROTRAIN_CACHE_DIR``, or the ``cache_dir`` argument).
* :func:`problem_from_record` turns a :class:`~protrain_fx.capture.CapturedGraph` (a step with a
  backward graph) into the search's plain-data :class:`~protrain_fx.cost.Problem`: per block its
  times and activation bytes, the parameter chunks and which block uses which, the work outside the
  blocks.

Approximations are stated where they are made (docstrings of :func:`problem_from_record` and of the
helpers); in short: times are a roofline estimate unless measured times are passed, recompute costs
the part of the forward the backward reads, a checkpointed block keeps the values crossing into it,
and swap leaves small values.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from protrain_fx import chunks as chunks_mod
from protrain_fx import cost, meta
from protrain_fx.capture import CapturedGraph
from protrain_fx.machine import Machine, machine_for
from protrain_fx.opprofile import compute_load, distinct_calls, measure_op_times, op_signature
from protrain_fx.passes.estimate import fused_node_times, node_time
from protrain_fx.passes.memory import _output_args, default_granule
from protrain_fx.passes.params import parameter_infos
from protrain_fx.passes.swap import swap_candidates

MiB = 2**20
#: Version of the machine cache file; a file of another version is measured again.
CACHE_VERSION = 8
#: Default sizes of the measurements (``measure_machine`` arguments).
COPY_BYTES = 256 * MiB
ADAM_PARAMS = 16 * 2**20
#: Parameters per chunk of the measured device steps (:func:`_device_step_bytes_per_s`): 8 of the
#: runtime's staging slices, so the slices' pipeline runs full for most of a step.
DEVICE_STEP_PARAMS = 64 * 2**20

# ---------------------------------------------------------------------------- machine


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where measured machine profiles are kept: ``path``, else ``$PROTRAIN_CACHE_DIR``, else
    ``~/.cache/protrain_fx``."""
    if path is not None:
        return Path(path)
    env = os.environ.get("PROTRAIN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "protrain_fx"


def device_name(device: torch.device | str) -> str:
    """The name a machine profile is cached under: the GPU's name, or ``cpu-<processor>``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.processor() or platform.machine() or 'unknown'}"


def cache_path(device: torch.device | str, cache: str | os.PathLike[str] | None = None) -> Path:
    """The JSON file of ``device``'s profile: keyed by device name and torch version."""
    key = f"{device_name(device)}-torch{torch.__version__}"
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", key).strip("_")
    return cache_dir(cache) / f"machine-{slug}.json"


#: Above this fraction of the host's CPUs busy with other processes, a measurement of a CPU rate
#: on CUDA waits (:func:`wait_for_quiet_cpus`), at most :data:`QUIET_WAIT_S` seconds.
BUSY_ELSEWHERE_LIMIT = 0.15
QUIET_WAIT_S = 60.0
#: What is left of :data:`QUIET_WAIT_S` for this process: the waits of all measurements share it, so a
#: host that is always this busy costs one minute, not one per measurement.
_quiet_wait_left = [QUIET_WAIT_S]


def host_cpu_times() -> list[int]:
    """The host's CPU ticks so far, summed over its CPUs (``/proc/stat``'s ``cpu`` line): user, nice,
    system, idle, iowait, irq, softirq, steal (guest time is in user). Raises ``OSError`` or
    ``ValueError`` where that cannot be read (not Linux)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        raise ValueError("/proc/stat: no cpu line with steal")
    return [int(x) for x in fields[1:9]]


def _process_ticks(stat: str) -> tuple[str, int]:
    """A process's name and its CPU ticks so far (user and system) from its ``/proc/<pid>/stat``."""
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 on
    return stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[11]) + int(fields[12])


def _cpu_ticks() -> tuple[int, int, int]:
    """The host's CPU ticks so far: all, idle (with I/O wait), and this process's."""
    ticks = host_cpu_times()
    with open("/proc/self/stat", encoding="ascii") as f:
        own = _process_ticks(f.read())[1]
    return sum(ticks), ticks[3] + ticks[4], own


def cpus_busy_elsewhere(window_s: float = 0.5) -> float | None:
    """The fraction of the host's CPU time that processes other than this one used over the next
    ``window_s`` seconds (``/proc/stat`` against ``/proc/self/stat``); ``None`` where those files
    cannot be read (not Linux)."""

    try:
        total0, idle0, own0 = _cpu_ticks()
        time.sleep(window_s)
        total1, idle1, own1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    if total <= 0:
        return None
    return max(0.0, ((total - (idle1 - idle0)) - (own1 - own0)) / total)


def busiest_elsewhere(window_s: float = 0.5, top: int = 3) -> list[tuple[str, int, float]]:
    """The ``top`` other processes that used the most CPU over the next ``window_s`` seconds, as
    ``(name, pid, CPUs' worth)``, from ``/proc/<pid>/stat``; empty where that cannot be read."""

    def ticks() -> dict[int, tuple[str, int]]:
        out = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                    out[int(entry.name)] = _process_ticks(f.read())
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile, or unreadable
        return out

    try:
        before = ticks()
        start = time.perf_counter()
        time.sleep(window_s)
        after = ticks()
        elapsed = time.perf_counter() - start
    except OSError:
        return []
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used = [(name, pid, (t - before[pid][1]) / hz / elapsed) for pid, (name, t) in after.items() if pid in before]
    return sorted((u for u in used if u[2] > 0), key=lambda u: -u[2])[:top]


def wait_for_quiet_cpus(device: torch.device, what: str, max_wait_s: float | None = None) -> float | None:
    """On CUDA, before ``what`` (a measurement of a CPU rate) starts: wait, up to ``max_wait_s``
    seconds (default: what is left of this process's :data:`QUIET_WAIT_S`), until at most
    :data:`BUSY_ELSEWHERE_LIMIT` of the host's CPUs are busy with other processes, with one
    progress line if it waits. Returns the last fraction seen (``None`` off CUDA or off Linux).

    Why: on two fresh H200 hosts (2026-12-02) a 4.2B compile read the CPU step at 0.19-0.69 G
    params/s, where training on one of them reached 1.07 and a later process on the other read
    1.08-1.22; the plan built on the low reading stepped every offloaded chunk on the GPU. The cause
    suspected then: ``torch._inductor.compile_fx`` wakes Inductor's pool of compile workers (one
    subprocess per ``TORCHINDUCTOR_COMPILE_THREADS``, 8 there, each importing torch) as the compile
    starts, and the profile runs inside that compile. It was ruled out on two H200 hosts
    (twenty-first session, ``bench/cpu_rate_after_wakeup.py``): the pool kept at most 9% of the CPUs
    busy, for about 10 s, the CPU step still moved 0.63-1.55 G params/s within a minute with nothing
    busy and under 1% steal, and this wait never waited in three compiles (nor in the twenty-second
    session's): the cause is outside what the guest sees. The wait stays, as it costs half a second
    when the host is quiet. The file keeps the fraction seen at each measurement
    (``"busy_elsewhere"``)."""
    if device.type != "cuda":
        return None
    shared = max_wait_s is None
    max_wait_s = _quiet_wait_left[0] if shared else max_wait_s
    start = time.perf_counter()
    busy = cpus_busy_elsewhere()
    if busy is None or busy <= BUSY_ELSEWHERE_LIMIT:
        return busy
    names = ", ".join(f"{name} {pid} ({cpus:.1f} CPUs)" for name, pid, cpus in busiest_elsewhere())
    print(f"protrain_fx: waiting for the host's CPUs before {what}: {busy:.0%} busy with other processes "
          f"({names or 'not named'}; up to {max_wait_s:.0f} s)", file=sys.stderr, flush=True)
    while busy is not None and busy > BUSY_ELSEWHERE_LIMIT and time.perf_counter() - start < max_wait_s:
        busy = cpus_busy_elsewhere()
    waited = time.perf_counter() - start
    if shared:
        _quiet_wait_left[0] = max(0.0, _quiet_wait_left[0] - waited)
    if busy is not None and busy > BUSY_ELSEWHERE_LIMIT:
        print(f"protrain_fx: measuring {what} with {busy:.0%} of the host's CPUs busy with other processes "
              f"(waited {waited:.0f} s); the rate may read low", file=sys.stderr, flush=True)
    return busy


def measure_machine(
    device: torch.device | str,
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    copy_bytes: int = COPY_BYTES,
    adam_params: int = ADAM_PARAMS,
    repeat: int = 3,
) -> cost.MachineProfile:
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
                return cost.MachineProfile.from_dict(data["profile"])
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
    profile = cost.MachineProfile(
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


#: The CPU chunk step is measured per chunk size rounded up to a multiple of this many parameters.
CHUNK_RATE_GRANULE = 16 * 2**20


def _granule(chunk_params: int) -> int:
    """``chunk_params`` rounded up to :data:`CHUNK_RATE_GRANULE` (at least one granule): the chunk
    size a CPU step rate is measured and kept at."""
    return max(1, -(-chunk_params // CHUNK_RATE_GRANULE)) * CHUNK_RATE_GRANULE


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


#: Device-stepped chunks per round of :func:`device_step_rate` (the CPU's chunk beside them is one more).
LAYOUT_STEP_CHUNKS = 3


def layout_key(parts: Sequence[int]) -> str:
    """The key of a chunk layout (its parameters' sizes in order) in the profile file: parameters,
    count, and a digest of the sizes."""
    digest = hashlib.sha1(",".join(map(str, parts)).encode()).hexdigest()[:12]
    return f"{sum(parts)}:{len(parts)}:{digest}"


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
    from protrain_fx.runtime.chunk_store import available_host_bytes

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


#: How many in-training measurements of each rate a profile file keeps (the newest); the rate used
#: is their median.
TRAINING_KEEP = 5
#: The key under ``"in_training"`` of the device steps' rates (``calibrate.alone_rate``: without the
#: re-fetches beside them). Until the twenty-first session the window kept the median span's rate,
#: re-fetches included, under ``"device_step_bytes_per_s"``; those entries are not read, since the
#: cost model now adds the re-fetches to the rate it is given.
TRAINING_DEVICE_KEY = "device_step_alone_bytes_per_s"


def note_training_rates(
    device: torch.device | str,
    *,
    chunk_params: int | None = None,
    cpu_adam_params_per_s: float = 0.0,
    device_step_bytes_per_s: float = 0.0,
    cache: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Keep rates measured in training (``protrain_fx.calibrate``) in ``device``'s profile file
    (``"in_training"``), for :func:`training_rates`: the CPU chunk step's (per chunk size, rounded as
    :func:`chunk_adam_rate` rounds it) and the device steps' (without the re-fetches beside them,
    under :data:`TRAINING_DEVICE_KEY`). A rate of 0 is not kept. Without a profile file (nothing was
    measured on this machine) nothing is written; measuring the profile again (``refresh``, another
    cache version) starts without them. Returns the file written, else ``None``."""
    path = cache_path(device, cache)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("version") != CACHE_VERSION or (device_step_bytes_per_s <= 0 and not (cpu_adam_params_per_s > 0 and chunk_params)):
        return None
    kept = data.setdefault("in_training", {})
    if device_step_bytes_per_s > 0:
        kept[TRAINING_DEVICE_KEY] = (kept.get(TRAINING_DEVICE_KEY, []) + [device_step_bytes_per_s])[-TRAINING_KEEP:]
    if cpu_adam_params_per_s > 0 and chunk_params:
        n = str(_granule(chunk_params))
        by_chunk = kept.setdefault("cpu_adam_by_chunk", {})
        by_chunk[n] = (by_chunk.get(n, []) + [cpu_adam_params_per_s])[-TRAINING_KEEP:]
    _write_json(path, data)
    return path


def training_rates(
    device: torch.device | str,
    profile: cost.MachineProfile,
    chunk_params: int | None = None,
    *,
    cache: str | os.PathLike[str] | None = None,
) -> tuple[cost.MachineProfile, list[str]]:
    """``profile`` with the rates training reached on this machine (:func:`note_training_rates`) in
    place of the profiler's, and the names of the fields replaced.

    * ``device_step_bytes_per_s``: the median of those kept.
    * ``cpu_adam_params_per_s`` (the rate of chunks of ``chunk_params``): the median of those kept for
      this chunk size; for a size not trained yet, the median of the trained sizes' rates within
      :data:`NEAR_CHUNK_FACTOR` of it; failing those, ``profile``'s rate scaled by the median ratio
      of training's rate to the profiler's (``"cpu_adam_by_chunk"``) over the sizes trained. Without
      ``chunk_params`` it is left as it is.

    Why a near size's rate and not the scaled profile: on the six H200 hosts of 2026-12-01 that
    trained chunks of both 117M and 234M parameters, the profiler's reading of each size missed its
    training rate by 0.69-1.28x, and not by one factor for both sizes of a host. Predicting each
    size's training rate from the other size on the same host, the scaled profile missed by 18% on
    average (4-35%), the size's own profiled rate by 14%, the other size's training rate by 11%.
    Scaled, one size's miss lands on the other: a 4.2B run's 234M chunks profiled at 0.99 and
    trained at 1.43, so the 1.3B run after it priced its 117M chunks at 1.33 x 1.44 = 1.92 G/s and
    trained at 1.48 (``docs/results.md``, seventeenth session)."""
    try:
        data = json.loads(cache_path(device, cache).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return profile, []
    if data.get("version") != CACHE_VERSION:
        return profile, []
    kept = data.get("in_training")
    kept = kept if isinstance(kept, dict) else {}
    changes: dict[str, float] = {}
    if device := _median_rate(kept.get(TRAINING_DEVICE_KEY)):
        changes["device_step_bytes_per_s"] = device
    by_chunk = kept.get("cpu_adam_by_chunk")
    by_chunk = {k: r for k, v in by_chunk.items() if (r := _median_rate(v))} if isinstance(by_chunk, dict) else {}
    if chunk_params and by_chunk:
        n = str(_granule(chunk_params))
        near = [r for k, r in by_chunk.items() if k.isdigit() and _near_size(int(k), int(n))]
        if n in by_chunk:
            changes["cpu_adam_params_per_s"] = by_chunk[n]
        elif near:
            changes["cpu_adam_params_per_s"] = statistics.median(near)
        else:
            profiled = data.get("cpu_adam_by_chunk")
            profiled = profiled if isinstance(profiled, dict) else {}
            ratios = [r / p for k, r in by_chunk.items() if (p := _median_rate([profiled.get(k)]))]
            if ratios:
                changes["cpu_adam_params_per_s"] = profile.cpu_adam_params_per_s * statistics.median(ratios)
    return dataclasses.replace(profile, **changes), sorted(changes)


#: A chunk size not trained yet takes the CPU rate training reached on sizes within this factor of
#: it (:func:`training_rates`). Chunks of 16M parameters stepped faster than those of 100M-230M
#: (0.51-0.87x the 16M rate on the H200's host; :func:`chunk_adam_rate`), while in training 117M
#: chunks stepped at 0.89-1.34x the rate of 234M ones on the same host (six hosts, 2026-12-01).
NEAR_CHUNK_FACTOR = 4


def _near_size(a: int, b: int) -> bool:
    return a > 0 and b > 0 and max(a, b) <= NEAR_CHUNK_FACTOR * min(a, b)


def _median_rate(values: object) -> float:
    """The median of the positive finite numbers in ``values`` (a list read from a profile file, which
    a person may have edited), else 0: entries that are not rates are left out."""
    if not isinstance(values, list):
        return 0.0
    rates = [float(v) for v in values
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0]
    return statistics.median(rates) if rates else 0.0


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


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


def _host_copy_rate(nbytes: int, repeat: int) -> float:
    """Bytes per second of one host-to-host ``copy_`` (the CPU stand-in for the copy links)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i:
            best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _chunk_adam_params_per_s(
    cuda: bool, n: int, repeat: int, *, chunks: int = 1, rates: list[float] | None = None
) -> float:
    """Parameters per second of the offload runtime's CPU step of one chunk of ``n`` fp32 parameters
    (``runtime/cpu_adam.ChunkAdamW.step_chunk``: AdamW on the fp32 master, then the chunk's new
    compute-dtype working copy; bf16 and pinned when a GPU will fetch it): what the chunks stepped on
    the CPU cost, measured on the code path that steps them, on the runtime's worker thread (its
    OpenMP team, ``cpu_adam.worker_threads``). On CUDA, as in training, pinned copies run both ways
    meanwhile (:class:`_CopyLoad`) and this thread launches small CUDA kernels from Python
    (:func:`_launch_until`: the training loop's share of the CPU). The median of ``repeat`` steps
    after a warm-up (training pays every step, not the best one). ``chunks``: distinct chunks in the
    store, stepped in turn (training steps each once per step, never one twice in a row);
    ``rates``: a list that gets each timed step's parameters per second."""
    from protrain_fx.chunks import ParamInfo, pack
    from protrain_fx.runtime.chunk_store import ChunkStore
    from protrain_fx.runtime.cpu_adam import ChunkAdamW, OptimizerWorker

    params = {f"w{c}": torch.nn.Parameter(torch.zeros(n, dtype=torch.float32)) for c in range(chunks)}
    layout = pack([ParamInfo((w,), 4 * n, f"blocks.{c}", c) for c, w in enumerate(params)], 4 * n)
    store = ChunkStore(layout, params, compute_dtype=torch.bfloat16 if cuda else None, pin_memory=cuda)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-3, weight_decay=0.1, fused=True)
    adam = ChunkAdamW(store, opt, params)
    grad = torch.full((n,), 1e-3, dtype=store.compute_dtype)
    load = _CopyLoad(nbytes=min(8 * n, _COPY_LOAD_BYTES)) if cuda else None
    rounds = max(8, -(-64 * n // _COPY_LOAD_BYTES))  # 64 bytes per parameter each way: about the step's length
    times = []
    with OptimizerWorker(adam.step_chunk) as worker:
        for i in range(repeat + chunks):  # the first round of each chunk warms its pages
            c = i % chunks
            store.write_grads({f"w{c}": grad})
            store.wait_grad(c)
            if load is not None:
                load.start(rounds)
            busy = worker.busy_s
            worker.submit(c)
            if cuda:
                _launch_until(lambda: not worker.pending(c))
            worker.wait(c)
            if load is not None:
                load.stop()
            if i >= chunks:
                times.append(worker.busy_s - busy)
    if rates is not None:
        rates.extend(n / max(t, 1e-9) for t in times)
    return n / max(statistics.median(times), 1e-9)


def _device_step_bytes_per_s(
    n: int, chunks: int = 3, repeat: int = 3, *, parts: Sequence[int] = (), cpu_rates: list[float] | None = None
) -> float:
    """Bytes per second each way of offloaded chunks' optimizer steps streamed through the GPU
    (``runtime/device_adam.DeviceAdamW``): the bytes a step copies out (fp32 master and moments, the
    new working copy: 14 per parameter) over the median span of :func:`device_step_spans` with the
    CPU step and matrix products beside them. B24 4.2B's device steps moved 14 bytes per parameter at
    38 GB/s in backward, where one copy out alone ran at 54 and both ways at once at 48 each, and this
    measurement without the products read 44 (H200, 2026-11-30). It reads high: 41.6 to 48.7 GB/s on
    2026-12-01's machines, whose training steps ran at 38 to 42. Keeping a kernel queue full beside
    (``beside="deep"``) and loading the GPU while the third step waits (``while_waiting``) read 30.9
    at this size and 42.6 at 226M parameters laid out as GPT blocks: not adopted before it matches
    training at every size (``bench/device_step_rate.py``). ``parts`` and ``cpu_rates`` as for
    :func:`device_step_spans` (:func:`device_step_rate` measures a model's chunk layout so)."""
    spans = device_step_spans(n, chunks, repeat, cpu=True, beside="matmul", parts=parts, cpu_rates=cpu_rates)
    return chunks * n * 14 / max(statistics.median(spans), 1e-9)


def device_step_spans(
    n: int, chunks: int = 3, repeat: int = 3, *, cpu: bool = True,
    beside: str | Callable[[Callable[[], bool]], None] | None = "matmul", priority: int = 0,
    parts: Sequence[int] = (), while_waiting: bool = False, cpu_rates: list[float] | None = None,
    step_spans: list[float] | None = None, refetch: bool = False,
) -> list[float]:
    """Seconds, per round, of ``chunks`` chunks of ``n`` fp32 parameters (bf16 working copies, pinned
    store) stepped through :class:`~protrain_fx.runtime.device_adam.DeviceAdamW` one after another,
    as backward issues them: from the first step's first copy in to the last step's last copy out
    (CUDA events), ``repeat`` rounds after a warm-up. Meanwhile, with ``cpu``, the CPU optimizer's
    worker steps another chunk of ``n`` over and over; this thread runs ``beside``: ``"matmul"``
    (:func:`_matmuls_until`, backward's kernels), ``"deep"`` (:func:`_deep_queue_until`: products and
    memory-bound kernels, the queue kept full), ``"deep_kept"`` (the same, its queue left to run when
    it returns), ``"launch"`` (:func:`_launch_until`, the training
    loop's launches), nothing, or a function of the caller's that takes ``done`` and returns once
    ``done()`` is true (``bench/device_step_chain.py``: a GPT block's backward); with
    ``while_waiting``, also while the issuing thread waits for room for the next step (as backward
    goes on meanwhile; without it, nothing runs beside the first step while the third waits for it).
    ``priority``: the update stream's (``bench/device_step_rate.py`` compares them). ``parts``: the
    sizes of each chunk's parameters (summing to ``n``; empty: one parameter), as a model's chunk
    holds its blocks' weights, biases and norms. ``cpu_rates``: a list
    that gets, per timed round, the CPU step's parameters per second over that round (its worker's
    compute, ``ChunkAdamW.computed``). ``step_spans``: a list that gets each timed step's own span
    (its first copy in to its last copy out, as ``calibrate.RateWindow`` times training's steps).
    ``refetch``: before each step, copy ``n`` compute-dtype elements in from pinned memory on a
    stream of their own (backward's re-fetch of the next chunk's working copy). CUDA only."""
    from protrain_fx.chunks import ParamInfo, pack
    from protrain_fx.runtime.chunk_store import ChunkStore
    from protrain_fx.runtime.cpu_adam import ChunkAdamW, OptimizerWorker
    from protrain_fx.runtime.device_adam import DeviceAdamW

    parts = list(parts) or [n]
    if sum(parts) != n or min(parts) <= 0:
        raise ValueError(f"device_step_spans: parts must be positive sizes summing to n={n}, got sum {sum(parts)}")
    names = [[f"w{i}_{k}" for k in range(len(parts))] for i in range(chunks + 1)]  # the last chunk is the CPU's
    params = {w: torch.nn.Parameter(torch.zeros(size, dtype=torch.float32))
              for ws in names for w, size in zip(ws, parts)}
    layout = pack([ParamInfo((w,), 4 * size, f"blocks.{i}", i) for i, ws in enumerate(names)
                   for w, size in zip(ws, parts)], 4 * n)
    store = ChunkStore(layout, params, compute_dtype=torch.bfloat16, pin_memory=True)
    adam = ChunkAdamW(store, torch.optim.AdamW(list(params.values()), lr=1e-3, weight_decay=0.1, fused=True), params)
    steps = DeviceAdamW(adam, "cuda", update_priority=priority)
    steps.timing = []
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16, device="cuda")  # read only: views for all
    cpu_grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    if refetch:
        fetch_src = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        fetch_dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        fetch_stream = torch.cuda.Stream()

    def grads_of(c: int, source: torch.Tensor) -> dict[str, torch.Tensor]:
        out, at = {}, 0
        for w, size in zip(names[c], parts):
            out[w] = source[at : at + size]
            at += size
        return out

    run_beside = beside if callable(beside) else {
        "matmul": _matmuls_until, "deep": _deep_queue_until, "launch": _launch_until,
        "deep_kept": functools.partial(_deep_queue_until, drain=False), None: _sync_until}[beside]
    spans = []
    with OptimizerWorker(adam.step_chunk) as worker:

        def keep_cpu_busy() -> None:
            if cpu and not worker.pending(chunks):
                store.write_grads(grads_of(chunks, cpu_grad))
                store.wait_grad(chunks)
                worker.submit(chunks)

        for i in range(repeat + 1):  # the first allocates the staging sets and warms the pages
            torch.cuda.synchronize()
            steps.timing.clear()
            computed = adam.computed
            keep_cpu_busy()
            for c in range(chunks):

                def room(dev: DeviceAdamW = steps) -> bool:
                    keep_cpu_busy()
                    return dev.has_room()

                if c and while_waiting:
                    run_beside(room)
                steps.make_room()
                if refetch:
                    with torch.cuda.stream(fetch_stream):
                        fetch_dst.copy_(fetch_src, non_blocking=True)
                steps.step_chunk(c, grads_of(c, grad))
            last = steps.timing[-1][2]

            def done() -> bool:
                keep_cpu_busy()
                return last.query()

            run_beside(done)
            if i:
                spans.append(steps.timing[0][1].elapsed_time(last) / 1e3)
                if step_spans is not None:
                    step_spans.extend(start.elapsed_time(end) / 1e3 for _, start, end in steps.timing)
            worker.wait_all()
            seconds, params = (a - b for a, b in zip(adam.computed, computed))
            if i and cpu_rates is not None and seconds > 0:
                cpu_rates.append(params / seconds)
    torch.cuda.synchronize()  # a re-fetch copy may still be reading
    del steps, grad
    torch.cuda.empty_cache()
    return spans


def _sync_until(done: Callable[[], bool]) -> None:
    """Wait until ``done()``, checking every millisecond (nothing else beside the measured work)."""
    while not done():
        time.sleep(1e-3)


def _matmuls_until(done: Callable[[], bool], size: int = 8192) -> None:
    """Run bf16 matrix products of ``size`` x ``size`` (about 1.5 ms each on the H200, as long as
    B24 4.2B's backward products) on this thread's stream until ``done()``: a stand-in for backward's
    kernels, which hold the SMs that the device steps' update kernels queue for."""
    x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    while not done():
        for _ in range(4):
            torch.mm(x, x)
        torch.cuda.current_stream().synchronize()


def _deep_queue_until(done: Callable[[], bool], size: int = 8192, depth: int = 48, drain: bool = True) -> None:
    """Keep about ``depth`` kernels queued on this thread's stream until ``done()``: bf16 matrix
    products and memory-bound elementwise kernels (2 GiB read and written, as backward's norms,
    activations and casts), launched ahead of the GPU the way a training loop runs ahead of it. Unlike
    :func:`_matmuls_until`, which waits after every four products, the queue does not drain while it
    runs; with ``drain``, it does when it returns (so a caller that returns often, as ``while_waiting``
    does, is held up by that drain); without, the kernels still queued run on after it returns, as
    backward's do while its thread waits for room for the next device step."""
    x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    big = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    marks: list[torch.cuda.Event] = []
    while not done():
        torch.mm(x, x)
        big.mul_(1.0)
        torch.mm(x, x)
        big.add_(0.0)
        mark = torch.cuda.Event()
        mark.record()
        marks.append(mark)
        if len(marks) * 4 >= depth:
            marks.pop(0).synchronize()
    if drain:
        torch.cuda.current_stream().synchronize()


def _launch_until(done: Callable[[], bool]) -> None:
    """Launch small CUDA kernels from Python on this thread until ``done()``: a stand-in for the
    training loop (the compiled step's wrapper code, the chunk runtime's hooks) that shares the CPU
    and the interpreter with the optimizer's worker."""
    x = torch.zeros(1 << 16, device="cuda")
    while not done():
        for _ in range(64):
            x.add_(1.0)
        torch.cuda.synchronize()


#: Largest buffer of the copy traffic laid under a measured CPU chunk step (:class:`_CopyLoad`).
_COPY_LOAD_BYTES = 256 * MiB


class _CopyLoad:
    """Pinned copies both ways on side streams while the CPU steps a chunk, as in training (chunk
    fetches, gradient landings): they share the host's memory bandwidth with the CPU Adam, which read
    about 2x faster alone than it ran in B24 1.3B/4.2B steps on the H200 (2026-11-30)."""

    def __init__(self, nbytes: int) -> None:
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def start(self, rounds: int = 8) -> None:
        with torch.cuda.stream(self.streams[0]):
            for _ in range(rounds):
                self.dev[0].copy_(self.host[0], non_blocking=True)
        with torch.cuda.stream(self.streams[1]):
            for _ in range(rounds):
                self.host[1].copy_(self.dev[1], non_blocking=True)

    def stop(self) -> None:
        for s in self.streams:
            s.synchronize()


def _adam_params_per_s(device: torch.device, n: int, repeat: int) -> float:
    """Parameters per second of ``torch.optim.AdamW(fused=True)`` on one fp32 tensor: the slope
    between steps of ``n`` and ``4 * n`` parameters. A step's fixed cost (the optimizer's Python
    bookkeeping, a launch: about 0.3 ms) is paid once per step, not per chunk; timing one tensor of
    16M read 43 G params/s on the H200, where a 1.3B model's 1.1 G persistent parameters stepped at
    123 G/s (B24, 2026-11-30)."""
    small = _adam_step_s(device, n, repeat)
    large = _adam_step_s(device, 4 * n, repeat)
    return 3 * n / max(large - small, large / 4, 1e-9)


def _adam_step_s(device: torch.device, n: int, repeat: int) -> float:
    """Best seconds of one ``torch.optim.AdamW(fused=True)`` step on one fp32 tensor of ``n``."""
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32, device=device))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(repeat + 1):  # the first step allocates the states
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


# ---------------------------------------------------------------------------- problem

#: Adam-family optimizers keep two fp32 moments per parameter (the cost model's Adam state); the
#: others as the analysis counts them (``config.OPTIMIZER_STATES_PER_PARAM``), 4 bytes each.
_STATE_BYTES = 4


def problem_from_record(
    record: CapturedGraph,
    machine: cost.MachineProfile,
    *,
    block_times: Mapping[str, Any] | None = None,
    chunk_bytes: int | None = None,
    estimate_machine: Machine | None = None,
    min_swap_bytes: int | None = None,
    layout: chunks_mod.ChunkLayout | None = None,
    buffer_bytes_per_byte: float = 1.0,
    persistent_param_bytes: int = 0,
    op_times: Mapping[str, float] | None = None,
    compute_scale: float = 1.0,
) -> cost.Problem:
    """The search's :class:`~protrain_fx.cost.Problem` for a captured training step.

    ``record`` must have a backward graph and its memory analysis (the backend fills both). Blocks are
    the labels of the forward graph's nodes other than ``"outside"``, in order of first appearance
    (forward order). Per block:

    * ``saved_bytes`` / ``transient_bytes``: the analysis' per-block table (``record.memory.blocks``:
      ``saved_activation_bytes``, ``transient_peak_bytes``). With Inductor codegen that table is the
      one of Inductor's plans once the backward has been compiled.
    * ``checkpoint_saved_bytes``: the bytes of the values that cross into the block (forward graph
      values of another block, or graph inputs other than parameters, read by the block's nodes; each
      storage once). That is what a checkpointed block must keep to rerun its forward; the min-cut
      partitioner may keep a little more (e.g. a cheap-to-save statistic), which this ignores.
    * ``swap_bytes``: what ``passes/swap.py`` moves when it swaps the block
      (``passes/swap.swap_candidates``: the storages its own selection takes, each rounded up to
      the allocator's granule), with ``min_swap_bytes`` (default: ``Machine``'s default, 1 MiB, the
      GPU rule even when the record was captured on the CPU, whose machine swaps everything);
      capped at ``saved_bytes``. What a swap leaves on the device is not counted: values under
      ``min_swap_bytes``, values computed from the model state alone (the compute-dtype casts of
      weights under autocast), storages no contiguous value covers (rotary q / k saved as views).
      ``swap_parts``: each of those storages, where the rewrite issues its copy out (after its last
      forward use) and where backward first reads it, on the rewrite's timeline (below).
    * ``place_fwd_s`` / ``place_bwd_s``: the block's forward and backward on the timeline the swap
      rewrite places its waits and reloads by (``passes/estimate.node_time`` per node, unfused,
      with ``estimate_machine``); the Problem's ``outside_place_bwd_s`` the outside backward nodes
      before the first block's, and its placement rates and ``copy_margin`` that machine's
      (``cost`` module docstring, "Swap memory").
    * ``fwd_s``, ``bwd_s``: from ``block_times`` when given, else a roofline estimate
      (``passes/estimate.node_time`` summed over the block's forward / backward nodes with
      ``estimate_machine``, default ``machine_for`` the analysed device). ``block_times`` maps a
      label to ``(fwd_s, bwd_s)``, or to one number (fwd + bwd, as ``profile.profile_block_times``
      returns), split 1 : 2 between forward and backward (backward computes two products per
      forward product). A block missing from ``block_times`` falls back to the roofline. With
      Inductor codegen the roofline fuses memory-bound nodes as Inductor does
      (``passes/estimate.fused_node_times``); with eager codegen every node is its own kernel.
      ``op_times`` (``opprofile.op_signature`` -> seconds, as ``opprofile.measure_op_times``
      returns) replaces the roofline of the nodes it has a time for: the matrix products,
      convolutions and attention ops measured on the device; the other nodes keep the roofline.
      ``compute_scale`` multiplies the times so estimated (not ``block_times``): what a step takes
      beyond the sum of its nodes (:data:`IN_STEP_SCALE`, with op times taken as
      :func:`device_op_times` takes them).
    * ``recompute_s`` / ``recompute_chained_s``: what a checkpointed block reruns in backward when the
      next block is not / is checkpointed too (:func:`_recompute_times`: the block's nodes the
      backward's reads depend on), as a fraction of the estimated forward applied to ``fwd_s``.
    * ``chunk_ids``: the chunks holding the block's parameters.

    Chunks: the parameters (``passes/params.parameter_infos``, tied ones once, buffers included)
    packed by ``chunks.choose_layout`` (or ``chunks.pack`` with ``chunk_bytes``), or ``layout`` when
    given (an offload handle's, whose chunks are the ones the runtime will move). A chunk's ``bytes``
    is the chunk size (padding included) times ``buffer_bytes_per_byte`` (the chunk buffers' element
    size over the parameters': 0.5 for fp32 parameters fetched as bf16), ``n_params`` its used bytes
    over the parameters' mean element size; ``persistent_param_bytes`` is passed to the Problem. Chunks holding ``"outside"`` parameters (or of a block the forward graph does not
    show) are ``outside_chunk_ids``.

    Outside: ``outside_fwd_s`` / ``outside_bwd_s`` as for blocks over the ``"outside"`` nodes (label
    ``"outside"`` in ``block_times``); ``outside_peak_bytes`` = the outside row's transient peak plus
    its saved bytes (the cost model keeps no saved bytes outside the blocks otherwise: embedding and
    head activations are counted as working memory at the end of forward). ``fixed_bytes`` = the
    step's inputs (``memory.input_bytes``). ``master_bytes_per_param`` is 0 when the parameters are
    fp32 (the working copy is the master), else 4; ``adam_state_bytes_per_param`` is 4 bytes per state
    the configured optimizer keeps (8 for Adam/AdamW); ``device_step_bytes`` is the device staging of
    chunks stepped on the GPU (``runtime/device_adam.py``).
    """
    if record.forward is None or record.backward is None or record.step is None:
        raise ValueError(f"graph {record.index} has no backward graph: nothing to train")
    if record.memory is None:
        raise ValueError(f"graph {record.index} has no memory analysis")
    analysis = record.memory
    rows = {b.block: b for b in analysis.blocks}
    fw_nodes = [n for n in record.forward.graph.nodes if n.op not in ("placeholder", "output")]
    bw_nodes = [n for n in record.backward.graph.nodes if n.op not in ("placeholder", "output")]
    labels = list(dict.fromkeys(_label(n) for n in fw_nodes if _label(n) != meta.OUTSIDE))
    if not labels:
        raise ValueError(f"graph {record.index}: no transformer blocks were found")

    device = torch.device(analysis.device)
    est = estimate_machine or machine_for(device, record.config.machine)
    fused = record.config.codegen == "inductor"
    fw_times = _node_times(fw_nodes, est, fused=fused, op_times=op_times)
    times = _label_times(fw_times, _node_times(bw_nodes, est, fused=fused, op_times=op_times))
    rerun = _recompute_times(fw_nodes, fw_times, _output_args(record.forward)[record.step.num_user_outputs :])
    estimated = dict(times)
    if compute_scale != 1.0:  # the recompute fractions below stay those of the unscaled estimate
        times = {label: (f * compute_scale, b * compute_scale) for label, (f, b) in times.items()}
    if block_times:
        for label, value in block_times.items():
            times[label] = _split(value)

    state = record.step.state_inputs
    crossing = _crossing_bytes(fw_nodes, state)
    if min_swap_bytes is None:
        min_swap_bytes = Machine.__dataclass_fields__["min_swap_bytes"].default
    place_fw = {n: node_time(n, est) for n in fw_nodes}
    place_bw = {n: node_time(n, est) for n in bw_nodes}
    place = _label_times(place_fw, place_bw)
    first_block = next((i for i, n in enumerate(bw_nodes) if _label(n) != meta.OUTSIDE), len(bw_nodes))
    outside_place_bwd = sum(place_bw[n] for n in bw_nodes[:first_block])
    parts = _swap_parts(record, labels, fw_nodes, bw_nodes, place_fw, place_bw, min_swap_bytes, default_granule(device))

    if layout is None:
        params = parameter_infos(record.step, record.dynamo_graph)
        layout = chunks_mod.pack(params, chunk_bytes) if chunk_bytes else chunks_mod.choose_layout(params)
    elem = _mean_param_element_size(record)
    buffer_bytes = round(layout.chunk_bytes * buffer_bytes_per_byte)
    chunk_profiles = [
        cost.ChunkProfile(bytes=buffer_bytes, n_params=round(c.used_bytes / elem)) for c in layout.chunks
    ]
    chunks_of: dict[str, list[int]] = defaultdict(list)
    for c in layout.chunks:
        for block in dict.fromkeys(s.param.block for s in c.slots):
            chunks_of[block if block in labels else meta.OUTSIDE].append(c.index)

    blocks = []
    for label in labels:
        row = rows.get(label)
        saved = row.saved_activation_bytes if row else 0
        fwd_s, bwd_s = times.get(label, (0.0, 0.0))
        est_fwd = estimated.get(label, (0.0, 0.0))[0]
        alone, chained = rerun.get(label, (est_fwd, est_fwd))
        scale = fwd_s / est_fwd if est_fwd > 0 else 0.0  # the estimate's fractions of a given forward time
        mine = _cap_parts(parts.get(label, []), saved)
        blocks.append(
            cost.BlockProfile(
                name=label,
                fwd_s=fwd_s,
                bwd_s=bwd_s,
                recompute_s=min(fwd_s, alone * scale),
                recompute_chained_s=min(fwd_s, chained * scale),
                saved_bytes=saved,
                checkpoint_saved_bytes=crossing.get(label, 0),
                swap_bytes=sum(x for *_, x in mine),
                swap_parts=tuple(mine),
                transient_bytes=row.transient_peak_bytes if row else 0,
                chunk_ids=tuple(sorted(set(chunks_of.get(label, ())))),
                place_fwd_s=place.get(label, (0.0, 0.0))[0],
                place_bwd_s=place.get(label, (0.0, 0.0))[1],
            )
        )
    outside = rows.get(meta.OUTSIDE)
    out_fwd, out_bwd = times.get(meta.OUTSIDE, (0.0, 0.0))
    n_states = record.config.optimizer_states_per_param
    return cost.Problem(
        blocks=tuple(blocks),
        chunks=tuple(chunk_profiles),
        machine=machine,
        outside_fwd_s=out_fwd,
        outside_bwd_s=out_bwd,
        outside_peak_bytes=(outside.transient_peak_bytes + outside.saved_activation_bytes) if outside else 0,
        outside_chunk_ids=tuple(sorted(set(chunks_of.get(meta.OUTSIDE, ())))),
        fixed_bytes=analysis.input_bytes,
        master_bytes_per_param=0 if elem >= 4 else 4,
        adam_state_bytes_per_param=_STATE_BYTES * n_states,
        device_step_bytes=_device_step_staging_bytes(round(elem * buffer_bytes_per_byte)),
        persistent_param_bytes=persistent_param_bytes,
        outside_place_bwd_s=outside_place_bwd,
        place_d2h_bytes_per_s=est.d2h_bytes,
        place_h2d_bytes_per_s=est.h2d_bytes,
        copy_margin=est.copy_margin,
    )


#: A training step's forward and backward over the sum of their nodes as :func:`problem_from_record`
#: prices them with :func:`device_op_times` (matrix and attention ops timed with the device kept busy,
#: the roofline for the rest). On the H200 (2026-12-02, ``bench/peers.py`` with ``PEERS_REREAD``:
#: the ops timed again right after training, in the same process) B24 350M, 760M at 24 and 40 GiB
#: and 1.3B at 40 GiB, on two hosts, took 1.047, 1.062, 1.055 and 1.068 times that (mean 1.058, sd
#: 0.009). What the ratio holds, from the step's kernel traces (``bench/step_trace.py``, twenty-third
#: session): the device's idle time, at each phase's start and between kernels, less what the timed
#: products read above their in-step kernel time. Priced with the ops as the profiler timed them
#: before (5 calls between two events, the first round cached), the same runs' forward and backward
#: took 0.92-0.97 times their price: a ratio that moved twice as much, from host to host and between
#: rounds, and put 760M@40's first plan 7.5% high.
IN_STEP_SCALE = 1.058


def device_op_times(record: CapturedGraph) -> dict[str, float] | None:
    """Measured seconds of the matrix, convolution and attention nodes of ``record``'s forward and
    backward graphs (``opprofile.measure_op_times`` with the device kept busy while each op's calls
    are queued: once per distinct call, device and torch version, cached), for
    :func:`problem_from_record`'s ``op_times``, with ``compute_scale`` :data:`IN_STEP_SCALE`;
    ``None`` off CUDA (the CPU "device" plans with relative numbers, and its tests stay
    deterministic)."""
    device = torch.device(record.memory.device) if record.memory is not None else None
    if device is None or device.type != "cuda" or record.forward is None or record.backward is None:
        return None
    nodes = [*record.forward.graph.nodes, *record.backward.graph.nodes]
    return measure_op_times(nodes, device, prefill=True)


def _device_step_staging_bytes(itemsize: int) -> int:
    """Device staging of chunks stepped on the GPU (``DeviceAdamW.staging_bytes`` for this working-copy
    element size): what a config with ``n_gpu_optim > 0`` adds besides its gradients in flight."""
    from protrain_fx.runtime.device_adam import DEVICE_SLICE_ELEMS, N_SETS

    return N_SETS * DEVICE_SLICE_ELEMS * (4 * 4 + itemsize)


def _label(node: fx.Node) -> str:
    return node.meta.get(meta.BLOCK, meta.OUTSIDE)


def _split(value: Any) -> tuple[float, float]:
    """``(fwd_s, bwd_s)`` from a pair, or from a total split 1 : 2."""
    if isinstance(value, (tuple, list)):
        fwd, bwd = value
        return float(fwd), float(bwd)
    total = float(value)
    return total / 3, 2 * total / 3


def _node_times(
    nodes: list[fx.Node],
    machine: Machine,
    *,
    fused: bool = False,
    op_times: Mapping[str, float] | None = None,
) -> dict[fx.Node, float]:
    """Seconds per node of one graph: the roofline (``passes/estimate.node_time``, or with ``fused``
    ``passes/estimate.fused_node_times``: memory-bound nodes fused as Inductor fuses them), except
    for nodes whose ``opprofile.op_signature`` has a measured time in ``op_times``."""
    times = fused_node_times(nodes, machine) if fused else {n: node_time(n, machine) for n in nodes}
    if op_times:
        for n in nodes:
            sig = op_signature(n)
            if sig is not None and sig in op_times:
                times[n] = op_times[sig]
    return times


def _phase_times(
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    machine: Machine,
    *,
    fused: bool = False,
    op_times: Mapping[str, float] | None = None,
) -> dict[str, tuple[float, float]]:
    """Seconds per label and phase: :func:`_node_times` of each graph, summed per label."""
    return _label_times(_node_times(fw_nodes, machine, fused=fused, op_times=op_times),
                        _node_times(bw_nodes, machine, fused=fused, op_times=op_times))


def _label_times(
    fw_times: Mapping[fx.Node, float], bw_times: Mapping[fx.Node, float]
) -> dict[str, tuple[float, float]]:
    """Seconds per label and phase: node times summed per label."""
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    for times, out in ((fw_times, fwd), (bw_times, bwd)):
        for n, t in times.items():
            out[_label(n)] += t
    return {label: (fwd[label], bwd[label]) for label in {*fwd, *bwd}}


def _recompute_times(
    fw_nodes: list[fx.Node], fw_times: Mapping[fx.Node, float], saved: Sequence[Any]
) -> dict[str, tuple[float, float]]:
    """Per block, the seconds of the forward a checkpointed block reruns in backward:
    ``(alone, chained)``.

    A checkpointed block's nodes are all tagged ``MUST_RECOMPUTE`` (``passes/annotate.py``), and the
    min-cut partitioner reruns those the backward reads, with what they need. Which values that is
    comes from the graph analysed without a plan: those its forward saves for backward (``saved``:
    the forward graph's outputs after the user's), produced by the block. What is rerun is the
    block's nodes they depend on inside the block (walking inputs until the block's input).

    * ``chained``: when the next block is checkpointed too, the partitioner saves the values of this
      block that the next one's tagged nodes read (``cleanup_recompute_tags`` in torch's
      partitioner: a tagged value read by a tagged node of a later checkpoint region is saved),
      so values read outside the block are not targets. In a GPT block, the MLP's second matrix
      product (and the residual add after it) is then not rerun: about a third of its matrix work.
    * ``alone``: otherwise its output is rerun as well: values read outside the block are targets.

    A block whose saved values are all read outside it too (so none tells what its own backward
    reads: a graph captured with a plan already checkpointing it) is priced at its whole forward,
    both ways."""
    label_of = {n: _label(n) for n in fw_nodes}
    saved_nodes: set[fx.Node] = {a for a in saved if isinstance(a, fx.Node) and a in label_of}
    out_read = {n for n in fw_nodes if any(u in label_of and label_of[u] != label_of[n] for u in n.users)}
    by_label: dict[str, list[fx.Node]] = defaultdict(list)
    for n in fw_nodes:
        by_label[label_of[n]].append(n)

    def rerun(targets: set[fx.Node], label: str) -> float:
        seen: set[fx.Node] = set()
        stack = list(targets)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(s for s in n.all_input_nodes if label_of.get(s) == label and s not in seen)
        return sum(fw_times.get(n, 0.0) for n in seen)

    out: dict[str, tuple[float, float]] = {}
    for label, nodes in by_label.items():
        own = {n for n in nodes if n in saved_nodes}
        whole = sum(fw_times.get(n, 0.0) for n in nodes)
        inner = own - out_read
        if not inner:
            out[label] = (whole, whole)
            continue
        out[label] = (rerun(own | {n for n in nodes if n in out_read}, label), rerun(inner, label))
    return out


def _swap_parts(
    record: CapturedGraph,
    labels: list[str],
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    place_fw: Mapping[fx.Node, float],
    place_bw: Mapping[fx.Node, float],
    min_bytes: int,
    granule: int,
) -> dict[str, list[tuple[float, float, int]]]:
    """Per block, ``BlockProfile.swap_parts``: what ``passes/swap.py`` moves when it swaps the
    block (``passes/swap.swap_candidates``), each storage as ``(issue_s, use_s, bytes)`` on the
    rewrite's own timeline (``place_fw`` / ``place_bw``: the roofline per node it places by): its
    copy out issued when its last forward use ends, from the start of the block's forward; its
    first backward use, from the start of the block's backward."""
    start_fw, start_bw = _starts(fw_nodes, place_fw), _starts(bw_nodes, place_bw)
    block_fw: dict[str, float] = {}
    for n in fw_nodes:
        block_fw.setdefault(_label(n), start_fw[n])
    block_bw: dict[str, float] = {}
    for n in bw_nodes:
        block_bw.setdefault(_label(n), start_bw[n])
    parts: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for c in swap_candidates(record.forward, record.backward, labels, record.step.num_user_outputs,
                             state_inputs=record.step.state_inputs, min_bytes=min_bytes, granule=granule):
        if c.block not in block_fw or c.issued_after not in start_fw:
            continue
        issued = start_fw[c.issued_after] + place_fw[c.issued_after] - block_fw[c.block]
        used = start_bw.get(c.first_use, 0.0) - block_bw.get(c.block, 0.0)
        parts[c.block].append((max(0.0, issued), used, c.nbytes))
    return parts


def _starts(nodes: list[fx.Node], times: Mapping[fx.Node, float]) -> dict[fx.Node, float]:
    """When each of ``nodes`` starts when they run back to back from 0 (``passes/estimate.start_times``)."""
    out, t = {}, 0.0
    for n in nodes:
        out[n] = t
        t += times[n]
    return out


def _cap_parts(parts: list[tuple[float, float, int]], cap: int) -> list[tuple[float, float, int]]:
    """``parts`` (in order of issue) adding up to at most ``cap`` bytes (the block's saved bytes, which
    the analysis attributes a little differently), the earliest kept."""
    out = []
    for issued, used, nbytes in sorted(parts):
        x = min(nbytes, cap)
        cap -= x
        if x:
            out.append((issued, used, x))
    return out


def _crossing_bytes(fw_nodes: list[fx.Node], state_inputs: frozenset[str]) -> dict[str, int]:
    """Per block: bytes of the storages its forward nodes read from outside it (parameters excluded)."""
    seen: dict[str, dict[int, int]] = defaultdict(dict)
    for node in fw_nodes:
        label = _label(node)
        for src in node.all_input_nodes:
            if _label(src) == label or (src.op == "placeholder" and src.name in state_inputs):
                continue
            for t in meta.tensor_values(src):
                seen[label][meta.storage_key(t)] = meta.storage_nbytes(t)
    return {label: sum(by_key.values()) for label, by_key in seen.items()}


def _mean_param_element_size(record: CapturedGraph) -> float:
    """Bytes per element over the model-state inputs (1 storage once): to turn chunk bytes into params."""
    nbytes = numel = 0
    seen: set[int] = set()
    for node in record.forward.graph.nodes:
        if node.op != "placeholder" or node.name not in record.step.state_inputs:
            continue
        for t in meta.tensor_values(node):
            key = meta.storage_key(t)
            if key not in seen:
                seen.add(key)
                nbytes += meta.storage_nbytes(t)
                numel += meta.storage_nbytes(t) // t.element_size()
    return nbytes / numel if numel else 4.0


__all__ = [
    "busiest_elsewhere", "cache_dir", "cache_path", "chunk_adam_rate", "cpus_busy_elsewhere", "device_name", "device_op_times",
    "device_step_rate", "device_step_spans", "host_cpu_times", "layout_key", "measure_machine", "note_training_rates",
    "problem_from_record", "training_rates", "wait_for_quiet_cpus",
]
