"""How fast offloaded chunks' optimizer steps stream through the GPU (``runtime/device_adam.py``),
against the copy rates the cost model builds them from. GPU only.

    python bench/device_step_rate.py [--params 226M] [--chunks 3] [--out FILE.json]

Steps ``--chunks`` chunks of ``--params`` fp32 parameters (bf16 working copies, pinned store) one
after another through :class:`~protrain_fx.runtime.device_adam.DeviceAdamW`, as backward issues
them (at most ``MAX_IN_FLIGHT`` at once), and times them with CUDA events from the first copy in to
the last copy out:

* ``alone``: nothing else runs;
* ``cpu``: the CPU optimizer's worker steps another chunk of the same size meanwhile, as it does in
  training (it reads and writes the host store the copies read and write);
* ``cpu_launch``: and this thread launches small kernels until the steps end (the training loop);
* ``cpu_matmul``: the CPU step, and bf16 matrix products on the default stream fill the SMs, as
  backward's kernels do; ``cpu_matmul_high``: the same with the steps' update kernels on a stream
  of high priority (the runtime's is of normal priority: measured, high did not help).

Beside them, the raw link: one pinned copy of the bytes a step moves in (master and moments, 12
bytes per parameter) and one of those it moves out (14), on two streams at once. The cost model
prices a device step at the profiler's measured device-step rate (``device_step_bytes_per_s``,
measured as ``cpu_launch`` here on 64M-parameter chunks), where it used to take the both-ways link
rate (``duplex / 2`` per direction).
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

from protrain_fx.chunks import ParamInfo, pack  # noqa: E402
from protrain_fx.profiler import _launch_until, measure_machine  # noqa: E402
from protrain_fx.runtime.chunk_store import ChunkStore  # noqa: E402
from protrain_fx.runtime.cpu_adam import ChunkAdamW, OptimizerWorker  # noqa: E402
from protrain_fx.runtime.device_adam import DeviceAdamW  # noqa: E402


def _count(text: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="226M", help="parameters per chunk (B24 4.2B: 226M)")
    parser.add_argument("--chunks", type=int, default=3, help="device-stepped chunks per round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("device_step_rate: needs a GPU")
    n, k = _count(args.params), args.chunks
    names = [f"w{i}" for i in range(k + 1)]  # the last one is stepped on the CPU
    params = {w: torch.nn.Parameter(torch.zeros(n)) for w in names}
    layout = pack([ParamInfo((w,), 4 * n, f"blocks.{i}", i) for i, w in enumerate(names)], 4 * n)
    t0 = time.perf_counter()
    store = ChunkStore(layout, params, compute_dtype=torch.bfloat16, pin_memory=True)
    setup_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(list(params.values()), lr=1e-3, weight_decay=0.1, fused=True)
    adam = ChunkAdamW(store, opt, params)
    dev = DeviceAdamW(adam, "cuda")
    dev.timing = []
    grads = {w: torch.full((n,), 1e-3, dtype=torch.bfloat16, device="cuda") for w in names[:k]}
    cpu_grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)

    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def matmuls_until(done) -> None:
        while not done():
            for _ in range(4):
                x @ x
            torch.cuda.current_stream().synchronize()

    def round_(cpu: bool, launch: bool, matmul: bool = False) -> dict:
        torch.cuda.synchronize()
        dev.timing.clear()
        with OptimizerWorker(adam.step_chunk) as worker:
            if cpu:
                store.write_grads({names[k]: cpu_grad})
                store.wait_grad(k)
                worker.submit(k)
            t = time.perf_counter()
            for i in range(k):
                dev.make_room()
                dev.step_chunk(i, {names[i]: grads[names[i]]})
            issued = time.perf_counter() - t
            if launch:
                _launch_until(lambda: dev.timing[-1][2].query())
            if matmul:
                matmuls_until(lambda: dev.timing[-1][2].query())
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            cpu_left = worker.pending(k) if cpu else False
            worker.wait_all()
        steps = [a.elapsed_time(b) / 1e3 for _, a, b in dev.timing]
        span = dev.timing[0][1].elapsed_time(dev.timing[-1][2]) / 1e3
        return {"steps_s": steps, "span_s": span, "wall_s": wall, "issue_s": issued, "cpu_still_busy": cpu_left,
                "params_per_s": k * n / span}

    out: dict = {"params": n, "chunks": k, "store_setup_s": setup_s, "device": torch.cuda.get_device_name()}
    round_(False, False)  # warm-up: staging sets, pages
    normal = dev._work
    for name, cpu, launch, matmul in (("alone", False, False, False), ("cpu", True, False, False),
                                      ("cpu_launch", True, True, False), ("cpu_matmul", True, False, True),
                                      ("cpu_matmul_high", True, False, True)):
        dev._work = torch.cuda.Stream(priority=-1) if name.endswith("_high") else normal
        runs = [round_(cpu, launch, matmul) for _ in range(args.repeat)]
        out[name] = {"median_params_per_s": statistics.median(r["params_per_s"] for r in runs), "runs": runs}
    dev._work = normal
    out["raw"] = _raw_link(n)
    torch.cuda.empty_cache()
    m = measure_machine("cuda")
    out["machine"] = m.to_dict()
    in_b, out_b = 12 * n, 14 * n
    shared = m.duplex_bytes_per_s / 2
    out["link_step_s"] = max(in_b / min(m.h2d_bytes_per_s, shared), out_b / min(m.d2h_bytes_per_s, shared))
    out["model_step_s"] = out_b / m.device_step_bytes_per_s if m.device_step_bytes_per_s else out["link_step_s"]
    text = json.dumps(out, indent=1)
    print(text)
    for name in ("alone", "cpu", "cpu_launch", "cpu_matmul", "cpu_matmul_high"):
        rate = out[name]["median_params_per_s"]
        print(f"{name:>10}: {rate / 1e9:.2f} G params/s, {n / rate * 1e3:.1f} ms per chunk (cost model "
              f"{out['model_step_s'] * 1e3:.1f} ms; at the shared link rate {out['link_step_s'] * 1e3:.1f})", file=sys.stderr)
    raw = out["raw"]
    print(f"  raw link: in {raw['in_s'] * 1e3:.1f} ms, out {raw['out_s'] * 1e3:.1f} ms, both {raw['both_s'] * 1e3:.1f} ms",
          file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _raw_link(n: int) -> dict:
    """One step's bytes in (12 n) and out (14 n) as single pinned copies: each alone, then both at once."""
    host_in = torch.empty(12 * n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(14 * n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(12 * n, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(14 * n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        best = float("inf")
        for i in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t)
        return best

    def copy_in():
        with torch.cuda.stream(s1):
            dev_in.copy_(host_in, non_blocking=True)

    def copy_out():
        with torch.cuda.stream(s2):
            host_out.copy_(dev_out, non_blocking=True)

    return {"in_s": timed(copy_in), "out_s": timed(copy_out), "both_s": timed(lambda: (copy_in(), copy_out()))}


if __name__ == "__main__":
    main()
