"""Checkpoint plans: per-block recompute written onto the joint graph and executed by the partitioner.

Gradients must equal eager exactly (fp32, eager codegen) for any plan; checkpointed blocks save only
what crosses their boundary and recompute the rest in backward.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import meta
from protrain_fx.plan import Plan, interleaved

CONFIG = gpt_config("tiny", n_layer=4)
LABELS = tuple(f"blocks.{i}" for i in range(CONFIG.n_layer))


def _train(plan: Plan | None, codegen: str = "eager", steps: int = 2):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    options = {"codegen": codegen}
    if plan is not None:
        options["plan"] = plan
    compiled = torch.compile(model, backend="protrain", options=options)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    batch = random_batch(CONFIG, 2, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss, ref_loss = compiled(*batch), reference(*batch)
        loss.backward()
        ref_loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        ref_grads = [p.grad.clone() for p in reference.parameters()]
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    return record, (loss, grads), (ref_loss, ref_grads)


@pytest.mark.parametrize("seed", range(8))
def test_random_plans_are_bit_exact(seed):
    rng = random.Random(seed)
    plan = Plan(blocks={label: rng.choice(["none", "checkpoint", "swap"]) for label in LABELS})
    _, (loss, grads), (ref_loss, ref_grads) = _train(plan)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def _saved_by_block(record):
    return {b.block: b.saved_activation_bytes for b in record.memory.blocks}


def _recomputed_forward_ops(record, block):
    """Forward ops (addmm, SDPA) of ``block`` that run again in the backward graph."""
    names = {"aten.addmm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"}
    return [
        n for n in record.backward.graph.nodes
        if n.op == "call_function" and meta.op_name(n) in names and n.meta.get(meta.BLOCK) == block
    ]


@pytest.mark.parametrize("policy", ["checkpoint", "swap"])
def test_a_block_with_dropout_recomputes_or_reloads_the_masks_its_forward_drew(policy):
    """Dropout in every block, a step under each plan from one seed: a checkpointed block's backward
    must use the forward's masks, not draw new ones (a random op is saved, never recomputed), so the
    loss and every gradient equal the step without a plan, bit for bit."""
    config = gpt_config("tiny", n_layer=4, dropout=0.2)
    batch = random_batch(config, 2, 32, generator=torch.Generator().manual_seed(1))

    def step(plan: Plan | None, masks: int = 1):
        torch._dynamo.reset()
        protrain_fx.reset()
        torch.manual_seed(0)
        model = GPT(config).train()
        options = {"codegen": "eager", **({"plan": plan} if plan is not None else {})}
        torch.manual_seed(masks)  # the masks' stream
        loss = torch.compile(model, backend="protrain", options=options)(*batch)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = step(Plan(blocks={label: policy for label in LABELS}))
    ref_loss, ref_grads = step(None)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert not torch.equal(step(None, masks=2)[0], ref_loss)  # the masks are drawn: other masks, another loss


def test_checkpointed_blocks_save_less_and_recompute():
    plan = Plan(blocks={"blocks.1": "checkpoint", "blocks.2": "checkpoint"})
    record, _, _ = _train(plan, steps=1)
    saved = _saved_by_block(record)
    protrain_fx.reset()
    torch._dynamo.reset()
    baseline, _, _ = _train(None, steps=1)
    saved_none = _saved_by_block(baseline)
    for label in ("blocks.1", "blocks.2"):
        assert saved[label] < saved_none[label] / 3, (label, saved[label], saved_none[label])
        assert _recomputed_forward_ops(record, label), label
    for label in ("blocks.0", "blocks.3"):
        assert not _recomputed_forward_ops(record, label)
        assert saved[label] == saved_none[label]
    assert record.memory.saved_activation_bytes < baseline.memory.saved_activation_bytes
    # The partitioner wraps recomputed attention (a random op) to save its RNG state; the wrapper
    # has no module metadata but still belongs to its block.
    wrappers = [n for n in record.forward.graph.nodes if "run_and_save_rng_state" in str(n.target)]
    assert sorted(n.meta[meta.BLOCK] for n in wrappers) == ["blocks.1", "blocks.2"]
    assert [p.name for p in record.passes][:1] == ["annotate_plan"]


def test_interleaved_plan_with_inductor_matches_eager():
    plan = interleaved(LABELS, n_swap=1, n_checkpoint=2)
    _, (loss, grads), (ref_loss, ref_grads) = _train(plan, codegen="inductor", steps=1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ({"blocks.9": "checkpoint"}, "blocks.9"),
    ],
)
def test_bad_plans_raise_value_error_naming_the_problem(blocks, message):
    model = GPT(CONFIG)
    batch = random_batch(CONFIG, 2, 16)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "plan": Plan(blocks=blocks)})
    with pytest.raises(Exception) as info:
        compiled(*batch)
    assert message in str(info.value)


def test_swapped_blocks_reload_every_saved_value_before_use():
    plan = Plan(blocks={"blocks.1": "swap", "blocks.3": "swap"})
    record, (loss, grads), (ref_loss, ref_grads) = _train(plan, steps=1)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    offloads = [n for n in record.forward.graph.nodes if n.target is torch.ops.protrain.offload.default]
    reloads = [n for n in record.backward.graph.nodes if n.target is torch.ops.protrain.reload.default]
    assert offloads and len(offloads) == len(reloads) == len(record.swapped)
    assert {n.meta[meta.BLOCK] for n in offloads} == {"blocks.1", "blocks.3"}
    fw_out = next(n for n in reversed(record.forward.graph.nodes) if n.op == "output").args[0]
    fw_order = {n: i for i, n in enumerate(record.forward.graph.nodes)}
    for host in offloads:
        assert host in fw_out  # the host copy, not the device value, crosses to backward
        value, slot = host.args
        assert value not in fw_out
        # offloaded right after the value's last forward use; its wait is the value's last use
        (wait,) = [u for u in host.users if u.op != "output"]
        assert wait.target is torch.ops.protrain.offload_wait.default and wait.args == (host, value, slot)
        assert all(fw_order[u] < fw_order[host] for u in value.users if u not in (host, wait))
        assert fw_order[host] < fw_order[wait]
    order = {n: i for i, n in enumerate(record.backward.graph.nodes)}
    for reload in reloads:
        host_input, slot, _ = reload.args
        assert host_input.op == "placeholder" and list(host_input.users) == [reload]  # nothing else reads the host copy
        (wait,) = [u for u in reload.users if u.target is torch.ops.protrain.reload_wait.default]
        assert wait.args == (reload, slot)
        others = [u for u in reload.users if u is not wait]
        assert others and all(order[wait] < order[u] for u in others)  # waited for before its first use
        assert order[reload] < order[wait]


def _saved_values(record, block):
    """Names of contiguous tensors the forward graph saves for backward, made in ``block``."""
    out = next(n for n in reversed(record.forward.graph.nodes) if n.op == "output")
    return [
        a.name for a in list(out.args[0])[record.step.num_user_outputs:]
        if isinstance(a, torch.fx.Node) and a.op == "call_function" and a.meta.get(meta.BLOCK) == block
        and a.meta["val"].is_contiguous()
    ]


def test_per_tensor_overrides_swap_and_recompute_single_values():
    baseline, _, _ = _train(None, steps=1)
    saved = _saved_values(baseline, "blocks.0")
    # A plain activation, and a layer norm statistic (a getitem: its op is recomputed whole).
    swap_name = next(name for name in saved if name.startswith("add"))
    recompute_name = next(name for name in saved if name.startswith("getitem"))
    protrain_fx.reset()
    torch._dynamo.reset()
    plan = Plan(blocks={}, tensors={swap_name: "swap", recompute_name: "recompute"})
    record, (loss, grads), (ref_loss, ref_grads) = _train(plan, steps=1)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    offloads = [n for n in record.forward.graph.nodes if n.target is torch.ops.protrain.offload.default]
    assert [n.args[0].name for n in offloads] == [swap_name]
    assert recompute_name not in _saved_values(record, "blocks.0")


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"primals_2": "swap"}, "primals_2"),  # a parameter
        ({"no_such_value": "swap"}, "no_such_value"),
    ],
)
def test_bad_tensor_overrides_name_the_tensor(tensors, message):
    model = GPT(CONFIG)
    batch = random_batch(CONFIG, 2, 16)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "plan": Plan(blocks={}, tensors=tensors)})
    with pytest.raises(Exception) as info:
        compiled(*batch)
    assert message in str(info.value)


def test_swapping_a_value_returned_to_the_user_is_refused():
    baseline, _, _ = _train(None, steps=1)
    out = next(n for n in reversed(baseline.forward.graph.nodes) if n.op == "output")
    loss_name = out.args[0][0].name
    protrain_fx.reset()
    torch._dynamo.reset()
    compiled = torch.compile(GPT(CONFIG), backend="protrain",
                             options={"codegen": "eager", "plan": Plan(blocks={}, tensors={loss_name: "swap"})})
    with pytest.raises(Exception) as info:
        compiled(*random_batch(CONFIG, 2, 16))
    assert loss_name in str(info.value) and "returns it to the user" in str(info.value)
