"""Timelines as a Chrome trace (chrome://tracing, ui.perfetto.dev).

Each timeline is one process with three threads: a live-bytes counter, one slice per node, one
slice per phase. Timestamps are step indices read as microseconds, so the trace shows order and
not wall time; with ``align_to_first`` the later timelines are mapped onto the first one's indices
phase by phase, for a measured step beside its prediction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from protrain_fx.analysis.timeline import Timeline
from protrain_fx.inspect.events import (
    ToTs,
    alignment,
    as_timelines,
    display_name,
    identity,
    map_x,
)


def _metadata_events(pid: int, timeline: Timeline) -> list[dict[str, Any]]:
    name = f"{display_name(timeline)} ({timeline.kind}, {timeline.device})"
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
    tls = as_timelines(timelines)
    events: list[dict[str, Any]] = []
    for pid, tl in enumerate(tls, start=1):
        reference = tls[0] if align_to_first and pid > 1 else None
        to_ts: ToTs = (
            identity if reference is None else partial(map_x, pairs=alignment(tl, reference))
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
