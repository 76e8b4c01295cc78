"""bench/auto_replay.py, the prediction check, on runs built here: --summary (each first plan as predicted
then and as replayed now) and --phases (the compute estimate per phase, the fit of one scale)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts
from tests.search.test_cost_search import make_problem

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("bench_auto_replay", ROOT / "bench" / "auto_replay.py")
auto_replay = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(auto_replay)


def _run(problem, config, predicted_s, steps, replan=None):
    return {"size": "tiny", "cap_gib": 8, "step_s": sorted(steps)[len(steps) // 2], "step_times_s": steps,
            "breakdown": [{}], "auto_plan": {"problem": problem.to_dict(), "config": config.to_dict(),
                                             "predicted_step_s": predicted_s, "replan": replan}}


def test_the_summary_replays_each_recorded_first_plan_and_names_the_means(tmp_path):
    problem = make_problem(5, n_blocks=4)
    with_steps, without = Counts(1, 2, 0, 0, 1), Counts(1, 2, 0, 0, 0)
    model = CostModel(problem)
    now = model.estimate(with_steps).step_s
    runs = [
        _run(problem, with_steps, 0.9 * now, [now / 1.1] * 3),  # predicted then 10% under now; measured
        # re-planned at call 9: only the calls before it count (the first 5 of the bench's steps; the median of all 11 is 9x)
        _run(problem, with_steps, now, [now] * 5 + [9 * now] * 6, replan={"calls": [9, 14]}),
        _run(problem, without, model.estimate(without).step_s, [model.estimate(without).step_s] * 3),
    ]
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(runs))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "auto_replay.py"), "--summary", str(path)],
                         check=True, cwd=ROOT, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if "predicted then" in line]
    assert len(lines) == 3
    errors = [tuple(float(x) for x in re.findall(r"\(\s*([+-][\d.]+)%\)", line)) for line in lines]
    assert errors[0] == (-1.0, 10.0)  # 0.9 * 1.1 - 1 and 1.1 - 1
    assert errors[1] == (0.0, 0.0)  # the re-planned calls left out
    assert errors[2] == (0.0, 0.0)
    assert "2 runs with device steps: mean error then -0.50%, now +5.00%" in out
    assert "1 runs without device steps: mean error then +0.00%, now +0.00%" in out


def test_phases_tabulates_the_on_device_runs_and_their_spread(tmp_path):
    # --phases: every run that kept every chunk on the device has a well-formed row (offloaded runs are
    # left out), and a size with three plain runs or more a spread line
    problem = make_problem(3)
    kept = Counts(n_persist=len(problem.chunks), n_buffer=0, n_swap=0, n_checkpoint=0)
    est = CostModel(problem).estimate(kept)
    runs = []
    for scale in (1.0, 1.1, 0.9):
        run = _run(problem, kept, est.step_s, [scale * est.step_s] * 3)
        run["size"] = "x"
        run["breakdown"] = [{"forward_s": scale * est.fwd_s, "backward_s": scale * est.bwd_s}] * 3
        runs.append(run)
    offloaded = _run(problem, Counts(0, 2, 0, 0), est.step_s, [est.step_s] * 3)
    offloaded["breakdown"] = [{"forward_s": est.fwd_s, "backward_s": est.bwd_s}] * 3
    path = tmp_path / "peers.json"
    path.write_text(json.dumps([*runs, offloaded]))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "auto_replay.py"), "--phases", str(path)],
                         check=True, cwd=ROOT, capture_output=True, text=True).stdout
    rows = re.findall(r"^peers\.json\s+(\S+)\s+\d+ GiB ck\s+(\d+)\s+fwd\s+([\d.]+) /\s+([\d.]+) \(\s*([+-][\d.]+)%\)",
                      out, re.M)
    assert len(rows) == 3
    for size, ck, pred, meas, err in rows:
        p, m = float(pred), float(meas)  # printed to 0.1 ms: the error's rounding allowed for
        assert float(err) == pytest.approx(100 * (p / m - 1), abs=100 * 0.05 * (1 / p + 1 / m) * p / m + 0.05)
    assert [float(e) for *_, e in rows] == pytest.approx([0.0, 100 * (1 / 1.1 - 1), 100 * (1 / 0.9 - 1)], abs=0.1)
    assert re.search(r"^\s+x over 3 runs: fwd: measured [\d.]+ \(sd [\d.]+%\), predicted", out, re.M)


def test_phases_reprice_a_reread_run_with_the_times_read_after_training(tmp_path):
    # an on-device run whose products were read again: each phase's cached sum is replaced by the new one

    problem = make_problem(3)
    config = Counts(n_persist=len(problem.chunks), n_buffer=0, n_swap=0, n_checkpoint=0)
    est = CostModel(problem).estimate(config)
    run = _run(problem, config, est.step_s, [0.2, 0.2, 0.2])
    run["breakdown"] = [{"forward_s": 0.05, "backward_s": 0.1}] * 3
    run["reread"] = {"op_sums_s": {"cached": [0.03, 0.06], "events": [0.031, 0.058], "prefilled": [0.025, 0.05]}}
    path = tmp_path / "run_peers.json"
    # a compile that scaled its node times (profiler.IN_STEP_SCALE) scales the replaced sums too
    scaled = {**run, "reread": {**run["reread"], "compute_scale": 2.0}}
    path.write_text(json.dumps([run, {**run, "reread": None}, scaled]))
    with_reread, without, twice = auto_replay.phase_rows([str(path)])
    assert "prefilled" not in without
    assert with_reread["prefilled"] == pytest.approx((est.fwd_s - 0.005, est.bwd_s - 0.01, est.step_s - 0.015))
    assert with_reread["events"] == pytest.approx((est.fwd_s + 0.001, est.bwd_s - 0.002, est.step_s - 0.001))
    assert twice["prefilled"] == pytest.approx((est.fwd_s - 0.01, est.bwd_s - 0.02, est.step_s - 0.03))
    # the phases at the prefilled times before any scale: what phase_scales fits a scale to
    assert with_reread["unscaled"] == pytest.approx((est.fwd_s - 0.005, est.bwd_s - 0.01))
    assert twice["unscaled"] == pytest.approx((est.fwd_s / 2 - 0.005, est.bwd_s / 2 - 0.01))


def test_phase_scales_fits_per_phase_ratios_and_prices_each_run_left_out(capsys):
    # runs whose forward took 1.2x its unscaled price and backward exactly its price: the per-phase
    # scales fitted on the others price every left-out run exactly, one shared scale does not

    table = []
    for f, b in ((0.010, 0.020), (0.020, 0.050), (0.030, 0.060), (0.015, 0.045)):
        fwd, bwd = 1.2 * f, b
        table.append({"size": "x", "unscaled": (f, b), "fwd": (f, fwd), "bwd": (b, bwd),
                      "step": (f + b + 0.003, fwd + bwd + 0.003)})
    table.append({"size": "y", "fwd": (1, 1), "bwd": (1, 1), "step": (2, 2)})  # no reread: left out
    auto_replay.phase_scales(table)
    out = capsys.readouterr().out
    assert "over 4 reread runs: fwd 1.200 (sd 0.000); bwd 1.000 (sd 0.000)" in out
    one, per = re.search(r"one scale: step ([\d.]+)%, phases ([\d.]+)%; per phase: step ([\d.]+)%, phases ([\d.]+)%",
                         out).group(1, 3)
    assert float(per) == 0 and float(one) > 0.1
