"""``planner.verify.confirmed_choice`` and ``judged_as_is`` on a made-up step: which configs are
lowered (``verify="inductor"``) and which are judged by the graph-level analysis alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protrain_fx.planner import verify
from protrain_fx.planner.judged import Judge
from protrain_fx.search.problem import Counts
from protrain_fx.search.search import NoPlanFits, SearchResult

#: n_checkpoint -> (the cost model's peak, the graph-level analysis' peak, Inductor's plan's peak):
#: the cost model is an upper bound of the analysis; Inductor's plan of one config (1 block
#: checkpointed) is 8 bytes above its analysis, as a lowering can be.
PEAKS = {k: (100 - 10 * k, 95 - 10 * k, 95 - 10 * k + (8 if k == 1 else 0)) for k in range(5)}
CAP = 85


def _config(k: int) -> Counts:
    return Counts(1, 0, 0, k)


def _search_at(lowered: int) -> SearchResult:
    """The fastest config (the fewest blocks checkpointed) the cost model puts under the cap lowered."""
    fitting = [k for k, (predicted, _, _) in PEAKS.items() if predicted <= CAP - lowered]
    if not fitting:
        raise NoPlanFits("nothing fits", min_budget_bytes=0)
    k = min(fitting)
    return SearchResult(_config(k), SimpleNamespace(step_s=1 + 0.1 * k, peak_bytes=PEAKS[k][0]), 1, 0, 0, 5, 0.0)


def _judge(lowers: bool) -> tuple[Judge, list[tuple[int, bool]]]:
    """A judge of the made-up step, and the (n_checkpoint, lowered) of every judgment run."""
    runs: list[tuple[int, bool]] = []

    def judge_now(lower: bool) -> tuple[int, bool]:
        k = judge.holding.n_checkpoint
        runs.append((k, lower))
        return (PEAKS[k][2], True) if lower and lowers else (PEAKS[k][1], False)

    judge = Judge({}, lambda c: str(c.n_checkpoint), lambda c: c, judge_now, lambda c: PEAKS[c.n_checkpoint][0],
                  lowers=lowers)
    return judge, runs


def _choose(judge: Judge) -> tuple[Counts | None, list[verify.Trial]]:
    trials: list[verify.Trial] = []

    def run(config: Counts) -> verify.Trial:
        t = judge(config)
        trials.append(t)
        return t

    config, *_ = verify.confirmed_choice(_search_at, run, [_config(4)], trials, CAP, judge)
    return config, trials


def test_only_the_configs_it_would_keep_are_lowered_and_an_overshoot_lowers_the_cap():
    judge, runs = _judge(lowers=True)
    config, trials = _choose(judge)
    # the analysis alone would keep 1 block checkpointed (85 <= 85); Inductor's plan of it is 93, so
    # the cap is lowered by 8 and the analysis keeps 2 (75), whose lowering fits
    assert config == _config(2)
    assert [k for k, lower in runs if lower] == [1, 2]
    assert [(t.config.n_checkpoint, t.analysed_peak_bytes, t.by_inductor) for t in trials] == [(1, 93, True), (2, 75, True)]
    assert judge.lowered == 2 and judge.kept.keys() == {"1", "2"}  # only lowered judgments are kept
    assert judge.holding == _config(2)  # the record holds the chosen plan's graphs


def test_every_trial_is_lowered_and_chooses_the_same_when_lowering_is_all_there_is():
    judge, runs = _judge(lowers=True)
    lowered_only: list[verify.Trial] = []

    def run(config: Counts) -> verify.Trial:
        t = judge(config)
        lowered_only.append(t)
        return t

    config, *_ = verify.verified_choice(_search_at, run, [_config(4)], lowered_only, CAP)
    assert config == _config(2) and all(lower for _, lower in runs)
    assert judge.lowered >= 2  # here no fewer than confirmed_choice's


def test_without_inductor_the_analysis_judges_every_trial_as_before():
    judge, runs = _judge(lowers=False)
    config, trials = _choose(judge)
    assert config == _config(1)  # the analysis is the judge: 85 fits
    assert all(not t.by_inductor for t in trials)


def test_a_step_far_over_the_cap_is_not_lowered_to_be_judged_as_it_is():
    judge, runs = _judge(lowers=True)
    far = verify.judged_as_is(judge, _config(0), CAP)  # 95 analysed: over 85 by more than the margin
    assert far.analysed_peak_bytes == 95 and not far.by_inductor and runs == [(0, False)]
    near = verify.judged_as_is(judge, _config(0), 92)  # within the margin: lowered
    assert near.by_inductor and runs[-1] == (0, True)


def _below_step(as_is_analysed: int) -> tuple[Counts | None, str, list[tuple[int, bool]]]:
    """A made-up step whose Inductor plans sit 10 bytes under their analysis (more than
    ``AS_IS_MARGIN`` of the cap: a loss fused away), with the step as it is analysed at
    ``as_is_analysed``; the choice and the (n_checkpoint, lowered) of every judgment run."""
    peaks = {k: (100 - 10 * k, 95 - 10 * k, 85 - 10 * k) for k in range(1, 5)}
    peaks[0] = (as_is_analysed + 5, as_is_analysed, as_is_analysed - 10)
    runs: list[tuple[int, bool]] = []

    def judge_now(lower: bool) -> tuple[int, bool]:
        k = judge.holding.n_checkpoint
        runs.append((k, lower))
        return (peaks[k][2], True) if lower else (peaks[k][1], False)

    judge = Judge({}, lambda c: str(c.n_checkpoint), lambda c: c, judge_now, lambda c: peaks[c.n_checkpoint][0],
                  lowers=True)

    def search_at(lowered: int) -> SearchResult:
        fitting = [k for k, (predicted, _, _) in peaks.items() if k and predicted <= CAP - lowered]
        if not fitting:
            raise NoPlanFits("nothing fits", min_budget_bytes=0)
        k = min(fitting)
        return SearchResult(_config(k), SimpleNamespace(step_s=1 + 0.1 * k, peak_bytes=peaks[k][0]), 1, 0, 0, 5, 0.0)

    trials: list[verify.Trial] = []

    def run(config: Counts) -> verify.Trial:
        t = judge(config)
        trials.append(t)
        return t

    as_is = verify.judged_as_is(judge, _config(0), CAP)
    config, how, *_ = verify.confirmed_choice(search_at, run, [_config(4)], trials, CAP, judge, as_is=as_is)
    return config, how, runs


def test_the_step_as_it_is_is_lowered_only_when_the_saving_seen_would_bring_it_under_the_cap():
    # analysed at 95, 10 over the cap: the lowerings came out 10 under their analysis, so it is lowered (85: fits)
    config, how, runs = _below_step(95)
    assert (config, how) == (_config(0), "fits as is") and (0, True) in runs
    # analysed at 200: no saving seen brings it under the cap; a lowering of it would be a minute for nothing
    config, how, runs = _below_step(200)
    assert config is not None and config.n_checkpoint > 0 and how != "fits as is"
    assert (0, True) not in runs


def _promised(better: int, ran: int = 3, as_is_peak: int = 200, cap: int = CAP):
    """``faster_after_first_step`` for a graph whose first step ran ``n_checkpoint=ran`` and found
    ``better`` faster: the choice, the judgments run and the log records."""
    from protrain_fx.state import STATE

    judge, runs = _judge(lowers=True)
    record = SimpleNamespace(memory=SimpleNamespace(device="cuda:0"), dynamo_code="code", index=1)
    STATE.faster_plan[("cuda:0", "code")] = (_config(ran), "searched", _config(better))
    trials: list[verify.Trial] = []

    def run(config: Counts) -> verify.Trial:
        t = judge(config)
        trials.append(t)
        return t

    as_is = verify.Trial(_config(0), as_is_peak, as_is_peak)
    try:
        return verify.faster_after_first_step(record, run, judge, cap, as_is), runs, trials
    finally:
        assert ("cuda:0", "code") not in STATE.faster_plan  # taken once
        STATE.faster_plan.clear()


def test_a_replan_for_speed_judges_the_plan_it_was_promised_first_and_keeps_it_when_it_fits():
    choice, runs, _ = _promised(better=2)  # Inductor's plan of 2 blocks checkpointed: 75, under 85
    assert choice == (_config(2), "searched")
    assert runs == [(2, False), (2, True)]  # analysed, then lowered: the search never runs


def test_a_replan_for_speed_keeps_the_plan_that_ran_when_the_promised_one_does_not_fit():
    choice, runs, trials = _promised(better=1)  # Inductor's plan of 1 block checkpointed: 93, over 85
    assert choice == (_config(3), "searched")
    assert [(k, lower) for k, lower in runs] == [(1, False), (1, True), (3, True)]
    assert [t.config for t in trials] == [_config(1), _config(3)]


def test_a_promised_plan_far_over_the_cap_is_not_lowered():
    choice, runs, _ = _promised(better=1, cap=60)  # analysed at 85, over 60 by more than the margin
    assert runs == [(1, False), (3, True)] and choice is None  # the plan that ran (65) no longer fits: search


def test_a_replan_for_speed_takes_the_step_as_it_is_when_it_fits_and_runs_nothing_without_a_promise():
    choice, runs, _ = _promised(better=2, as_is_peak=80)
    assert choice == (_config(0), "fits as is") and runs == []
    judge, runs = _judge(lowers=True)
    record = SimpleNamespace(memory=SimpleNamespace(device="cuda:0"), dynamo_code="other", index=1)
    assert verify.faster_after_first_step(record, judge, judge, CAP, verify.Trial(_config(0), 80, 80)) is None


def test_a_promised_plan_the_placed_buffers_cannot_run_keeps_the_plan_that_ran():
    from protrain_fx.state import STATE

    judge, runs = _judge(lowers=True)

    def rewrite(config):
        if config.n_checkpoint == 2:
            raise ValueError("needs more chunk buffers than placed")
        return config

    judge.rewrite = rewrite
    record = SimpleNamespace(memory=SimpleNamespace(device="cuda:0"), dynamo_code="code", index=1)
    STATE.faster_plan[("cuda:0", "code")] = (_config(3), "searched", _config(2))

    def run(config):  # as choose_for_placed's run: a rewrite that cannot run is a trial over every cap
        try:
            return judge(config)
        except ValueError:
            judge.holding = None
            return verify.Trial(config, 0, 2**63 - 1)

    as_is = verify.Trial(_config(0), 200, 200)
    assert verify.faster_after_first_step(record, run, judge, CAP, as_is) == (_config(3), "searched")
    assert runs == [(3, True)]  # nothing of the promised plan was judged, nor lowered


def test_a_faster_plan_after_the_first_step_must_fit_under_the_least_margin_the_judged_trials_showed():
    """The cost model's peak of a plan never judged is held to the cap scaled by the least ratio of
    cost-model to judged peak among the plans judged the same way (lowered, or analysed), not the
    chosen plan's alone: a promise that its lowering then finds over the cap costs a compile that
    keeps nothing."""
    from protrain_fx.planner.first_step import _least_margin
    from protrain_fx.planner.verify import Trial

    config = Counts(2, 1, 0, 3)
    trials = [Trial(config, 120, 100, by_inductor=True), Trial(config, 105, 100, by_inductor=True),
              Trial(config, 90, 100, by_inductor=False)]  # judged by the analysis: not this judge's margin
    auto = SimpleNamespace(judged_by="inductor", predicted_peak_bytes=1200, analysed_peak_bytes=1000, trials=trials)
    assert _least_margin(auto) == pytest.approx(1.05)
    auto.trials = trials[:1]
    assert _least_margin(auto) == pytest.approx(1.2)
    auto.trials = [Trial(config, 95, 100, by_inductor=True)]  # a cost model under the judged peak tightens the cap
    assert _least_margin(auto) == pytest.approx(0.95)
