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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import CapturedGraph
from protrain_fx.machine import machine_for
from protrain_fx.planner.budget import allocated_cap_bytes
from protrain_fx.state import STATE

#: A training graph's outputs handed back to the user's code with a gradient to come (a tangent)
#: of at least this many bytes are where that code computes (a loss on logits): named in the plan
#: table, and what it holds at the step's peak is reserved (:data:`OUTSIDE_BYTES_PER_ELEMENT`).
LARGE_OUTPUT_BYTES = 16 * 2**20


#: Bytes per element of such an output kept under the cap for the user's code until a first step
#: measures it: a loss in fp32 on it (``F.cross_entropy(logits.float(), y)``) holds an fp32 copy and
#: its log-softmax at the forward's end, then the log-softmax and its gradient at the backward's
#: start, 8 bytes per element (``docs/results.md#loss-outside-the-compiled-model``). A loss that holds
#: more is measured at the first step, and a plan over its cap then is chosen again.
OUTSIDE_BYTES_PER_ELEMENT = 8

#: Bytes an fp32 cross-entropy's eager kernels read plus write per element of the outputs it is computed
#: on (``F.cross_entropy(logits.float(), y)``, forward and backward), counted as the cost model counts a
#: kernel's traffic, inputs plus outputs: the cast 2 + 4, log_softmax 4 + 4, nll_loss's backward 4,
#: log_softmax's backward 4 + 4 + 4, the cast back 4 + 2
#: (``docs/results.md#the-estimate-on-each-card``).
OUTSIDE_LOSS_BYTES_PER_ELEMENT = 36


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


def outside_seconds(record: CapturedGraph) -> float:
    """Seconds a step of ``record`` is estimated to spend in the user's code on the large outputs
    returned to it (:func:`returned_seconds`). No plan changes it; it completes a first plan's
    prediction of the step the loop runs, until the first steps measure it
    (``planner.rates.StepPhases.around_s``)."""
    if record.memory is None:
        return 0.0
    return returned_seconds(returned_outputs(record), record.memory.device, record.config.machine)


def returned_seconds(returned: Sequence[ReturnedOutput], device: str | torch.device,
                     overrides: Mapping[str, Any] | None = None) -> float:
    """Seconds of a loss on ``returned`` (forward and backward) on ``device``:
    :data:`OUTSIDE_LOSS_BYTES_PER_ELEMENT` per element at the device's memory rate (``machine_for``,
    with the option ``machine``'s ``overrides``), as the cost model prices a memory-bound kernel. 0
    where nothing large is returned."""
    if not returned:
        return 0.0
    machine = machine_for(torch.device(device), overrides)
    return sum(o.numel for o in returned) * OUTSIDE_LOSS_BYTES_PER_ELEMENT / (machine.hbm_bytes * machine.hbm_efficiency)
