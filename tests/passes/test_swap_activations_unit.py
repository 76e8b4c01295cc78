"""``swap_activations`` on hand-built partitioned graphs (``tests/passes/graphs.py``; one 512x512
fp32 value is 1 MiB): the saved values of a swapped block leave through ``offload`` and come back
through ``reload`` before their first use in backward."""

from __future__ import annotations

import pytest
import torch

from protrain_fx import meta
from protrain_fx.passes.pipeline import PassContext, analyze_memory, attribute_blocks, run_passes, swap_activations
from protrain_fx.plan import Plan
from tests.passes.graphs import MiB, count, graph_text, nodes_made_by, outputs, record_for, trace
from protrain_fx import settings

ops = torch.ops.protrain


def _run(plan: Plan | None, passes=(attribute_blocks, swap_activations)):
    _, forward, backward = trace()
    record = record_for(forward, backward)
    record.rewritten = run_passes(list(passes), PassContext(record, plan))
    return record, forward, backward


def test_a_swapped_blocks_saved_value_goes_to_the_host_and_back():
    record, forward, backward = _run(Plan(blocks={"blocks.0": "swap"}))
    (swapped,) = record.swapped
    assert (swapped.name, swapped.members, swapped.block, swapped.nbytes) == ("relu", ("relu",), "blocks.0", MiB)
    # forward: the copy starts after relu's last forward use and replaces it among the saved values
    (offload,) = [n for n in forward.graph.nodes if n.target is ops.offload.default]
    assert offload.args[0].name == "relu" and swapped.offload_after == "mm_1"
    assert offload in outputs(forward) and "relu" not in [getattr(a, "name", None) for a in outputs(forward)]
    assert count(forward, ops.offload_wait.default) == 1
    assert "detach_2" in [getattr(a, "name", None) for a in outputs(forward)]  # blocks.1's value stays
    # backward: the input now holds the host copy, reloaded and waited for before its first use
    (reload,) = [n for n in backward.graph.nodes if n.target is ops.reload.default]
    (wait,) = [n for n in backward.graph.nodes if n.target is ops.reload_wait.default]
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    first_use = next(n for n in backward.graph.nodes if n.name == swapped.first_use)
    assert order[reload] < order[wait] < order[first_use]
    assert reload.args[0].op == "placeholder" and reload.args[0].name == offload.name
    assert not any(n.name == "relu" for n in backward.graph.nodes)  # every reader reads the reload
    made = nodes_made_by(forward, "swap_pass") + nodes_made_by(backward, "swap_pass")
    assert [n.meta[meta.BLOCK] for n in made] == ["blocks.0"] * 4
    assert record.passes[-1].summary == "1 saved values (1.0 MiB) offloaded to host memory and reloaded for backward"


def test_a_tensor_override_swaps_one_value_without_blocks():
    _, forward, backward = trace()
    record = record_for(forward, backward)
    plan = Plan(blocks={}, tensors={"relu": "swap"})
    # no blocks attributed: the override alone
    record.rewritten = run_passes([swap_activations], PassContext(record, plan))
    assert [s.name for s in record.swapped] == ["relu"]


def test_a_value_the_backward_does_not_take_is_refused():
    with pytest.raises(ValueError, match=r"cannot swap \['sum_1'\].*in pass 'swap_activations'"):
        _run(Plan(blocks={}, tensors={"sum_1": "swap"}))


def test_the_memory_analysis_counts_the_swapped_value_off_the_device():
    kept, _, _ = _run(Plan(blocks={"blocks.0": "checkpoint"}), (attribute_blocks, swap_activations, analyze_memory))
    swapped, _, _ = _run(Plan(blocks={"blocks.0": "swap"}), (attribute_blocks, swap_activations, analyze_memory))
    assert kept.memory.saved_activation_bytes == 2 * MiB  # relu and relu_1
    assert swapped.memory.saved_activation_bytes == 1 * MiB


@pytest.mark.parametrize("plan", [None, Plan(blocks={"blocks.0": "checkpoint"})])
def test_nothing_to_do_without_a_swap(plan):
    _, forward, backward = trace()
    before = graph_text(forward, backward)
    record = record_for(forward, backward)
    record.rewritten = run_passes([attribute_blocks, swap_activations], PassContext(record, plan))
    assert graph_text(forward, backward) == before
    assert record.swapped == [] and [p.name for p in record.passes] == ["attribute_blocks"]


def test_disabled_by_name(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_PASSES, "swap_activations")
    record, forward, backward = _run(Plan(blocks={"blocks.0": "swap"}))
    assert record.swapped == []
    assert count(forward, ops.offload.default) == count(backward, ops.reload.default) == 0
