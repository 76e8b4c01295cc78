"""Annotate: write an activation plan onto the joint graph, for the partitioner to act on.

A policy pass: it only tags nodes. Forward nodes of a block the plan checkpoints get
``meta["recompute"] = MUST_RECOMPUTE`` and the block's ``ac_graph_id``; PyTorch's min-cut partitioner
then recomputes them in the backward graph (saving each checkpointed block's input and boundary
output), with its tested recompute machinery (RNG functionalisation, backward reordering).
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.passes.blocks import BlockInfo, own_block
from protrain_fx.plan import Plan


def annotate_plan(joint: fx.GraphModule, plan: Plan, info: BlockInfo) -> int:
    """Tag the forward nodes of checkpointed blocks; returns how many nodes were tagged.

    Raises ``ValueError`` for a plan naming a block the graph does not have, or per-tensor overrides
    (not executed yet). Swapped blocks are left to ``swap_pass`` after partitioning.
    """
    plan.validate(info.labels)
    if plan.tensors:
        raise ValueError("per-tensor plan overrides are not supported yet; give per-block policies only")
    graph_id = {label: i + 1 for i, label in enumerate(info.labels)}
    tagged = 0
    for node in joint.graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        block = own_block(node, info)
        if block is not None and plan.policy(block) == "checkpoint":
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = graph_id[block]
            tagged += 1
    return tagged
