"""``gather_chunks`` on hand-built partitioned graphs whose parameter inputs an offload handle holds
(a two-block MLP, one chunk per block, on the CPU): every read of a parameter goes through a
``chunk_gather`` / ``chunk_release`` pair and the parameters' gradients leave through ``chunk_grads``."""

from __future__ import annotations

import torch

from protrain_fx import meta
from protrain_fx.passes import gather
from protrain_fx.passes.pipeline import PassContext, attribute_blocks, gather_chunks, run_passes
from tests.passes.graphs import count, graph_text, nodes_made_by, offloaded_mlp, outputs, record_for, trace
from protrain_fx import settings

WIDTH = 64
ops = torch.ops.protrain


def _graphs():
    inputs = (torch.randn(WIDTH, WIDTH, requires_grad=True), torch.randn(WIDTH, WIDTH, requires_grad=True),
              torch.randn(8, WIDTH))
    _, forward, backward = trace(inputs=inputs)
    return forward, backward


def _position(gm) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def test_parameters_are_read_from_chunk_buffers():
    model, handle, weights = offloaded_mlp(WIDTH)
    forward, backward = _graphs()
    record = record_for(forward, backward, example_inputs=(*weights, torch.zeros(8, WIDTH)))
    record.rewritten = run_passes([attribute_blocks, gather_chunks], PassContext(record))

    gathers = [n for n in forward.graph.nodes if n.target is ops.chunk_gather.default]
    releases = [n for n in forward.graph.nodes if n.target is ops.chunk_release.default]
    assert len(gathers) == len(releases) == len(record.gathered) >= 2
    assert {(g.args[0], g.args[1]) for g in gathers} == {(handle.id, 0), (handle.id, 1)}
    # each release follows its gather; a later gather waits for the releases before it
    order = _position(forward)
    for g in gathers:
        (release,) = [r for r in releases if r.args[0] is g]
        assert order[g.name] < order[release.name]
    assert gathers[1].args[4] == [releases[0]]
    # nothing reads the parameter inputs any more except the gathers (their shells, for the shape)
    for ph in ("primals_1", "primals_2"):
        node = next(n for n in forward.graph.nodes if n.name == ph)
        assert node.meta[meta.OFFLOADED] is True
        assert {u.target for u in node.users} == {ops.chunk_gather.default}
    (first,) = [c for c in record.gathered if c.chunk == 0]
    assert (first.phase, first.params, first.gather_before) == ("forward", ("blocks.0.fc.weight",), "mm")
    # backward: the gradients go to the chunk store, the graph returns None for them
    assert outputs(backward)[:2] == [None, None]
    grads = [n for n in backward.graph.nodes if n.target is ops.chunk_grads.default]
    assert sorted((n.args[3], n.args[4]) for n in grads) == [(0, "blocks.0.fc.weight"), (1, "blocks.1.fc.weight")]
    made = nodes_made_by(forward, "gather_pass") + nodes_made_by(backward, "gather_pass")
    assert {n.target for n in made} >= {ops.chunk_gather.default, ops.chunk_release.default,
                                        ops.chunk_grads.default, torch.ops.aten.as_strided.default}
    assert record.passes[-1].name == "gather_chunks"
    assert record.passes[-1].summary.startswith(f"{len(record.gathered)} chunk gathers")


def test_a_block_reads_its_chunk_inside_the_block():
    model, handle, weights = offloaded_mlp(WIDTH)
    forward, backward = _graphs()
    record = record_for(forward, backward, example_inputs=(*weights, torch.zeros(8, WIDTH)))
    record.rewritten = run_passes([attribute_blocks, gather_chunks], PassContext(record))
    by_chunk = {(c.chunk, c.gather_before) for c in record.gathered}
    assert (0, "mm") in by_chunk and (1, "mm_1") in by_chunk
    gather0 = next(n for n in forward.graph.nodes if n.target is ops.chunk_gather.default)
    assert gather0.meta[meta.BLOCK] == "blocks.0"


def test_an_inference_graph_reads_chunks_too():
    model, handle, weights = offloaded_mlp(WIDTH)
    forward, _ = _graphs()
    record = record_for(inference=forward, example_inputs=(*weights, torch.zeros(8, WIDTH)))
    record.rewritten = run_passes([gather_chunks], PassContext(record))
    assert count(forward, ops.chunk_gather.default) == len(record.gathered) >= 2


def test_nothing_to_do_without_offloaded_inputs():
    forward, backward = _graphs()
    before = graph_text(forward, backward)
    record = record_for(forward, backward, example_inputs=(torch.zeros(WIDTH, WIDTH), torch.zeros(WIDTH, WIDTH)))
    record.rewritten = run_passes([gather_chunks], PassContext(record))
    assert graph_text(forward, backward) == before
    assert record.gathered == [] and record.passes == []


def test_disabled_by_name(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_PASSES, "gather_chunks")
    model, handle, weights = offloaded_mlp(WIDTH)
    forward, backward = _graphs()
    before = graph_text(forward, backward)
    record = record_for(forward, backward, example_inputs=(*weights, torch.zeros(8, WIDTH)))
    record.rewritten = run_passes([gather_chunks], PassContext(record))
    assert graph_text(forward, backward) == before
    assert record.gathered == [] and record.passes == []


def _views_chain(n_views: int) -> tuple[torch.fx.Graph, torch.fx.Node, list[torch.fx.Node]]:
    """A parameter whose ``n_views`` transposes are made at the start and read, all by one add, at
    the end, after an unrelated chain of ops: each sinks right before the add."""
    graph = torch.fx.Graph()
    param, x = graph.placeholder("param"), graph.placeholder("x")
    views = [graph.call_function(torch.ops.aten.t.default, (param,)) for _ in range(n_views)]
    y = x
    for _ in range(3):
        y = graph.call_function(torch.ops.aten.relu.default, (y,))
    total = graph.call_function(torch.ops.aten.add.Tensor, (y, views[0]))
    for v in views[1:]:
        total = graph.call_function(torch.ops.aten.add.Tensor, (total, v))
    graph.output(total)
    return graph, param, views


def test_sinking_views_keeps_the_positions_of_the_graph_order():
    """``_sink_views`` keeps the positions it is given in the graph's order as it moves views (a moved
    view takes the middle of its gap; the graph is numbered again where no middle is left), so that
    the positions a later parameter's views are sorted by are the graph's."""
    for n_views, squeeze in ((3, False), (3, True)):
        graph, param, views = _views_chain(n_views)
        positions = gather._positions(graph)
        if squeeze:  # no number between two neighbours: the first move numbers the graph again
            nodes = list(graph.nodes)
            positions.update({n: float(len(nodes)) for n in nodes[nodes.index(views[-1]) + 1:]})
        gather._sink_views(param, positions)
        order = list(graph.nodes)
        assert all(v.next in v.users for v in views)  # each view right before its reader
        assert all(positions[a] < positions[b] for a, b in zip(order, order[1:]))
        graph.lint()
