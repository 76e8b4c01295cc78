"""What a plan keeps under its cap for the user's code around the compiled graph.

A training graph that hands large outputs back to the user's code (logits, when the loss is
computed outside the compiled module) leaves that code to compute on them between forward and
backward, outside every graph the analysis sees. Until a first step on the device measures what it
holds (``STATE.measured_outside``), a plan keeps :data:`OUTSIDE_BYTES_PER_ELEMENT` per element of
those outputs; afterwards the measured bytes. :func:`plan_cap` is the cap a plan's graph peak must
stay under: the allocated cap less that reserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import CapturedGraph
from protrain_fx.planner.budget import allocated_cap_bytes
from protrain_fx.state import STATE

#: A training graph's outputs handed back to the user's code with a gradient to come (a tangent)
#: of at least this many bytes are where that code computes (a loss on logits): named in the plan
#: table, and what it holds at the step's peak is reserved (:data:`OUTSIDE_BYTES_PER_ELEMENT`).
LARGE_OUTPUT_BYTES = 16 * 2**20


#: Bytes per element of such an output kept under the cap for the user's code until a first step
#: measures it: a loss in fp32 on it (``F.cross_entropy(logits.float(), y)``) holds an fp32 copy and
#: its log-softmax at the forward's end, then the log-softmax and its gradient at the backward's
#: start, 8 bytes per element (``docs/results.md#loss-outside-the-compiled-model``); a quarter more
#: for a loss with one more fp32 temporary.
OUTSIDE_BYTES_PER_ELEMENT = 10


@dataclass(frozen=True)
class ReturnedOutput:
    """A large output of a training graph returned to the user's code, which computes on it (a loss)
    outside the plan: its position among the graph's differentiable outputs, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def line(self) -> str:
        return f"output {self.index} ({'x'.join(map(str, self.shape))} {self.dtype}, {human_bytes(self.nbytes)})"


def returned_outputs(record: CapturedGraph) -> list[ReturnedOutput]:
    """The training graph's differentiable outputs of at least :data:`LARGE_OUTPUT_BYTES` (the
    backward graph's tangents: each gradient the user's code hands back), in order; none when one
    of them is a scalar: the loss is computed inside, and the large ones ride along unused (a
    Hugging Face model returns its logits beside the loss)."""
    step = record.step
    if step is None or step.backward is None:
        return []
    out = []
    tangents = [n for n in step.backward.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.numel() == 1 for n in tangents):
        return []
    for i, node in enumerate(tangents):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            nbytes = val.numel() * val.element_size()
            if nbytes >= LARGE_OUTPUT_BYTES:
                out.append(ReturnedOutput(i, tuple(int(d) for d in val.shape), str(val.dtype).replace("torch.", ""),
                                          int(nbytes)))
    return out


def outside_reserve(record: CapturedGraph) -> tuple[int, str]:
    """Bytes a plan of ``record`` keeps under its cap for the user's code around the graph, and
    where the number comes from: ``"measured"`` (a first step on this device, ``STATE.measured_outside``),
    ``"outputs"`` (:data:`OUTSIDE_BYTES_PER_ELEMENT` per element of the large outputs returned to
    that code: an estimate, measured and corrected at the first step), or ``""`` (nothing to keep)."""
    assert record.memory is not None
    measured = STATE.measured_outside.get(record.memory.device)
    if measured is not None:
        return measured, "measured"
    estimate = sum(OUTSIDE_BYTES_PER_ELEMENT * o.numel for o in returned_outputs(record))
    return (estimate, "outputs") if estimate else (0, "")


def plan_cap(record: CapturedGraph, budget: int) -> tuple[int, int, str]:
    """``(cap, reserve, source)``: the allocated peak a plan of ``record`` may reach under ``budget``
    (``planner.budget.allocated_cap_bytes`` less :func:`outside_reserve`), the reserve and its source."""
    reserve, source = outside_reserve(record)
    return max(0, allocated_cap_bytes(budget) - reserve), reserve, source


def reserve_note(reserve: int, source: str) -> str:
    """For a refusal's minimum budget: the bytes it keeps for the user's code (``""`` without any)."""
    if not reserve:
        return ""
    why = {"measured": "measured above the plan in an earlier first step on this device",
           "outputs": "for the user's code on the outputs returned to it (a loss)"}.get(source, source)
    return f", and {human_bytes(reserve)} {why}"
