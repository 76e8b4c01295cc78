"""Activation swap: where the copies are placed, the host buffer pool, and what the analysis counts.

The copies themselves are synchronous on the CPU (CI has no GPU); placement, buffer reuse and the
memory model are the same code as on the GPU, where ``tests/runtime/test_gpu_swap.py`` checks the streams.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.plan import Plan
from protrain_fx.planner import activations
from protrain_fx.runtime.swap import POOL

CONFIG = gpt_config("tiny", n_layer=4)
SWAP = Plan(blocks={"blocks.0": "swap", "blocks.1": "swap"})
SLOW = {"d2h_bytes": 1.0, "h2d_bytes": 1.0}  # every copy takes "forever": waits as late as possible
FAST = {"d2h_bytes": 1e30, "h2d_bytes": 1e30}  # copies take no time: waits at once, reloads at use



def _record(plan: Plan | None, machine: dict | None = None, codegen: str = "eager"):
    torch.manual_seed(0)
    options = {"codegen": codegen, "plan": plan}
    if machine is not None:
        options["machine"] = machine
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="protrain", options=options)
    compiled(*random_batch(CONFIG, 2, 32)).backward()
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    return record


def _positions(gm):
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def test_slow_copies_wait_late_and_prefetch_early_fast_ones_the_opposite():
    slow = _record(SWAP, SLOW)
    fw, bw = _positions(slow.forward), _positions(slow.backward)
    first_compute = min(i for n, i in bw.items() if not slow.backward.graph.find_nodes(op="placeholder", target=n))
    last_fw = max(fw.values())
    for s in slow.swapped:
        assert fw[s.wait_before] == last_fw  # before the output node: the copy never finishes sooner
        assert bw[s.reload_before] <= first_compute + len(slow.swapped)  # issued first thing in backward
    protrain_fx.reset()
    torch._dynamo.reset()
    fast = _record(SWAP, FAST)
    fw, bw = _positions(fast.forward), _positions(fast.backward)
    for s in fast.swapped:
        offload = fw[s.offload_after]
        # the wait follows the offload and at most the other offloads/waits issued at the same node
        assert 0 < fw[s.wait_before] - offload <= 2 * len(fast.swapped) + 1
        assert bw[s.first_use] - bw[s.reload_before] <= 2 * len(fast.swapped) + 1
    assert [s.name for s in slow.swapped] == [s.name for s in fast.swapped]


def test_copies_queue_in_order_on_each_stream():
    record = _record(SWAP)
    fw = _positions(record.forward)
    offloads = [n for n in record.forward.graph.nodes if n.target is torch.ops.protrain.offload.default]
    waits = [n for n in record.forward.graph.nodes if n.target is torch.ops.protrain.offload_wait.default]
    assert [w.args[2] for w in waits] == [o.args[1] for o in offloads]  # waited for in issue order
    reloads = [n for n in record.backward.graph.nodes if n.target is torch.ops.protrain.reload.default]
    rwaits = [n for n in record.backward.graph.nodes if n.target is torch.ops.protrain.reload_wait.default]
    assert [w.args[1] for w in rwaits] == [r.args[1] for r in reloads]
    assert all(fw[o.name] < fw[w.name] for o, w in zip(offloads, waits))


def test_swapped_bytes_leave_the_device_between_wait_and_reload():
    none = _record(Plan(blocks={}))
    protrain_fx.reset()
    torch._dynamo.reset()
    fast = _record(SWAP, FAST)
    swapped = sum(s.nbytes for s in fast.swapped)
    assert swapped > 0

    def live_at_forward_end(record):
        return [e for e in record.memory.timeline.entries if e.phase == "forward"][-1].live_bytes

    assert live_at_forward_end(none) - live_at_forward_end(fast) == swapped
    # With copies that never finish in time, the device values stay until the end of forward.
    protrain_fx.reset()
    torch._dynamo.reset()
    slow = _record(SWAP, SLOW)
    assert fast.memory.peak_bytes <= slow.memory.peak_bytes


def test_host_pool_is_reused_across_steps_and_never_shared_by_two_pending_forwards():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "plan": SWAP})
    batches = [random_batch(CONFIG, 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    compiled(*batches[0]).backward()
    n_values = len(protrain_fx.captured_graphs()[-1].swapped)
    assert POOL.buffers() == n_values
    for _ in range(3):  # steady state: the same buffers every step
        compiled(*batches[0]).backward()
    assert POOL.buffers() == n_values
    model.zero_grad()
    # Two forwards saved for backward at once: each needs its own host copies.
    (compiled(*batches[0]) + compiled(*batches[1])).backward()
    assert POOL.buffers() == 2 * n_values
    (reference(*batches[0]) + reference(*batches[1])).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        # the two graphs' gradients may be summed in another order than eager's: fp32 rounding only
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)


def test_swap_with_inductor_keeps_the_placed_order():
    record = _record(SWAP, codegen="inductor")
    for phase, gm, issue in (
        ("forward", record.forward, torch.ops.protrain.offload.default),
        ("backward", record.backward, torch.ops.protrain.reload.default),
    ):
        issued = [n.name for n in gm.graph.nodes if n.target is issue]
        waits = {n.name: n.args[0].name for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "protrain" and n.target is not issue}
        assert issued and len(waits) == len(issued)
        contexts = [row.context for row in record.inductor_plans[phase].rows]
        first = {name: contexts.index(name) for name in [*issued, *waits] if name in contexts}
        # Inductor lowers the copies in the order we issued them, each before its wait (it may
        # sink a wait past the next copy's issue: nothing reads the buffer before its wait anyway).
        seen = [name for name in issued if name in first]
        assert len(seen) == len(issued) and sorted(seen, key=first.__getitem__) == seen
        for wait, copy_node in waits.items():
            assert wait in first and first[copy_node] < first[wait], (phase, wait)


def test_bad_machine_option_is_refused():
    with pytest.raises(ValueError, match="h2d"):
        protrain_fx.config.parse_options({"machine": {"h2d": 1}})
    with pytest.raises(ValueError, match="positive"):
        protrain_fx.config.parse_options({"machine": {"h2d_bytes": 0}})


def test_weight_casts_are_not_swapped_with_their_block():
    """Under bf16 autocast the backward saves bf16 copies of the weights; copying them over PCIe is
    pointless (they are made from parameters alone), so a swapped block leaves them on the device."""
    from protrain_fx.analysis.swappable import _state_derived

    torch.manual_seed(0)
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "plan": SWAP})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(*random_batch(CONFIG, 2, 32))
    loss.backward()
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    derived = _state_derived(record.forward, record.step.state_inputs)
    nodes = {n.name: n for n in record.forward.graph.nodes}
    out = next(n for n in reversed(record.forward.graph.nodes) if n.op == "output").args[0]
    saved_casts = [a for a in out[record.step.num_user_outputs:] if isinstance(a, torch.fx.Node) and a.op != "placeholder"
                   and derived[a] and a.meta.get(protrain_fx.meta.BLOCK) in SWAP.blocks]
    assert saved_casts, "bf16 weight casts of the swapped blocks are saved for backward"
    assert record.swapped and not any(derived[nodes[s.name]] for s in record.swapped)


def test_small_values_stay_on_the_device_below_min_swap_bytes():
    record = _record(SWAP, {"min_swap_bytes": 20_000})
    assert record.swapped and all(s.nbytes >= 20_000 for s in record.swapped)
    out = next(n for n in reversed(record.forward.graph.nodes) if n.op == "output").args[0]
    small = [a for a in out[record.step.num_user_outputs:] if isinstance(a, torch.fx.Node)
             and a.meta.get(protrain_fx.meta.BLOCK) in SWAP.blocks and a.op != "placeholder"
             and a.target is not torch.ops.protrain.offload.default]
    assert small, "small saved values of the swapped blocks are kept"


def _step_of(gm, labels: list[str]):
    """Node name -> the step of the forward graph it lies in, by position: block ``i`` from its first
    node on, ``len(labels)`` (the outside work) from the first node outside the blocks after the
    last block's first node."""
    from protrain_fx import meta

    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    first = {}
    for i, n in enumerate(nodes):
        first.setdefault(n.meta.get(meta.BLOCK), i)
    outside = next(i for i, n in enumerate(nodes) if i > first[labels[-1]] and n.meta.get(meta.BLOCK) not in labels)
    steps = {}
    for i, n in enumerate(nodes):
        step = max((j for j, label in enumerate(labels) if first.get(label, len(nodes)) <= i), default=-1)
        steps[n.name] = len(labels) if i >= outside else step
    return steps


