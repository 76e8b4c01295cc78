"""``recompute_param_casts`` on a hand-built joint graph: the bf16 casts of an offloaded model's
weights (and their views) are tagged for recompute, so the partitioner saves the weight (a shell
without bytes) and recasts it in backward instead of saving the cast."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.passes.pipeline import PassContext, recompute_param_casts, run_passes
from tests.passes.graphs import offloaded_mlp, outputs, record_for, trace
from protrain_fx import settings

WIDTH = 64
PARAMETERS = frozenset({"primals_1", "primals_2"})


def _bf16_step(w0, w1, x):
    h = torch.relu(x @ w0.to(torch.bfloat16).t())
    return torch.relu(h @ w1.to(torch.bfloat16)).float().sum()


def _run(real_inputs):
    """Trace the step, run the pass on its joint graph before the partitioner; returns the
    record, the recompute tags the joint graph ended with, and the partitioned graphs."""
    seen = {}

    def on_joint(joint):
        record = seen["record"] = record_for(joint=joint, example_inputs=tuple(real_inputs))
        record.rewritten = run_passes([recompute_param_casts], PassContext(record, None, PARAMETERS, 1))
        seen["tags"] = {n.name: n.meta["recompute"] for n in joint.graph.nodes if n.meta.get("recompute")}

    inputs = (torch.randn(WIDTH, WIDTH, requires_grad=True), torch.randn(WIDTH, WIDTH, requires_grad=True),
              torch.randn(8, WIDTH, dtype=torch.bfloat16))
    _, forward, backward = trace(_bf16_step, inputs, on_joint=on_joint)
    return seen["record"], seen["tags"], forward, backward


def _saved_casts(forward) -> list[str]:
    """Saved values that are a weight's cast, or a view of one (the transpose a product saves)."""
    found = []
    for value in outputs(forward)[1:]:
        node, cast = value, False
        while node.target in (torch.ops.aten._to_copy.default, torch.ops.aten.t.default):
            cast = cast or node.target is torch.ops.aten._to_copy.default
            node = node.args[0]
        if cast and node.name in PARAMETERS:
            found.append(value.name)
    return found


def test_casts_of_offloaded_weights_and_their_views_are_recomputed():
    model, handle, weights = offloaded_mlp(WIDTH)
    record, tags, forward, backward = _run([*weights, torch.zeros(8, WIDTH)])
    # w0's cast and its transpose, w1's cast: nothing else (the batch's and the loss's casts stay)
    assert tags == {"_to_copy": CheckpointPolicy.MUST_RECOMPUTE, "t": CheckpointPolicy.MUST_RECOMPUTE,
                    "_to_copy_1": CheckpointPolicy.MUST_RECOMPUTE}
    assert record.passes[0].summary == "3 parameter casts and views of them recomputed in backward"
    # the partitioner acted on them: the weight is saved, its cast made again in backward
    assert _saved_casts(forward) == []
    assert "primals_2" in [a.name for a in outputs(forward)[1:]]
    recast = [n for n in backward.graph.nodes if n.target is torch.ops.aten._to_copy.default
              and n.args[0].name == "primals_2"]
    assert len(recast) == 1


def test_nothing_to_do_without_an_offload_handle():
    """Plain tensors as the graph's inputs: no tag, no line, and the partitioner saves the cast."""
    inputs = [torch.randn(WIDTH, WIDTH), torch.randn(WIDTH, WIDTH), torch.zeros(8, WIDTH)]
    record, tags, forward, _ = _run(inputs)
    assert tags == {} and record.passes == []
    assert _saved_casts(forward) != []


def test_nothing_to_do_without_a_joint_graph():
    model, handle, weights = offloaded_mlp(WIDTH)
    record = record_for(example_inputs=tuple(weights))
    assert recompute_param_casts(PassContext(record, None, PARAMETERS, 1)) is None


def test_disabled_by_name(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_PASSES, "recompute_param_casts")
    model, handle, weights = offloaded_mlp(WIDTH)
    record, tags, forward, _ = _run([*weights, torch.zeros(8, WIDTH)])
    assert tags == {} and record.passes == []
    assert _saved_casts(forward) != []
