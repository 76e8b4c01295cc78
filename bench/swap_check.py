"""GPU checks of activation swap (issue 4) that the peer benchmark does not make.

    python bench/swap_check.py pcie  --out pcie.json
        pinned host<->device copy speed: H2D alone, D2H alone, both at once (GB/s)
    python bench/swap_check.py loss  --size 350M --plan swap=2,checkpoint=6 --steps 50 --out loss.json
        bf16 losses of eager and of protrain with the plan, step by step, same weights and batches
    python bench/swap_check.py overlap --runs peers.json --pcie pcie.json
        from peer-benchmark runs of plans that differ only in n_swap: the extra step time of each
        swap plan over the no-swap plan against the serialized copy time of its swapped bytes

"hidden fraction" = 1 - max(0, t(swap) - t(no swap)) / (bytes / D2H + bytes / H2D), the share of
the transfer time the step did not pay for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def pcie(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    import torch

    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def up() -> None:
        with torch.cuda.stream(h2d):
            dev_dst.copy_(host_src, non_blocking=True)

    def down() -> None:
        with torch.cuda.stream(d2h):
            host_dst.copy_(dev_src, non_blocking=True)

    def both() -> None:
        up()
        down()

    t_up, t_down, t_both = timed(up), timed(down), timed(both)
    return {
        "bytes": nbytes,
        "h2d_GBps": nbytes / t_up / 1e9,
        "d2h_GBps": nbytes / t_down / 1e9,
        "both_GBps_total": 2 * nbytes / t_both / 1e9,
        "device": torch.cuda.get_device_name(),
    }


def loss_check(size: str, plan_spec: str, steps: int, batch: int, seq: int, device: str = "cuda") -> dict:
    """Per-step bf16 losses of eager and protrain+plan from the same weights on the same batches."""
    import torch

    import peers

    losses: dict[str, list[float]] = {}
    for system in ("eager", f"protrain_plan[{plan_spec}]"):
        torch.manual_seed(0)
        step, model, _ = peers.build(system, size, device)
        idx, targets = peers.make_batch(size, batch, seq, device)  # the benchmark's fixed batch
        losses[system] = [float(step(idx, targets).item()) for _ in range(steps)]
        del step, model
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    (eager, ours) = losses.values()
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, eager)]
    return {
        "size": size,
        "plan": plan_spec,
        "steps": steps,
        "losses": losses,
        "max_rel_diff": max(rel),
        "final_rel_diff": rel[-1],
        "within_1pct": max(rel) <= 0.01,
    }


def overlap(runs: list[dict], link: dict) -> list[dict]:
    """Hidden fraction of every swap plan against the no-swap plan with the same checkpoint count."""
    ok = [r for r in runs if r.get("status") == "ok" and r.get("plan_blocks")]
    rows = []
    for r in ok:
        if not r["plan_blocks"]["swap"]:
            continue
        base = next(
            (b for b in ok if b["size"] == r["size"] and b["plan_blocks"]["swap"] == 0
             and b["plan_blocks"]["checkpoint"] == r["plan_blocks"]["checkpoint"]),
            None,
        )
        if base is None:
            continue
        nbytes = r.get("swapped_bytes", 0)
        serial = nbytes / (link["d2h_GBps"] * 1e9) + nbytes / (link["h2d_GBps"] * 1e9)
        extra = r["step_s"] - base["step_s"]
        rows.append({
            "size": r["size"],
            "plan": r.get("plan"),
            "n_swap": r["plan_blocks"]["swap"],
            "swapped_GiB": nbytes / 2**30,
            "step_ms": 1000 * r["step_s"],
            "base_step_ms": 1000 * base["step_s"],
            "extra_ms": 1000 * extra,
            "serial_copy_ms": 1000 * serial,
            "hidden_fraction": 1 - max(0.0, extra) / serial if serial else None,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("pcie", "loss", "overlap"))
    parser.add_argument("--size", default="350M")
    parser.add_argument("--plan", default="swap=2,checkpoint=6")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--runs", type=Path, help="peers.json of the swap series (overlap)")
    parser.add_argument("--pcie", type=Path, help="output of the pcie check (overlap)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.what == "pcie":
        result = pcie()
    elif args.what == "loss":
        result = loss_check(args.size, args.plan, args.steps, args.batch, args.seq, args.device)
    else:
        runs = json.loads(args.runs.read_text())
        runs = runs["results"] if isinstance(runs, dict) else runs
        result = overlap(runs, json.loads(args.pcie.read_text()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2)[:4000])


if __name__ == "__main__":
    main()
