"""The ``node.meta`` keys protrain_fx writes, and small helpers every pass shares.

One module owns the keys so passes never spell them twice. Analyses write only these keys; they never
change a graph's nodes or edges.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import size_hint

#: Block label of nodes not inside any repeated layer (embeddings, head, loss, optimizer glue);
#: the chunk layout uses the same label for parameters outside blocks.
from protrain_fx.chunks import OUTSIDE  # noqa: F401

#: Block label of a node: a repeated layer such as ``"blocks.3"``, or :data:`OUTSIDE`.
BLOCK = "protrain_block"
#: ``"forward"`` or ``"backward"``: which partitioned graph the node runs in.
PHASE = "protrain_phase"

#: On a parameter placeholder: the parameter lives in a host chunk store (``passes/gather.py``);
#: the graph reads it from a chunk buffer, so the device holds neither it nor its optimizer state.
OFFLOADED = "protrain_offloaded"

#: Which rewrite inserted a node (``"swap_pass"``, ``"gather_pass"``); absent on captured nodes.
MADE_BY = "protrain_made_by"



def tensor_values(node: fx.Node) -> list[torch.Tensor]:
    """The tensors a node produces, from its ``meta["val"]`` (tuples and lists flattened)."""
    return [v for v in _flatten(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def _flatten(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _flatten(v)
    elif value is not None:
        yield value


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an op whose every result aliases an input without writing it (a view)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return _aliases_only(target)


@functools.cache
def _aliases_only(op: torch._ops.OpOverload) -> bool:
    """Whether every result of ``op`` aliases an input without writing it: its schema's, read once
    per op (the passes and the memory analysis ask of every node, several times a rewrite)."""
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def tag_inserted(node: fx.Node, source: fx.Node, phase: str, made_by: str) -> None:
    """Metadata of a node a rewrite inserts: ``source``'s module stack and user line, ``source``'s
    block, the graph ``phase`` and which pass made it (readable graphs and block tables use them)."""
    for key in ("nn_module_stack", "stack_trace", "seq_nr"):
        if key in source.meta:
            node.meta[key] = source.meta[key]
    node.meta[BLOCK] = source.meta.get(BLOCK, OUTSIDE)
    node.meta[PHASE] = phase
    node.meta[MADE_BY] = made_by


def concrete(n: Any) -> int:
    """An int from an int or a SymInt (its hint: the size seen when the graph was traced)."""
    return n if isinstance(n, int) else size_hint(n)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (for a view: its base's storage)."""
    return concrete(t.untyped_storage().nbytes())


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own elements (``numel * element_size``), whatever its storage."""
    return concrete(t.numel()) * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """An id shared by all tensors (views included) on the same storage.

    FakeTensors of one trace share fake storages exactly where the real tensors would share memory,
    and the partitioned graphs keep the joint graph's values, so the key is stable across the
    forward and backward graphs.
    """
    return t.untyped_storage()._cdata


def op_name(node: fx.Node) -> str:
    """``aten.mm.default`` for OpOverloads, the target's name otherwise (``getitem``, ``placeholder``)."""
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def source_line(node: fx.Node) -> str:
    """``file:line`` and code of the user's line that made ``node`` (innermost frame), or ``""``."""
    trace = node.meta.get("stack_trace")
    return _line_of(trace) if trace else ""


@functools.lru_cache(maxsize=4096)
def _line_of(trace: str) -> str:
    """:func:`source_line` of a stack trace, read once per trace (the nodes of one line of the model,
    in every block and in the recomputes, share it)."""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    location = ""
    for ln in lines:
        if ln.startswith("File "):
            location = ln
    code = lines[-1] if lines and not lines[-1].startswith("File ") else ""
    if location:
        # 'File "/path/x.py", line 12, in forward'  ->  'x.py:12 forward'
        try:
            fname = location.split('"')[1].rsplit("/", 1)[-1]
            lineno = location.split("line ")[1].split(",")[0]
            func = location.rsplit(" in ", 1)[-1]
            location = f"{fname}:{lineno} {func}"
        except IndexError:
            pass
    return f"{location}: {code}" if code else location
