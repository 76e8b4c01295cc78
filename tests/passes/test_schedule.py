"""The pass schedule (``passes/pipeline.py``): each pass declares what it reads and writes, and each
list of passes is checked against it when the package loads."""

from __future__ import annotations

import pytest

from protrain_fx.passes import pipeline


def test_every_pass_declares_what_it_reads_and_writes():
    for fn in (*pipeline.JOINT_PASSES, *pipeline.STEP_PASSES, *pipeline.LOWERED_PASSES):
        assert isinstance(fn.reads, frozenset) and fn.writes, fn.__name__


def test_a_pass_before_what_it_reads_is_refused_naming_it():
    swapped_first = (pipeline.attribute_blocks, pipeline.swap_activations, pipeline.gather_chunks,
                     pipeline.analyze_memory)
    with pytest.raises(RuntimeError, match=r"swap_activations reads graphs:gathered, which no pass before it"):
        pipeline.check_schedule(swapped_first, frozenset({"forward", "backward", "step"}), "STEP_PASSES")
    with pytest.raises(RuntimeError, match="analyze_memory reads blocks"):
        pipeline.check_schedule((pipeline.analyze_memory,), frozenset({"forward", "backward", "step"}), "x")
    tags_first = (pipeline.annotate_plan, pipeline.recompute_param_casts)
    with pytest.raises(RuntimeError, match="annotate_plan reads joint:casts recomputed"):
        pipeline.check_schedule(tags_first, frozenset({"joint"}), "JOINT_PASSES")


def test_the_shipped_schedule_provides_what_the_lowered_passes_read():
    step = pipeline.check_schedule(pipeline.STEP_PASSES, frozenset({"forward", "backward", "step"}), "STEP_PASSES")
    assert {"blocks", "gathered", "swapped", "memory"} <= step
    pipeline.check_schedule(pipeline.LOWERED_PASSES, step | {"inductor_plans"}, "LOWERED_PASSES")
