"""First-order time estimate of every node of a graph, before anything runs.

A node costs the larger of its FLOPs over the machine's matmul rate and the bytes it reads and writes
over the device memory bandwidth (a roofline), plus a small launch cost; views and bookkeeping cost
nothing. This over-counts the memory traffic of pointwise chains Inductor fuses, so it under-estimates
nothing that matters for placing copies: the rewrites that use it (when to wait for an offload, how
early to prefetch) add a margin on top. The profiler (a later release) replaces it by measured times.
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


def start_times(nodes: list[fx.Node], machine: Machine) -> dict[fx.Node, float]:
    """Estimated start time of every node when ``nodes`` run back to back from time 0."""
    durations = [node_time(n, machine) for n in nodes]
    return dict(zip(nodes, accumulate(durations, initial=0.0)))


def _is_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )
