"""Memory timelines of one training step, predicted (from the graphs) or measured (on a GPU).

A timeline is plain data (no FX, no torch tensors): a list of buffer events (a buffer of ``nbytes``
becomes live or dies at step position ``index``) plus, for predicted timelines, one entry per graph
node. Exporters (``inspect/export.py``) turn it into a PyTorch memory snapshot pickle, a Chrome trace
JSON or an SVG plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["setup", "forward", "backward", "optimizer"]
#: What a buffer holds; the categories of the per-block table and of the plots.
Category = Literal[
    "parameter", "gradient", "optimizer_state", "input", "activation", "transient", "output", "other"
]


@dataclass(frozen=True)
class BufferEvent:
    """A buffer becoming live (``alloc``) or being released (``free``) at step position ``index``.

    ``buffer`` identifies the storage within the timeline (same id for its alloc and its free).
    For predicted timelines ``index`` is a node position (``TimelineEntry.index``); for measured ones
    it is the position of the allocator event in the trace.
    """

    index: int
    action: Literal["alloc", "free"]
    buffer: int
    nbytes: int
    category: str
    name: str  # the node (predicted) or the allocating frame (measured) that made the buffer
    source: str = ""  # "file:line" of the user code, when known


@dataclass(frozen=True)
class TimelineEntry:
    """One graph node of the step, in execution order.

    ``peak_bytes`` is what is live while the node runs (its inputs and its new outputs);
    ``live_bytes`` is what stays live after it (buffers whose last use it was are freed).
    """

    index: int
    phase: Phase
    graph: int
    name: str
    op: str
    block: str
    source: str
    peak_bytes: int
    live_bytes: int
    alloc_bytes: int
    freed_bytes: int


@dataclass(frozen=True)
class Timeline:
    """Memory over one training step on one device.

    ``kind`` says where the numbers come from. ``phase_bounds`` maps each phase to the half-open range
    ``[start, end)`` of indices it covers, which lets a measured timeline be laid over a predicted one.
    ``baseline_bytes`` holds, per category, bytes live before the step's first node (model states and
    inputs for predicted timelines); they have no events. Bytes live at any point are the baseline
    plus :meth:`curve`; ``peak_bytes`` includes the baseline.
    """

    kind: Literal["predicted", "measured"]
    device: str
    events: tuple[BufferEvent, ...]
    entries: tuple[TimelineEntry, ...] = ()
    phase_bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    baseline_bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    label: str = ""

    def curve(self) -> list[tuple[int, int]]:
        """``(index, bytes live above the baseline)`` after each event, in index order."""
        live = 0
        points: list[tuple[int, int]] = []
        for ev in sorted(self.events, key=lambda e: (e.index, e.action == "free")):
            live += ev.nbytes if ev.action == "alloc" else -ev.nbytes
            points.append((ev.index, live))
        return points
