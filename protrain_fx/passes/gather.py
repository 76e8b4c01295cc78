"""Chunk rewrite: graphs read host-stored parameters from chunk buffers, and hand their gradients back.

Runs on the partitioned graphs when some forward inputs are parameters an offload handle holds
(``runtime/offload/handle.py``; the model keeps them as device tensors with no bytes). Per chunk and graph:

* ``chunk_gather`` before the first node that reads one of the chunk's parameters, each parameter
  then a view of the returned flat buffer, made where the parameter is first read (cast to the
  parameter's dtype when the store computes in another one; a reader that only casts the
  parameter to the buffer's dtype, autocast's cast or one recomputed in backward by
  ``passes/param_casts.py``, reads the buffer's view itself: the same values, no fp32 copy and
  no cast back), and ``chunk_release`` after the last reader. Each gather takes the tokens the
  releases before it return, so that Inductor keeps it after them;
* in backward, the same for the parameters saved for it, and the chunk's gradients leave through
  ``chunk_grads`` (to the host store and the CPU optimizer) instead of the graph's outputs, which
  return ``None`` for them: autograd never sees a gradient of an offloaded parameter.

The parameter inputs themselves stay in the graphs' signatures (and are still what the forward
saves for backward): they cost no memory and nothing reads them.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._prims_common import make_contiguous_strides_for

from protrain_fx import meta
from protrain_fx.errors import TooFewBuffers
from protrain_fx.passes.param_casts import is_dtype_cast
from protrain_fx.runtime.offload import chunk_ops

_ops = torch.ops.protrain


@dataclass(frozen=True)
class GatheredChunk:
    """Where one chunk is gathered and released in one graph."""

    phase: str
    handle: int
    chunk: int
    params: tuple[str, ...]
    gather_before: str
    release_after: str


def gather_pass(
    forward: fx.GraphModule, backward: fx.GraphModule | None, real_inputs: list[Any]
) -> list[GatheredChunk]:
    """Rewrite both graphs for the offloaded parameters among ``real_inputs`` (forward input order)."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    info = {}
    for node, real in zip(placeholders, real_inputs):
        found = chunk_ops.offloaded(real)
        if found is not None:
            info[node.name] = found
    if not info:
        return []
    for graph_module in (forward, backward):
        for node in graph_module.graph.nodes if graph_module is not None else ():
            if node.op == "placeholder" and node.name in info:
                node.meta[meta.OFFLOADED] = True
    done = _rewrite_reads(forward, info, "forward")
    if backward is not None:
        done += _rewrite_reads(backward, info, "backward")
        _route_grads(backward, placeholders, info)
        backward.graph.lint()
        backward.recompile()
    forward.graph.lint()
    forward.recompile()
    for graph_module, phase in ((forward, "forward"), (backward, "backward")):
        if graph_module is not None:
            _check_buffers(graph_module, phase)
    return done


def _check_buffers(gm: fx.GraphModule, phase: str) -> None:
    """Refuse a graph that holds more chunks at once than its handle has buffers: it would stop
    at run time, mid-step, with the buffers full (a checkpointed block's recompute and backward
    hold all the chunks of the block together)."""
    live: dict[int, set[int]] = defaultdict(set)
    most: dict[int, tuple[int, str]] = {}
    for node in gm.graph.nodes:
        if node.target is _ops.chunk_gather.default:
            hid, chunk = node.args[0], node.args[1]
            live[hid].add(chunk)
            if len(live[hid]) > most.get(hid, (0, ""))[0]:
                most[hid] = (len(live[hid]), node.meta.get(meta.BLOCK, meta.OUTSIDE))
        elif node.target is _ops.chunk_release.default:
            live[node.args[2]].discard(node.args[3])
    for hid, (needed, block) in most.items():
        n_buffer = chunk_ops.handle(hid).n_buffer
        if needed > n_buffer:
            raise TooFewBuffers(
                f"the {phase} graph holds {needed} parameter chunks at once (at {block}), "
                f"but the offload has n_buffer={n_buffer}: use n_buffer >= {needed}, larger chunks "
                "(chunk_bytes) so that a block fits in fewer, or checkpoint fewer blocks (a "
                "checkpointed block keeps its chunks from its recompute to its backward)",
                needed,
            )


