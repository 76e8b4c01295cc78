"""The two memory judges of a plan side by side, on any device (the CPU too): the graph-level
analysis (every value of the graphs) and Inductor's allocation plan of the compiled step.

    python bench/memory_judges.py [--layers 2] [--vocab 50304] [--batch 8] [--seq 256] [--bf16]

Compiles one training step of a tiny GPT with ``auto_plan=False`` and prints both peaks and where
each one is reached. The gap is what ``options={"verify": "inductor"}`` recovers (``docs/results.md``,
ninth session: the loss's fp32 logits-sized values, which Inductor never stores).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import protrain_fx  # noqa: E402
from examples.gpt import GPT, gpt_config, random_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_layer=args.layers, vocab_size=args.vocab, block_size=args.seq)
    model = GPT(cfg).to(args.device)
    idx, targets = random_batch(cfg, args.batch, args.seq, device=args.device)
    step = torch.compile(model, backend="protrain", options={"auto_plan": False})
    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16):
        loss = step(idx, targets)
    loss.backward()
    record = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1]
    for name, memory in (("graph-level analysis", record.memory_unfused), ("Inductor's allocation plan", record.memory)):
        e = memory.peak_entry
        print(f"{name:>27}: peak {memory.peak_bytes / 2**20:8.1f} MiB at {e.phase} {e.name} ({e.op}; {e.source})")


if __name__ == "__main__":
    main()
