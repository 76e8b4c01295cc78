"""Two gloo ranks training an offloaded model whose host chunks are sharded: each rank's store
holds half of every offloaded chunk; fetches all-gather, gradients reduce-scatter.

Exactness: each rank's gradient equals eager autograd's on its micro-batch (codegen eager); the
reduce-scatter's sum of two then halving is exactly ``(g0 + g1) / 2``; the CPU AdamW steps pieces
of parameters whose cuts lie on its 64-element grid (``offload.SHARD_ALIGN``), giving fused AdamW's
bits. Where the reduction order differs from the reference's, the tolerance is said at the check."""

from __future__ import annotations

import copy

import torch

import protrain_fx
from tests.distributed import common
from tests.distributed.ranks import run_ranks

#: (n_persist, n_buffer, n_gpu_optim, n_lean): streamed chunks with and without persistent ones,
#: shards stepped by the device optimizer (``device="cpu"`` runs its code on the CPU), lean chunks.
COUNTS = [(0, 2, 0, 0), (2, 3, 1, 0), (1, 2, 2, 3)]


def _train(rank: int, world: int, n_persist: int, n_buffer: int, n_gpu_optim: int, n_lean: int, *, micro: int = 1,
           clip: float | None = None, frozen: str | None = None, reduce_each_micro: bool = False) -> dict:
    model, reference, opt, ref_opt = common.models(frozen)
    handle = protrain_fx.offload(model, opt, n_persist=n_persist, n_buffer=n_buffer, device="cpu",
                                 chunk_bytes=common.CHUNK, n_lean=n_lean, n_gpu_optim=n_gpu_optim)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref_opt)]
    losses = []
    for step in range(3):
        loss = common.forward_backward(compiled, handle, step, rank, micro)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(), opt.zero_grad()
        ref = common.reference_step(reference, ref_opt, step, world, micro=micro, clip=clip,
                                    reduce_each_micro=reduce_each_micro)
        losses.append((loss.detach(), ref[rank]))
        for s in schedules:
            s.step()
    state = handle.state_dict(model)
    whole = handle.store.full_numel
    out = {
        "losses": losses,
        "params": {n: (state[n], p.detach().clone()) for n, p in reference.named_parameters()},
        "host_elems": handle.store.chunk_numel, "whole_elems": whole,
        "device_steps": handle.device_adam.chunk_steps if handle.device_adam is not None else 0,
        # of the chunks stepped on the device, those this rank holds a trainable piece of (a part
        # of padding alone has nothing to step)
        "device_chunks": sum(any(s.chunk == c and s.trainable for s in handle.store.slots) for c in range(n_gpu_optim)),
        "optimizer": copy.deepcopy(handle.optimizer_state_dict()), "ref_optimizer": copy.deepcopy(ref_opt.state_dict()),
    }
    handle.close()
    torch._dynamo.reset()  # the next model of this class compiles for its own chunks
    return out


def _check(result: dict, exact: bool) -> None:
    for loss, ref in result["losses"]:
        assert torch.equal(loss, ref) if exact else torch.allclose(loss, ref, rtol=1e-5, atol=0), (loss, ref)
    for name, (got, want) in result["params"].items():
        if exact:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def _several_counts(rank: int, world: int) -> list[dict]:
    return [_train(rank, world, *counts) for counts in COUNTS]


def test_sharded_chunks_train_as_eager_on_the_averaged_gradients_for_several_counts():
    ranks = run_ranks(_several_counts)
    for i, counts in enumerate(COUNTS):  # every chunk stepped on the device has a piece on some rank
        assert sum(results[i]["device_chunks"] for results in ranks) >= counts[2], counts
    for rank, results in enumerate(ranks):
        for counts, result in zip(COUNTS, results):
            assert result["host_elems"] * 2 == result["whole_elems"]  # each rank's store holds half of each chunk
            # the first n_gpu_optim offloaded chunks' parts went through the device optimizer, once a
            # step after the first (held to learn whether the loop clips: stepped on the CPU)
            assert result["device_steps"] == 2 * result["device_chunks"], counts
            _check(result, exact=True)
            # every rank's optimizer state dict is whole: the reference's, bit for bit
            got, want = result["optimizer"]["state"], result["ref_optimizer"]["state"]
            assert got.keys() == want.keys(), counts
            for index in want:
                for kind in ("step", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(got[index][kind], want[index][kind]), (counts, index, kind)


def _accumulate_clip_frozen(rank: int, world: int) -> list[dict]:
    return [
        _train(rank, world, 0, 2, 0, 0, micro=2, reduce_each_micro=True),
        _train(rank, world, 0, 2, 0, 2, clip=0.05, frozen="blocks.2.mlp.fc.weight"),
    ]


def test_sharded_chunks_accumulate_clip_and_keep_frozen_parameters():
    for accumulated, clipped in run_ranks(_accumulate_clip_frozen):
        # Micro-batches: each backward's gradient is reduced and the averages added on the host,
        # (a0 + a1) / 2 + (b0 + b1) / 2: the reference adds in that order, bit for bit.
        _check(accumulated, exact=True)
        # The clip's norm sums squared pieces over ranks where torch takes the norm of the
        # per-parameter norms: the scale differs in its last bits, so each update does by a relative
        # few 1e-7 (Adam's update is nearly scale-free); 1e-6 on weights of about 0.02 bounds that.
        _check(clipped, exact=False)
        frozen = clipped["params"]["blocks.2.mlp.fc.weight"]
        assert torch.equal(*frozen)
