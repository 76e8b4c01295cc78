"""Where a swap plan's time goes: forward and backward time per plan, and the copies in a profile.

    python bench/swap_profile.py --size 760M --plans swap=0,checkpoint=0 swap=2,checkpoint=0 \
        --machine '{"d2h_bytes": 20e9}' --out OUT

For each plan (and each --machine override, applied to every plan after the plain run): median
forward and backward time over 5 steps (CUDA events around each), and from a torch.profiler trace of
one step the GPU time of the D2H/H2D copies and of compute, and how much compute-stream time
passed with no kernel running (stalls). Writes swap_profile.json (and one trace per plan).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def measure(size: str, spec: str, machine: dict | None, out: Path, batch: int, seq: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import peers
    import protrain_fx
    from protrain_fx.backend import register

    register()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = peers.build_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    options = {"plan": peers.plan_from_spec(spec, peers.block_labels(size))}
    if machine:
        options["machine"] = machine
    run = torch.compile(model, backend="protrain", options=options)
    idx, targets = peers.make_batch(size, batch, seq, "cuda")

    def step(events=None):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, targets)
        if events:
            events[0].record()
        loss.backward()
        if events:
            events[1].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    fw, bw = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        step((mid, end))
        torch.cuda.synchronize()
        fw.append(start.elapsed_time(mid))
        bw.append(mid.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    label = spec.replace(",", "_").replace("=", "") + ("_m" if machine else "")
    prof.export_chrome_trace(str(out / f"trace_{label}.json"))
    copies = {"DtoH": 0.0, "HtoD": 0.0}
    kernels = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name
        if "Memcpy DtoH" in name:
            copies["DtoH"] += e.device_time / 1e3
        elif "Memcpy HtoD" in name:
            copies["HtoD"] += e.device_time / 1e3
        elif "Memcpy" not in name and "Memset" not in name:
            kernels.append((e.time_range.start, e.time_range.end))
    kernels.sort()
    busy, gaps, cursor = 0.0, [], None
    for s, e in kernels:
        if cursor is not None and s > cursor:
            gaps.append((s - cursor) / 1e3)
        busy += max(0, e - max(s, cursor or s)) / 1e3
        cursor = max(cursor or e, e)
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    result = {
        "plan": spec,
        "machine": machine,
        "forward_ms": statistics.median(fw),
        "backward_ms": statistics.median(bw),
        "copy_ms": copies,
        "kernel_busy_ms": busy,
        "idle_gaps_ms_total": sum(gaps),
        "idle_gaps_ms_top": sorted(gaps, reverse=True)[:8],
        "swapped_bytes": sum(s.nbytes for s in record.swapped),
        "placements": [
            {"name": s.name, "MiB": s.nbytes / 2**20, "offload_after": s.offload_after, "wait_before": s.wait_before,
             "reload_before": s.reload_before, "first_use": s.first_use}
            for s in record.swapped if s.nbytes > 2**20
        ],
    }
    del run, model, optimizer
    protrain_fx.reset()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="760M")
    parser.add_argument("--plans", nargs="+", default=["swap=0,checkpoint=0", "swap=2,checkpoint=0"])
    parser.add_argument("--machine", type=json.loads, action="append", default=[])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    runs = [(spec, None) for spec in args.plans]
    runs += [(spec, m) for m in args.machine for spec in args.plans if not spec.startswith("swap=0")]
    for spec, machine in runs:
        try:
            results.append(measure(args.size, spec, machine, args.out, args.batch, args.seq))
        except Exception as e:  # noqa: BLE001  keep the other runs
            results.append({"plan": spec, "machine": machine, "error": f"{type(e).__name__}: {e}"[:500]})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "placements"}), flush=True)
        (args.out / "swap_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
