"""bench/tensor_refinement_bound.py: the most a finer activation plan could save in a run's slack."""

import sys
from pathlib import Path

import pytest

from protrain_fx.cost import Config, CostModel
from tests.test_cost_search import make_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
try:
    import tensor_refinement_bound as bench
finally:
    sys.path.pop(0)


def _record(problem, config, cap, analysed):
    return {"size": "tiny", "cap_gib": 1, "auto_plan": {
        "problem": problem.to_dict(), "config": config.to_dict(), "allocated_cap_bytes": cap,
        "analysed_peak_bytes": analysed, "cost_model_peak_bytes": analysed + 10, "predicted_step_s": 1.0}}


def test_the_slack_is_filled_by_the_most_recompute_per_byte_first():
    problem = make_problem(3, n_blocks=5)
    config = Config(0, 2, 0, 5, 0)  # every block checkpointed
    model = CostModel(problem)
    recompute = model.recomputes(0, 5)
    kept = [b.saved_bytes - b.checkpoint_saved_bytes for b in problem.blocks]
    order = sorted(range(5), key=lambda i: -recompute[i] / kept[i])
    first, second = order[0], order[1]
    # slack: the first block whole and half of the second
    got = bench.bound(_record(problem, config, 10**12, 10**12 - kept[first] - kept[second] // 2))
    assert got["whole_blocks"] == 1 and got["checkpointed"] == 5
    assert got["saving_s"] == pytest.approx(recompute[first] + recompute[second] * (kept[second] // 2) / kept[second])
    # no slack (the judged peak at the cap or above): nothing to save
    assert bench.bound(_record(problem, config, 10**12, 10**12 + 5))["saving_s"] == 0.0
    # no checkpointed block: nothing to refine
    none = bench.bound(_record(problem, Config(0, 2, 0, 0, 0), 10**12, 10**9))
    assert none["checkpointed"] == 0 and none["saving_s"] == 0.0
    assert bench.bound({"size": "x"}) is None  # not an automatic run
