"""Block attribution: which repeated layer (transformer block) every forward and backward node belongs to.

Blocks are the children of the repeated container found in the nodes' module metadata: a ``ModuleList``
or ``Sequential`` whose integer-indexed children share one class (``blocks.0 .. blocks.N``,
``transformer.h.0 ..``, ``model.layers.0 ..``). Forward nodes carry ``nn_module_stack``; backward nodes
carry ``fwd_nn_module_stack`` or share a ``seq_nr`` with their forward op; nodes with neither (views,
``getitem``, parameters) take the block of the node they read from, else of their users. Everything else
is :data:`~protrain_fx.meta.OUTSIDE` (embeddings, head, loss).
"""

from __future__ import annotations

import functools
import operator
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.fx as fx

from protrain_fx import meta

# The root: L['self'], or L['args'][0] when the forward is wrapped by a (*args, **kwargs) decorator.
_ROOT = re.compile(r"^L\['[^']*'\](\[\d+\])*\.?")
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]")
_GETATTR = re.compile(r"getattr\(([^,]+), '([^']*)'\)")
_INDEXED = re.compile(r"^(.*)\.(\d+)$")


@dataclass(frozen=True)
class BlockInfo:
    """The repeated layers found in a graph, in forward execution order.

    ``container`` is the module path of the repeated container (``""`` when none was found),
    ``layer_class`` the class name of its children, ``labels`` the block labels in order.
    """

    container: str
    layer_class: str
    labels: tuple[str, ...]

    def order(self, label: str) -> int:
        """Position of a block in forward order; :data:`meta.OUTSIDE` sorts last."""
        return self.labels.index(label) if label in self.labels else len(self.labels)


@functools.lru_cache(maxsize=8192)
def normalize_module_path(path: str) -> str:
    """``"L['self'].blocks.0.attn"`` / ``"L['self']._modules['blocks']._modules['0']"`` → ``"blocks.0.attn"``
    (read once per path: every node of a module carries it)."""
    for _ in range(8):  # getattr(getattr(x, 'a'), 'b') nests
        new = _GETATTR.sub(lambda m: f"{m.group(1)}.{m.group(2)}", path)
        if new == path:
            break
        path = new
    path = _MODULES_ITEM.sub(lambda m: f".{m.group(1)}", path)
    path = _ROOT.sub("", path)
    return path.strip(".")


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(normalized path, class name) of the modules around a node, outermost first."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1]
        name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((normalize_module_path(str(path)), name.rsplit(".", 1)[-1]))
    return out


def block_at_end(gm: fx.GraphModule) -> str:
    """The repeated layer (a child of a ``ModuleList`` / ``Sequential``: ``blocks.3``) that the
    graph's last operation ran inside, ``""`` when none: a graph ending at a graph break there broke
    inside that block."""
    last = next((n for n in reversed(gm.graph.nodes) if n.op in ("call_function", "call_method", "call_module")), None)
    if last is None:
        return ""
    for path, _cls in reversed(_stack(last)):
        while path:
            if _INDEXED.match(path):
                return path
            path = path.rsplit(".", 1)[0] if "." in path else ""
    return ""


def find_blocks(graphs: Sequence[fx.GraphModule]) -> BlockInfo:
    """Find the repeated container covering the most nodes (outermost on ties); a container of one
    indexed child only where none repeats (a model built with one layer)."""
    children: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    covered: Counter[str] = Counter()
    first_seen: dict[str, int] = {}
    position = 0
    for gm in graphs:
        for node in gm.graph.nodes:
            position += 1
            seen_here = set()
            for path, cls in _stack(node):
                m = _INDEXED.match(path)
                if not m:
                    continue
                container, idx = m.group(1), int(m.group(2))
                children[container][idx].add(cls)
                if container not in seen_here:
                    covered[container] += 1
                    seen_here.add(container)
                first_seen.setdefault(path, position)
    candidates = []
    for container, kids in children.items():
        classes = set().union(*kids.values())
        if len(classes) == 1:  # (a model of one layer: its one child, where no container repeats)
            candidates.append((len(kids) < 2, -covered[container], container.count("."), container, classes.pop()))
    if not candidates:
        return BlockInfo(container="", layer_class="", labels=())
    _, _, _, container, cls = min(candidates)
    labels = sorted(
        (f"{container}.{i}" if container else str(i) for i in children[container]),
        key=lambda lab: (first_seen.get(lab, 1 << 60), lab),
    )
    return BlockInfo(container=container, layer_class=cls, labels=tuple(labels))


