"""Host-side measurements: the CPU optimizer's chunk step, the host's copy rate, and how busy its CPUs are.

:func:`_chunk_adam_params_per_s` times the offload runtime's own CPU step of a chunk on its worker
thread, with training's copy traffic and kernel launches beside it on CUDA;
:func:`_adam_params_per_s` times a fused AdamW step on the device. Rates are parameters (or bytes)
per second. A CPU rate read while other processes hold the host's CPUs reads low and misleads the
plan, so :func:`wait_for_quiet_cpus` holds each such measurement back (``/proc``; Linux only, and
at most :data:`QUIET_WAIT_S` per process). Nothing here is cached: ``machine_profile.py`` keeps it."""

from __future__ import annotations

import os
import statistics
import time

import torch

from protrain_fx import progress
from protrain_fx.chunks import ParamInfo, pack
from protrain_fx.profile.load import _COPY_LOAD_BYTES, _CopyLoad, _launch_until
from protrain_fx.runtime.store.chunk_store import ChunkStore
from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW, OptimizerWorker

#: Default parameters of the timed optimizer steps (``measure_machine``'s ``adam_params``).
ADAM_PARAMS = 16 * 2**20


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

    Why: a CPU rate read low makes the plan step every offloaded chunk on the GPU, and the profile
    runs inside a compile, beside whatever else the host runs (Inductor's compile workers among
    them). Other processes do not explain every slow reading (a host's CPU step also moves while
    nothing else is busy: ``docs/results.md#cpu-step-rate-within-and-across-hosts``), but the wait
    costs half a second when the host is quiet. The profile file keeps the fraction seen at each
    measurement (``"busy_elsewhere"``)."""
    if device.type != "cuda":
        return None
    shared = max_wait_s is None
    max_wait_s = _quiet_wait_left[0] if shared else max_wait_s
    start = time.perf_counter()
    busy = cpus_busy_elsewhere()
    if busy is None or busy <= BUSY_ELSEWHERE_LIMIT:
        return busy
    names = ", ".join(f"{name} {pid} ({cpus:.1f} CPUs)" for name, pid, cpus in busiest_elsewhere())
    progress.note(f"protrain_fx: waiting for the host's CPUs before {what}: {busy:.0%} busy with other processes "
                  f"({names or 'not named'}; up to {max_wait_s:.0f} s)")
    while busy is not None and busy > BUSY_ELSEWHERE_LIMIT and time.perf_counter() - start < max_wait_s:
        busy = cpus_busy_elsewhere()
    waited = time.perf_counter() - start
    if shared:
        _quiet_wait_left[0] = max(0.0, _quiet_wait_left[0] - waited)
    if busy is not None and busy > BUSY_ELSEWHERE_LIMIT:
        progress.note(f"protrain_fx: measuring {what} with {busy:.0%} of the host's CPUs busy with other processes "
                      f"(waited {waited:.0f} s); the rate may read low")
    return busy


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
    (``runtime/optim/cpu_adam.ChunkAdamW.step_chunk``: AdamW on the fp32 master, then the chunk's new
    compute-dtype working copy; bf16 and pinned when a GPU will fetch it): what the chunks stepped on
    the CPU cost, measured on the code path that steps them, on the runtime's worker thread (its
    OpenMP team, ``cpu_adam.worker_threads``). On CUDA, as in training, pinned copies run both ways
    meanwhile (:class:`_CopyLoad`) and this thread launches small CUDA kernels from Python
    (:func:`_launch_until`: the training loop's share of the CPU). The median of ``repeat`` steps
    after a warm-up (training pays every step, not the best one). ``chunks``: distinct chunks in the
    store, stepped in turn (training steps each once per step, never one twice in a row);
    ``rates``: a list that gets each timed step's parameters per second."""
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


def _adam_params_per_s(device: torch.device, n: int, repeat: int) -> float:
    """Parameters per second of ``torch.optim.AdamW(fused=True)`` on one fp32 tensor: the slope
    between steps of ``n`` and ``4 * n`` parameters. A step's fixed cost (the optimizer's Python
    bookkeeping, a launch: about 0.3 ms) is paid once per step, not per chunk, so timing one small
    tensor alone reads a fraction of the rate a model's persistent parameters step at."""
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
