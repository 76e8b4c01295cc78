"""Exporters for memory timelines (``protrain_fx.timeline.Timeline``).

Three views of the same numbers, none of which needs anything beyond the standard library:

* ``to_memory_snapshot`` / ``write_memory_snapshot``: a pickle in the layout of
  ``torch.cuda.memory._snapshot()`` (the CUDA caching allocator's snapshot), which
  https://pytorch.org/memory_viz opens. Every buffer gets a fake, non-overlapping address in one
  fake segment, its trace entries are named by the node that made it and carry the user's source
  line as their innermost frame, and bytes live before the step (``baseline_bytes``) appear as
  blocks that were allocated before recording began, the way a real snapshot shows them.
* ``write_chrome_trace``: Chrome trace JSON (chrome://tracing, ui.perfetto.dev) with one process
  per timeline, a counter of live bytes, one slice per graph node and one per phase.
* ``write_svg_plot``: a self-contained SVG of bytes live over the step, predicted against measured.

``write_all`` writes them all into one folder.
"""

from __future__ import annotations

import bisect
import json
import math
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from protrain_fx.timeline import BufferEvent, Timeline, TimelineEntry

#: pytorch.org/memory_viz has its own unpickler, which reads protocols 2 to 4 only (Python 3.14
#: pickles with 5 by default), so every snapshot is written with this protocol.
PICKLE_PROTOCOL = 4
#: The caching allocator rounds every block to 512 bytes; fake addresses keep that alignment.
BLOCK_ALIGN = 512
#: Where the one fake segment starts (an address of the shape CUDA hands out).
SEGMENT_BASE = 0x7F00_0000_0000
#: Fake segments are a whole number of 2 MiB pages, like the allocator's.
SEGMENT_ROUND = 2 * 1024 * 1024
GIB = 1024**3

Bounds = Mapping[str, tuple[int, int]]
Point = tuple[float, float]
#: Maps a step index to a trace timestamp, or None to leave the point out.
ToTs = Callable[[float], float | None]


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def ordered_events(timeline: Timeline) -> list[BufferEvent]:
    """The events in the order ``Timeline.curve()`` applies them (allocs first at equal index)."""
    return sorted(timeline.events, key=lambda e: (e.index, e.action == "free"))


