"""Where the roofline estimate of a block's time goes, per op (a diagnostic for the cost model).

    python bench/roofline_ops.py --size 350M --batch 8 --seq 1024

Captures the B24 GPT step through the backend (eager codegen: nothing is compiled, one step runs
on the device), then prints, for one block's forward and backward nodes, the estimated seconds per
op (``passes/estimate.node_time`` with the device's ``Machine``) and the largest tensors, and the
attention ops the graph holds. Compare with a measured step (``bench/peers.py``)."""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    import torch

    import peers
    import protrain_fx
    from protrain_fx import meta
    from protrain_fx.backend import register
    from protrain_fx.machine import machine_for
    from protrain_fx.passes.estimate import node_time
    from protrain_fx.profiler import _label

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="350M")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--block", default="blocks.3")
    parser.add_argument("--auto", action="store_true", help="offload without counts under a 24 GiB budget, "
                        "and print the cost model's block times next to the sums below")
    args = parser.parse_args()
    register()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = peers.build_model(args.size)
    options = {"codegen": "eager", "auto_plan": False}
    if args.auto:
        protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), device=device,
                            compute_dtype=torch.bfloat16 if device == "cuda" else None)
        options = {"codegen": "eager", "memory_budget": "24GiB"}
    run = torch.compile(model, backend="protrain", options=options)
    idx, targets = peers.make_batch(args.size, args.batch, args.seq, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = run(idx, targets)
    loss.backward()
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    machine = machine_for(torch.device(device))
    print(f"{args.size} on {device} ({machine.name}), batch {args.batch} x {args.seq}")
    if record.auto_plan is not None:
        p = record.auto_plan.problem
        b = next(b for b in p.blocks if b.name == args.block)
        print(f"cost model's {args.block}: forward {b.fwd_s * 1e3:.3f} ms, backward {b.bwd_s * 1e3:.3f} ms; "
              f"outside {p.outside_fwd_s * 1e3:.3f} / {p.outside_bwd_s * 1e3:.3f} ms; record.memory.device "
              f"{record.memory.device}; machine {machine_for(torch.device(record.memory.device)).name}")
    print("flash", torch.backends.cuda.flash_sdp_enabled(), "mem_efficient",
          torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn", torch.backends.cuda.cudnn_sdp_enabled())
    for name, gm in (("forward", record.forward), ("backward", record.backward)):
        by_op: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        big = []
        total = 0.0
        for node in gm.graph.nodes:
            if "attention" in str(node.target) or "softmax" in str(node.target):
                count["attention-like: " + str(node.target)] += 1
            if _label(node) != args.block:
                continue
            t = node_time(node, machine)
            total += t
            by_op[str(node.target)] += t
            nbytes = sum(meta.tensor_nbytes(v) for v in meta.tensor_values(node))
            big.append((nbytes, str(node.target), [tuple(v.shape) for v in meta.tensor_values(node)][:2]))
        print(f"\n{name} of {args.block}: {total * 1e3:.3f} ms estimated")
        for op, t in by_op.most_common(10):
            print(f"  {t * 1e3:8.3f} ms  {op}")
        print("  largest outputs:")
        for nbytes, op, shapes in sorted(big, reverse=True)[:5]:
            print(f"  {nbytes / 2**20:9.1f} MiB  {op} {shapes}")
        for k, v in count.items():
            print(f"  {v} x {k}")


if __name__ == "__main__":
    main()
