"""How much the profiler's CPU chunk-step rate moves between rounds and between measurements.

The machine profile prices the offload runtime's CPU step of a chunk (``profiler.chunk_adam_rate``)
at the median of a few steps of one chunk. On the H200 hosts of 2026-11-30 .. 12-01 that number sat
0.78-1.17x of what the same host's training reached. This script measures, per chunk size:

* ``rounds``: every timed step of one long run (``ROUNDS`` steps), as rates;
* ``medians``: the profiler's own measurement (the median of 3 steps) repeated ``REPEATS`` times;
* the same with ``chunks`` distinct chunks stepped in turn (as training steps several chunks once
  each) instead of one chunk again and again.

    python bench/cpu_rate_rounds.py --sizes 117440512 234881024 --out OUT   # writes OUT/cpu_rate_rounds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protrain_fx.profiler import _chunk_adam_params_per_s  # noqa: E402


def summary(rates: list[float]) -> dict[str, float]:
    q = statistics.quantiles(rates, n=4) if len(rates) > 1 else rates * 3
    return {"n": len(rates), "median": statistics.median(rates), "min": min(rates), "max": max(rates),
            "q1": q[0], "q3": q[2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[117440512, 234881024])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    out: dict[str, object] = {"cuda": cuda, "threads": torch.get_num_threads(), "sizes": {}}
    for n in a.sizes:
        row: dict[str, object] = {}
        t0 = time.perf_counter()
        rates: list[float] = []
        _chunk_adam_params_per_s(cuda, n, a.rounds, rates=rates)
        row["rounds"] = {"rates": rates, **summary(rates)}
        row["medians"] = [_chunk_adam_params_per_s(cuda, n, 3) for _ in range(a.repeats)]
        rates = []
        _chunk_adam_params_per_s(cuda, n, a.rounds, chunks=a.chunks, rates=rates)
        row["rounds_distinct_chunks"] = {"chunks": a.chunks, "rates": rates, **summary(rates)}
        row["seconds"] = time.perf_counter() - t0
        out["sizes"][str(n)] = row
        r, d = row["rounds"], row["rounds_distinct_chunks"]
        print(f"{n / 2**20:.0f}M params: one chunk {r['median'] / 1e9:.2f} G/s (q1 {r['q1'] / 1e9:.2f}, q3 "
              f"{r['q3'] / 1e9:.2f}, min {r['min'] / 1e9:.2f}, max {r['max'] / 1e9:.2f}); profiler's 3-step medians "
              + " ".join(f"{m / 1e9:.2f}" for m in row["medians"])
              + f"; {a.chunks} chunks in turn {d['median'] / 1e9:.2f} (q1 {d['q1'] / 1e9:.2f}, q3 {d['q3'] / 1e9:.2f})"
              f"  [{row['seconds']:.0f} s]", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "cpu_rate_rounds.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
