"""A timeline as a ``torch.cuda.memory._snapshot()`` dict that pytorch.org/memory_viz opens.

The predicted timeline has no addresses, so buffers are placed first-fit in one fake segment
(512-byte blocks, 2 MiB-rounded segment) and every event becomes the allocator's trace entry
(``alloc``, or ``free_requested`` + ``free_completed``) with the step index as ``time_us``.
Buffers freed without an alloc in the step are live from the start; the baseline bytes no event
frees (parameters, optimizer state) are permanent blocks. Pickles are written with protocol 4, the highest the
viewer's unpickler reads.
"""

from __future__ import annotations

import bisect
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain_fx.analysis.timeline import BufferEvent, Timeline, TimelineEntry
from protrain_fx.inspect.events import (
    align_bytes,
    check_events,
    ordered_events,
    split_source,
)

#: pytorch.org/memory_viz has its own unpickler, which reads protocols 2 to 4 only (Python 3.14
#: pickles with 5 by default), so every snapshot is written with this protocol.
PICKLE_PROTOCOL = 4


#: Where the one fake segment starts (an address of the shape CUDA hands out).
SEGMENT_BASE = 0x7F00_0000_0000


#: Fake segments are a whole number of 2 MiB pages, like the allocator's.
SEGMENT_ROUND = 2 * 1024 * 1024


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
    filename, line = split_source(ev.source or (entry.source if entry else ""))
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
        span = align_bytes(remaining)
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
    check_events(timeline)
    events = ordered_events(timeline)
    orphans = _find_orphan_frees(events)
    entries = {e.index: e for e in timeline.entries}
    space = _AddressSpace()
    live: dict[int, _Block] = {}
    for ev in orphans:  # live from the start, so placed first
        span = align_bytes(ev.nbytes)
        frames = _frames_for(ev, None, timeline.kind)
        live[ev.buffer] = _Block(space.alloc(span), span, ev.nbytes, frames, ev.category)
    permanent = _baseline_blocks(timeline, orphans, space)
    trace: list[dict[str, Any]] = []
    for ev in events:
        if ev.action == "alloc":
            span = align_bytes(ev.nbytes)
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
