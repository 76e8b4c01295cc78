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
    """``"1.50 GiB"``, ``"512.00 KiB"``, ``"12 B"``; past a thousand TiB in powers of ten (``"9.31e+77 TiB"``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g} {unit}" if abs(value) >= 1000 and unit == "TiB" else f"{value:.2f} {unit}"
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




def readable_graphs(forward: fx.GraphModule | None, backward: fx.GraphModule | None, index: int) -> dict[str, str]:
    """Graph ``index``'s forward (or inference) and backward graphs as text."""
    out = {}
    for kind, gm in (("forward", forward), ("backward", backward)):
        if gm is not None:
            out[kind] = format_graph(gm, title=f"graph {index} {kind}")
    return out


def text_plot(timeline, *, width: int = 72, height: int = 10) -> str:
    """The timeline as a terminal bar chart: bytes live (peak per column) over the step, phases marked."""
    entries = timeline.entries
    if not entries:
        return "(empty timeline)"
    columns = min(width, len(entries))
    per = len(entries) / columns
    peaks = [
        max(e.peak_bytes for e in entries[int(c * per): max(int((c + 1) * per), int(c * per) + 1)])
        for c in range(columns)
    ]
    top = max(peaks) or 1
    rows = []
    for level in range(height, 0, -1):
        threshold = top * (level - 0.5) / height
        label = human_bytes(int(top * level / height)).rjust(10) if level in (height, 1) or level == height // 2 else " " * 10
        rows.append(f"{label} |" + "".join("#" if p >= threshold else " " for p in peaks))
    axis = [" "] * columns
    for phase, (lo, _hi) in timeline.phase_bounds.items():
        col = min(int(lo / per), columns - 1)
        for i, ch in enumerate(phase[: max(1, columns - col)]):
            if col + i < columns:
                axis[col + i] = ch
    rows.append(" " * 10 + " +" + "-" * columns)
    rows.append(" " * 12 + "".join(axis))
    peak = max(entries, key=lambda e: e.peak_bytes)
    rows.append(f"peak {human_bytes(peak.peak_bytes)} at {peak.phase} node {peak.name} [{peak.block}] {peak.source}".rstrip())
    return "\n".join(rows)
