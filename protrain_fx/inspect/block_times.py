"""Measured time per block: run a captured step's graphs node by node and time each node.

Each node runs through an ``fx.Interpreter`` (eagerly, one aten op at a time) and is timed with the
device synchronised around it, so the numbers are per-op costs without Inductor's fusions: good for
*shares* of the step (which block costs what), not for absolute step time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.analysis.memory import output_args
from protrain_fx.capture import CapturedGraph


class _TimedInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, times: dict[str, float], sync) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.times, self.sync = times, sync

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        self.sync()
        start = time.perf_counter()
        out = super().run_node(n)
        self.sync()
        self.times[n.meta.get(meta.BLOCK, meta.OUTSIDE)] += time.perf_counter() - start
        return out


def profile_block_times(record: CapturedGraph, *, repeat: int = 3) -> dict[str, float]:
    """Seconds per block (forward + backward, best of ``repeat``) for a captured training step.

    Needs the step's example inputs to be alive (profile right after the first call).
    """
    if record.forward is None or record.backward is None:
        raise ValueError(f"graph {record.index} has no backward graph to profile")
    inputs = record.real_inputs()
    if any(x is None for x in inputs):
        raise ValueError(f"graph {record.index}: its example inputs were freed; profile right after the first call")
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best: dict[str, float] = {}
    fw_out_names = [a.name if isinstance(a, fx.Node) else None for a in output_args(record.forward)]
    for _ in range(repeat):
        times: dict[str, float] = defaultdict(float)
        with torch.no_grad():
            fw = _TimedInterpreter(record.forward, times, sync)
            outs = fw.boxed_run(list(inputs))
            fw.env.clear()
            produced = dict(zip(fw_out_names, outs))
            args = []
            for node in record.backward.graph.nodes:
                if node.op != "placeholder":
                    continue
                if node.name in produced:
                    args.append(produced[node.name])
                elif node.name.startswith("tangents"):
                    val = node.meta["val"]
                    args.append(torch.ones(val.shape, dtype=val.dtype, device=val.device))
                else:
                    raise ValueError(f"graph {record.index}: no value for backward input {node.name!r}")
            del outs, produced
            _TimedInterpreter(record.backward, times, sync).boxed_run(args)
        for block, seconds in times.items():
            best[block] = min(best.get(block, float("inf")), seconds)
    return best

