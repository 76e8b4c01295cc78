"""How fast offloaded chunks' optimizer steps stream through the GPU (``runtime/optim/device_adam.py``),
against the copy rates the cost model builds them from. GPU only.

    python bench/device_step_rate.py [--params 226M] [--chunks 3] [--out FILE.json]

Steps ``--chunks`` chunks of ``--params`` fp32 parameters (bf16 working copies, pinned store) one
after another through :class:`~protrain_fx.runtime.optim.device_adam.DeviceAdamW`, as backward issues
them, and times them from the first copy in to the last copy out: the profiler's own measurement
(``profile.device.device_step_spans``), in each of these scenarios:

* ``alone``: nothing else runs;
* ``cpu``: the CPU optimizer's worker steps another chunk of the same size meanwhile, as it does in
  training (it reads and writes the host store the copies read and write);
* ``cpu_launch``: and this thread launches small kernels until the steps end (the training loop);
* ``cpu_matmul``: the CPU step, and bf16 matrix products on the default stream fill the SMs, as
  backward's kernels do; ``cpu_matmul_high``: the same with the steps' update kernels on a stream
  of high priority (the runtime's is of normal priority: measured, high did not help);
* ``cpu_deep``: the CPU step, and products and memory-bound kernels kept about 48 deep in the
  default stream's queue, as a training loop runs ahead of the GPU;
* ``cpu_matmul_waiting`` / ``cpu_deep_waiting``: those loads also while the issuing thread waits for
  room for the next step (the others leave the GPU to the steps then, as the profiler does).
* ``cpu_deep_kept`` / ``cpu_deep_kept_waiting``: the deep queue, not drained when the load returns
  (backward's queued kernels run on while its thread waits for room; ``cpu_deep_waiting`` drains it
  each time, which holds up the next step's issue).

Beside them, the raw link: one pinned copy of the bytes a step moves in (master and moments, 12
bytes per parameter) and one of those it moves out (14), on two streams at once. The cost model
prices a device step at the profiler's measured device-step rate (``device_step_bytes_per_s``,
measured as ``cpu_matmul`` here on 64M-parameter chunks), where it used to take the both-ways link
rate (``duplex / 2`` per direction). Results: ``docs/results.md#device-optimizer-steps``.
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

from protrain_fx.profile.device import device_step_spans
from protrain_fx.profile.machine_profile import measure_machine  # noqa: E402

#: name -> (the CPU step beside the device steps, what this thread runs beside them, update stream
#: priority, whether it also runs while the issuing thread waits for room for the next step)
SCENARIOS = {
    "alone": (False, None, 0, False),
    "cpu": (True, None, 0, False),
    "cpu_launch": (True, "launch", 0, False),
    "cpu_matmul": (True, "matmul", 0, False),
    "cpu_matmul_high": (True, "matmul", -1, False),
    "cpu_deep": (True, "deep", 0, False),
    "cpu_matmul_waiting": (True, "matmul", 0, True),
    "cpu_deep_waiting": (True, "deep", 0, True),
    "cpu_deep_kept": (True, "deep_kept", 0, False),
    "cpu_deep_kept_waiting": (True, "deep_kept", 0, True),
}


def _count(text: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="226M", help="parameters per chunk (B24 4.2B: 226M)")
    parser.add_argument("--chunks", type=int, default=3, help="device-stepped chunks per round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--block-width", type=int, default=0,
                        help="split each chunk into GPT blocks of this width (norms, biases, weights) as a model's chunk; 0: one parameter")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    parser.add_argument("--no-machine", action="store_true", help="skip the machine measurement (the cost model's columns)")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = [x for x in args.scenarios.split(",") if x]
    if unknown := [x for x in names if x not in SCENARIOS]:
        sys.exit(f"device_step_rate: unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    if not torch.cuda.is_available():
        sys.exit("device_step_rate: needs a GPU")
    n, k = _count(args.params), args.chunks
    if args.block_width < 0 or n <= 0 or k <= 0:
        sys.exit(f"device_step_rate: --params ({n}) and --chunks ({k}) must be positive, --block-width "
                 f"({args.block_width}) >= 0")
    parts = gpt_parts(n, args.block_width) if args.block_width else []
    n = sum(parts) or n
    out: dict = {"params": n, "chunks": k, "parameters_per_chunk": len(parts) or 1, "device": torch.cuda.get_device_name()}
    for name in names:  # the profiler's measurement, per scenario
        cpu, beside, priority, waiting = SCENARIOS[name]
        spans = device_step_spans(n, k, args.repeat, cpu=cpu, beside=beside, priority=priority, parts=parts,
                                  while_waiting=waiting)
        out[name] = {"median_params_per_s": k * n / statistics.median(spans), "spans_s": spans}
    out["raw"] = _raw_link(n)
    torch.cuda.empty_cache()
    in_b, out_b = 12 * n, 14 * n
    if not args.no_machine:
        m = measure_machine("cuda")
        out["machine"] = m.to_dict()
        shared = m.duplex_bytes_per_s / 2
        out["link_step_s"] = max(in_b / min(m.h2d_bytes_per_s, shared), out_b / min(m.d2h_bytes_per_s, shared))
        out["model_step_s"] = out_b / m.device_step_bytes_per_s if m.device_step_bytes_per_s else out["link_step_s"]
    text = json.dumps(out, indent=1)
    print(text)
    for name in names:
        rate = out[name]["median_params_per_s"]
        model = (f" (cost model {out['model_step_s'] * 1e3:.1f} ms; at the shared link rate "
                 f"{out['link_step_s'] * 1e3:.1f})" if "model_step_s" in out else "")
        print(f"{name:>22}: {rate / 1e9:.2f} G params/s, {out_b * rate / n / 1e9:.1f} GB/s out, "
              f"{n / rate * 1e3:.1f} ms per chunk{model}", file=sys.stderr)
    raw = out["raw"]
    print(f"  raw link: in {raw['in_s'] * 1e3:.1f} ms, out {raw['out_s'] * 1e3:.1f} ms, both {raw['both_s'] * 1e3:.1f} ms",
          file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")


def gpt_parts(n: int, d: int) -> list[int]:
    """Parameter sizes of the GPT blocks of width ``d`` that fill about ``n`` parameters (at least
    one block): per block two norms (weight, bias), the fused QKV (3d^2 + 3d), the projection
    (d^2 + d), and the MLP (4d^2 + 4d, 4d^2 + d)."""
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return block * max(1, round(n / sum(block)))


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
