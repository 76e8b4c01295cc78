"""Activation swap on a GPU: copy streams, pinned pool, and numerics of swapped training steps.

Skipped without CUDA (CI). Overlap and speed are measured by ``bench/peers.py`` (``protrain_plan`` runs), not here.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.plan import Plan, interleaved
from protrain_fx.runtime import swap

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Machine override that swaps values of any size (the tiny test models have none over 1 MiB).
SWAP_ALL = {"min_swap_bytes": 0}



def test_ops_copy_on_side_streams_into_pinned_buffers():
    x = torch.randn(1 << 20, device="cuda")
    y = x * 2  # queued on the compute stream before the offload: the copy must see it
    host = torch.ops.protrain.offload(y, "t.slot")
    assert host.device.type == "cpu" and host.is_pinned()
    torch.ops.protrain.offload_wait(host, y, "t.slot")
    back = torch.ops.protrain.reload(host, "t.slot", y.device)
    torch.ops.protrain.reload_wait(back, "t.slot")
    assert torch.equal(back, y)
    assert swap.copy_stream("d2h", y.device) != torch.cuda.current_stream()
    assert swap.copy_stream("h2d", y.device) != swap.copy_stream("d2h", y.device)
    buffers = swap.POOL.buffers()
    del host
    host = torch.ops.protrain.offload(y, "t.slot")  # the previous buffer is free again: reused
    torch.ops.protrain.offload_wait(host, y, "t.slot")
    assert swap.POOL.buffers() == buffers


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_swap_plan_trains_like_eager_in_bf16(codegen):
    torch.manual_seed(0)
    config = gpt_config("tiny", n_layer=6)
    model = GPT(config).cuda()
    reference = copy.deepcopy(model)
    labels = [f"blocks.{i}" for i in range(config.n_layer)]
    plan = interleaved(labels, n_swap=2, n_checkpoint=2)
    # This model's saved values are all under 1 MiB, which the swap leaves on the GPU by default
    # (Machine.min_swap_bytes): swap them anyway, or the test swaps nothing (seen on the H200).
    options = {"codegen": codegen, "plan": plan, "machine": SWAP_ALL}
    compiled = torch.compile(model, backend="protrain", options=options)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    losses, ref_losses = [], []
    for step in range(5):
        batch = [t.cuda() for t in random_batch(config, 4, 64, generator=torch.Generator().manual_seed(step))]
        for m, o, out in ((compiled, opt, losses), (reference, ref_opt, ref_losses)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(*batch)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    assert record.swapped, "the plan swaps two blocks"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.01 * abs(b), (losses, ref_losses)


def test_fp32_swap_is_exact_on_gpu_with_eager_codegen():
    torch.manual_seed(0)
    config = gpt_config("tiny", n_layer=4)
    model = GPT(config).cuda()
    reference = copy.deepcopy(model)
    plan = Plan(blocks={"blocks.0": "swap", "blocks.2": "swap"})
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "plan": plan, "machine": SWAP_ALL})
    batch = [t.cuda() for t in random_batch(config, 2, 64)]
    compiled(*batch).backward()
    reference(*batch).backward()
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    assert record.swapped
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad)
