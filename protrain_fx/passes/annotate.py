"""Annotate: write an activation plan onto the joint graph, for the partitioner to act on.

A policy pass: it only tags nodes. Forward nodes of a block the plan checkpoints get
``meta["recompute"] = MUST_RECOMPUTE`` and the block's ``ac_graph_id``; PyTorch's min-cut partitioner
then recomputes them in the backward graph (saving each checkpointed block's input and boundary
output), with its tested recompute machinery (RNG functionalisation, backward reordering).
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx import meta
from protrain_fx.analysis.blocks import BlockInfo, own_block
from protrain_fx.plan import Plan


def annotate_plan(
    joint: fx.GraphModule,
    plan: Plan,
    info: BlockInfo,
    *,
    parameter_names: frozenset[str] = frozenset(),
    num_fwd_outputs: int = 0,
) -> int:
    """Tag the joint graph for the partitioner; returns how many nodes were tagged.

    Forward nodes of checkpointed blocks: ``MUST_RECOMPUTE`` with the block's ``ac_graph_id``.
    Per-tensor overrides name forward values: ``recompute`` tags it ``MUST_RECOMPUTE``, ``keep`` and
    ``swap`` tag it ``MUST_SAVE`` (a swapped value must be saved to be swapped; ``swap_pass`` moves
    it after partitioning) and win over the block's policy. Raises ``ValueError`` naming an unknown
    block or tensor, a parameter, or a value the forward returns to the user (which is not saved).
    """
    forward_nodes = {
        n.name: n
        for n in joint.graph.nodes
        if n.op != "output" and n.meta.get("partitioner_tag") != "is_backward"
    }
    plan.validate(info.labels, tensor_names=forward_nodes if plan.tensors else None)
    out = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    user_outputs = {a.name for a in list(out.args[0])[:num_fwd_outputs] if isinstance(a, fx.Node)}
    for name, policy in plan.tensors.items():
        node = forward_nodes[name]
        if name in parameter_names or node.op == "placeholder":
            raise ValueError(f"plan: cannot {policy} {name!r}: it is a model input (parameter or input), not an activation")
        if name in user_outputs and policy != "keep":
            raise ValueError(f"plan: cannot {policy} {name!r}: the forward returns it to the user")
    overrides = dict(plan.tensors)
    for name, policy in plan.tensors.items():
        node = forward_nodes[name]
        if policy == "recompute" and node.target is operator.getitem:
            # A multi-output op is recomputed whole: its results come back together.
            producer = node.args[0]
            overrides[producer.name] = policy
            overrides.update({user.name: policy for user in producer.users if user.target is operator.getitem})
    graph_id = {label: i + 1 for i, label in enumerate(info.labels)}
    tagged = 0
    for name, node in forward_nodes.items():
        if node.op != "call_function":
            continue
        block = own_block(node, info)
        override = overrides.get(name)
        if override in ("keep", "swap"):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif override == "recompute" or (override is None and block is not None and plan.policy(block) == "checkpoint"):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = graph_id.get(block, len(graph_id) + 1)
        else:
            continue
        tagged += 1
    return tagged + _save_viewed_boundaries(forward_nodes.values())


def _save_viewed_boundaries(nodes) -> int:
    """Tag ``MUST_SAVE`` the base of a checkpointed block's output that leaves the block as a view
    (``(residual + h).view(shape)``, OPT's layers) and is read by a later checkpointed block.

    The partitioner saves a checkpoint region's value read by a later region
    (``cleanup_recompute_tags``), but not when that value is a view: the min-cut recomputes views
    from their base, so the boundary was dropped and each block's recompute reran every
    checkpointed block before it, with all their chunks gathered at once. Returns how many."""
    saved = 0
    for node in nodes:
        if not (meta.is_view(node) and node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE):
            continue
        region = node.meta.get("ac_graph_id")
        if not any(u.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
                   and u.meta.get("ac_graph_id", region) != region for u in node.users):
            continue
        base = node.args[0]
        while isinstance(base, fx.Node) and meta.is_view(base) and base.meta.get("ac_graph_id") == region:
            base = base.args[0]
        if (isinstance(base, fx.Node) and base.meta.get("ac_graph_id") == region
                and base.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE):
            base.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved += 1
    return saved
