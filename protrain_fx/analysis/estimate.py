"""First-order time estimate of every node of a graph, before anything runs.

A node costs the larger of its FLOPs over the machine's matmul rate and the bytes it reads and writes
over the device memory bandwidth (a roofline), plus a small launch cost; views and bookkeeping cost
nothing. This over-counts the memory traffic of pointwise chains Inductor fuses, so it under-estimates
nothing that matters for placing copies: the rewrites that use it (when to wait for an offload, how
early to prefetch) add a margin on top. :func:`fused_node_times` counts what fused kernels move
instead (the cost model's block times, for Inductor codegen).
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from protrain_fx import meta
from protrain_fx.machine import Machine

#: Seconds a kernel launch costs at least (CPU-side dispatch of one op).
LAUNCH_S = 3e-6


def node_time(node: fx.Node, machine: Machine) -> float:
    """Estimated seconds ``node`` takes on ``machine``."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    if node.target.namespace == "protrain" or _is_view(node.target):
        return 0.0
    outputs = meta.tensor_values(node)
    inputs = [t for n in node.all_input_nodes for t in meta.tensor_values(n)]
    moved = sum(meta.tensor_nbytes(t) for t in (*inputs, *outputs))
    flops = 0
    count = flop_registry.get(node.target.overloadpacket)
    if count is not None:
        args, kwargs = fx.node.map_arg(
            (node.args, node.kwargs), lambda n: n.meta.get("val")
        )
        try:
            flops = int(count(*args, **kwargs, out_val=node.meta.get("val")))
        except (
            Exception
        ):  # a formula that cannot read these arguments: count the bytes only
            flops = 0
    return LAUNCH_S + max(
        flops / (machine.flops * machine.flops_efficiency),
        moved / (machine.hbm_bytes * machine.hbm_efficiency),
    )


def fused_node_times(nodes: list[fx.Node], machine: Machine) -> dict[fx.Node, float]:
    """Estimated seconds per node when the memory-bound nodes are fused, as Inductor fuses them.

    Nodes without a FLOP formula (pointwise ops, reductions, casts, concatenations: what Inductor
    generates kernels for) that feed one another form fused groups. A group reads the tensors that
    enter it from outside, each once however many of its nodes read it, and writes the tensors
    used outside it (or returned): one launch plus those bytes over the memory bandwidth, shared
    among its nodes in proportion to their own traffic (counted once per reading node instead, a
    decomposed layer norm's backward would read its incoming gradient three or four times). Matrix
    products and attention (nodes with a FLOP count) keep :func:`node_time`, and so do views and
    the ``protrain`` ops (0). The per-node sum of :func:`node_time` counts every intermediate of a
    decomposed layer norm or GELU as a round trip to memory and reads several times the measured
    step (``docs/results.md#the-compute-estimate``)."""
    members = [n for n in nodes if _fusable(n)]
    in_graph = set(nodes)
    group: dict[fx.Node, int] = {}
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    fusable = set(members)
    for i, n in enumerate(members):
        group[n] = parent[i] = i
    for n in members:
        for src in n.all_input_nodes:
            if src in fusable:
                a, b = find(group[n]), find(group[src])
                if a != b:
                    parent[a] = b
    roots = {n: find(group[n]) for n in members}
    traffic: dict[int, int] = {}
    weight: dict[fx.Node, int] = {}
    read: set[tuple[int, fx.Node]] = set()  # (group, node outside it whose value the group reads)
    for n in members:
        g = roots[n]
        entering = [src for src in n.all_input_nodes if roots.get(src) != g and (g, src) not in read]
        read.update((g, src) for src in entering)
        outside_in = sum(meta.tensor_nbytes(t) for src in entering for t in meta.tensor_values(src))
        used_outside = any(u not in in_graph or roots.get(u) != g for u in n.users) or not n.users
        out = sum(meta.tensor_nbytes(t) for t in meta.tensor_values(n)) if used_outside else 0
        traffic[g] = traffic.get(g, 0) + outside_in + out
        weight[n] = 1 + sum(meta.tensor_nbytes(t) for t in meta.tensor_values(n))
    total_weight: dict[int, int] = {}
    for n in members:
        total_weight[roots[n]] = total_weight.get(roots[n], 0) + weight[n]
    times = {}
    for n in nodes:
        if n in fusable:
            g = roots[n]
            group_s = LAUNCH_S + traffic[g] / (machine.hbm_bytes * machine.hbm_efficiency)
            times[n] = group_s * weight[n] / total_weight[g]
        else:
            times[n] = node_time(n, machine)
    return times


def _fusable(node: fx.Node) -> bool:
    """A node Inductor generates a (fusable) kernel for: an ATen op with no FLOP formula, not a view."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.namespace == "protrain" or _is_view(node.target):
        return False
    return flop_registry.get(node.target.overloadpacket) is None


def start_times(nodes: list[fx.Node], machine: Machine) -> dict[fx.Node, float]:
    """Estimated start time of every node when ``nodes`` run back to back from time 0."""
    durations = [node_time(n, machine) for n in nodes]
    return dict(zip(nodes, accumulate(durations, initial=0.0)))


def _is_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )
