"""Swap rewrite: move the saved activations of swapped blocks to host memory between the graphs.

Runs on the partitioned graphs (after ``attribute_blocks``). For every value the forward graph saves
for backward whose block the plan swaps: an ``offload`` node right after the value's last forward
use takes its place among the forward outputs; in the backward graph the matching input now holds
the host copy, and a ``reload`` node before its first use brings it back. Parameters, user outputs
and non-contiguous (view) values are left alone. Returns the number of swapped values.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from protrain_fx import meta
from protrain_fx.plan import Plan
from protrain_fx.runtime import swap as swap_ops  # noqa: F401  (registers protrain::offload/reload)

MADE_BY = "protrain_made_by"


def swap_pass(forward: fx.GraphModule, backward: fx.GraphModule, plan: Plan, num_user_outputs: int) -> int:
    swapped_blocks = set(plan.blocks_with("swap"))
    if not swapped_blocks and "swap" not in plan.tensors.values():
        return 0
    out_node = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    outputs = list(out_node.args[0])
    bw_inputs = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    fw_order = {n: i for i, n in enumerate(forward.graph.nodes)}
    bw_order = {n: i for i, n in enumerate(backward.graph.nodes)}
    count = 0
    swapped: set[str] = set()
    for j, value in enumerate(outputs):
        if j < num_user_outputs or not isinstance(value, fx.Node) or value.op == "placeholder":
            continue
        block = value.meta.get(meta.BLOCK)
        val = value.meta.get("val")
        target = bw_inputs.get(value.name)
        override = plan.tensors.get(value.name)
        wanted = override == "swap" or (override is None and block in swapped_blocks)
        if not wanted or target is None or not isinstance(val, torch.Tensor):
            continue
        if not val.is_contiguous() or not target.users:
            continue
        fake_mode = detect_fake_mode([val])
        last_use = max((u for u in value.users if u.op != "output"), key=fw_order.get, default=value)
        with forward.graph.inserting_after(last_use):
            host = forward.graph.call_function(torch.ops.protrain.offload.default, (value,))
        with fake_mode:
            host.meta["val"] = torch.ops.protrain.offload.default(val)
        _tag(host, value, "forward")
        outputs[j] = host
        # The backward input now receives the host copy; it takes the offload node's name, which
        # keeps "a backward input is named after the forward output it receives".
        target._rename(host.name)
        target.target = target.name
        target.meta["val"] = host.meta["val"]
        first_use = min(target.users, key=bw_order.get)
        with backward.graph.inserting_before(first_use):
            device_copy = backward.graph.call_function(torch.ops.protrain.reload.default, (target, val.device))
        with fake_mode:
            device_copy.meta["val"] = torch.ops.protrain.reload.default(host.meta["val"], val.device)
        _tag(device_copy, value, "backward")
        target.replace_all_uses_with(device_copy, delete_user_cb=lambda user: user is not device_copy)
        swapped.add(value.name)
        count += 1
    asked = {name for name, policy in plan.tensors.items() if policy == "swap"}
    if asked - swapped:
        raise ValueError(
            f"plan: cannot swap {sorted(asked - swapped)}: not saved for backward as a contiguous "
            "tensor (only values the forward graph saves, not views, can be swapped)"
        )
    out_node.args = (tuple(outputs),)
    for gm in (forward, backward):
        gm.graph.lint()
        gm.recompile()
    return count


def _tag(node: fx.Node, source: fx.Node, phase: str) -> None:
    for key in ("nn_module_stack", "stack_trace", "seq_nr"):
        if key in source.meta:
            node.meta[key] = source.meta[key]
    node.meta[meta.BLOCK] = source.meta.get(meta.BLOCK, meta.OUTSIDE)
    node.meta[meta.PHASE] = phase
    node.meta[MADE_BY] = "swap_pass"