def _align(nbytes: int) -> int:
    return max(BLOCK_ALIGN, -(-nbytes // BLOCK_ALIGN) * BLOCK_ALIGN)


def _split_source(source: str) -> tuple[str, int]:
    """``"path/model.py:12"`` (or ``"path:12:4"``) into ``("path/model.py", 12)``."""
    parts = source.split(":")
    numbers: list[int] = []
    while len(parts) > 1 and parts[-1].strip().isdigit():
        numbers.insert(0, int(parts.pop()))
    filename = ":".join(parts)
    return (filename or "<unknown source>", numbers[0] if numbers else 0)


def _check_events(timeline: Timeline) -> None:
    for ev in timeline.events:
        if ev.action not in ("alloc", "free"):
            raise ValueError(f"event {ev!r}: action must be 'alloc' or 'free'")
        if not isinstance(ev.nbytes, int) or ev.nbytes < 0:
            raise ValueError(f"event {ev!r}: nbytes must be a non-negative int")
        if not isinstance(ev.index, int):
            raise ValueError(f"event {ev!r}: index must be an int")


def _as_timelines(timelines: Timeline | Iterable[Timeline]) -> list[Timeline]:
    result = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not result:
        raise ValueError("no timeline given")
    for tl in result:
        if not isinstance(tl, Timeline):
            raise ValueError(f"expected Timeline objects, got {type(tl).__name__}")
    return result


def _display_name(timeline: Timeline) -> str:
    return timeline.label or timeline.kind


# --------------------------------------------------------------------------------------------
# Memory snapshot (pytorch.org/memory_viz)
# --------------------------------------------------------------------------------------------


class _AddressSpace:
    """First-fit placement of the live buffers in one segment (offsets, BLOCK_ALIGN aligned)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: dict[int, int] = {}
        self.high_water = 0

    def alloc(self, span: int) -> int:
        offset = 0
        for start in self._starts:
            if start - offset >= span:
                break
            offset = start + self._spans[start]
        bisect.insort(self._starts, offset)
        self._spans[offset] = span
        self.high_water = max(self.high_water, offset + span)
        return offset

    def free(self, offset: int) -> None:
        self._starts.pop(bisect.bisect_left(self._starts, offset))
        del self._spans[offset]


@dataclass
class _Block:
    """One placed buffer: where it lies and what the viewer shows about it."""

    offset: int
    span: int
    nbytes: int
    frames: list[dict[str, Any]]
    category: str


def _frames_for(ev: BufferEvent, entry: TimelineEntry | None, kind: str) -> list[dict[str, Any]]:
    """Innermost frame first: the user's source line named by the node, then the node's context."""
    filename, line = _split_source(ev.source or (entry.source if entry else ""))
    frames: list[dict[str, Any]] = [{"filename": filename, "line": line, "name": ev.name}]
    if entry is not None:
        where = f"[{entry.phase}] {entry.block}" if entry.block else f"[{entry.phase}]"
        frames.append({"filename": where, "line": entry.index, "name": entry.op})
    frames.append({"filename": f"<protrain_fx {kind} {ev.category}>", "line": ev.index, "name": ""})
    return frames


def _trace_entry(action: str, block: _Block, nbytes: int, time_us: int) -> dict[str, Any]:
    return {
        "action": action,
        "addr": SEGMENT_BASE + block.offset,
        "size": nbytes,
        "stream": 0,
        "frames": block.frames,
        "time_us": time_us,
        "compile_context": "N/A",
        "user_metadata": "",
        "category": block.category,
    }


def _find_orphan_frees(events: Sequence[BufferEvent]) -> list[BufferEvent]:
    """Frees of buffers live before the step (no alloc before them); rejects double frees."""
    live: dict[int, int] = {}
    seen: set[int] = set()
    orphans: list[BufferEvent] = []
    for ev in events:
        if ev.action == "alloc":
            if ev.buffer in live:
                raise ValueError(
                    f"buffer {ev.buffer} allocated again at index {ev.index} while live"
                )
            live[ev.buffer] = ev.nbytes
            seen.add(ev.buffer)
        elif ev.buffer in live:
            nbytes = live.pop(ev.buffer)
            if nbytes != ev.nbytes:
                raise ValueError(
                    f"buffer {ev.buffer} allocated with {nbytes} bytes but freed with {ev.nbytes}"
                )
        elif ev.buffer in seen:
            raise ValueError(f"buffer {ev.buffer} freed twice (again at index {ev.index})")
        else:
            orphans.append(ev)
            seen.add(ev.buffer)
    return orphans


def _baseline_blocks(
    timeline: Timeline, orphans: Sequence[BufferEvent], space: _AddressSpace
) -> list[_Block]:
    """Blocks for bytes live before the step that no event frees (orphan frees are the rest)."""
    freed: dict[str, int] = {}
    for ev in orphans:
        freed[ev.category] = freed.get(ev.category, 0) + ev.nbytes
    blocks = []
    for category, nbytes in timeline.baseline_bytes.items():
        if nbytes < 0:
            raise ValueError(f"baseline_bytes[{category!r}] is negative ({nbytes})")
        remaining = nbytes - freed.get(category, 0)
        if remaining <= 0:
            continue
        span = _align(remaining)
        frames = [{"filename": "<live before the step>", "line": 0, "name": f"baseline {category}"}]
        blocks.append(_Block(space.alloc(span), span, remaining, frames, category))
    return blocks


def _segment(blocks: Iterable[_Block], total_size: int, device_index: int) -> dict[str, Any]:
    """The one fake segment at the end of the trace: live blocks and the gaps between them."""
    layout: list[dict[str, Any]] = []
    cursor = 0
    for b in sorted(blocks, key=lambda b: b.offset):
        if b.offset > cursor:
            layout.append(_inactive_block(cursor, b.offset - cursor))
        layout.append(
            {
                "address": SEGMENT_BASE + b.offset,
                "size": b.span,
                "requested_size": b.nbytes,
                "state": "active_allocated",
                "frames": b.frames,
            }
        )
        cursor = b.offset + b.span
    if cursor < total_size:
        layout.append(_inactive_block(cursor, total_size - cursor))
    active = [b for b in layout if b["state"] == "active_allocated"]
    return {
        "device": device_index,
        "address": SEGMENT_BASE,
        "total_size": total_size,
        "allocated_size": sum(b["size"] for b in active),
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": layout,
    }


def _inactive_block(offset: int, size: int) -> dict[str, Any]:
    return {
        "address": SEGMENT_BASE + offset,
        "size": size,
        "requested_size": 0,
        "state": "inactive",
        "frames": [],
    }


def _phase_annotations(timeline: Timeline, device_index: int) -> list[dict[str, Any]]:
    """Phases as record_function-style annotations (``external_annotations`` of 2.11 snapshots)."""
    notes = []
    for phase, (start, end) in sorted(timeline.phase_bounds.items(), key=lambda kv: kv[1]):
        for stage, time_us in (("START", start), ("END", end)):
            notes.append(
                {"name": phase, "stage": stage, "device": device_index, "time_us": time_us}
            )
    return notes


def to_memory_snapshot(timeline: Timeline, *, device_index: int = 0) -> dict[str, Any]:
    """The timeline as a ``torch.cuda.memory._snapshot()`` dict (segments + device_traces).

    Each alloc becomes an ``alloc`` trace entry, each free a ``free_requested`` +
    ``free_completed`` pair, in ``Timeline.curve()`` order, with ``time_us`` = the event's index.
    """
    if not isinstance(device_index, int) or device_index < 0:
        raise ValueError(f"device_index must be a non-negative int, got {device_index!r}")
    _check_events(timeline)
    events = ordered_events(timeline)
    orphans = _find_orphan_frees(events)
    entries = {e.index: e for e in timeline.entries}
    space = _AddressSpace()
    live: dict[int, _Block] = {}
    for ev in orphans:  # live from the start, so placed first
        span = _align(ev.nbytes)
        frames = _frames_for(ev, None, timeline.kind)
        live[ev.buffer] = _Block(space.alloc(span), span, ev.nbytes, frames, ev.category)
    permanent = _baseline_blocks(timeline, orphans, space)
    trace: list[dict[str, Any]] = []
    for ev in events:
        if ev.action == "alloc":
            span = _align(ev.nbytes)
            frames = _frames_for(ev, entries.get(ev.index), timeline.kind)
            block = _Block(space.alloc(span), span, ev.nbytes, frames, ev.category)
            live[ev.buffer] = block
            trace.append(_trace_entry("alloc", block, ev.nbytes, ev.index))
        else:
            block = live.pop(ev.buffer)
            space.free(block.offset)
            trace.append(_trace_entry("free_requested", block, ev.nbytes, ev.index))
            trace.append(_trace_entry("free_completed", block, ev.nbytes, ev.index))
    if trace:
        # memory_viz colours allocations by "category" and then expects the category "unknown"
        # to exist (some versions crash without it); blocks from before the step use that colour.
        trace.append(
            {
                "action": "snapshot",
                "addr": 0,
                "size": 0,
                "stream": 0,
                "frames": [],
                "time_us": trace[-1]["time_us"],
                "category": "unknown",
            }
        )
    total = -(-max(space.high_water, 1) // SEGMENT_ROUND) * SEGMENT_ROUND
    return {
        "segments": [_segment([*permanent, *live.values()], total, device_index)],
        "device_traces": [[] for _ in range(device_index)] + [trace],
        "allocator_settings": {},
        "external_annotations": _phase_annotations(timeline, device_index),
    }


def write_snapshot_pickle(snapshot: Mapping[str, Any], path: str | Path) -> Path:
    """Pickle a snapshot dict (ours or a real one) so that pytorch.org/memory_viz can read it."""
    if "segments" not in snapshot or "device_traces" not in snapshot:
        raise ValueError("not a memory snapshot: it needs 'segments' and 'device_traces'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(dict(snapshot), f, protocol=PICKLE_PROTOCOL)
    return path


def write_memory_snapshot(timeline: Timeline, path: str | Path, *, device_index: int = 0) -> Path:
    """Write ``to_memory_snapshot(timeline)`` as a pickle for pytorch.org/memory_viz."""
    return write_snapshot_pickle(to_memory_snapshot(timeline, device_index=device_index), path)


# --------------------------------------------------------------------------------------------
# Phase alignment (measured x onto predicted x)
# --------------------------------------------------------------------------------------------


def _phase_pairs(src: Bounds, dst: Bounds) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``(src range, dst range)`` of each phase both have, in destination order."""
    pairs = [
        (tuple(src[p]), tuple(dst[p]))
        for p in dst
        if p in src and src[p][1] >= src[p][0] and dst[p][1] >= dst[p][0]
    ]
    return sorted(pairs, key=lambda pair: pair[1])  # type: ignore[return-value]


def _map_linear(x: float, src: tuple[float, float], dst: tuple[float, float]) -> float:
    if src[1] == src[0]:
        return float(dst[0])
    return dst[0] + (x - src[0]) * (dst[1] - dst[0]) / (src[1] - src[0])


def _map_x(x: float, pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]]) -> float | None:
    for src, dst in pairs:
        if src[0] <= x < src[1]:
            return _map_linear(x, src, dst)
    return None


