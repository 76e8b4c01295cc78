"""Readable text of a graph: one line per node with its block, output shapes, bytes and source line."""

from __future__ import annotations


import torch.fx as fx

from protrain_fx import meta


def _fmt_arg(a: object) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    return repr(a)


def _fmt_val(node: fx.Node) -> str:
    parts = []
    for t in meta.tensor_values(node):
        shape = "x".join(str(meta.concrete(s)) for s in t.shape) or "scalar"
        dtype = str(t.dtype).replace("torch.", "")
        parts.append(f"{dtype}[{shape}]")
    return ", ".join(parts)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_graph(gm: fx.GraphModule, *, title: str = "") -> str:
    """The graph as text: ``%out = op(args)  # block | dtype[shape] bytes | source``."""
    lines = [f"# {title}"] if title else []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            call = f"%{node.name} = placeholder"
        elif node.op == "output":
            call = f"return {_fmt_arg(node.args[0])}"
        else:
            args = ", ".join([_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()])
            call = f"%{node.name} = {meta.op_name(node)}({args})"
        notes = [node.meta.get(meta.BLOCK, "")]
        val = _fmt_val(node)
        if val:
            nbytes = sum(meta.tensor_nbytes(t) for t in meta.tensor_values(node))
            notes.append(f"{val} {human_bytes(nbytes)}")
        src = meta.source_line(node)
        if src:
            notes.append(src)
        notes = [n for n in notes if n]
        lines.append(call + (f"  # {' | '.join(notes)}" if notes else ""))
    return "\n".join(lines) + "\n"


