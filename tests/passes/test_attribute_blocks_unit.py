"""``attribute_blocks`` on the hand-built two-block step (``tests/passes/graphs.py``): the block and
phase of every node, from the module metadata of the forward nodes alone."""

from __future__ import annotations

import pytest

from protrain_fx import meta
from protrain_fx.passes.pipeline import PassContext, attribute_blocks, run_passes
from tests.passes.graphs import graph_text, record_for, trace
from protrain_fx import settings


def _blocks(gm) -> dict[str, str]:
    return {n.name: n.meta.get(meta.BLOCK) for n in gm.graph.nodes if n.op != "output"}


def test_every_node_gets_its_block_and_phase():
    _, forward, backward = trace()
    record = record_for(forward, backward)
    record.rewritten = run_passes([attribute_blocks], PassContext(record))

    assert (record.blocks.container, record.blocks.layer_class) == ("blocks", "Block")
    assert record.blocks.labels == ("blocks.0", "blocks.1")
    fw, bw = _blocks(forward), _blocks(backward)
    # forward: the module stack decides; a placeholder takes its users' block; the loss is outside
    assert {k: fw[k] for k in ("mm", "relu", "mm_1", "relu_1", "sum_1")} == {
        "mm": "blocks.0", "relu": "blocks.0", "mm_1": "blocks.1", "relu_1": "blocks.1", "sum_1": meta.OUTSIDE}
    assert fw["primals_1"] == "blocks.0"  # read by blocks.0 alone
    assert fw["primals_2"] == meta.OUTSIDE  # read by blocks.1 and by the saved transpose (outside)
    # backward: the forward op with the same seq_nr decides (no module stack there)
    assert bw["threshold_backward"] == "blocks.1" and bw["mm_3"] == "blocks.1"
    assert bw["threshold_backward_1"] == "blocks.0" and bw["mm_4"] == "blocks.0"
    assert bw["tangents_1"] == meta.OUTSIDE and bw["expand"] == meta.OUTSIDE
    assert {n.meta[meta.PHASE] for n in forward.graph.nodes} == {"forward"}
    assert {n.meta[meta.PHASE] for n in backward.graph.nodes} == {"backward"}
    (line,) = record.passes
    assert (line.name, line.summary) == ("attribute_blocks", "2 blocks of Block under blocks")


def test_it_only_writes_metadata():
    _, forward, backward = trace()
    before = graph_text(forward, backward)
    run_passes([attribute_blocks], PassContext(record_for(forward, backward)))
    assert graph_text(forward, backward) == before


def test_a_graph_without_repeated_layers_is_all_outside():
    _, forward, backward = trace()
    for gm in (forward, backward):
        for node in gm.graph.nodes:
            node.meta.pop("nn_module_stack", None)
    record = record_for(forward, backward)
    record.rewritten = run_passes([attribute_blocks], PassContext(record))
    assert record.blocks.labels == ()
    assert set(_blocks(forward).values()) == set(_blocks(backward).values()) == {meta.OUTSIDE}
    assert record.passes[0].summary == "0 blocks of - under -"


def test_an_inference_graph_is_attributed_as_the_forward():
    _, forward, _ = trace()
    record = record_for(inference=forward)
    record.rewritten = run_passes([attribute_blocks], PassContext(record))
    assert _blocks(forward)["mm_1"] == "blocks.1"
    assert record.blocks.labels == ("blocks.0", "blocks.1")


def test_an_analysis_cannot_be_disabled(monkeypatch):
    """Every later pass reads the blocks: naming it in PROTRAIN_DISABLE_PASSES is refused."""
    monkeypatch.setenv(settings.DISABLE_PASSES, "attribute_blocks")
    _, forward, backward = trace()
    with pytest.raises(ValueError, match="attribute_blocks cannot be disabled"):
        run_passes([attribute_blocks], PassContext(record_for(forward, backward)))
