"""Why matrix products run faster inside a step than the profiler times them alone (GPU only).

    python bench/op_timing_conditions.py [--json out.json]

``bench/step_trace.py`` found B24 760M's products 10-13% faster inside the compiled step than
``opprofile.measure_op_times`` had timed them, and 350M's 25-36% (H200, 2026-12-02). This times a
few of those products (B24 350M's and 760M's linear layers, bf16, bias fused) under four conditions:

* ``profiler``: as ``opprofile._time_node`` does (clocks warmed 0.2 s, then 5 calls back to back
  between two events, three times, the median of the means);
* ``prefilled``: the same with the GPU kept busy (``torch.cuda._sleep``) while the calls are queued,
  so that the start event does not wait for the first call's launch;
* ``kernel``: the same calls traced with ``torch.profiler``: the kernels' own device time (no launch
  gaps between them);
* ``interleaved``: each call after a memory-bound kernel (a 256 MiB in-place scale), timed alone
  between events around it, as products sit between Inductor's kernels in a step; the median;
* ``burst``: 200 calls back to back, the mean (a long run of products: the GPU's power limit).

and prints the GPU's SM clock and power (``nvidia-smi``) sampled meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (name, tokens, in features, out features): B24's linear layers (batch 8 x 1024 tokens)
SHAPES = [
    ("350M qkv", 8192, 1024, 3072),
    ("350M fc1", 8192, 1024, 4096),
    ("350M fc2", 8192, 4096, 1024),
    ("760M qkv", 8192, 1536, 4608),
    ("760M fc1", 8192, 1536, 6144),
    ("760M fc2", 8192, 6144, 1536),
]


def _events_s(fn, repeat: int, prefill: bool = False) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if prefill:  # the GPU busy while the calls are queued: the events see no launch latency
        torch.cuda._sleep(2_000_000)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def main() -> None:
    from protrain_fx.opprofile import _warm_clocks

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("op_timing_conditions.py needs CUDA")
    device = torch.device("cuda")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    scratch = torch.empty(128 * 2**20, dtype=torch.bfloat16, device=device)  # 256 MiB
    out: dict = {}
    for name, m, k, n in SHAPES:
        x = torch.empty(m, k, dtype=torch.bfloat16, device=device).normal_().mul_(0.02)
        w = torch.empty(n, k, dtype=torch.bfloat16, device=device).normal_().mul_(0.02).t()  # (k, n), stride (1, k)
        b = torch.empty(n, dtype=torch.bfloat16, device=device).normal_().mul_(0.02)

        def op(b=b, x=x, w=w):
            return torch.ops.aten.addmm.default(b, x, w)

        op()
        _warm_clocks(device)
        profiler = statistics.median(_events_s(op, 5) for _ in range(3))
        prefilled = statistics.median(_events_s(op, 5, prefill=True) for _ in range(3))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(15):
                op()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)]
        kernels = [e for e in kernels if not e.name.startswith("Memset")]  # cuBLASLt's workspace memsets
        kernel = statistics.median(e.time_range.elapsed_us() * 1e-6 for e in kernels) if kernels else 0.0
        names = sorted({e.name for e in kernels})
        inter = []
        for _ in range(30):
            scratch.mul_(1.0)
            inter.append(_events_s(op, 1))
        burst = _events_s(op, 200)
        flops = 2 * m * k * n
        out[name] = {"profiler_s": profiler, "prefilled_s": prefilled, "kernel_s": kernel, "interleaved_s": statistics.median(inter[5:]),
                     "burst_s": burst, "flops": flops, "kernels": names}
        print(f"{name}: profiler {profiler * 1e6:7.1f} us, prefilled {prefilled * 1e6:7.1f}, kernel {kernel * 1e6:7.1f}, interleaved "
              f"{statistics.median(inter[5:]) * 1e6:7.1f}, burst {burst * 1e6:7.1f} "
              f"({flops / profiler / 1e12:.0f} / {flops / max(kernel, 1e-12) / 1e12:.0f} / "
              f"{flops / statistics.median(inter[5:]) / 1e12:.0f} / {flops / burst / 1e12:.0f} TFLOP/s)  {names}",
              flush=True)
        del x, w, b, op
    time.sleep(0.1)
    smi.terminate()
    samples = smi.communicate()[0].strip().splitlines()
    out["nvidia_smi"] = samples
    clocks = [int(s.split(",")[1].split()[0]) for s in samples if s.count(",") == 2 and "MHz" in s]
    if clocks:
        print(f"SM clock while measuring: min {min(clocks)}, median {statistics.median(clocks)}, max {max(clocks)} MHz "
              f"({len(clocks)} samples)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
