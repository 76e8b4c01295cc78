"""CPU optimizer throughput of a host chunk (``protrain_fx.runtime.optim.cpu_adam``) against torch's own
fused CPU AdamW on plain fp32 parameters of the same size: parameters per second, per slice size.

    python bench/cpu_adam_speed.py --params 200e6 --out OUT   # prints a table, writes OUT/cpu_adam.json

A chunk step with bf16 compute converts the bf16 gradient to fp32, runs the fused kernel and writes
the new bf16 working copy; ``--slices`` are the elements per fused call (a huge value = one pass
per buffer over the whole chunk, the first version's way).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protrain_fx.chunks import ParamInfo, pack  # noqa: E402
from protrain_fx.runtime.store.chunk_store import ChunkStore  # noqa: E402
from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW  # noqa: E402


def best_rate(fn, n: int, repeats: int, setup=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        setup()  # not timed (the gradient's landing is a DMA from the GPU in training)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return n / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=200e6, help="parameters in the chunk (4 tensors)")
    parser.add_argument("--slices", type=int, nargs="+", default=[1 << 40, 1 << 22, 1 << 20, 1 << 18])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    n = int(args.params) // 4 * 4
    params = {f"p{i}": torch.nn.Parameter(torch.randn(n // 4)) for i in range(4)}
    rows = {"threads": torch.get_num_threads(), "params": n}

    plain = torch.optim.AdamW(params.values(), lr=1e-3, fused=True)
    for p in params.values():
        p.grad = torch.randn_like(p)
    rows["torch_fused_adamw_fp32"] = best_rate(plain.step, n, args.repeats)
    for p in params.values():
        p.grad = None

    infos = [ParamInfo((k,), v.numel() * 4, "blocks.0", i) for i, (k, v) in enumerate(params.items())]
    store = ChunkStore(pack(infos, n * 4), params, compute_dtype=torch.bfloat16, pin_memory=False)
    adam = ChunkAdamW(store, torch.optim.AdamW(params.values(), lr=1e-3), params)
    grads = {k: torch.randn_like(v, dtype=torch.bfloat16) for k, v in params.items()}
    for size in args.slices:
        adam.slice_elems = size

        rows[f"chunk_bf16_slice_{size}"] = best_rate(
            lambda: adam.step_chunk(0), n, args.repeats, setup=lambda: store.write_grads(grads)
        )
    for key, value in rows.items():
        print(f"{key:>32}: {value / 1e9:.2f} G params/s" if key.startswith(("torch", "chunk")) else f"{key:>32}: {value}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_adam.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