def _index_range(timeline: Timeline) -> tuple[int, int]:
    """``[first, last + 1)`` over events, nodes and phases (``(0, 1)`` for an empty timeline)."""
    xs = [e.index for e in timeline.events] + [e.index for e in timeline.entries]
    lo = min([*xs, *(b[0] for b in timeline.phase_bounds.values())], default=0)
    hi = max([*(x + 1 for x in xs), *(b[1] for b in timeline.phase_bounds.values())], default=1)
    return lo, max(hi, lo + 1)


def _alignment(
    timeline: Timeline, reference: Timeline
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """How ``timeline``'s x maps onto ``reference``'s: phase by phase, or whole range if no phase
    is shared."""
    pairs = _phase_pairs(timeline.phase_bounds, reference.phase_bounds)
    return pairs or [(_index_range(timeline), _index_range(reference))]


# --------------------------------------------------------------------------------------------
# Chrome trace
# --------------------------------------------------------------------------------------------


def _identity(x: float) -> float:
    return x


def _metadata_events(pid: int, timeline: Timeline) -> list[dict[str, Any]]:
    name = f"{_display_name(timeline)} ({timeline.kind}, {timeline.device})"
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": pid},
        },
    ]
    for tid, thread in ((0, "memory"), (1, "nodes"), (2, "phases")):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
        )
    return events


