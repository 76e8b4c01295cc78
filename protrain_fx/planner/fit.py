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
its later graphs are not reached). A model offloaded without counts (``protrain_fx.offload(model,
optimizer)``, before its first training compile) gets the chunk counts too, chosen and checked as
the training compile would (:func:`answer_offload`: the chunks are placed for each config tried,
host store included, and removed before it returns). A model offloaded with counts by hand is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from protrain_fx.analysis.memory import MemoryAnalysis
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import Budget, CapturedGraph, captured_graphs, forget_records_after
from protrain_fx.handoffs import ChunkFacts
from protrain_fx.plan import Plan
from protrain_fx.planner import activations, reserve, result, verify
from protrain_fx.planner import offload as planner_offload
from protrain_fx.planner.budget import allocated_cap_bytes, budget_for_peak
from protrain_fx.planner.reserve import outside_reserve
from protrain_fx.runtime.store.host_memory import HostMemoryError, planned_store_bytes, spill_bytes
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import block_plan
from protrain_fx.search.search import NoPlanFits

#: Inductor's analysis of the plan now in a record (``lowering.probe_inductor``), ``None`` when it
#: cannot be had.
Lower = Callable[[], "MemoryAnalysis | None"]

#: The budget a report without one is planned under: large enough for any step, so only the
#: smallest budget is of interest.
UNBOUNDED = 2**62


@dataclass(frozen=True)
class FitReport:
    """One training graph's answer. ``budget_bytes``: what it was asked under (``None``: no budget,
    only the minimum is reported); ``predicted_peak_bytes``: the peak ``step_report()`` gives after the
    training compile: Inductor's allocation plan with Inductor's code (the plan lowered once where it was
    judged by the memory analysis alone, as on the CPU), else the memory analysis; ``fits``: a plan keeps
    that peak under the budget less the allocator's headroom (``planner.budget.allocated_cap_bytes``); ``plan``: the plan the backend would run
    (``None`` when nothing fits); ``min_budget_bytes``: the smallest budget with which the backend
    finds a plan (that of least memory, allocator headroom included); ``host_swap_bytes``: pinned host
    memory the plan's swaps need (0 without swaps).

    For ``protrain_fx.offload`` without counts (:func:`answer_offload`): ``counts`` are the chunk
    counts (``n_persist``, ``n_buffer``, ``n_gpu_optim`` of ``n_chunks``; when nothing fits, those
    of least memory) and ``host_chunk_bytes`` the host store they need (fp32 master, two Adam
    moments and the compute-dtype copy of each offloaded chunk, before any chunk is made lean). The
    chunks were placed to check each config with the memory analysis, as training does, and
    removed again. When the host cannot hold the store of any config, nothing is placed: ``fits`` is
    false, ``host_needed_bytes`` / ``host_available_bytes`` say what the store needs and what the
    host has, and ``min_budget_bytes`` is the cost model's for the least-memory counts. ``tiers``: where
    the store of those counts keeps what (:func:`tier_bytes`: ``n_lean`` chunks without a
    host working copy, ``n_spill`` chunks whose optimizer state is in a file in ``spill_dir``,
    ``host_bytes`` of host memory and ``disk_bytes`` on disk)."""

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
    counts: dict[str, int] | None = None
    host_chunk_bytes: int = 0
    host_needed_bytes: int = 0
    host_available_bytes: int | None = None
    tiers: dict[str, Any] | None = None

    def __str__(self) -> str:
        if self.budget_bytes is None:
            head = "no memory budget given"
        else:
            if self.fits:
                verdict = "fits"
            elif self.host_available_bytes is not None and self.min_budget_bytes <= self.budget_bytes:
                verdict = "does NOT fit: the device budget would do, the host memory does not (below)"
            else:
                verdict = "does NOT fit"
            head = f"budget {human_bytes(self.budget_bytes)} ({self.budget_source}): {verdict}"
        lines = [f"graph {self.graph}: {head}; smallest budget {human_bytes(self.min_budget_bytes)} "
                 f"({self.min_budget_bytes} bytes)"]
        if self.plan is not None:
            counts = {p: len(self.plan.blocks_with(p)) for p in ("swap", "checkpoint")}
            lines.append(
                f"  plan: {counts['swap']} swapped, {counts['checkpoint']} checkpointed block(s); predicted peak "
                f"{human_bytes(self.predicted_peak_bytes or 0)}, step {1e3 * (self.predicted_step_s or 0):.3f} ms; "
                f"pinned host memory for swaps {human_bytes(self.host_swap_bytes)}"
            )
        if self.counts is not None:
            c = self.counts
            lines.append(
                f"  chunks: n_persist={c['n_persist']}, n_buffer={c['n_buffer']}, n_gpu_optim={c['n_gpu_optim']} of "
                f"{c['n_chunks']}; host store {human_bytes(self.host_chunk_bytes)}"
            )
        if self.tiers is not None:
            t = self.tiers
            disk = (f"; disk {human_bytes(t['disk_bytes'])}: the optimizer state of {t['n_spill']} chunk(s) in "
                    f"{t['spill_dir']}" if t["n_spill"] else "; nothing on disk")
            lines.append(f"  tiers: host memory {human_bytes(t['host_bytes'])} ({t['n_lean']} lean chunk(s)){disk}")
        if self.host_available_bytes is not None:
            lines.append(
                f"  host memory: the chunk store needs {human_bytes(self.host_needed_bytes)} "
                f"({self.host_needed_bytes} bytes, every chunk lean that can be), "
                f"{human_bytes(self.host_available_bytes)} available: does NOT fit this host "
                "(no plan was placed and analysed; the smallest budget is the cost model's)"
            )
        return "\n".join(lines)


