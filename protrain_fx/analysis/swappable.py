"""Which saved values a swap plan moves to host memory: the swap pass's selection, read-only.

:func:`swap_candidates` runs the selection ``passes/swap.py`` makes when a plan swaps every block it
names, without rewriting anything, so the planner prices exactly what the pass will move: values
computed from the model state alone, values under ``min_bytes``, storages no contiguous value covers
and values also returned to the user stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.plan import Plan


@dataclass
class SwapGroup:
    """Saved values sharing one storage (q, k and v are views of one projection): swapped together."""

    members: list[
        tuple[int, fx.Node, fx.Node]
    ]  # (forward output index, forward value, backward input)
    base: fx.Node  # a contiguous forward value covering the storage: what is copied
    last_use: fx.Node  # the last forward node that reads the storage
    host: fx.Node | None = None


@dataclass(frozen=True)
class SwapCandidate:
    """A storage :func:`swap_pass` would move if its block were swapped: its block (that of its
    covering value), bytes (rounded up to the caller's granule), the forward node after which the
    copy out is issued (its last forward use) and the first backward node that reads it."""

    block: str
    nbytes: int
    issued_after: fx.Node
    first_use: fx.Node


def swap_candidates(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    labels: list[str],
    num_user_outputs: int,
    *,
    state_inputs: frozenset[str] = frozenset(),
    min_bytes: int,
    granule: int = 1,
) -> list[SwapCandidate]:
    """What :func:`swap_pass` moves to host memory when the plan swaps every block in ``labels``,
    found by its own selection without rewriting anything. What it leaves on the device (values
    computed from the model state alone, values under ``min_bytes``, storages no contiguous value
    covers, values also returned to the user) is not among them."""
    out_node = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    plan = Plan(blocks={label: "swap" for label in labels})
    groups, _ = select_swaps(forward, backward, list(out_node.args[0]), plan, set(labels), num_user_outputs,
                        state_inputs, min_bytes)
    position = {n: i for i, n in enumerate(backward.graph.nodes)}
    found = []
    for g in groups:
        users = [u for _, _, target in g.members for u in target.users]
        nbytes = meta.storage_nbytes(g.base.meta["val"])
        found.append(SwapCandidate(
            block=g.base.meta.get(meta.BLOCK, meta.OUTSIDE),
            nbytes=-(-nbytes // granule) * granule,
            issued_after=g.last_use,
            first_use=min(users, key=position.__getitem__),
        ))
    return found


def select_swaps(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    outputs: list,
    plan: Plan,
    swapped_blocks: set[str],
    num_user_outputs: int,
    state_inputs: frozenset[str],
    min_bytes: int,
) -> tuple[list[SwapGroup], dict[str, str]]:
    """Storages to swap (a storage is swapped whole or not at all), and why asked values were not."""
    from_state = _state_derived(forward, state_inputs)
    bw_inputs = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    by_storage: dict[int, list[tuple[int, fx.Node]]] = {}
    for j, value in enumerate(outputs):
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if isinstance(val, torch.Tensor):
            by_storage.setdefault(meta.storage_key(val), []).append((j, value))
    aliases: dict[int, list[fx.Node]] = {}
    for node in forward.graph.nodes:
        for t in meta.tensor_values(node):
            aliases.setdefault(meta.storage_key(t), []).append(node)
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    groups: list[SwapGroup] = []
    refused: dict[str, str] = {}
    for key, entries in by_storage.items():
        names = [value.name for _, value in entries]

        def wanted(value: fx.Node) -> bool:
            override = plan.tensors.get(value.name)
            in_block = (
                value.meta.get(meta.BLOCK) in swapped_blocks
                and not from_state[value]
                and meta.storage_nbytes(value.meta["val"]) >= min_bytes
            )
            return override == "swap" or (override is None and in_block)

        if not any(wanted(value) for _, value in entries):
            continue
        why = None
        if any(j < num_user_outputs for j, _ in entries):
            why = "its memory is also returned to the user"
        elif any(value.op == "placeholder" for _, value in entries):
            why = "it is a graph input (a parameter or a user input)"
        elif any(bw_inputs.get(value.name) is None for _, value in entries):
            why = "the backward graph does not take it"
        elif not all(_static(value.meta["val"]) for _, value in entries):
            why = "its shape is symbolic"
        base = _covering_node(aliases[key], order)
        if why is None and base is None:
            why = "no contiguous value covers its whole storage"
        if why is not None:
            refused.update({name: why for name in names})
            continue
        members = [(j, value, bw_inputs[value.name]) for j, value in entries]
        if not any(target.users for _, _, target in members):
            continue
        readers = [u for n in aliases[key] for u in n.users if u.op != "output"]
        last_use = max((*aliases[key], *readers), key=order.__getitem__)
        groups.append(SwapGroup(members=members, base=base, last_use=last_use))
    return groups, refused


def _state_derived(forward: fx.GraphModule, state_inputs: frozenset[str]) -> dict[fx.Node, bool]:
    """Per node: computed from model state (and constants) alone, not from the batch."""
    derived: dict[fx.Node, bool] = {}
    for node in forward.graph.nodes:
        if node.op == "placeholder":
            derived[node] = node.name in state_inputs
        else:
            derived[node] = all(derived.get(n, False) for n in node.all_input_nodes)
    return derived


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(x, int) for x in (*t.shape, *t.stride(), t.storage_offset()))


def _covering_node(nodes: list[fx.Node], order: dict[fx.Node, int]) -> fx.Node | None:
    """The earliest node whose value is contiguous and spans its whole storage."""
    for node in sorted(nodes, key=order.__getitem__):
        val = node.meta.get("val")
        if (
            isinstance(val, torch.Tensor)
            and _static(val)
            and val.is_contiguous()
            and val.storage_offset() == 0
            and meta.tensor_nbytes(val) == meta.storage_nbytes(val)
        ):
            return node
    return None
