"""Judged peaks kept: a plan judged once is not rewritten, analysed or lowered again.

A trial (the joint graph partitioned with a plan, the passes, the memory analysis and, with
``verify="inductor"``, a lowering of both graphs by Inductor) answers one question: the step's peak
under that plan. The answer rests on the joint graph, the plan, the chunk placement and the options
that change a rewrite or its lowering, not on the memory budget nor on the room kept for the code
around the graph. So it is kept, per graph (:func:`judge_key`):

* in this process (:data:`KEPT`), for the compile of the same graph again after its first step
  measured the code around it (``planner/first_step.py``), and for later compiles of it;
* in the plan cache file beside the plans (``planner/plan_cache.py``), for later launches.

A planner asks a :class:`Judge` for a config's :class:`~protrain_fx.planner.verify.Trial`: answered
from what is kept, or run and kept. A kept answer leaves the record's graphs as they were, so the
planner ends with :meth:`Judge.hold`, which rewrites the step once more for the config chosen when
the last rewrite was of another. :attr:`Judge.lowered` counts the trials run (each a lowering of
both graphs under ``verify="inductor"``) and :attr:`Judge.reused` those answered from what was kept.

Under ``verify="inductor"`` a judge also answers without lowering (:attr:`Judge.lower` off: the
graph-level analysis alone, a second or two where a lowering takes a minute on a large model);
``planner.verify.confirmed_choice`` searches with those answers and lowers only the plan it would
choose. Such answers are kept for the judge's own compile, never with the Inductor judgments.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protrain_fx import progress
from protrain_fx.plan import Plan
from protrain_fx.planner.verify import Trial
from protrain_fx.search.problem import Counts
from protrain_fx.state import STATE


@dataclass(frozen=True)
class Judgment:
    """What one trial found, without its graphs: the analysed peak, whether Inductor's allocation
    plan gave it, and the config applied (more chunk buffers than asked for, when the rewrite held
    more chunks at once: ``Trial.requested``)."""

    analysed_peak_bytes: int
    by_inductor: bool
    applied: Counts

    def to_list(self) -> list[Any]:
        return [self.analysed_peak_bytes, self.by_inductor, self.applied.to_dict()]

    @classmethod
    def from_list(cls, raw: Any) -> Judgment:
        peak, by_inductor, applied = raw
        if not isinstance(peak, int) or isinstance(peak, bool) or not isinstance(by_inductor, bool):
            raise TypeError(f"a judgment is [peak bytes, by Inductor, config], not {raw!r}")
        return cls(peak, by_inductor, Counts.from_dict(applied))


#: Judged graphs kept in this process: judge key -> trial key -> judgment. ``protrain_fx.reset()``
#: forgets them.
KEPT: dict[str, dict[str, Judgment]] = {}
STATE.on_reset(KEPT.clear)

log = logging.getLogger("protrain_fx")

#: The compile phase the trials are timed and counted in (``progress.py``; the backend times them).
TRIALS_PHASE = "trial lowerings"

#: Parts of a plan cache key (``planner.plan_cache.plan_key``) that choose among plans but change no
#: trial's answer: the budget and where it came from.
NOT_JUDGED = ("budget_bytes", "budget_source")


def judge_key(plan_key_parts: Mapping[str, Any]) -> str:
    """The key judgments of one graph are kept under: the plan cache key's parts less :data:`NOT_JUDGED`
    (the joint graph's structure, the devices, versions, sources, planning options and chunk layout)."""
    parts = {k: v for k, v in plan_key_parts.items() if k not in NOT_JUDGED}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def trial_key(plan: Plan, counts: tuple[int, ...] = ()) -> str:
    """What makes two trials of one graph the same: the blocks the plan swaps and checkpoints (and
    its per-tensor overrides), and for an offload the placement's counts (``n_persist``,
    ``n_buffer``, ``n_gpu_optim``, lean chunks)."""
    return json.dumps({"swap": sorted(plan.blocks_with("swap")), "checkpoint": sorted(plan.blocks_with("checkpoint")),
                       "tensors": dict(sorted(plan.tensors.items())), "counts": list(counts)}, sort_keys=True)


def kept_for(key: str) -> dict[str, Judgment]:
    """The judgments kept in this process for the graph of ``key`` (a dict the planner adds to)."""
    return KEPT.setdefault(key, {})


@dataclass
class Judge:
    """Trials of one graph's configs, answered from ``kept`` where a trial of the same step was run
    before (module docstring).

    ``key_of(config)``: :func:`trial_key` of the config; ``rewrite(config)``: place (an offload),
    partition, rewrite and analyse the step for ``config``, leaving the record as of it, and return
    the config applied (an offload's rewrite can need more chunk buffers than asked);
    ``judge_now(lower)``: the peak of the step the record holds and whether Inductor's plan gave it
    (``planner.verify.judged_peak``: the lowering, with ``verify="inductor"`` and ``lower``);
    ``predict(config)``: the cost model's peak. ``holding``: the config whose rewrite the record
    holds now, if any. ``lowers``: whether a judgment lowers the step (``verify="inductor"``);
    ``lower``: whether the next judgments do (module docstring)."""

    kept: dict[str, Judgment]
    key_of: Callable[[Counts], str]
    rewrite: Callable[[Counts], Counts]
    judge_now: Callable[[bool], tuple[int, bool]]
    predict: Callable[[Counts], int]
    holding: Counts | None = None
    lowered: int = 0
    reused: int = 0
    lowers: bool = False
    lower: bool = True
    analysed: dict[str, Judgment] = field(default_factory=dict)

    def __call__(self, config: Counts) -> Trial:
        """The :class:`Trial` of ``config``: kept, or rewritten (unless the record holds it) and judged."""
        key = self.key_of(config)
        got = self.kept.get(key)
        if got is None and self.lowers and not self.lower:
            if (got := self.analysed.get(key)) is None:
                applied = config if self.holding == config else self.rewrite(config)
                self.holding = applied
                got = self.analysed[key] = Judgment(self.judge_now(False)[0], False, applied)
                log.debug("protrain_fx: trial %s: analysed at %d bytes (graph-level analysis, not lowered)",
                          applied, got.analysed_peak_bytes)
            return Trial(got.applied, self.predict(got.applied), got.analysed_peak_bytes, got.by_inductor,
                         requested=None if got.applied == config else config)
        if got is not None:
            self.reused += 1
            log.debug("protrain_fx: trial %s: judged before at %d bytes (%s)", got.applied, got.analysed_peak_bytes,
                      "Inductor's allocation plan" if got.by_inductor else "graph-level analysis")
            return Trial(got.applied, self.predict(got.applied), got.analysed_peak_bytes, got.by_inductor,
                         requested=None if got.applied == config else config)
        analysed = self.analysed.get(key)  # the record can hold its rewrite from the analysis alone
        target = analysed.applied if analysed is not None else config
        applied = target if self.holding == target else self.rewrite(config)
        self.holding = applied
        peak, by_inductor = self.judge_now(True)
        self.lowered += 1
        if (rec := progress.current()) is not None:
            rec.advance(TRIALS_PHASE)
        self.kept[key] = Judgment(peak, by_inductor, applied)
        log.debug("protrain_fx: trial %s: judged at %d bytes (%s; the cost model's %d)", applied, peak,
                  "Inductor's allocation plan" if by_inductor else "graph-level analysis", self.predict(applied))
        return Trial(applied, self.predict(applied), peak, by_inductor,
                     requested=None if applied == config else config)

    def hold(self, config: Counts) -> None:
        """Leave the record with the rewrite of ``config`` (a config as applied): rewritten again
        unless the record holds it."""
        if self.holding != config:
            self.holding = self.rewrite(config)