class _Answered(BaseException):
    """Raised by the backend with the report, through Dynamo (a ``BaseException``: Dynamo wraps, or
    with ``suppress_errors`` swallows and runs eagerly, only ``Exception``s)."""

    def __init__(self, report: FitReport) -> None:
        super().__init__(str(report))
        self.report = report


def _as_training_reports(record: CapturedGraph, chosen: result.AutoPlan, lower: Lower | None) -> tuple[int, bool]:
    """The peak training's report will give for ``chosen`` (the plan now in ``record``), and whether
    it stays under the plan's cap: the judged peak, or, where the plan was judged by the graph-level
    analysis but the compile's code is Inductor's (``codegen="inductor"`` on the CPU), the peak of
    Inductor's allocation plan of it (``lower``: one lowering, which Inductor's cache keeps for the
    training compile of the same plan). That peak is what ``step_report()`` shows after the compile,
    and what the compile checks against the budget (``planner.budget.check_budget``)."""
    if chosen.judged_by == "inductor" or lower is None or record.config.codegen != "inductor":
        return chosen.analysed_peak_bytes, True
    lowered = lower()
    if lowered is None:
        return chosen.analysed_peak_bytes, True
    return lowered.peak_bytes, lowered.peak_bytes <= chosen.allocated_cap_bytes


def planning_budget(budget: Budget | None) -> Budget:
    """The budget ``what_fits`` plans under, which the backend stores in the record before
    :func:`answer`: the resolved ``budget``, or :data:`UNBOUNDED` when there is none."""
    given, source = (budget.bytes, budget.source) if budget is not None else (None, None)
    return Budget(given or UNBOUNDED, source or "user")


