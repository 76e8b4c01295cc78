"""``bench/loops.py``: the run specs (what each names, and those refused before anything runs) and the summary line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_loops", Path(__file__).parents[2] / "bench" / "loops.py")
loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loops)


def test_a_spec_names_model_size_loss_and_flags():
    run = loops.parse_run("gpt:760M:outside:offload+clip")
    assert (run["model"], run["size"], run["loss"]) == ("gpt", "760M", "outside")
    assert run["offload"] and run["clip"] and not run["inductor"] and not run["said"]
    assert loops.parse_run("gpt:13B:outside:offload+clip+said")["said"]
    assert loops.parse_run("gpt:4.2B:inside:offload+graph")["graph"] and not run["graph"]
    assert loops.parse_run("gpt:4.2B:outside:offload+clip+counts=4/3/6")["counts"] == (4, 3, 6)
    assert run["counts"] is None
    reference = loops.parse_run("gpt:350M:inside:inductor")
    assert reference["inductor"] and not reference["offload"]


@pytest.mark.parametrize(("spec", "named"), [
    ("gpt:350M", "MODEL:SIZE:LOSS"),
    ("bert:350M:inside", "model 'bert'"),
    ("gpt:350M:sideways", "loss 'sideways'"),
    ("gpt:350M:inside:fast", "flags ['fast']"),
    ("gpt:350M:inside:offload+inductor", "only through the protrain backend"),
    ("gpt:13B:outside:offload+said", "needs 'offload' and 'clip'"),
    ("gpt:350M:inside:inductor+graph", "judges plans"),
    ("gpt:4.2B:inside:offload+counts=4/3", "counts=N_PERSIST/N_BUFFER/N_GPU_OPTIM"),
    ("gpt:4.2B:inside:offload+counts=a/b/c", "counts=N_PERSIST/N_BUFFER/N_GPU_OPTIM"),
    ("gpt:4.2B:inside:clip+counts=4/3/6", "needs 'offload'"),
])
def test_a_bad_spec_is_refused_naming_what_is_wrong(spec, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        loops.parse_run(spec)


def test_the_summary_line_sets_steps_beside_a_compile_against_those_after_it():
    steps = [{"s": 30.0, "since_launch_s": 40.0}, {"s": 2.0, "beside": True}, {"s": 4.0, "beside": True},
             {"s": 3.0, "beside": True}, {"s": 1.0}, {"s": 1.5, "since_launch_s": 60.0}]
    run = {"spec": "gpt:4.2B:outside:offload", "status": "ok", "steps": steps, "tokens_per_s": 6000.0,
           "recompiles": 1, "wall_s": 70.0}
    line = loops._line(run)
    assert "3 step(s) beside a compile (median 3.00 s against 1.25 s after it)" in line, line
    del run["steps"][1:4]
    assert "beside" not in loops._line(run)