def _counter_events(pid: int, timeline: Timeline, to_ts: ToTs) -> list[dict[str, Any]]:
    baseline = sum(timeline.baseline_bytes.values())
    events = []
    for index, live in timeline.curve():
        ts = to_ts(index)
        if ts is not None:
            events.append(
                {
                    "ph": "C",
                    "name": "live bytes",
                    "pid": pid,
                    "tid": 0,
                    "ts": ts,
                    "args": {"baseline": baseline, "step": live},
                }
            )
    return events


def _node_events(pid: int, timeline: Timeline, to_ts: ToTs) -> list[dict[str, Any]]:
    events = []
    for e in timeline.entries:
        ts = to_ts(e.index)
        if ts is None:
            continue
        events.append(
            {
                "ph": "X",
                "name": e.name,
                "cat": e.phase,
                "pid": pid,
                "tid": 1,
                "ts": ts,
                "dur": 1,
                "args": {
                    "block": e.block,
                    "op": e.op,
                    "source": e.source,
                    "graph": e.graph,
                    "peak_bytes": e.peak_bytes,
                    "live_bytes": e.live_bytes,
                    "alloc_bytes": e.alloc_bytes,
                    "freed_bytes": e.freed_bytes,
                },
            }
        )
    return events


def _phase_events(pid: int, timeline: Timeline, reference: Timeline | None) -> list[dict[str, Any]]:
    events = []
    for phase, (start, end) in timeline.phase_bounds.items():
        span: tuple[float, float] = (start, end)
        if reference is not None:
            if phase not in reference.phase_bounds:
                continue
            span = tuple(reference.phase_bounds[phase])  # type: ignore[assignment]
        events.append(
            {
                "ph": "X",
                "name": phase,
                "cat": "phase",
                "pid": pid,
                "tid": 2,
                "ts": span[0],
                "dur": span[1] - span[0],
                "args": {"start_index": start, "end_index": end},
            }
        )
    return events