@pytest.mark.parametrize("rate", [3e10, 1e10, 1.0])
def test_the_cost_model_frees_swapped_bytes_where_the_rewrite_waits_for_their_copy(rate):
    """``cost.CostModel.swap_freed_at`` follows ``passes/swap.py``: the same storages in the same
    queue, each freed in the step where its wait is placed or at the start of the next one. Rates
    (bytes/s, with the default margin) from copies done within a block to copies never done."""
    from protrain_fx.plan import interleaved
    from protrain_fx.search.cost import CostModel

    machine = {"d2h_bytes": rate, "h2d_bytes": rate}
    model = CostModel(activations.activation_problem(_record(None, machine)))
    labels = [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    protrain_fx.reset()
    torch._dynamo.reset()
    swapped = _record(interleaved(labels, 3, 0), machine)
    step = _step_of(swapped.forward, labels)
    parts = list(model.swap_freed_at(3))
    assert sorted((labels[i], x) for i, _, x in parts) == sorted((s.block, s.nbytes) for s in swapped.swapped)
    for value in swapped.swapped:  # storages of one block and size queued at one node may swap places
        at = step.get(value.wait_before, len(labels) + 1)  # the output node: at the forward's end
        match = next((p for p in parts
                      if (labels[p[0]], p[2]) == (value.block, value.nbytes) and at in (p[1] - 1, p[1])), None)
        assert match is not None, (value.name, value.block, value.nbytes, at)
        parts.remove(match)
    if rate == 1.0:  # nothing is freed before the forward's end, and swapping saves nothing
        assert all(k == len(labels) + 1 for _, k, _ in parts)
        assert model.activation_peak(3, 0) == model.activation_peak(0, 0)
