"""What fits: the plan and the smallest memory budget of a model and batch, without training.

    report = protrain_fx.what_fits(model, x, y, memory_budget="24GiB")
    print(report)            # fits or not, the plan, the smallest budget, host bytes the swaps pin

:func:`what_fits` compiles ``model`` with ``backend="protrain"`` and calls it once on the example
inputs, but the backend stops inside the compile, after the step was captured, partitioned and
analysed for the plans it tried: no graph runs, nothing is allocated for activations, and no
parameter changes. The capture needs what any compile needs: the model and its inputs on their
device (their bytes exist), ``requires_grad`` parameters (a training step), and the same options
as training (``codegen``, ``optimizer``, ``machine``...).

The report is the first captured training graph's (a model with graph breaks is planned per graph;
its later graphs are not reached). Offloaded models (``protrain_fx.offload``) are not planned
automatically: they are refused here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from protrain_fx.capture import CapturedGraph
from protrain_fx.cost import CostModel, block_plan
from protrain_fx.plan import Plan
from protrain_fx.readable import human_bytes

#: The budget a report without one is planned under: large enough for any step, so only the
#: smallest budget is of interest.
UNBOUNDED = 2**62


@dataclass(frozen=True)
class FitReport:
    """One training graph's answer. ``budget_bytes``: what it was asked under (``None``: no budget,
    only the minimum is reported); ``fits``: a plan keeps the allocated peak under the budget less the
    allocator's headroom (``pipeline.allocated_cap_bytes``); ``plan``: the plan the backend would run
    (``None`` when nothing fits); ``min_budget_bytes``: the smallest budget with which the backend
    finds a plan (that of least memory, allocator headroom included); ``host_swap_bytes``: pinned host
    memory the plan's swaps need (0 without swaps)."""

    graph: int
    budget_bytes: int | None
    budget_source: str | None
    fits: bool
    plan: Plan | None
    predicted_peak_bytes: int | None
    predicted_step_s: float | None
    min_budget_bytes: int
    least_memory_plan: Plan | None
    host_swap_bytes: int

    def __str__(self) -> str:
        if self.budget_bytes is None:
            head = "no memory budget given"
        else:
            head = f"budget {human_bytes(self.budget_bytes)} ({self.budget_source}): " + (
                "fits" if self.fits else "does NOT fit"
            )
        lines = [f"graph {self.graph}: {head}; smallest budget {human_bytes(self.min_budget_bytes)} "
                 f"({self.min_budget_bytes} bytes)"]
        if self.plan is not None:
            counts = {p: len(self.plan.blocks_with(p)) for p in ("swap", "checkpoint")}
            lines.append(
                f"  plan: {counts['swap']} swapped, {counts['checkpoint']} checkpointed block(s); predicted peak "
                f"{human_bytes(self.predicted_peak_bytes or 0)}, step {1e3 * (self.predicted_step_s or 0):.3f} ms; "
                f"pinned host memory for swaps {human_bytes(self.host_swap_bytes)}"
            )
        return "\n".join(lines)


class _Answered(BaseException):
    """Raised by the backend with the report, through Dynamo (a ``BaseException``: Dynamo wraps, or
    with ``suppress_errors`` swallows and runs eagerly, only ``Exception``s)."""

    def __init__(self, report: FitReport) -> None:
        super().__init__(str(report))
        self.report = report


def answer(record: CapturedGraph, trial: Callable[[Plan | None], None]) -> None:
    """The backend's side (``config.dry_run``): plan ``record`` as :func:`autoplan.choose_plan` would,
    find the smallest budget, and stop the compile with the report."""
    from protrain_fx import autoplan
    from protrain_fx.pipeline import allocated_cap_bytes, budget_for_peak
    from protrain_fx.search import NoPlanFits

    given = record.config.memory_budget_bytes
    record.config = dataclasses.replace(record.config, memory_budget_bytes=given or UNBOUNDED)
    chosen: autoplan.AutoPlan | None = None
    try:
        chosen = autoplan.choose_plan(record, trial)
        fits, minimum = True, None
    except NoPlanFits as e:
        fits, minimum = False, e.min_budget_bytes
    assert record.memory is not None
    least: Plan | None = None
    if chosen is None and fits:  # no transformer block: the step as it is
        minimum = budget_for_peak(record.memory.peak_bytes)
        fits = given is None or record.memory.peak_bytes <= allocated_cap_bytes(given)
    elif minimum is None:  # a plan fits: the smallest budget is the least-memory plan's
        model = CostModel(chosen.problem)
        config = autoplan.least_memory_config(model)
        least = block_plan(chosen.problem, config)
        trial(least if least.blocks_with("swap") or least.blocks_with("checkpoint") else None)
        minimum = budget_for_peak(max(model.estimate(config).peak_bytes, record.memory.peak_bytes))
    swap_bytes = 0
    if chosen is not None:
        swapped = set(chosen.plan.blocks_with("swap"))
        swap_bytes = sum(b.swap_bytes for b in chosen.problem.blocks if b.name in swapped)
    raise _Answered(
        FitReport(
            graph=record.index,
            budget_bytes=given,
            budget_source=record.budget_source if given is not None else None,
            fits=fits,
            plan=chosen.plan if chosen is not None else (Plan(blocks={}) if fits else None),
            predicted_peak_bytes=chosen.predicted_peak_bytes if chosen is not None else record.memory.peak_bytes,
            predicted_step_s=chosen.estimate.step_s if chosen is not None else None,
            min_budget_bytes=minimum,
            least_memory_plan=least,
            host_swap_bytes=swap_bytes,
        )
    )


def what_fits(
    model: torch.nn.Module,
    *args: Any,
    memory_budget: int | str | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> FitReport:
    """The plan ``model`` would train with on ``args``/``kwargs`` under ``memory_budget`` (or, on a
    CUDA device with none given, what the process can reach there), and the smallest budget that
    has a plan, without running the step (module docstring). ``options``: the other backend options
    of the training run."""
    opts = dict(options or {})
    if opts.get("plan") is not None or opts.get("auto_plan") is False:
        raise ValueError("what_fits: the backend must choose the plan (no 'plan', no auto_plan=False in options)")
    if memory_budget is not None:
        opts["memory_budget"] = memory_budget
    opts["dry_run"] = True
    compiled = torch.compile(model, backend="protrain", options=opts)
    try:
        with torch.enable_grad():
            compiled(*args, **kwargs)
    except _Answered as answered:
        # The compile stopped before Dynamo cached anything for this frame: a later torch.compile of
        # the model compiles afresh, and other compiled models keep their graphs (tested).
        return answered.report
    raise ValueError(
        "what_fits: no training step was captured: no parameter requires grad, or the model is offloaded "
        "(protrain_fx.offload: its n_persist / n_buffer are chosen by hand)"
    )