def to_chrome_trace(
    timelines: Timeline | Iterable[Timeline], *, align_to_first: bool = False
) -> dict[str, Any]:
    """Chrome trace dict: per timeline a process with a live-bytes counter, node and phase slices.

    Timestamps are step indices read as microseconds. With ``align_to_first`` the later timelines'
    indices are mapped onto the first one's, phase by phase (points outside shared phases dropped).
    """
    tls = _as_timelines(timelines)
    events: list[dict[str, Any]] = []
    for pid, tl in enumerate(tls, start=1):
        reference = tls[0] if align_to_first and pid > 1 else None
        to_ts: ToTs = (
            _identity if reference is None else partial(_map_x, pairs=_alignment(tl, reference))
        )
        events += _metadata_events(pid, tl)
        events += _counter_events(pid, tl, to_ts)
        events += _node_events(pid, tl, to_ts)
        events += _phase_events(pid, tl, reference)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "protrain_fx", "time_axis": "step index (1 index = 1 us)"},
    }


def write_chrome_trace(
    timelines: Timeline | Iterable[Timeline], path: str | Path, *, align_to_first: bool = False
) -> Path:
    """Write ``to_chrome_trace(timelines)`` as JSON (chrome://tracing, ui.perfetto.dev)."""
    trace = to_chrome_trace(timelines, align_to_first=align_to_first)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# SVG plot
# --------------------------------------------------------------------------------------------

_W, _H = 1000, 500
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 970, 56, 420
_COLORS = {"predicted": "#1f77b4", "measured": "#d62728", "baseline": "#7f7f7f"}
_UNITS = (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))


def _unit(max_bytes: float) -> tuple[str, int]:
    """GiB for real workloads; a smaller unit only when everything is under half a GiB."""
    for name, scale in _UNITS:
        if max_bytes >= scale / 2 or scale == 1:
            return name, scale
    return "B", 1


def _format_bytes(nbytes: float, unit: tuple[str, int]) -> str:
    return f"{nbytes / unit[1]:.2f} {unit[0]}"


def _nice_step(span: float, target: int) -> float:
    if span <= 0:
        return 1.0
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * magnitude >= raw:
            return m * magnitude
    return 10 * magnitude


def _ticks(lo: float, hi: float, target: int, integer: bool = False) -> list[float]:
    step = _nice_step(hi - lo, target)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step) * step
    count = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [first + i * step for i in range(max(count, 0))]


def _tick_label(value: float) -> str:
    return f"{round(value, 6):g}"


@dataclass
class _Series:
    """One curve to draw: step vertices per run (data coordinates) and its peak."""

    key: str
    label: str
    runs: list[list[Point]]
    peak: Point | None
    peak_bytes: int


def _total_curve(timeline: Timeline) -> list[tuple[int, int]]:
    baseline = sum(timeline.baseline_bytes.values())
    return [(i, baseline + live) for i, live in timeline.curve()]


