"""``bench/loops.py``'s run specs: what each names, and the specs it refuses before anything runs."""

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