def own_block(node: fx.Node, info: BlockInfo) -> str | None:
    labels = set(info.labels)
    for path, _ in _stack(node):
        while path:  # the block is the path or one of its prefixes (labels are siblings: one at most)
            if path in labels:
                return path
            path = path.rpartition(".")[0]
    if node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack"):
        return meta.OUTSIDE  # inside some module, but not in a block
    return None


def attribute_blocks(
    forward: fx.GraphModule | None,
    backward: fx.GraphModule | None = None,
    *,
    info: BlockInfo | None = None,
) -> BlockInfo:
    """Write ``meta.BLOCK`` and ``meta.PHASE`` on every node of the forward and backward graphs.

    Forward: a node's module stack decides; ``getitem`` follows its producer; other ops outside any
    module are the model's own top-level code (outside blocks). Backward: the forward module stack
    (``fwd_nn_module_stack``) decides; a gradient accumulation (``add`` of two gradients of one block)
    stays in that block; otherwise the forward op with the same ``seq_nr``. Placeholders (parameters,
    saved values, tangents) take their users' block when they all agree. Returns the :class:`BlockInfo`.
    """
    graphs = [g for g in (forward, backward) if g is not None]
    if info is None:
        info = find_blocks(graphs)
    by_seq: dict[int, str] = {}
    for phase, gm in (("forward", forward), ("backward", backward)):
        if gm is None:
            continue
        nodes = list(gm.graph.nodes)
        for node in nodes:
            node.meta[meta.PHASE] = phase
            if node.op in ("placeholder", "output"):
                block = own_block(node, info)  # saved values keep their forward module stack
            else:
                block = own_block(node, info) or _inferred_block(node, phase, by_seq, info)
            if block is not None:
                node.meta[meta.BLOCK] = block
                if phase == "forward" and node.op != "placeholder" and "seq_nr" in node.meta:
                    by_seq.setdefault(node.meta["seq_nr"], block)
        _fill_placeholders(nodes)
    return info


def _inferred_block(node: fx.Node, phase: str, by_seq: dict[int, str], info: BlockInfo) -> str:
    """Block of a compute node that carries no module stack."""
    producers = [a for a in node.all_input_nodes if a.op != "placeholder" and meta.BLOCK in a.meta]
    if node.target is operator.getitem and producers:
        return producers[0].meta[meta.BLOCK]
    if phase == "forward":
        wrapped = _rng_wrapper_block(node, info)
        return wrapped or meta.OUTSIDE  # else: the model's own forward, outside every submodule
    if node.target is torch.ops.aten.add.Tensor and len(producers) == 2:
        blocks = {p.meta[meta.BLOCK] for p in producers}
        if len(blocks) == 1 and meta.OUTSIDE not in blocks:
            return blocks.pop()  # gradient accumulation inside one block
    if node.meta.get("seq_nr") in by_seq:
        return by_seq[node.meta["seq_nr"]]
    blocks = {p.meta[meta.BLOCK] for p in producers}
    return blocks.pop() if len(blocks) == 1 else meta.OUTSIDE


_RNG_WRAPPERS = ("run_and_save_rng_state", "run_with_rng_state")


def _rng_wrapper_block(node: fx.Node, info: BlockInfo) -> str | None:
    """The partitioner wraps a recomputed random op (e.g. attention) in ``run_and_save_rng_state``
    without module metadata: the wrapper belongs where the consumers of its results are."""
    if getattr(node.target, "__name__", "") not in _RNG_WRAPPERS:
        return None
    blocks = {own_block(user, info) for item in node.users for user in item.users}
    blocks.discard(None)
    return blocks.pop() if len(blocks) == 1 else None


def _fill_placeholders(nodes: Iterable[fx.Node]) -> None:
    """Placeholders without module information take their users' common block, else outside."""
    for node in nodes:
        if node.op != "placeholder" or meta.BLOCK in node.meta:
            continue
        user_blocks = {u.meta.get(meta.BLOCK) for u in node.users if u.op != "output"}
        user_blocks.discard(None)
        node.meta[meta.BLOCK] = user_blocks.pop() if len(user_blocks) == 1 else meta.OUTSIDE