def _rewrite_reads(gm: fx.GraphModule, info: dict, phase: str) -> list[GatheredChunk]:
    params_of: dict[tuple[int, int], list[fx.Node]] = defaultdict(list)
    positions = _positions(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in info and _readers(node):
            _sink_views(node, positions)
            hid, chunk, _, _ = info[node.name]
            params_of[(hid, chunk)].append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    outputs = _output_storage_nodes(gm)
    spans = []  # (first reader, last reader, handle, chunk, params)
    for (hid, chunk), params in params_of.items():
        for span in _spans([r for p in params for r in _readers(p)], order):
            spans.append((span[0], span[-1], hid, chunk, params, span))
    done = []
    spans.sort(key=lambda s: order[s[0]])
    releases: list[tuple[fx.Node, fx.Node]] = []  # (release, the node it follows)
    for number, (first, last, hid, chunk, params, span) in enumerate(spans):
        fake_mode = detect_fake_mode([p.meta["val"] for p in params])
        buffer_dtype = chunk_ops.handle(hid).store.compute_dtype  # what chunk_gather returns
        # A cast of a parameter to the buffer's dtype (autocast's, or one recomputed in backward:
        # passes/param_casts.py) reads the buffer itself: the same values, no copy in another dtype.
        folded = {r for r in span if any(r in p.users for p in params) and _foldable(r, buffer_dtype, outputs)}
        touched = _through_views(span, transparent=folded)
        readers_done = _tensor_results([n for n in touched if not meta.is_view(n) and n not in folded])
        last_touched = max([n for n in [*touched, *readers_done] if n not in folded], key=lambda n: order.get(n, -1),
                           default=last)
        # releases before ``first`` (their tokens: ordering only): each sits right after its anchor
        if first in order and all(a in order for _, a in releases):
            after = [r for r, a in releases if order[a] < order[first]]
        else:  # an anchor this pass made: the graph's order as it is now
            position = {n: i for i, n in enumerate(gm.graph.nodes)}
            after = [r for r, _ in releases if position[r] < position[first]]
        with gm.graph.inserting_before(first):
            buf = gm.graph.call_function(_ops.chunk_gather.default, (hid, chunk, number, params[0], after))
            with fake_mode:
                buf.meta["val"] = _ops.chunk_gather.default(
                    hid, chunk, number, params[0].meta["val"], [a.meta["val"] for a in after]
                )
            _tag(buf, first, phase)
            upcoming = next((s for s in spans[number + 1 :] if (s[2], s[3]) != (hid, chunk)), None)
            if upcoming is not None:  # the next other chunk starts its copy while this one computes
                hint = gm.graph.call_function(_ops.chunk_prefetch.default, (buf, upcoming[2], upcoming[3]))
                hint.meta["val"] = None
                _tag(hint, first, phase)
        gather_before = first.name if first not in folded else min(first.users, key=order.__getitem__).name
        for p in params:
            readers = sorted((r for r in _readers(p) if r in span), key=order.__getitem__)
            if not readers:
                continue
            with gm.graph.inserting_before(readers[0]):  # each parameter's view where it is first read
                view = _param_view(gm, buf, p, info[p.name][2], fake_mode)
                kept = [r for r in readers if r not in folded]
                cast = _param_cast(gm, view, p, fake_mode) if kept else view
            for r in kept:
                r.replace_input_with(p, cast)
            for r in readers:
                if r in folded:
                    r.replace_all_uses_with(view)
                    gm.graph.erase_node(r)
        with gm.graph.inserting_after(last_touched):
            release = gm.graph.call_function(_ops.chunk_release.default, (buf, readers_done, hid, chunk))
            with fake_mode:
                release.meta["val"] = _ops.chunk_release.default(buf.meta["val"], [], hid, chunk)
            _tag(release, last, phase)
        releases.append((release, last_touched))
        done.append(
            GatheredChunk(phase, hid, chunk, tuple(info[p.name][3] for p in params), gather_before, last_touched.name)
        )
    return done


def _output_storage_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value, or a view of it, the graph returns (saved for backward, or the user's)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found: set[fx.Node] = set()
    stack = [a for a in out.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        if meta.is_view(n):
            stack.extend(n.all_input_nodes)
    return found


def _foldable(reader: fx.Node, buffer_dtype: torch.dtype, outputs: set[fx.Node]) -> bool:
    """``reader`` casts a parameter to the chunk buffer's dtype, and neither it nor a view of it
    leaves the graph (a returned view of the buffer would see the next chunk's values)."""
    if not is_dtype_cast(reader, buffer_dtype) or reader.args[0].meta["val"].dtype == buffer_dtype:
        return False
    aliases, stack = set(), [reader]
    while stack:
        n = stack.pop()
        if n not in aliases:
            aliases.add(n)
            stack.extend(u for u in _readers(n) if meta.is_view(u))
    return not aliases & outputs


def _tensor_results(nodes: list[fx.Node]) -> list[fx.Node]:
    """Nodes holding the tensors ``nodes`` produce (the getitems of a multi-output op)."""
    out = []
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append(node)
        elif isinstance(val, (tuple, list)):
            out += [u for u in node.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
    return out


def _spans(readers: list[fx.Node], order: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """The chunk's readers split into runs of one block each: the chunk is gathered per run, so a
    chunk read at the start and at the end of a graph (a tied embedding and head) does not hold a
    buffer in between (the pool keeps it resident while no other chunk needs the buffer)."""
    runs: list[list[fx.Node]] = []
    for node in sorted(set(readers), key=order.__getitem__):
        block = node.meta.get(meta.BLOCK, meta.OUTSIDE)
        if runs and runs[-1][-1].meta.get(meta.BLOCK, meta.OUTSIDE) == block:
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def _sink_views(param: fx.Node, positions: dict[fx.Node, float]) -> None:
    """Move the views of ``param`` (a transpose the partitioner placed early, say) right before
    their first reader, so the buffer they read is not held from there on. ``positions``: the
    graph's order (:func:`_positions`), kept as the views move."""
    views = [n for n in _through_views(_readers(param)) if meta.is_view(n) and _readers(n)]
    for view in sorted(views, key=positions.__getitem__, reverse=True):
        first_user = min(_readers(view), key=positions.__getitem__)
        # a reader comes after the view: not right after it, there are nodes between them
        if first_user is not view.next and all(positions[a] < positions[first_user] for a in view.all_input_nodes):
            _move_before(view, first_user, positions)


def _positions(graph: fx.Graph) -> dict[fx.Node, float]:
    """Each node of ``graph`` by its place in the order, ascending (:func:`_move_before` keeps it)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def _move_before(node: fx.Node, user: fx.Node, positions: dict[fx.Node, float]) -> None:
    """``node`` moved right before ``user``, with ``positions`` kept: the moved node takes the middle
    of the gap it lands in, so that no move walks the graph (numbered again only where the gaps
    of many moves into one place leave no number between two nodes)."""
    below, above = positions[user.prev], positions[user]
    user.prepend(node)
    middle = (below + above) / 2
    if below < middle < above:
        positions[node] = middle
    else:
        positions.update(_positions(user.graph))


def _readers(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.op != "output"]


def _through_views(nodes: list[fx.Node], transparent: set[fx.Node] = frozenset()) -> list[fx.Node]:
    """``nodes`` and, for those that are views (or in ``transparent``), every node that reads them
    (transitively)."""
    seen: list[fx.Node] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.append(node)
        if meta.is_view(node) or node in transparent:
            stack.extend(_readers(node))
    return seen


def _param_view(gm: fx.GraphModule, buf: fx.Node, param: fx.Node, offset: int, fake_mode: Any) -> fx.Node:
    """``param`` as a view of the chunk buffer, in the buffer's dtype."""
    val = param.meta["val"]
    stride = make_contiguous_strides_for(val.shape)
    view = gm.graph.call_function(torch.ops.aten.as_strided.default, (buf, tuple(val.shape), stride, offset))
    with fake_mode:
        view.meta["val"] = torch.ops.aten.as_strided.default(buf.meta["val"], tuple(val.shape), stride, offset)
    _tag(view, param, param.meta.get(meta.PHASE, ""))
    return view


def _param_cast(gm: fx.GraphModule, view: fx.Node, param: fx.Node, fake_mode: Any) -> fx.Node:
    """``view`` cast to ``param``'s dtype when the buffer's differs (else ``view``)."""
    dtype = param.meta["val"].dtype
    if view.meta["val"].dtype == dtype:
        return view
    out = gm.graph.call_function(torch.ops.prims.convert_element_type.default, (view, dtype))
    with fake_mode:
        out.meta["val"] = torch.ops.prims.convert_element_type.default(view.meta["val"], dtype)
    _tag(out, param, param.meta.get(meta.PHASE, ""))
    return out


def _route_grads(backward: fx.GraphModule, fw_placeholders: list[fx.Node], info: dict) -> None:
    """Offloaded parameters' gradients go to ``chunk_grads``; the graph returns None for them."""
    out = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
    grads = list(out.args[0])
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    by_chunk: dict[tuple[int, int], list[tuple[str, fx.Node]]] = defaultdict(list)
    for i, ph in enumerate(fw_placeholders):
        if ph.name in info and i < len(grads) and isinstance(grads[i], fx.Node):
            hid, chunk, _, name = info[ph.name]
            by_chunk[(hid, chunk)].append((name, grads[i]))
            grads[i] = None
    out.args = (tuple(grads),)
    for (hid, chunk), items in by_chunk.items():
        last = max((g for _, g in items), key=order.__getitem__)
        grad = last.meta["val"]
        with backward.graph.inserting_after(last):
            token = backward.graph.call_function(
                torch.ops.aten.empty.memory_format, ([0],), {"dtype": torch.uint8, "device": grad.device}
            )
            with detect_fake_mode([grad]):
                token.meta["val"] = torch.empty(0, dtype=torch.uint8, device=grad.device)
        with backward.graph.inserting_after(token):
            node = backward.graph.call_function(
                _ops.chunk_grads.default, (token, [g for _, g in items], hid, chunk, "\n".join(n for n, _ in items))
            )
        node.meta["val"] = None
        _tag(token, last, "backward")
        _tag(node, last, "backward")


def _tag(node: fx.Node, source: fx.Node, phase: str) -> None:
    meta.tag_inserted(node, source, phase, "gather_pass")