def _runs(
    timeline: Timeline, pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]]
) -> list[list[Point]]:
    """Step vertices ``(x, value from x on)``, one run per mapped range, in destination x."""
    points = _total_curve(timeline)
    xs = [p[0] for p in points]
    baseline = sum(timeline.baseline_bytes.values())
    runs = []
    for src, dst in pairs:
        i = bisect.bisect_left(xs, src[0])
        run: list[Point] = [(float(dst[0]), float(points[i - 1][1] if i else baseline))]
        while i < len(points) and points[i][0] < src[1]:
            run.append((_map_linear(points[i][0], src, dst), float(points[i][1])))
            i += 1
        run.append((float(dst[1]), run[-1][1]))
        runs.append(run)
    return runs


def _series(key: str, timeline: Timeline, pairs: Sequence[Any], note: str = "") -> _Series:
    runs = _runs(timeline, pairs)
    peak = max((v for run in runs for v in run), key=lambda v: v[1], default=None)
    reported = max(timeline.peak_bytes, int(peak[1]) if peak else 0)
    label = (
        f"{key} ({_display_name(timeline)})" if timeline.label and timeline.label != key else key
    )
    return _Series(key, label + note, runs, peak, reported)


class _Canvas:
    """Data-to-pixel transform of the plot area."""

    def __init__(self, x_range: tuple[float, float], y_max: float) -> None:
        self.x0, self.x1 = x_range
        self.y_max = y_max

    def px(self, x: float) -> float:
        return _LEFT + (x - self.x0) * (_RIGHT - _LEFT) / (self.x1 - self.x0)

    def py(self, y: float) -> float:
        return _BOTTOM - y * (_BOTTOM - _TOP) / self.y_max


def _column_moves(y_in: float, ys: Sequence[float]) -> list[str]:
    """Vertical moves within one pixel column: its extent, ending at the last value."""
    moves, current = [], y_in
    for y in (min(ys), max(ys), ys[-1]) if ys else ():
        if abs(y - current) >= 0.05:
            moves.append(f"V{y:.1f}")
            current = y
    return moves


def _step_path(vertices: Sequence[Point]) -> str:
    """SVG path of a step curve through pixel vertices, compressed to one column per half pixel."""
    (x, y), rest = vertices[0], vertices[1:]
    commands = [f"M{x:.1f},{y:.1f}"]
    column_x, y_in, ys = x, y, []
    for x, y in rest:
        if x - column_x >= 0.5:
            commands += _column_moves(y_in, ys)
            y_in = ys[-1] if ys else y_in
            commands.append(f"H{x:.1f}")
            column_x, ys = x, []
        ys.append(y)
    commands += _column_moves(y_in, ys)
    return "".join(commands)


def _svg_axes(canvas: _Canvas, unit: tuple[str, int]) -> list[str]:
    parts = [
        f'<rect x="{_LEFT}" y="{_TOP}" width="{_RIGHT - _LEFT}" height="{_BOTTOM - _TOP}" '
        'fill="white" stroke="#444"/>'
    ]
    for v in _ticks(0, canvas.y_max / unit[1], 6):
        y = canvas.py(v * unit[1])
        parts.append(
            f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_RIGHT}" y2="{y:.1f}" stroke="#e6e6e6"/>'
        )
        parts.append(
            f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(v)}</text>'
        )
    for v in _ticks(canvas.x0, canvas.x1, 10, integer=True):
        x = canvas.px(v)
        parts.append(
            f'<line x1="{x:.1f}" y1="{_BOTTOM}" x2="{x:.1f}" y2="{_BOTTOM + 5}" stroke="#444"/>'
        )
        parts.append(
            f'<text x="{x:.1f}" y="{_BOTTOM + 18}" text-anchor="middle">{_tick_label(v)}</text>'
        )
    mid_y = (_TOP + _BOTTOM) / 2
    parts.append(
        f'<text x="22" y="{mid_y}" text-anchor="middle" transform="rotate(-90 22 {mid_y})">'
        f"{unit[0]} live (before the step + allocated in it)</text>"
    )
    parts.append(
        f'<text x="{(_LEFT + _RIGHT) / 2}" y="{_BOTTOM + 38}" text-anchor="middle">'
        "step position (node index of the predicted timeline)</text>"
    )
    return parts


