"""Does waking Inductor's compile workers slow the profiler's CPU chunk step, and for how long?

The twentieth session's 4.2B compiles read the CPU step at 0.19-0.69 G params/s on two fresh H200
hosts, where training reached 1.07 (``docs/results.md``). ``torch._inductor.compile_fx`` wakes the
pool of compile workers (one subprocess per ``TORCHINDUCTOR_COMPILE_THREADS``, each importing torch)
as a compile with CUDA inputs begins, and the profile runs inside that compile. This script
measures the CPU chunk step (``profiler._chunk_adam_params_per_s``, as ``chunk_adam_rate`` does)
on a quiet host, then wakes the pool as ``compile_fx`` does and measures it again and again for
``--seconds``, each time with the fraction of the host's CPUs busy in other processes
(``profiler.cpus_busy_elsewhere``) and the busiest of them (``profiler.busiest_elsewhere``), and
the share of CPU time the hypervisor stole while it stepped (``/proc/stat``'s ``steal``).
``--no-wakeup``: the same without waking the pool (the control).

On the H200 host of the twenty-first session's first call, the reading moved between 0.63 and 1.55
G params/s within a minute while at most 6% of the CPUs were busy in other processes, and the pool
was busy for about 10 s after waking: not the pool. The steal share is there to tell whether the
virtual machine's CPUs were taken from it when a reading came out low.

    python bench/cpu_rate_after_wakeup.py [--params 234881024] [--seconds 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_times() -> list[int] | None:
    """``profiler.host_cpu_times`` (user, nice, system, idle, iowait, irq, softirq, steal); None where
    it cannot be read."""
    from protrain_fx import profiler

    try:
        return profiler.host_cpu_times()
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the CPUs' time between two :func:`cpu_times` that the hypervisor gave to others
    (``steal``, the eighth field): a virtual machine's CPUs taken while it wanted to run. None where
    not readable or no time passed."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else None


def reading(cuda: bool, params: int, repeat: int, t0: float) -> dict:
    """One CPU-step reading with the host's state just before it, and the steal while it ran."""
    from protrain_fx import profiler

    busy = profiler.cpus_busy_elsewhere(0.5)
    top = profiler.busiest_elsewhere(0.5)
    start = time.perf_counter() - t0
    ticks = cpu_times()
    rate = profiler._chunk_adam_params_per_s(cuda, params, repeat)
    return {"t_s": start, "busy_elsewhere": busy, "busiest": top, "params_per_s": rate,
            "steal": steal_share(ticks, cpu_times())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=234881024, help="the chunk's parameters (B24 4.2B's: 224M)")
    parser.add_argument("--repeat", type=int, default=3, help="steps per reading (their median)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--no-wakeup", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    out: dict = {"cuda": cuda, "params": args.params, "wakeup": not args.no_wakeup, "before": [], "after": []}
    out["before"].append(reading(cuda, args.params, args.repeat, t0))
    if not args.no_wakeup:
        from torch._inductor.async_compile import AsyncCompile

        out["wakeup_at_s"] = time.perf_counter() - t0
        AsyncCompile.wakeup()  # what compile_fx does first, given CUDA inputs
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        out["after"].append(reading(cuda, args.params, args.repeat, t0))
    for phase in ("before", "after"):
        for r in out[phase]:
            top = ", ".join(f"{n} {p} {c:.1f}" for n, p, c in r["busiest"])
            busy = "?" if r["busy_elsewhere"] is None else f"{r['busy_elsewhere']:.0%}"
            steal = "?" if r["steal"] is None else f"{r['steal']:.1%}"
            print(f"{phase:>6} {r['t_s']:6.1f} s: {r['params_per_s'] / 1e9:5.2f} G params/s, busy elsewhere {busy} "
                  f"({top}), steal while stepping {steal}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
