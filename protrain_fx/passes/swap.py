"""Swap rewrite: move the saved activations of swapped blocks to host memory between the graphs.

Runs on the partitioned graphs (after ``attribute_blocks``). For every value the forward graph saves
for backward whose block the plan swaps (or that a per-tensor override swaps):

* forward: ``offload`` right after the value's last forward use starts the D2H copy, and takes the
  value's place among the forward outputs; ``offload_wait`` is placed where the copy is estimated to
  have finished (copies queue on one stream, each issued when its value is done), so the compute
  stream rarely stalls, and the device value is freed right after it;
* backward: the matching input now holds the host copy; ``reload`` is issued as late as lets the copy
  (queued behind the earlier reloads) finish before the first use, and ``reload_wait`` sits right
  before that first use.

"Estimated" uses ``analysis/estimate.py`` (roofline per node) and the machine's copy bandwidth, with
:attr:`Machine.copy_margin` on top. Parameters, user outputs, and values computed from the model state
alone (bf16 casts of weights: a block swap leaves them; cheap to keep, pointless to copy) stay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from protrain_fx import meta
from protrain_fx.analysis.estimate import start_times
from protrain_fx.analysis.swappable import SwapGroup, select_swaps
from protrain_fx.machine import Machine
from protrain_fx.plan import Plan
from protrain_fx.runtime import swap as swap_ops  # noqa: F401  (registers the protrain:: ops)

MADE_BY = meta.MADE_BY


_ops = torch.ops.protrain


@dataclass(frozen=True)
class SwappedValue:
    """One swapped storage: the saved values on it (``members``), the node copied (``name``, a
    contiguous view covering the whole storage) and where its copies were placed (node names), with
    the estimated copy times used to place them."""

    name: str
    members: tuple[str, ...]
    block: str
    nbytes: int
    offload_after: str
    wait_before: str
    reload_before: str
    first_use: str
    d2h_s: float
    h2d_s: float


def swap_pass(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    plan: Plan,
    num_user_outputs: int,
    *,
    machine: Machine,
    slot_prefix: str = "",
    state_inputs: frozenset[str] = frozenset(),
) -> list[SwappedValue]:
    """Rewrite both graphs for ``plan``'s swaps; returns what was swapped (empty when nothing).

    ``state_inputs`` names the forward placeholders that are model state (parameters, buffers)."""
    swapped_blocks = set(plan.blocks_with("swap"))
    if not swapped_blocks and "swap" not in plan.tensors.values():
        return []
    out_node = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    outputs = list(out_node.args[0])
    groups, refused = select_swaps(
        forward, backward, outputs, plan, swapped_blocks, num_user_outputs, state_inputs, machine.min_swap_bytes
    )
    asked = {name for name, policy in plan.tensors.items() if policy == "swap"}
    chosen_names = {value.name for g in groups for _, value, _ in g.members}
    if asked - chosen_names:
        why = "; ".join(
            f"{name}: {refused.get(name, 'not a value the forward graph saves for backward')}"
            for name in sorted(asked - chosen_names)
        )
        raise ValueError(f"plan: cannot swap {sorted(asked - chosen_names)} ({why})")
    if not groups:
        return []
    fw_order = {n: i for i, n in enumerate(forward.graph.nodes)}
    groups.sort(key=lambda g: fw_order[g.last_use])
    after: dict[fx.Node, fx.Node] = {}  # offloads issued after one node keep the group order
    for g in groups:
        g.host = _insert_offload(forward, g, outputs, slot_prefix, after.get(g.last_use, g.last_use))
        after[g.last_use] = g.host
    out_node.args = (tuple(outputs),)
    waits = _place_offload_waits(forward, groups, machine)
    reloads = _place_reloads(backward, groups, machine)
    for gm in (forward, backward):
        gm.graph.lint()
        gm.recompile()
    return [
        SwappedValue(
            name=g.base.name,
            members=tuple(value.name for _, value, _ in g.members),
            block=g.base.meta.get(meta.BLOCK, meta.OUTSIDE),
            nbytes=meta.storage_nbytes(g.base.meta["val"]),
            offload_after=g.last_use.name,
            wait_before=wait_before,
            reload_before=reload_before,
            first_use=first_use,
            d2h_s=d2h_s,
            h2d_s=h2d_s,
        )
        for g, (wait_before, d2h_s), (reload_before, first_use, h2d_s) in zip(
            groups, waits, reloads
        )
    ]


def _insert_offload(
    forward: fx.GraphModule, group: SwapGroup, outputs: list, slot_prefix: str, where: fx.Node
) -> fx.Node:
    """``offload`` of the storage right after its last forward use; the host copy replaces every
    member among the forward outputs."""
    val = group.base.meta["val"]
    slot = f"{slot_prefix}{group.base.name}"
    with forward.graph.inserting_after(where):
        host = forward.graph.call_function(_ops.offload.default, (group.base, slot))
    with detect_fake_mode([val]):
        host.meta["val"] = _ops.offload.default(val, slot)
    _tag(host, group.base, "forward")
    for j, _, _ in group.members:
        outputs[j] = host
    return host


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _place_offload_waits(
    forward: fx.GraphModule, groups: list[SwapGroup], machine: Machine
) -> list[tuple[str, float]]:
    """Insert each ``offload_wait`` where its copy is estimated done; returns (node before, copy s)."""
    nodes = _compute_nodes(forward)
    start = start_times(nodes, machine)
    times = [start[n] for n in nodes]
    position = {n: i for i, n in enumerate(nodes)}
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    placed = []
    queue_free = 0.0
    for g in groups:  # in issue order
        seconds = meta.storage_nbytes(g.base.meta["val"]) / machine.d2h_bytes
        begin = max(start[g.host], queue_free)
        queue_free = begin + seconds * machine.copy_margin
        i = bisect.bisect_left(times, queue_free, lo=position[g.host] + 1)
        before = nodes[i] if i < len(nodes) else output
        with forward.graph.inserting_before(before):
            wait = forward.graph.call_function(
                _ops.offload_wait.default, (g.host, g.base, g.host.args[1])
            )
        wait.meta["val"] = None
        _tag(wait, g.base, "forward")
        placed.append((before.name, seconds))
    return placed


def _place_reloads(
    backward: fx.GraphModule, groups: list[SwapGroup], machine: Machine
) -> list[tuple[str, str, float]]:
    """Insert ``reload`` as late as lets the queued copy finish before the first use, ``reload_wait``
    right before that use and the members as views of the reloaded storage after it; returns
    (node the reload precedes, first use, copy s) per group."""
    nodes = _compute_nodes(backward)
    start = start_times(nodes, machine)
    times = [start[n] for n in nodes]
    position = {n: i for i, n in enumerate(nodes)}
    items = []
    for g in groups:
        targets = [target for _, _, target in g.members]
        for target in targets:
            target.meta["val"] = g.host.meta["val"]
        # The first backward input now receives the host copy; it takes the offload node's name,
        # which keeps "a backward input is named after the forward output it receives".
        targets[0]._rename(g.host.name)
        targets[0].target = targets[0].name
        first_use = min((u for t in targets for u in t.users), key=position.__getitem__)
        seconds = meta.storage_nbytes(g.base.meta["val"]) / machine.h2d_bytes
        items.append((position[first_use], g, first_use, seconds))
    items.sort(key=lambda item: item[0])
    # Latest starts, last use first: copy k must end by its use and before copy k+1 starts.
    latest_end = float("inf")
    starts = [0.0] * len(items)
    for k in range(len(items) - 1, -1, -1):
        use_at, _, _, seconds = items[k]
        latest_end = min(start[nodes[use_at]], latest_end)
        starts[k] = latest_end - seconds * machine.copy_margin
        latest_end = starts[k]
    placed: dict[int, tuple[str, str, float]] = {}
    for (use_at, g, first_use, seconds), latest in zip(items, starts):
        i = max(0, min(bisect.bisect_right(times, latest, hi=use_at) - 1, use_at))
        base = g.base.meta["val"]
        slot = g.host.args[1]
        fake_mode = detect_fake_mode([base])
        host_input = g.members[0][2]
        with backward.graph.inserting_before(nodes[i]):
            device_copy = backward.graph.call_function(
                _ops.reload.default, (host_input, slot, base.device)
            )
        with fake_mode:
            device_copy.meta["val"] = _ops.reload.default(
                g.host.meta["val"], slot, base.device
            )
        _tag(device_copy, g.base, "backward")
        with backward.graph.inserting_before(first_use):
            wait = backward.graph.call_function(
                _ops.reload_wait.default, (device_copy, slot)
            )
            wait.meta["val"] = None
            _tag(wait, g.base, "backward")
            for _, value, target in g.members:
                view = _view_of(
                    backward, device_copy, value.meta["val"], base, fake_mode
                )
                if view is not device_copy:
                    _tag(view, value, "backward")
                target.replace_all_uses_with(
                    view, delete_user_cb=lambda user: user is not device_copy
                )
        placed[id(g)] = (nodes[i].name, first_use.name, seconds)
    _refresh_views(backward, {meta.storage_key(g.base.meta["val"]) for g in groups})
    return [placed[id(g)] for g in groups]


def _refresh_views(backward: fx.GraphModule, old_storages: set[int]) -> None:
    """Backward nodes traced as views of a swapped value still carry fake values on the old
    storage; recompute them from their (new) inputs so the analysis sees the reloaded storage."""
    fake_mode = None
    for node in backward.graph.nodes:
        if node.op != "call_function":
            continue
        if not any(meta.storage_key(t) in old_storages for t in meta.tensor_values(node)):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        fake_mode = fake_mode or detect_fake_mode(meta.tensor_values(node))
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)


def _view_of(
    graph_module: fx.GraphModule,
    device_copy: fx.Node,
    val: torch.Tensor,
    base: torch.Tensor,
    fake_mode,
) -> fx.Node:
    """``val`` (a value on the swapped storage) as a view of the reloaded storage."""
    if (
        val.shape == base.shape
        and val.stride() == base.stride()
        and val.storage_offset() == 0
    ):
        return device_copy
    args = (device_copy, tuple(val.shape), tuple(val.stride()), val.storage_offset())
    view = graph_module.graph.call_function(torch.ops.aten.as_strided.default, args)
    with fake_mode:
        view.meta["val"] = torch.ops.aten.as_strided.default(
            device_copy.meta["val"], *args[1:]
        )
    return view


def _tag(node: fx.Node, source: fx.Node, phase: str) -> None:
    meta.tag_inserted(node, source, phase, "swap_pass")
