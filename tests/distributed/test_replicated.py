"""Two gloo ranks: agreement between ranks, its errors, and data-parallel training of an offloaded
model whose chunks all stay on the device (replicated; gradients all-reduced in backward).

Exactness: each rank's gradient is bit-equal to eager autograd's on its micro-batch (codegen
eager), two ranks' sum then halving is exactly ``(g0 + g1) / 2``, and fused AdamW on equal inputs
gives equal bits, so parameters equal the reference bit for bit."""

from __future__ import annotations

import time

import torch

import protrain_fx
from protrain_fx.runtime.parallel import distributed
from protrain_fx.runtime.offload.handle import _layout
from tests.distributed import common
from tests.distributed.ranks import run_ranks


def _errors(rank: int, world: int) -> dict[str, tuple[str, str, float]]:
    """Each refusal this rank saw: (error type, message, seconds it took); under ``"chunks"`` the
    layout's chunk count."""
    seen = {}

    def expect(what, fn):
        start = time.monotonic()
        try:
            fn()
        except Exception as error:  # noqa: BLE001 -- the test checks type and message
            seen[what] = (type(error).__name__, str(error), time.monotonic() - start)
        else:
            seen[what] = ("none", "", time.monotonic() - start)

    expect("agree", lambda: distributed.agree({"value": rank, "same": 1}, "a test"))
    model, _, opt, _ = common.models()
    expect("counts", lambda: protrain_fx.offload(model, opt, n_persist=1, n_buffer=1 + rank, device="cpu",
                                                 chunk_bytes=common.CHUNK))
    expect("gloo with cuda chunks", lambda: protrain_fx.offload(model, opt, device="cuda"))
    model, _, opt, _ = common.models()
    expect("host memory", lambda: protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu",
                                                      chunk_bytes=common.CHUNK, n_lean=0, available_host_bytes=1000))
    seen["chunks"] = len(_layout(dict(model.named_parameters(remove_duplicate=False)), common.CHUNK,
                                 distributed.active()).chunks)
    model, _, opt, _ = common.models()
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=common.CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    idx, targets = common.batch(0, rank)
    cut = 32 - 8 * rank  # rank 1 feeds a shorter sequence
    expect("input shapes", lambda: compiled(idx[:, :cut], targets[:, :cut]))
    handle.close()
    torch._dynamo.reset()
    return seen


def test_a_disagreement_raises_on_every_rank_within_seconds_naming_each_ranks_value():
    ranks = run_ranks(_errors)
    for rank, seen in enumerate(ranks):
        kind, message, seconds = seen["agree"]
        assert kind == "RankDisagreement" and "value: rank 0: 0, rank 1: 1" in message and "  same:" not in message
        kind, message, _ = seen["counts"]
        assert kind == "RankDisagreement" and "(1, 2, None, 'auto')" in message and "(1, 1, None, 'auto')" in message
        kind, message, _ = seen["gloo with cuda chunks"]
        assert kind == "ValueError" and "init_process_group('nccl')" in message and "rank 1:" in message
        # Every chunk offloaded, none lean, fp32: a rank holds half of each 64 KiB chunk (8192 of its
        # 16384 elements) with its master, two moments and working copy, 16 bytes an element; the
        # node's two ranks need 16 x 16384 bytes a chunk together, of 2 x 1000 available.
        kind, message, _ = seen["host memory"]
        need = 16 * 16384 * seen.pop("chunks")
        assert kind == "HostMemoryError", (kind, message)
        assert f"its 2 ranks: together they need {need} bytes" in message, message
        assert "and 2000 bytes (0.00 GiB) are available to them; run fewer ranks a node" in message, message
        assert "(ranks [0, 1] refused; rank 0: the chunk store" in message, message
        kind, message, _ = seen["input shapes"]
        assert kind == "RankDisagreement" and "(2, 32):torch.int64" in message and "(2, 24):torch.int64" in message
        assert all(s < 20 for _, _, s in seen.values()), (rank, seen)


def _train_replicated(rank: int, world: int, micro: int) -> dict:
    model, reference, opt, ref_opt = common.models()
    n_chunks = len(_layout(dict(model.named_parameters(remove_duplicate=False)), common.CHUNK,
                           distributed.active()).chunks)
    handle = protrain_fx.offload(model, opt, n_persist=n_chunks, n_buffer=0, device="cpu", chunk_bytes=common.CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref_opt)]
    same_losses = []
    for step in range(3):
        loss = common.forward_backward(compiled, handle, step, rank, micro)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step(), opt.zero_grad()
        ref_losses = common.reference_step(reference, ref_opt, step, world, micro=micro, clip=0.05)
        same_losses.append(torch.equal(loss.detach(), ref_losses[rank]))
        for s in schedules:
            s.step()
    same = common.full_params(handle.state_dict(model), reference)
    reduced = handle.grad_sync.reduced
    handle.close()
    torch._dynamo.reset()  # the next model of this class compiles for its own chunks
    return {"losses": same_losses, "params": same, "reduced": reduced, "threads": handle.group.local_world_size}


def _train_replicated_each(rank: int, world: int, micros: tuple[int, ...]) -> list[dict]:
    """:func:`_train_replicated` for each micro-batch count, one model after the other, in one start of the
    ranks (a start is most of a run: each rank imports torch and joins the group)."""
    return [_train_replicated(rank, world, micro) for micro in micros]


def test_every_chunk_on_the_device_trains_as_eager_on_the_averaged_gradients():
    micros = (1, 2)  # 2: a micro-batch under handle.accumulate(), reduced once at the last
    for results in zip(*run_ranks(_train_replicated_each, micros)):  # per micro-batch count, each rank's
        for result in results:
            assert all(result["losses"]), result["losses"]
            assert all(result["params"].values()), [n for n, ok in result["params"].items() if not ok]
            assert result["reduced"] == 3 * len(result["params"])  # each parameter once per step (tied: once)


def _train_ddp(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from protrain_fx.plan import from_counts

    model, reference, opt, ref_opt = common.models()
    plan = from_counts("checkpoint=all", [f"blocks.{i}" for i in range(common.CONFIG.n_layer)])
    compiled = torch.compile(DDP(model), backend="protrain", options={"codegen": "eager", "plan": plan})
    same_losses = []
    for step in range(3):
        loss = compiled(*common.batch(step, rank))
        loss.backward()
        opt.step(), opt.zero_grad()
        same_losses.append(torch.equal(loss.detach(), common.reference_step(reference, ref_opt, step, world)[rank]))
    checkpointed = [g for g in protrain_fx.captured_graphs() if g.plan is not None]
    same = {n: torch.equal(p, r) for (n, p), r in zip(model.named_parameters(), reference.parameters())}
    return {"losses": same_losses, "params": same, "planned": len(checkpointed)}


def test_ddp_compiled_with_an_activation_plan_trains_as_eager_ddp():
    # DDP divides each gradient by the world size and sums: g0 / 2 + g1 / 2 is exactly (g0 + g1) / 2
    # (halving is exact), so the parameters equal the reference bit for bit.
    for result in run_ranks(_train_ddp):
        assert result["planned"] >= 1  # the plan reached the graphs DDP's optimizer split out
        assert all(result["losses"]), result["losses"]
        assert all(result["params"].values()), [n for n, ok in result["params"].items() if not ok]
