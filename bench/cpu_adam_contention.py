"""The offload runtime's CPU chunk step under what runs beside it in training: on the worker thread
(as ``runtime/cpu_adam.OptimizerWorker`` runs it), with pinned copies both ways on side streams, and
with the main thread busy launching CUDA kernels (a training loop's Python); for several OpenMP
thread counts of the worker. Parameters per second, the median of the steps.

    python bench/cpu_adam_contention.py --params 128e6 --out OUT   # prints a table, writes OUT/cpu_adam_contention.json

Why: B24 1.3B/4.2B steps on the H200 ran their chunk steps at 0.82-1.20 G params/s, against
1.29-1.97 measured by the profiler on the worker's code path under copy traffic alone (seventh
session, ``docs/results.md``). A worker whose OpenMP team spans every core shares one of them with
the main thread's launches, and a parallel region waits for its slowest thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protrain_fx.chunks import ParamInfo, pack  # noqa: E402
from protrain_fx.profiler import _COPY_LOAD_BYTES, _CopyLoad, _launch_until  # noqa: E402
from protrain_fx.runtime.chunk_store import ChunkStore  # noqa: E402
from protrain_fx.runtime.cpu_adam import ChunkAdamW  # noqa: E402


class Launcher:
    """The training loop's share of the CPU (``profiler._launch_until``: small CUDA kernels launched
    from Python) on a thread of its own, until the ``with`` block ends."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_launch_until, args=(self.stop.is_set,))

    def __enter__(self) -> Launcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def rate(n: int, repeats: int, threads: int | None, copies: bool, launcher: bool,
         slice_elems: int | None = None, switch_s: float | None = None) -> float:
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32))
    layout = pack([ParamInfo(("w",), 4 * n, "blocks.0", 0)], 4 * n)
    store = ChunkStore(layout, {"w": p}, compute_dtype=torch.bfloat16, pin_memory=True)
    adam = ChunkAdamW(store, torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True), {"w": p})
    if slice_elems is not None:
        adam.slice_elems = slice_elems
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    load = _CopyLoad(nbytes=min(8 * n, _COPY_LOAD_BYTES)) if copies else None
    rounds = max(8, -(-64 * n // _COPY_LOAD_BYTES))
    pool = ThreadPoolExecutor(max_workers=1)
    if threads is not None:
        pool.submit(torch.set_num_threads, threads).result()

    def step() -> float:
        t0 = time.perf_counter()
        adam.step_chunk(0)
        return time.perf_counter() - t0

    times = []
    switch = sys.getswitchinterval()
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    try:
        for i in range(repeats + 1):
            store.write_grads({"w": grad})
            store.wait_grad(0)
            if load is not None:
                load.start(rounds)
            if launcher:
                with Launcher():
                    elapsed = pool.submit(step).result()
            else:
                elapsed = pool.submit(step).result()
            if load is not None:
                load.stop()
            if i:
                times.append(elapsed)
    finally:
        sys.setswitchinterval(switch)
        pool.shutdown()
    return n / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[128e6])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cpu_adam_contention.py measures beside a GPU's copies and launches: run it on the GPU machine")
    cores = os.cpu_count() or 1
    counts = sorted({None, max(1, cores - 1), max(1, cores - 2), max(1, cores // 2)}, key=lambda c: -(c or cores + 1))
    rows = []
    for params in args.params:
        n = int(params)
        for copies, launcher in ((False, False), (True, False), (True, True)):
            for threads in counts if copies and launcher else [None]:
                r = rate(n, args.repeats, threads, copies, launcher)
                rows.append(dict(params=n, copies=copies, launcher=launcher,
                                 threads=threads or torch.get_num_threads(), rate=r))
                print(f"{n / 1e6:6.0f}M copies={copies!s:5} launcher={launcher!s:5} "
                      f"threads={rows[-1]['threads']:3d}: {r / 1e9:.2f} G params/s", flush=True)
        # The worker's Python between fused calls waits for the GIL the launcher holds (switch
        # interval 5 ms): fewer, larger calls, or a shorter interval.
        for slice_elems, switch_s in ((1 << 22, None), (1 << 40, None), (None, 5e-4)):
            r = rate(n, args.repeats, None, True, True, slice_elems, switch_s)
            rows.append(dict(params=n, copies=True, launcher=True, threads=torch.get_num_threads(),
                             slice_elems=slice_elems, switch_s=switch_s, rate=r))
            print(f"{n / 1e6:6.0f}M copies+launcher slice={slice_elems} switch={switch_s}: {r / 1e9:.2f} G params/s",
                  flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_adam_contention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
