"""The plan, the candidates judged, the block table, the rewritten graphs and the predicted memory
timeline in torch's structured trace (``TORCH_TRACE=<dir>``, read by ``tlparse``).

``tlparse`` turns a ``TORCH_TRACE`` folder into one HTML report per compile: Dynamo's and
AOTAutograd's graphs, guards, recompiles and Inductor's output. These artifacts put the backend's
side beside them, under the same compile id (torch's ``trace_structured`` takes it from the compile
running): one set per compile, written when its plan is chosen (:func:`write_plan`) and when its
memory analysis is final (:func:`write_timeline`: after Inductor's allocation plans are read, or
with eager codegen at once). Nothing is built when no trace is written (:func:`tracing`). Artifact names, each ``protrain_``-prefixed: ``plan`` and ``candidates`` (JSON),
``block_table``, ``forward_graph``, ``backward_graph`` (text), ``memory_timeline`` (JSON: the Chrome
trace the timeline export writes).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from torch._logging import trace_structured
from torch._logging._internal import LazyTraceHandler, trace_log

from protrain_fx.capture import CapturedGraph
from protrain_fx.inspect.tables import block_table
from protrain_fx.inspect.trace import to_chrome_trace
from protrain_fx.search.cost import CostModel

#: The prefix of every artifact name (what a user greps a trace for).
PREFIX = "protrain_"


def tracing() -> bool:
    """Whether torch's structured trace is written anywhere: a handler on its log other than torch's
    lazy one with no folder, and other than a test runner's log capture. (``trace_structured`` builds
    a payload whenever its log has a handler; ``torch._logging.set_logs()`` puts the lazy one back
    until the next record removes it, and pytest 9 attaches its capture handlers to every logger that
    does not propagate, torch's trace log among them: a large payload would be built for nothing.)"""
    return any(_writes(h) for h in trace_log.handlers)


def _writes(handler: logging.Handler) -> bool:
    if isinstance(handler, LazyTraceHandler):
        return handler.root_dir is not None or handler.stream is not None
    return not type(handler).__module__.startswith(_TEST_RUNNER_CAPTURE)


#: The package of the log-capture handlers pytest attaches to every non-propagating logger.
_TEST_RUNNER_CAPTURE = "_pytest."


def artifact(name: str, encoding: str, payload: Callable[[], str]) -> None:
    """One artifact ``PREFIX + name`` of the compile running, ``encoding`` ``"json"`` or ``"string"``;
    nothing when no trace is written (:func:`tracing`)."""
    if not tracing():
        return
    trace_structured("artifact", metadata_fn=lambda: {"name": PREFIX + name, "encoding": encoding},
                     payload_fn=payload)


def plan_json(record: CapturedGraph) -> dict[str, Any]:
    """The chosen plan of ``record`` as data: budget and reserve, counts, the blocks swapped and
    checkpointed, predicted step and peak, the trials run and kept (none for a graph without a plan)."""
    auto = record.auto_plan
    if auto is None:
        return {"graph": record.index, "plan": None, "budget_bytes": record.budget_bytes}
    return {
        "graph": record.index,
        "how": auto.how,
        "budget_bytes": auto.budget_bytes,
        "budget_source": auto.budget_source,
        "allocated_cap_bytes": auto.allocated_cap_bytes,
        "reserve_bytes": auto.reserve_bytes,
        "reserve_source": auto.reserve_source,
        "config": auto.config.to_dict(),
        "offload": auto.offload,
        "swapped": list(auto.plan.blocks_with("swap")),
        "checkpointed": list(auto.plan.blocks_with("checkpoint")),
        "predicted_step_s": auto.estimate.step_s,
        "predicted_peak_bytes": auto.predicted_peak_bytes,
        "judged_peak_bytes": auto.analysed_peak_bytes,
        "judged_by": auto.judged_by,
        "from_plan_cache": auto.from_cache,
        "from_aot_cache": auto.from_aot_cache,
        "trials_run": auto.trials_run,
        "trials_kept": auto.trials_kept,
        "phases_s": dict(auto.phases),
    }


def candidates_json(record: CapturedGraph) -> list[dict[str, Any]]:
    """Every config the planner judged for ``record``, in order: the config, the peak it was judged
    by and the cost model's, its predicted step, and whether it fitted the cap."""
    auto = record.auto_plan
    if auto is None:
        return []
    model = CostModel(auto.problem)
    return [{"config": t.config.to_dict(), "requested": t.requested.to_dict() if t.requested else None,
             "judged_peak_bytes": t.analysed_peak_bytes, "by_inductor": t.by_inductor,
             "predicted_peak_bytes": t.predicted_peak_bytes, "predicted_step_s": model.estimate(t.config).step_s,
             "fits": t.analysed_peak_bytes <= auto.allocated_cap_bytes} for t in auto.trials]


def write_plan(record: CapturedGraph) -> None:
    """The plan, the candidates, the block table and the rewritten graphs of ``record``, once its
    plan is chosen."""
    artifact("plan", "json", lambda: json.dumps(plan_json(record)))
    if record.auto_plan is not None:
        artifact("candidates", "json", lambda: json.dumps(candidates_json(record)))
    if record.memory is not None:
        artifact("block_table", "string", lambda: block_table(record))
    for kind in ("forward", "backward"):
        if record.readable.get(kind):
            artifact(f"{kind}_graph", "string", lambda kind=kind: record.readable[kind])


def write_timeline(record: CapturedGraph) -> None:
    """The predicted memory timeline of ``record`` (its analysis as it stands: Inductor's allocation
    plans once read), as the Chrome trace the export writes."""
    if record.memory is not None and record.memory.timeline is not None:
        artifact("memory_timeline", "json", lambda: json.dumps(to_chrome_trace([record.memory.timeline])))