def answer(record: CapturedGraph, budget: Budget | None, trial: verify.TrialFn, kept: dict | None = None,
           lower: Lower | None = None) -> None:
    """The backend's side (``config.dry_run``): plan ``record`` as :func:`activations.choose_plan` would
    (``kept``: the graph's judgments kept, ``planner/judged.py``), find the smallest budget, and stop
    the compile with the report. ``budget``: the resolved budget the report is asked under (``None``:
    none; the record holds :func:`planning_budget` of it); ``lower``: Inductor's analysis of the plan
    now in ``record`` (:func:`_as_training_reports`)."""
    given, source = (budget.bytes, budget.source) if budget is not None else (None, None)
    chosen: result.AutoPlan | None = None
    reported: int | None = None
    try:
        chosen = activations.choose_plan(record, trial, kept)
        fits, minimum = True, None
        if chosen is not None:
            trial(chosen.plan if chosen.plan.rewrites() else None)  # the plan chosen, in record again
            reported, fits = _as_training_reports(record, chosen, lower)
    except NoPlanFits as e:
        fits, minimum = False, e.min_budget_bytes
    assert record.memory is not None
    least: Plan | None = None
    if chosen is None and fits:  # no transformer block: the step as it is
        reported = record.memory.peak_bytes
        if lower is not None and record.config.codegen == "inductor" and not verify.lowers(record):
            lowered = lower()  # as training's report gives it (_as_training_reports)
            reported = lowered.peak_bytes if lowered is not None else reported
        minimum = budget_for_peak(reported)
        fits = given is None or reported <= allocated_cap_bytes(given)
    elif minimum is None:  # the smallest budget is that of the least-memory plans' least peak
        model = CostModel(chosen.problem)
        lowest: tuple[int, Plan] | None = None
        for config in activations.least_memory_configs(model, model.n_chunks, 0):
            plan = block_plan(chosen.problem, config)
            trial(plan)
            judged, _ = verify.judged_peak(record)  # as training judges it (option verify), and it alone
            if lowest is None or judged < lowest[0]:
                lowest = (judged, plan)
        assert lowest is not None
        judged, least = lowest
        minimum = budget_for_peak(judged + reserve.outside_reserve(record)[0])
    swap_bytes = 0
    if chosen is not None:
        swapped = set(chosen.plan.blocks_with("swap"))
        swap_bytes = sum(b.swap_bytes for b in chosen.problem.blocks if b.name in swapped)
    raise _Answered(
        FitReport(
            graph=record.index,
            budget_bytes=given,
            budget_source=source,
            fits=fits,
            plan=(chosen.plan if chosen is not None else Plan(blocks={})) if fits else None,
            predicted_peak_bytes=reported if reported is not None else record.memory.peak_bytes,
            predicted_step_s=chosen.estimate.step_s if chosen is not None else None,
            min_budget_bytes=minimum,
            least_memory_plan=least,
            host_swap_bytes=swap_bytes,
        )
    )