def _svg_phases(canvas: _Canvas, bounds: Bounds) -> list[str]:
    parts = []
    for phase, (start, end) in sorted(bounds.items(), key=lambda kv: kv[1]):
        for x in (canvas.px(start), canvas.px(end)):
            if _LEFT < x < _RIGHT:
                parts.append(
                    f'<line x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{_BOTTOM}" '
                    'stroke="#999" stroke-dasharray="4 3"/>'
                )
        middle = (canvas.px(start) + canvas.px(end)) / 2
        parts.append(
            f'<text x="{middle:.1f}" y="{_TOP - 8}" text-anchor="middle" fill="#555" '
            f'class="phase-label">{escape(phase)}</text>'
        )
    return parts


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels


def _label_box(x: float, y: float, anchor: str, text: str) -> Box:
    width = 7.2 * len(text)  # bold 12 px Helvetica, generously
    x0 = x - width if anchor == "end" else x
    return (x0, y - 12, x0 + width, y + 3)


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _place_label(x: float, y: float, text: str, taken: Sequence[Box]) -> tuple[float, float, str]:
    """Where a peak label goes: above the marker, on the roomier side, away from other labels."""
    sides = [("start", 8), ("end", -8)]
    if x > _LEFT + 0.6 * (_RIGHT - _LEFT):
        sides.reverse()
    candidates = [(x + dx, y + dy, anchor) for dy in (-8, 18, -26, 36) for anchor, dx in sides]
    for cx, cy, anchor in candidates:
        box = _label_box(cx, cy, anchor, text)
        inside = _LEFT <= box[0] and box[2] <= _RIGHT and _TOP <= box[1] and box[3] <= _BOTTOM
        if inside and not any(_overlaps(box, other) for other in taken):
            return cx, cy, anchor
    return candidates[0]


def _svg_series(
    canvas: _Canvas, series: _Series, unit: tuple[str, int], taken: list[Box]
) -> list[str]:
    """The series' curve and its peak marker; the label's box is added to ``taken``."""
    color = _COLORS[series.key]
    d = "".join(_step_path([(canvas.px(x), canvas.py(y)) for x, y in run]) for run in series.runs)
    parts = [
        f'<path class="curve curve-{series.key}" d="{d}" fill="none" stroke="{color}" '
        'stroke-width="1.6" stroke-linejoin="round"/>'
    ]
    if series.peak is not None:
        x, y = canvas.px(series.peak[0]), canvas.py(series.peak_bytes)
        text = f"{series.key} peak {_format_bytes(series.peak_bytes, unit)}"
        tx, ty, anchor = _place_label(x, y, text, taken)
        taken.append(_label_box(tx, ty, anchor, text))
        parts.append(
            f'<circle class="peak peak-{series.key}" cx="{x:.1f}" cy="{y:.1f}" r="4" '
            f'fill="{color}"/>'
        )
        parts.append(
            f'<text x="{tx:.1f}" y="{ty:.1f}" text-anchor="{anchor}" fill="{color}" '
            'font-weight="bold" stroke="white" stroke-width="3" paint-order="stroke">'
            f"{escape(text)}</text>"
        )
    return parts


def _svg_legend(
    series: Sequence[_Series], baseline: float | None, unit: tuple[str, int]
) -> list[str]:
    items = [
        (f"{s.label}, peak {_format_bytes(s.peak_bytes, unit)}", _COLORS[s.key], "") for s in series
    ]
    if baseline is not None:
        items.append(
            ("live before the step (predicted)", _COLORS["baseline"], ' stroke-dasharray="6 4"')
        )
    parts, x, y = [], float(_LEFT), _H - 14
    for text, color, dash in items:
        parts.append(
            f'<line x1="{x:.0f}" y1="{y - 4}" x2="{x + 24:.0f}" y2="{y - 4}" stroke="{color}" '
            f'stroke-width="2"{dash}/>'
        )
        parts.append(f'<text x="{x + 30:.0f}" y="{y}" class="legend">{escape(text)}</text>')
        x += 42 + 6.6 * len(text)
    return parts


