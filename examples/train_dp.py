"""Data-parallel training under ``torchrun``: offloaded chunks sharded over the ranks (docs/distributed.md).

    torchrun --nproc_per_node=2 examples/train_dp.py                      # CPU: gloo, small GPT
    torchrun --nproc_per_node=2 examples/train_dp.py --size 350M --budget 8GiB   # one GPU per rank: NCCL

Each rank trains on its own micro-batch; the offloaded chunks' fp32 master and Adam state are split
over the ranks' host memory, gradients are averaged as DDP averages them. Rank 0 prints the loss of
each step (the mean over ranks) and, at the end, checks that every rank holds the same parameters and
writes a checkpoint of whole tensors that loads into a plain model at any number of ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import protrain_fx  # noqa: E402
from examples.gpt import GPT, gpt_config, random_batch  # noqa: E402
from protrain_fx.backend import register  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125M" if cuda else "small", help="GPT preset (examples/gpt.py SIZES)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8 if cuda else 2, help="per rank")
    parser.add_argument("--budget", default=None if cuda else "12MB",
                        help="memory budget per rank (CPU: the counts are chosen for it)")
    parser.add_argument("--chunk-bytes", type=int, default=None if cuda else 1 << 19,
                        help="chunk size (default: the offload's own; CPU: small chunks for the small GPT)")
    parser.add_argument("--codegen", choices=("inductor", "eager"), default="inductor" if cuda else "eager")
    parser.add_argument("--out", type=Path, default=None, help="write the checkpoint here (rank 0)")
    args = parser.parse_args(argv)

    register()  # a no-op once the package is installed
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    config = gpt_config(args.size)

    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    handle = protrain_fx.offload(model, optimizer, device=device, chunk_bytes=args.chunk_bytes,
                                 compute_dtype=torch.bfloat16 if cuda else None)
    options = {"codegen": args.codegen} | ({"memory_budget": args.budget} if args.budget else {})
    compiled = torch.compile(model, backend="protrain", options=options)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own micro-batches
    for step in range(1, args.steps + 1):
        batch = random_batch(config, args.batch_size, config.block_size, device=device, generator=data)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = compiled(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm over every rank's chunks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f} (mean over {world} rank{'s' if world > 1 else ''}), "
                  f"{time.perf_counter() - start:.2f} s", flush=True)

    state = handle.state_dict(model)  # collectives: every rank calls both
    optimizer_state = handle.optimizer_state_dict()
    digest = torch.stack([t.double().sum() for t in state.values()]).to(device)
    digests = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest)
    same = all(torch.equal(d, digests[0]) for d in digests)
    if rank == 0:
        print(f"{handle.n_persist} of {len(handle.layout.chunks)} chunks on the {device.type}, the rest sharded "
              f"over {world} rank{'s' if world > 1 else ''}; every rank holds the same parameters: {same}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save({"model": state, "optimizer": optimizer_state}, args.out / "checkpoint.pt")
    handle.close()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
