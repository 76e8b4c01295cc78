"""Parameter casts recomputed in backward: an offloaded model saves no cast of its weights.

Under autocast a matrix product reads its weight cast to the compute dtype, and the partitioner
saves that cast (or a transposed view of it) for the product's backward: two bytes per parameter of
saved activations per block, which a swap leaves on the device (a value computed from the model
state alone) and checkpointing only moves. For a model whose parameters an offload handle holds
(``protrain_fx.offload``), the weight is in a chunk the backward gathers anyway, in the compute dtype
already: keeping the cast across the step only costs memory.

A policy pass on the joint graph, before the partitioner (``JOINT_PASSES`` in
``passes/pipeline.py``): every dtype cast of a parameter input, and the views of it (a transpose),
is tagged ``MUST_RECOMPUTE``; the partitioner then saves the parameter itself (a shell without bytes) and recasts it in the
backward graph, where ``passes/gather.py`` reads it from the chunk buffer (the cast to the buffer's
dtype folds into the buffer's view there). Tags the plan writes afterwards (``passes/annotate.py``)
take precedence. The values are the same: a cast recomputed from the same parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx import meta
from protrain_fx.runtime.offload import chunk_ops

_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def recompute_param_casts(joint: fx.GraphModule, parameter_names: frozenset[str]) -> int:
    """Tag the forward casts of parameters (and their views) ``MUST_RECOMPUTE``; returns how many
    nodes were tagged."""
    tagged = 0
    for node in joint.graph.nodes:
        if node.op != "placeholder" or node.name not in parameter_names:
            continue
        stack = [u for u in node.users if is_dtype_cast(u) and _forward(u)]
        while stack:
            n = stack.pop()
            if n.meta.get("recompute") is not None:
                continue
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
            stack.extend(u for u in n.users if meta.is_view(u) and _forward(u))
    return tagged


def reads_offload_handle(inputs: list[Any]) -> bool:
    """Whether any of a graph's real ``inputs`` is a parameter of an offload handle: offloaded,
    waiting for the backend to place it, or kept on the device (a persistent chunk's: its casts
    are recomputed too, so that a block saves the same whatever the counts, as the cost model's
    Problem, measured before the counts are chosen, assumes)."""
    if any(chunk_ops.offloaded(t) or chunk_ops.deferred(t) for t in inputs):
        return True
    held = {id(p) for ref in list(chunk_ops._handles.values()) if (h := ref()) is not None for p in h._named.values()}
    return any(isinstance(t, torch.Tensor) and id(t) in held for t in inputs)


def is_dtype_cast(node: fx.Node, dtype: torch.dtype | None = None) -> bool:
    """``node`` casts its first argument to another dtype (to ``dtype`` when given) and changes
    nothing else: same device, layout and memory format."""
    if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is torch.ops.aten._to_copy.default:
        if set(node.kwargs) - {"dtype"} or len(node.args) != 1:
            return False
        to = node.kwargs.get("dtype")
    else:
        to = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return isinstance(to, torch.dtype) and (dtype is None or to == dtype)


def _forward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") != "is_backward"