def svg_plot(predicted: Timeline, measured: Timeline | None = None, *, title: str = "") -> str:
    """The SVG document ``write_svg_plot`` writes."""
    x_range = _index_range(predicted)
    series = [_series("predicted", predicted, [(x_range, x_range)])]
    if measured is not None:
        shared = _phase_pairs(measured.phase_bounds, predicted.phase_bounds)
        note = "" if shared else ", x scaled linearly: no shared phase"
        series.append(_series("measured", measured, _alignment(measured, predicted), note))
    baseline = sum(predicted.baseline_bytes.values())
    top = max(
        [
            baseline,
            1,
            *(s.peak_bytes for s in series),
            *(y for s in series for run in s.runs for _, y in run),
        ]
    )
    unit = _unit(top)
    canvas = _Canvas((float(x_range[0]), float(x_range[1])), top * 1.12)
    title = (
        title or f"Memory over one training step: {_display_name(predicted)} on {predicted.device}"
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_LEFT}" y="22" font-size="16" font-weight="bold">{escape(title)}</text>',
        *_svg_axes(canvas, unit),
        *_svg_phases(canvas, predicted.phase_bounds),
    ]
    if baseline:
        y = canvas.py(baseline)
        parts.append(
            f'<line class="baseline" x1="{_LEFT}" y1="{y:.1f}" x2="{_RIGHT}" y2="{y:.1f}" '
            f'stroke="{_COLORS["baseline"]}" stroke-dasharray="6 4"/>'
        )
    taken: list[Box] = []
    for s in series:
        parts += _svg_series(canvas, s, unit, taken)
    parts += _svg_legend(series, baseline or None, unit)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_svg_plot(
    predicted: Timeline, path: str | Path, measured: Timeline | None = None, *, title: str = ""
) -> Path:
    """Plot bytes live over the step (predicted; measured overlaid, aligned phase by phase)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg_plot(predicted, measured, title=title), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------


def write_all(
    predicted: Timeline,
    out_dir: str | Path,
    measured: Timeline | None = None,
    stem: str = "timeline",
    *,
    measured_snapshot: Mapping[str, Any] | None = None,
    title: str = "",
) -> dict[str, Path]:
    """Write snapshots, Chrome trace and SVG into ``out_dir``; returns their paths by kind.

    ``measured_snapshot`` (the raw ``torch.cuda.memory._snapshot()`` dict, e.g.
    ``record_memory.snapshot``) is written as the measured snapshot when given, with its real
    addresses and stacks; otherwise the measured timeline is exported like the predicted one.
    Without ``measured``, the measured timeline is read from ``measured_snapshot``.
    """
    if not stem or "/" in stem:
        raise ValueError(f"stem must be a plain file name stem, got {stem!r}")
    if measured is None and measured_snapshot is not None:
        from protrain_fx.measure import timeline_from_snapshot

        measured = timeline_from_snapshot(measured_snapshot)
    out = Path(out_dir)
    paths = {
        "predicted_snapshot": write_memory_snapshot(predicted, out / f"{stem}_predicted.pickle")
    }
    if measured_snapshot is not None:
        paths["measured_snapshot"] = write_snapshot_pickle(
            measured_snapshot, out / f"{stem}_measured.pickle"
        )
    elif measured is not None:
        paths["measured_snapshot"] = write_memory_snapshot(
            measured, out / f"{stem}_measured.pickle"
        )
    timelines = [predicted] if measured is None else [predicted, measured]
    paths["chrome_trace"] = write_chrome_trace(timelines, out / f"{stem}.json")
    paths["svg"] = write_svg_plot(predicted, out / f"{stem}.svg", measured, title=title)
    return paths
