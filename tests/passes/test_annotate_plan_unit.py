"""``annotate_plan`` on a hand-built joint graph: the plan's recompute / save tags written on the
forward nodes, which the min-cut partitioner then acts on (``tests/passes/graphs.py``: ``mm``,
``relu`` in ``blocks.0``; ``mm_1``, ``relu_1`` in ``blocks.1``)."""

from __future__ import annotations

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.passes.pipeline import PassContext, annotate_plan, run_passes
from protrain_fx.plan import Plan
from tests.passes.graphs import outputs, record_for, trace, two_blocks, two_blocks_viewed
from protrain_fx import settings

PARAMETERS = frozenset({"primals_1", "primals_2"})
RECOMPUTE, SAVE = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE


def _run(plan: Plan | None, fn=two_blocks):
    """The pass on the joint graph of ``fn`` before the partitioner; returns the record, the tags
    written (name -> (policy, ac_graph_id)) and the partitioned graphs."""
    seen = {}

    def on_joint(joint):
        record = seen["record"] = record_for(joint=joint)
        record.rewritten = run_passes([annotate_plan], PassContext(record, plan, PARAMETERS, 1))
        seen["tags"] = {n.name: (n.meta["recompute"], n.meta.get("ac_graph_id"))
                        for n in joint.graph.nodes if "recompute" in n.meta}

    _, forward, backward = trace(fn, on_joint=on_joint)
    return seen["record"], seen["tags"], forward, backward


def _saved(forward) -> list[str]:
    return [a.name for a in outputs(forward)[1:]]


def test_a_checkpointed_block_is_tagged_and_recomputed():
    record, tags, forward, backward = _run(Plan(blocks={"blocks.0": "checkpoint"}))
    assert tags == {"mm": (RECOMPUTE, 1), "relu": (RECOMPUTE, 1)}
    assert record.passes[0].summary == "2 forward nodes tagged (1 checkpointed block(s), 0 per-tensor override(s))"
    # the partitioner recomputed blocks.0 in backward: its output is no longer saved
    assert "relu" not in _saved(forward)
    assert [n.name for n in backward.graph.nodes if n.name in ("mm", "relu")] == ["mm", "relu"]


def test_each_block_gets_its_own_graph_id():
    _, tags, _, _ = _run(Plan(blocks={"blocks.0": "checkpoint", "blocks.1": "checkpoint"}))
    assert tags == {"mm": (RECOMPUTE, 1), "relu": (RECOMPUTE, 1), "mm_1": (RECOMPUTE, 2), "relu_1": (RECOMPUTE, 2)}


def test_a_checkpointed_block_handing_on_a_view_saves_its_base_for_the_next_checkpointed_block():
    """The partitioner saves the boundary between two checkpoint regions, but not a view (it
    recomputes views from their base): blocks.1's recompute would rerun blocks.0 too."""
    _, tags, forward, backward = _run(Plan(blocks={"blocks.0": "checkpoint", "blocks.1": "checkpoint"}),
                                      two_blocks_viewed)
    assert tags["relu"] == (SAVE, 1) and tags["mm"] == (RECOMPUTE, 1) and tags["mm_1"] == (RECOMPUTE, 2)
    assert "mm" not in {n.name for n in backward.graph.nodes}  # blocks.0 is not rerun
    assert {"relu", "view_1"} & set(_saved(forward))


def test_a_tensor_override_wins_over_its_block():
    record, tags, forward, _ = _run(Plan(blocks={"blocks.0": "checkpoint"}, tensors={"relu": "keep"}))
    assert tags == {"mm": (RECOMPUTE, 1), "relu": (SAVE, None)}
    assert "relu" in _saved(forward)
    assert "1 per-tensor override(s)" in record.passes[0].summary


def test_a_plan_that_changes_nothing_saves_as_without_one():
    record, tags, forward, _ = _run(Plan(blocks={"blocks.0": "none"}))
    assert tags == {}
    assert record.passes[0].summary.startswith("0 forward nodes tagged")
    _, _, plain, _ = _run(None)
    assert _saved(forward) == _saved(plain)


def test_nothing_to_do_without_a_plan():
    record, tags, forward, _ = _run(None)
    assert tags == {} and record.passes == []
    assert "relu" in _saved(forward)


def test_an_unknown_block_is_the_users_error():
    with pytest.raises(ValueError, match=r"unknown block.*blocks\.7.*in pass 'annotate_plan'"):
        _run(Plan(blocks={"blocks.7": "checkpoint"}))


def test_disabled_by_name(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_PASSES, "annotate_plan")
    record, tags, forward, _ = _run(Plan(blocks={"blocks.0": "checkpoint"}))
    assert tags == {} and record.passes == []
    assert "relu" in _saved(forward)
