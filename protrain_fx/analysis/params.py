"""Extract the model's parameters from a captured step as plain data (for the chunk layout).

An analysis: reads the forward graph (placeholders that are model state, their first use and block)
and the Dynamo graph (readable names), returns ``chunks.ParamInfo`` rows. No FX leaves this module.
"""

from __future__ import annotations

import re

import torch.fx as fx

from protrain_fx import meta
from protrain_fx.analysis.memory import StepGraphs
from protrain_fx.chunks import ParamInfo, dedupe_tied

_PARTS = re.compile(r"_(?:modules|parameters|buffers)_")


def readable_param_name(dynamo_name: str) -> str:
    """``L_self_modules_blocks_modules_0_modules_ln_1_parameters_weight_`` → ``blocks.0.ln_1.weight``."""
    parts = _PARTS.split(dynamo_name.strip("_"))
    if len(parts) > 1 and parts[0].lower().startswith("l_"):
        parts = parts[1:]
    return ".".join(parts)


def parameter_infos(step: StepGraphs, dynamo_graph: fx.GraphModule) -> list[ParamInfo]:
    """One ``ParamInfo`` per parameter storage: bytes, block, first forward use, readable names."""
    forward_inputs = [n for n in step.forward.graph.nodes if n.op == "placeholder"]
    dynamo_inputs = [n.name for n in dynamo_graph.graph.nodes if n.op == "placeholder"]
    names = dict(zip([n.name for n in forward_inputs], dynamo_inputs))
    position = {n: i for i, n in enumerate(step.forward.graph.nodes)}
    rows = []
    for node in forward_inputs:
        values = meta.tensor_values(node)
        if node.name not in step.state_inputs or not values:
            continue
        users = [position[u] for u in node.users if u.op != "output"]
        rows.append(
            (
                readable_param_name(names.get(node.name, node.name)),
                meta.storage_key(values[0]),
                meta.storage_nbytes(values[0]),
                node.meta.get(meta.BLOCK, meta.OUTSIDE),
                min(users, default=len(position)),
            )
        )
    return dedupe_tied(rows)