def answer_offload(record: CapturedGraph, budget: Budget | None, facts: ChunkFacts, placer: verify.Placer,
                   trial: verify.TrialFn, kept: dict | None = None, lower: Lower | None = None) -> None:
    """The backend's side for an offload without counts (``config.dry_run``): the counts and plan
    the training compile would choose under the budget (``planner.offload.choose_offload``, which
    places the chunks of each config it tries and checks it with the memory analysis), and the
    smallest budget: the least peak of the least-memory configs
    (``planner.offload.least_memory_candidates``: the cost model's least, and checkpointing every
    block) as the analysis judges it, the judge training uses (the cost model's peak is not asked to
    fit: it can fall below the analysis', on small chunks and on swaps, or far above it). Then
    nothing stays placed (``placer.undo()``) and the compile stops with the report. ``facts``: the
    offloaded model as the backend read it; ``kept``: the graph's judgments kept
    (``planner/judged.py``); ``budget``, ``lower``: as :func:`answer`'s."""
    given, source = (budget.bytes, budget.source) if budget is not None else (None, None)
    trial(None)  # the step as if every parameter stayed on the device: the blocks' activations
    assert record.memory is not None
    model = planner_offload.offload_cost_model(record, facts, "what_fits cannot choose its offload counts")
    problem = model.problem
    candidates = planner_offload.least_memory_candidates(model)
    least = candidates[0]
    outside = outside_reserve(record)[0]
    chosen = None
    reported, fits = None, False
    host_short: HostMemoryError | None = None
    try:
        try:
            chosen = planner_offload.choose_offload(record, facts, placer, trial, model=model, kept=kept)
            reported, fits = _as_training_reports(record, chosen, lower)  # the chunks stay placed for it
            judged = []
            for config in candidates:
                done = verify.tried(chosen.trials, config)
                if done is None:
                    done = planner_offload.place_and_analyse(record, placer, model, config, trial)
                judged.append(done)
            done = min(judged, key=lambda t: t.analysed_peak_bytes)
            least = done.config
            minimum = budget_for_peak(done.analysed_peak_bytes + outside)
        except NoPlanFits as e:  # training's own refusal, with the minimum it names
            minimum = e.min_budget_bytes
            least = getattr(e, "least_config", least)
        except HostMemoryError as e:
            # No config can be placed to be analysed: the answer is the host memory the store needs,
            # and the device side as the cost model alone puts it.
            host_short = e
            minimum = budget_for_peak(model.estimate(least).peak_bytes + outside)
    finally:
        placer.undo()  # nothing stays placed: the training compile chooses again
    config = chosen.config if chosen is not None else least
    plan = chosen.plan if chosen is not None else None
    swapped = set(plan.blocks_with("swap")) if plan is not None else set()
    numel = facts.layout.chunk_bytes // torch.empty(0, dtype=facts.param_dtype).element_size()
    compute_size = torch.empty(0, dtype=facts.compute_dtype).element_size()
    offloaded = model.n_chunks - config.n_persist
    raise _Answered(
        FitReport(
            graph=record.index,
            budget_bytes=given,
            budget_source=source,
            fits=chosen is not None and fits,
            plan=plan if fits else None,
            predicted_peak_bytes=reported,
            predicted_step_s=chosen.estimate.step_s if chosen is not None else None,
            min_budget_bytes=minimum,
            least_memory_plan=block_plan(problem, least),
            host_swap_bytes=sum(b.swap_bytes for b in problem.blocks if b.name in swapped),
            counts={"n_persist": config.n_persist, "n_buffer": config.n_buffer, "n_gpu_optim": config.n_gpu_optim,
                    "n_chunks": model.n_chunks},
            host_chunk_bytes=offloaded * numel * (4 + problem.adam_state_bytes_per_param + compute_size),
            host_needed_bytes=host_short.needed_bytes if host_short is not None else 0,
            host_available_bytes=host_short.available_bytes if host_short is not None else None,
            tiers={**tier_bytes(facts, config.n_persist), "spill_dir": str(facts.spill_dir)},
        )
    )


def tier_bytes(facts: ChunkFacts, n_persist: int) -> dict[str, int]:
    """Where the store of ``n_persist`` persistent chunks would keep what: ``n_lean`` and ``n_spill``
    (``ChunkFacts.tiers``), ``host_bytes`` of host memory, ``disk_bytes`` in the spill file (the
    store's arithmetic, ``runtime/store/host_memory.py``)."""
    lean, spill = facts.tiers[n_persist]
    rest = facts.trainable[n_persist:]
    return {"n_lean": lean, "n_spill": spill,
            "host_bytes": planned_store_bytes(facts.chunk_params, rest, facts.compute_dtype.itemsize, lean,
                                              facts.landing_pool, spill),
            "disk_bytes": spill_bytes(facts.chunk_params, rest, lean, spill)}


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
    kept = len(captured_graphs())
    try:
        with torch.enable_grad():
            compiled(*args, **kwargs)
    except _Answered as answered:
        # The compile stopped before Dynamo cached anything for this frame: a later torch.compile of
        # the model compiles afresh, and other compiled models keep their graphs (tested).
        return answered.report
    finally:  # the graphs captured to answer are not the user's: step_report() lists what trained
        forget_records_after(kept)
    raise ValueError(
        "what_fits: no training step was captured: no parameter requires grad, or the model is offloaded "
        "with n_persist / n_buffer given by hand"
    )
