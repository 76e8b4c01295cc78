"""Where the roofline estimate of a block's time goes, per op (a diagnostic for the cost model).

    python bench/roofline_ops.py --size 350M --batch 8 --seq 1024 [--machine H200]

Captures the B24 GPT step through the backend without running it (``protrain_fx.what_fits``: the
graphs Inductor codegen would get, decompositions included), then prints for one block the
estimated seconds per op (``passes/estimate.node_time`` with the ``Machine`` constants) and the
totals over the whole step per node and with memory-bound nodes fused
(``passes/estimate.fused_node_times``, what the cost model uses for Inductor codegen). Compare with
a measured step (``bench/peers.py``). Runs on a CPU too (the GPU's constants with ``--machine H200``;
CPU autocast decides a few casts differently from CUDA's).
"""

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
    from protrain_fx import machine as machines
    from protrain_fx.passes.estimate import node_time
    from protrain_fx.profiler import _label, _phase_times

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="350M")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--block", default="blocks.3")
    parser.add_argument("--machine", choices=("device", "H200", "GENERIC_GPU"), default="device",
                        help="constants: the device's (default) or a named GPU's")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = peers.build_model(args.size)
    idx, targets = peers.make_batch(args.size, args.batch, args.seq, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        protrain_fx.what_fits(model, idx, targets, memory_budget=2**60)
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    machine = (machines.machine_for(torch.device(device)) if args.machine == "device"
               else getattr(machines, args.machine))
    print(f"{args.size} on {device}, constants of {machine.name}, batch {args.batch} x {args.seq}")
    fw = [n for n in record.forward.graph.nodes if n.op not in ("placeholder", "output")]
    bw = [n for n in record.backward.graph.nodes if n.op not in ("placeholder", "output")]
    for fused in (False, True):
        times = _phase_times(fw, bw, machine, fused=fused)
        total = sum(f + b for f, b in times.values())
        block = times.get(args.block, (0.0, 0.0))
        print(f"{'fused' if fused else 'per node'}: step {total * 1e3:.1f} ms; {args.block} forward "
              f"{block[0] * 1e3:.3f} ms, backward {block[1] * 1e3:.3f} ms")
    for name, nodes in (("forward", fw), ("backward", bw)):
        by_op: collections.Counter = collections.Counter()
        for node in nodes:
            if _label(node) == args.block:
                by_op[str(node.target)] += node_time(node, machine)
        print(f"\n{name} of {args.block}, per node, largest ops:")
        for op, t in by_op.most_common(10):
            print(f"  {t * 1e3:8.3f} ms  {op}")


if __name__ == "__main__":
    main()
