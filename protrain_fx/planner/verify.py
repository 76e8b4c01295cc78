"""How a plan the cost model proposes is judged and kept: the memory analysis is the judge.

The cost model's peak is an upper bound of the analysis', not its order, so every config the search
proposes is applied and analysed (the graph-level analysis or, with ``verify="inductor"``,
Inductor's allocation plan). :func:`verified_choice` lowers the cap after an overshoot and falls
back to the least-memory configs; :func:`raised_choice` uses a fitting plan's margin to search
again with a raised cap. Both are control flow over two callbacks (``search_at``, ``run``): the
caller partitions and analyses, so the same procedure serves the activation plan and the offload
counts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Protocol

from protrain_fx.analysis.memory import MemoryAnalysis
from protrain_fx.capture import CapturedGraph
from protrain_fx.handoffs import Placement
from protrain_fx.plan import Plan
from protrain_fx.search.problem import Counts
from protrain_fx.search.search import NoPlanFits, SearchResult
from protrain_fx.state import STATE

log = logging.getLogger("protrain_fx")


#: Searches after a rewritten step analysed above the cap, before the least-memory config is tried.
MAX_SEARCHES = 3


@dataclass(frozen=True)
class Rewrite:
    """What the backend's ``trial(plan)`` hands back: the step partitioned and rewritten with
    ``plan`` (``None``: none; a plan that neither swaps nor checkpoints a block is applied as none)
    and analysed. ``memory``: the graph-level memory analysis of the graphs it left in the record
    (``analysis.memory.MemoryAnalysis``), which hold them until the next trial."""

    plan: Plan | None
    memory: MemoryAnalysis


#: The backend's ``trial(plan)`` (``backend.py``): one rewrite of the step per call.
TrialFn = Callable[[Plan | None], Rewrite]


class Placer(Protocol):
    """How the planner places an offloaded model's chunks mid-search, to rewrite and judge a config
    on them (the backend adapts the offload handle to it: ``backend.py``). It places and undoes,
    nothing more: the config chosen is handed back, and the backend makes it final."""

    def place(self, placement: Placement) -> None:
        """The chunks placed with these counts, the host store laid out but not filled (a trial needs
        the placement's sizes, not its bytes)."""

    def set_gpu_optim(self, n_gpu_optim: int) -> None:
        """The first ``n_gpu_optim`` offloaded chunks stepped on the device: no graph changes, nothing moves."""

    def undo(self) -> None:
        """Nothing placed: a later compile chooses again."""


@dataclass(frozen=True)
class Trial:
    """One plan partitioned and analysed: its config, the cost model's peak, the analysis' peak
    (``by_inductor``: Inductor's allocation plan of the step, ``verify="inductor"``). ``requested``:
    the config asked for, when the rewrite needed more chunk buffers than it gave
    (:class:`~protrain_fx.errors.TooFewBuffers`); ``config`` is then the one applied."""

    config: Counts
    predicted_peak_bytes: int
    analysed_peak_bytes: int
    by_inductor: bool = False
    requested: Counts | None = None

    def answers(self, config: Counts) -> bool:
        """Whether this trial is what running ``config`` gives (asked for, or applied)."""
        return config == self.config or config == self.requested


def tried(trials: Sequence[Trial], config: Counts) -> Trial | None:
    """The first of ``trials`` that :meth:`Trial.answers` ``config``."""
    return next((t for t in trials if t.answers(config)), None)


class Judge(Protocol):
    """What :func:`confirmed_choice` needs of a judge (``planner.judged.Judge``): whether its judgments
    can lower the step (``lowers``), whether the next ones do (``lower``), and a config's trial."""

    lowers: bool
    lower: bool

    def __call__(self, config: Counts) -> Trial: ...


def judged_peak(record: CapturedGraph, lower: bool = True) -> tuple[int, bool]:
    """The peak the plan now in ``record`` is judged by, and whether Inductor's allocation plan gave
    it: the graph-level analysis' peak, or with ``verify="inductor"`` and ``lower`` the peak of
    Inductor's plan of the same graphs (``record.probe_inductor``: one lowering of both graphs, as
    the compile lowers them). That plan is what runs: it can be below the graph-level peak (values
    Inductor never stores) or above it (a tiny offloaded GPT on the CPU: 2.82 MB against 2.59)."""
    assert record.memory is not None
    peak = record.memory.peak_bytes
    if lower and record.probe_inductor is not None:
        probed = record.probe_inductor()
        if probed is not None:
            log.info("protrain_fx: a plan the graph-level analysis puts at %d bytes peaks at %d in "
                     "Inductor's allocation plan", peak, probed.peak_bytes)
            return probed.peak_bytes, True
    return peak, False


def lowers(record: CapturedGraph) -> bool:
    """Whether a judgment of ``record``'s step lowers it with Inductor (``verify="inductor"``, or
    ``"auto"`` for a CUDA step): what :attr:`~protrain_fx.planner.judged.Judge.lowers` is given."""
    assert record.memory is not None
    return record.probe_inductor is not None and record.config.verify_for(record.memory.device) == "inductor"


def judged_trial(record: CapturedGraph, config: Counts, predicted_peak_bytes: int) -> Trial:
    """The :class:`Trial` of the plan now in ``record`` (:func:`judged_peak`)."""
    peak, by_inductor = judged_peak(record)
    return Trial(config, predicted_peak_bytes, peak, by_inductor)


def verified_choice(
    search_at: Callable[[int], SearchResult],
    run: Callable[[Counts], Trial],
    least: Counts | Sequence[Counts],
    trials: list[Trial],
    cap: int,
) -> tuple[Counts | None, str, SearchResult | None, int, Counts]:
    """Steps 3 and 4 of ``planner/activations.py``'s module docstring, shared with
    ``planner/offload.py``: ``search_at(lowered)`` searches with the cap lowered by ``lowered``
    bytes (raised when negative), ``run(config)`` applies a config and returns its analysed
    :class:`Trial` (appending it to ``trials``). ``least``: the configs of least memory
    (``planner.activations.least_memory_configs``), in the order to try them. Returns
    ``(config, how, last search, peak needed, least config)``, each config as applied
    (:attr:`Trial.config`): a searched config analysed under ``cap`` (``"searched"``), else the
    first of ``least`` the analysis puts under ``cap`` (``"least memory"``; tried even when the cost model says it does not fit, and judged by the analysis
    alone, as every trial is: the cost model's peak is an upper bound of it, and with
    ``verify="inductor"`` it can be gigabytes above the plan that runs), else ``None`` with the
    least peak any of ``least`` analyses to and that config, so that the minimum a caller names is
    one this procedure keeps. On return the last ``run`` is of the returned config.

    A searched config that fits is then used as a measure of the cost model's margin
    (:func:`raised_choice`): the search runs again with the cap raised by what the cost model
    predicted above the analysis, and the faster config it finds is kept if it analyses under the
    cap too."""
    found: SearchResult | None = None
    lowered = 0
    for _ in range(MAX_SEARCHES):
        try:
            found = search_at(lowered)
        except NoPlanFits:
            break
        if tried(trials, found.best):
            break
        t = run(found.best)
        if t.analysed_peak_bytes <= cap:
            found = raised_choice(search_at, run, found, t, trials, cap)
            kept = tried(trials, found.best)
            assert kept is not None
            return kept.config, "searched", found, kept.analysed_peak_bytes, kept.config
        lowered += max(1, t.analysed_peak_bytes - t.predicted_peak_bytes)
    judged: list[Trial] = []
    for config in [least] if isinstance(least, Counts) else least:
        done = tried(trials, config) or run(config)
        judged.append(done)
        if done.analysed_peak_bytes <= cap:  # the analysis judges (the cost model's peak is an upper bound of it)
            if trials[-1] is not done:
                run(config)  # the record holds the graphs of the last trial
            return done.config, "least memory", found, done.analysed_peak_bytes, done.config
    lowest = min(judged, key=lambda t: t.analysed_peak_bytes)
    return None, "", found, lowest.analysed_peak_bytes, lowest.config


#: Searches judged by the graph-level analysis, each ended by one lowering of the config it chose,
#: before :func:`confirmed_choice` lowers every trial as :func:`verified_choice` does.
CONFIRM_ROUNDS = 3

#: A step the graph-level analysis puts at most this fraction above the cap is lowered to be judged
#: as it is (:func:`judged_as_is`); further above, :func:`confirmed_choice` reaches it when a lowering
#: shows Inductor's plan that far below the analysis.
AS_IS_MARGIN = 0.05


#: How far above the cap the step as it is, scaled as the plans' lowerings came out against their
#: analysis, may be and still be lowered by :func:`confirmed_choice` (it can keep more values a lowering
#: fuses away than a plan; ``docs/results.md#time-to-the-first-steps``).
AS_IS_LOWER_MARGIN = 0.25


def judged_as_is(judge: Judge, empty: Counts, cap: int) -> Trial:
    """The :class:`Trial` of the step without a plan (``empty``): lowered (``verify="inductor"``) only
    when the graph-level analysis puts it under ``cap`` or within :data:`AS_IS_MARGIN` above it. A
    step gigabytes over the cap is not lowered: a lowering of a large model's step costs a minute
    (``docs/results.md#time-to-the-first-steps``), and the plan chosen instead is lowered anyway."""
    if judge.lowers:
        judge.lower = False
        try:
            analysed = judge(empty)
        finally:
            judge.lower = True
        if analysed.analysed_peak_bytes > cap * (1 + AS_IS_MARGIN):
            return analysed
    return judge(empty)


def faster_after_first_step(record: CapturedGraph, run: Callable[[Counts], Trial], judge: Judge,
                            cap: int, as_is: Trial) -> tuple[Counts, str] | None:
    """The choice of a graph compiled again because its first step found a plan predicted faster
    with the reserve it measured (``planner.first_step.record_first_step`` keeps it in
    ``STATE.faster_plan``): that plan is judged first, and kept when it fits ``cap``; else the plan
    that ran stays (judged before, its lowering in Inductor's cache), with a line that says why. A
    re-plan for speed thus lowers one config at most and never ends on a plan no faster than the
    one it replaces. Not lowered when its graph-level analysis lies more than
    :data:`AS_IS_LOWER_MARGIN` above ``cap``. ``(config, how)``, or ``None`` when no such plan waits
    for ``record`` (or the plan that ran no longer fits): the search runs. ``as_is``: the step
    without a plan, judged; under ``cap`` it is the choice (no plan is faster)."""
    assert record.memory is not None
    promise = STATE.faster_plan.pop((record.memory.device, record.dynamo_code), None)
    if promise is None:
        return None
    if as_is.analysed_peak_bytes <= cap:
        return as_is.config, "fits as is"
    ran, ran_how, better = promise
    peak = None
    if judge.lowers:
        judge.lower = False
        try:
            peak = judge(better).analysed_peak_bytes
        except ValueError:  # a rewrite the placed chunk buffers cannot run (the caller's run says so too)
            judge.holding = None
            peak = math.inf
        finally:
            judge.lower = True
    if peak is None or peak <= cap * (1 + AS_IS_LOWER_MARGIN):
        t = run(better)
        peak = t.analysed_peak_bytes
        if peak <= cap and t.config == better:
            return better, "fits as is" if better.n_swap == better.n_checkpoint == 0 else "searched"
    log.info("protrain_fx: graph %d: n_swap=%d, n_checkpoint=%d, predicted faster after the first step, peaks at %s "
             "bytes, over the cap of %d: the plan that ran (n_swap=%d, n_checkpoint=%d) stays", record.index,
             better.n_swap, better.n_checkpoint, peak, cap, ran.n_swap, ran.n_checkpoint)
    t = run(ran)
    return (ran, ran_how) if t.analysed_peak_bytes <= cap and t.config == ran else None


def confirmed_choice(
    search_at: Callable[[int], SearchResult],
    run: Callable[[Counts], Trial],
    least: Counts | Sequence[Counts],
    trials: list[Trial],
    cap: int,
    judge: Judge,
    as_is: Trial | None = None,
) -> tuple[Counts | None, str, SearchResult | None, int, Counts]:
    """:func:`verified_choice`, lowering (``verify="inductor"``: ``judge.lowers``) only the configs it
    would choose. Each round runs :func:`verified_choice` with ``judge.lower`` off (every trial judged
    by the graph-level analysis, which puts most plans of a step at the byte Inductor's allocation
    plan does, in a second where a lowering takes a minute on a large model) and lowers its choice
    (where nothing fits the analysis, the config of least analysed peak).

    * Above ``cap``: the next round searches with the cap lowered by what Inductor's plan added to the
      analysis of that config.
    * Under ``cap``, below its analysis by more than :data:`AS_IS_MARGIN` of ``cap`` (Inductor fuses
      away values the analysis counts, a loss over a large vocabulary say): the next round searches with the cap raised by that difference, and a
      config it finds predicted :data:`RAISE_MIN_GAIN` faster is lowered and kept if it fits; and
      ``as_is`` (the step without a plan, judged by its analysis alone: :func:`judged_as_is`) is
      lowered, and chosen (``"fits as is"``) if it fits, when its analysis scaled as a lowering's
      came out (the least fraction) lies within :data:`AS_IS_LOWER_MARGIN` above ``cap`` (a step
      gigabytes over it is not lowered for nothing).
    * Under ``cap`` otherwise: kept.

    The last config lowered under ``cap`` is returned (its lowering is the one the compile reuses).
    None after :data:`CONFIRM_ROUNDS` rounds: every trial is lowered (:func:`verified_choice` as it
    is), with the lowerings done kept. ``trials`` holds the lowered trials only."""
    if not judge.lowers:
        return verified_choice(search_at, run, least, trials, cap)
    shift = 0  # how far the cap of the next round lies under ``cap`` (above, when negative)
    kept: tuple[Trial, str, SearchResult | None] | None = None
    below = False  # a lowering came out under its analysis
    kept_of = 1.0  # the least fraction of its analysis a lowering came out at
    for _ in range(CONFIRM_ROUNDS):
        start = len(trials)
        judge.lower = False
        try:
            config, how, found, _, lowest = verified_choice(
                lambda lowered, shift=shift: search_at(lowered + shift), run, least, trials, cap - shift)
        finally:
            judge.lower = True
        if config is None:
            config, how = lowest, "least memory"
        analysed = next((t for t in trials[start:] if t.answers(config)), None)
        del trials[start:]
        if analysed is None or tried(trials, config):
            break
        if kept is not None:  # a raised round: only a faster searched config is worth its lowering
            kept_s = kept[2].estimate.step_s if kept[1] == "searched" and kept[2] is not None else math.inf
            if how != "searched" or found is None or found.estimate.step_s > kept_s * (1 - RAISE_MIN_GAIN):
                break
        lowered = run(analysed.requested or config)  # as asked for: the trial says what the rewrite added
        gap = analysed.analysed_peak_bytes - lowered.analysed_peak_bytes
        below |= gap > AS_IS_MARGIN * cap
        kept_of = min(kept_of, lowered.analysed_peak_bytes / max(analysed.analysed_peak_bytes, 1))
        if lowered.analysed_peak_bytes <= cap:
            kept = (lowered, how, found)
            if gap <= AS_IS_MARGIN * cap:
                break
            shift = -gap
            continue
        if kept is not None:
            break
        log.info("protrain_fx: %s analysed at %d bytes peaks at %d in Inductor's allocation plan, over the cap of "
                 "%d: searched again under a lower cap", config, analysed.analysed_peak_bytes,
                 lowered.analysed_peak_bytes, cap)
        shift = max(shift + 1, lowered.analysed_peak_bytes - analysed.analysed_peak_bytes)
    if (below and as_is is not None and not as_is.by_inductor and not tried(trials, as_is.config)
            and as_is.analysed_peak_bytes * kept_of <= cap * (1 + AS_IS_LOWER_MARGIN)):
        plain = run(as_is.config)
        if plain.analysed_peak_bytes <= cap:
            return plain.config, "fits as is", None, plain.analysed_peak_bytes, plain.config
    if kept is not None:
        t, how, found = kept
        return t.config, how, found, t.analysed_peak_bytes, t.config
    return verified_choice(search_at, run, least, trials, cap)


#: Searches with a raised (or, after one analysed above the cap, lowered again) cap after a searched
#: config fitted (:func:`raised_choice`).
MAX_RAISES = 3


#: A raised search's config is tried only when the cost model predicts it at least this fraction
#: faster than the config that fitted (each try is a rewrite and an analysis of the whole step).
RAISE_MIN_GAIN = 0.02


def raised_choice(
    search_at: Callable[[int], SearchResult],
    run: Callable[[Counts], Trial],
    found: SearchResult,
    fitted: Trial,
    trials: list[Trial],
    cap: int,
) -> SearchResult:
    """The search result to keep after ``found.best`` (trial ``fitted``) analysed under ``cap``.

    The cost model's peak is an upper bound of the analysis' (it keeps gradients and optimizer
    state live for the whole step: ``docs/results.md#which-analysis-judges-a-plan``), so a plan it
    calls fitting may leave gigabytes unused that a faster plan could take. Up to
    :data:`MAX_RAISES` times: the search runs again with the cap raised by the fitted config's ratio
    of predicted to analysed peak (a config the model predicts at most ``cap * predicted / analysed``
    analyses under the cap if the ratio carries over; the ratio varies less across configs than the
    difference does: ``docs/results.md#the-raised-search``), and a config it finds that is predicted
    :data:`RAISE_MIN_GAIN` faster and was not tried is applied and analysed. Under the cap it is kept
    and the next raise starts from it. Above it, the search runs again with the raised cap lowered to
    just under that config's predicted peak (it, and every config the model puts at or above it,
    left out) and at the point where the line through the fitted config's and the overshooting
    config's (predicted, analysed) peaks reaches the cap (:func:`lowered_raise`), and so on,
    :data:`MAX_RAISES` searches in all; at the end the last config that fitted is applied again if
    another was tried after it (the record must hold its graphs). The analysis stays the judge:
    nothing is kept that it puts above the cap.

    Why lower rather than stop: the predicted-to-analysed ratio is not one number. The raised
    search's pick can analyse over the cap where a config the cost model puts a little lower
    analyses under it and runs faster than the config that first fitted."""
    applied = fitted.requested or fitted.config  # the config whose graphs the record holds, as asked for
    raise_by: int | None = None  # None: from the fitted config's ratio
    for _ in range(MAX_RAISES):
        if raise_by is None:
            margin = fitted.predicted_peak_bytes - fitted.analysed_peak_bytes
            if margin <= 0:
                break
            raise_by = math.ceil(margin * cap / max(fitted.analysed_peak_bytes, 1))
        try:
            raised = search_at(-raise_by)
        except NoPlanFits:
            break
        if raised.estimate.step_s > found.estimate.step_s * (1 - RAISE_MIN_GAIN) or tried(trials, raised.best):
            break
        t = run(raised.best)
        applied = raised.best
        if t.analysed_peak_bytes > cap:
            raise_by = lowered_raise(fitted, t, cap)
            if raise_by <= 0:
                break
            continue
        found, fitted, raise_by = raised, t, None
    if applied != found.best:
        run(found.best)
    return found


def lowered_raise(fitted: Trial, over: Trial, cap: int) -> int:
    """The raise of the next search after ``over`` (a raised config) analysed above ``cap``, where
    ``fitted`` analysed under it: to just under ``over``'s predicted peak (it, and every config the
    cost model puts at or above it, left out), and no higher than where the line through the two
    trials' (predicted, analysed) peaks puts an analysed peak of ``cap``.

    Why the line: stepping down just under the overshooting config moves one buffer per search,
    and the raises run out gigabytes short of the cap. Where the two trials differ from their
    analysis by about the same bytes, the line puts the next cap near the fastest config that
    fits in one search (``docs/results.md#the-raised-search``)."""
    top = over.predicted_peak_bytes - 1
    predicted_rise = over.predicted_peak_bytes - fitted.predicted_peak_bytes
    analysed_rise = over.analysed_peak_bytes - fitted.analysed_peak_bytes
    if predicted_rise > 0 and analysed_rise > 0:
        top = min(top, fitted.predicted_peak_bytes + (cap - fitted.analysed_peak_bytes) * predicted_rise // analysed_rise)
    return top - cap


def widened(budget: int, reserve: int) -> tuple[int, int]:
    """``(budget, reserve)`` for :func:`protrain_fx.search.search.search` with a reserve that may be negative
    (a cap raised above the budget by :func:`raised_choice`): the search takes no negative reserve, so
    the budget grows instead."""
    return (budget - reserve, 0) if reserve < 0 else (budget, reserve)
