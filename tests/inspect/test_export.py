"""CPU tests of protrain_fx.inspect.export and of the pure-Python half of protrain_fx.inspect.measure."""

from __future__ import annotations

import json
import pickle
import pickletools
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from torch.cuda import _memory_viz

from protrain_fx.analysis.timeline import BufferEvent, Timeline, TimelineEntry
from protrain_fx.inspect.export import write_all
from protrain_fx.inspect.measure import (
    mark_phase,
    marker_nbytes,
    record_memory,
    timeline_from_snapshot,
)
from protrain_fx.inspect.snapshot import (
    PICKLE_PROTOCOL,
    to_memory_snapshot,
    write_memory_snapshot,
)
from protrain_fx.inspect.svg import write_svg_plot
from protrain_fx.inspect.trace import to_chrome_trace, write_chrome_trace

MiB = 1024**2
SVG = "{http://www.w3.org/2000/svg}"
#: Opcodes the unpickler of pytorch.org/memory_viz (MemoryViz.js) understands.
VIEWER_OPCODES = {
    "PROTO",
    "APPEND",
    "APPENDS",
    "LIST",
    "TUPLE",
    "NEWFALSE",
    "NEWTRUE",
    "NONE",
    "BINGET",
    "BININT",
    "BININT1",
    "BININT2",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "FRAME",
    "LONG1",
    "LONG_BINGET",
    "MARK",
    "MEMOIZE",
    "BINPUT",
    "LONG_BINPUT",
    "SETITEMS",
    "SETITEM",
    "DICT",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "STOP",
    "EMPTY_TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "BINFLOAT",
}


# ------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------

NODES = [  # index, phase, name, op, block, source
    (0, "forward", "mm", "aten.mm", "layer1", "model.py:10"),
    (1, "forward", "relu", "aten.relu", "layer1", "model.py:11"),
    (2, "forward", "sum", "aten.sum", "head", "model.py:20"),
    (3, "backward", "sum_backward", "aten.expand", "head", "model.py:20"),
    (4, "backward", "relu_backward", "aten.threshold_backward", "layer1", "model.py:11"),
    (5, "backward", "mm_backward", "aten.mm", "layer1", "model.py:10"),
]


def _ev(index, action, buffer, nbytes, category, name, source=""):
    return BufferEvent(index, action, buffer, nbytes, category, name, source)


def predicted_timeline() -> Timeline:
    events = (
        _ev(0, "alloc", 1, 2 * MiB, "activation", "mm", "model.py:10"),
        _ev(1, "alloc", 2, 2 * MiB, "activation", "relu", "model.py:11"),
        _ev(1, "alloc", 7, 3 * MiB, "transient", "relu", "model.py:11"),
        _ev(1, "free", 7, 3 * MiB, "transient", "relu", "model.py:11"),
        _ev(2, "alloc", 3, 100, "output", "sum", "model.py:20"),  # not a multiple of 512
        _ev(3, "alloc", 4, 2 * MiB, "transient", "sum_backward", "model.py:20"),
        _ev(3, "free", 3, 100, "output", "sum_backward", "model.py:20"),
        _ev(4, "alloc", 5, 2 * MiB, "gradient", "relu_backward", "model.py:11"),
        _ev(4, "free", 4, 2 * MiB, "transient", "relu_backward", "model.py:11"),
        _ev(4, "free", 2, 2 * MiB, "activation", "relu_backward", "model.py:11"),
        _ev(5, "alloc", 6, 4 * MiB, "gradient", "mm_backward", "model.py:10"),
        _ev(5, "free", 5, 2 * MiB, "gradient", "mm_backward", "model.py:10"),
        _ev(5, "free", 1, 2 * MiB, "activation", "mm_backward", "model.py:10"),
        _ev(5, "free", 0, 1 * MiB, "input", "mm_backward", "model.py:10"),  # live before the step
        _ev(5, "alloc", 8, 0, "output", "mm_backward", "model.py:10"),  # empty tensor, stays live
    )
    entries = tuple(
        TimelineEntry(i, phase, 0, name, op, block, src, 10 * MiB, 5 * MiB, MiB, 0)
        for i, phase, name, op, block, src in NODES
    )
    timeline = Timeline(
        kind="predicted",
        device="cuda:0",
        events=events,
        entries=entries,
        phase_bounds={"forward": (0, 3), "backward": (3, 6)},
        baseline_bytes={"parameter": 4 * MiB, "input": 1 * MiB},
        label="toy",
    )
    peak = sum(timeline.baseline_bytes.values()) + max(v for _, v in timeline.curve())
    return Timeline(**{**timeline.__dict__, "peak_bytes": peak})


def measured_timeline() -> Timeline:
    sizes = [3, 3, 2, -2, 4, -3, 1, -4, -3, -1]  # MiB allocated (+) / freed (-) per event
    events, live, next_id = [], [], 100
    for i, mib in enumerate(sizes):
        if mib > 0:
            events.append(
                _ev(4 * i + 2, "alloc", next_id, mib * MiB, "other", "forward", "train.py:5")
            )
            live.append((next_id, mib))
            next_id += 1
        else:
            buf = next(b for b in live if b[1] == -mib)
            live.remove(buf)
            events.append(
                _ev(4 * i + 2, "free", buf[0], -mib * MiB, "other", "backward", "train.py:9")
            )
    return Timeline(
        kind="measured",
        device="cuda:0",
        events=tuple(events),
        phase_bounds={"forward": (1, 16), "backward": (16, 36), "optimizer": (36, 44)},
        baseline_bytes={"other": 5 * MiB},
        peak_bytes=5 * MiB + 10 * MiB,
        label="measured",
    )


# ------------------------------------------------------------------------------------------
# A Python port of what memory_viz's "Active Memory Timeline" computes
# ------------------------------------------------------------------------------------------


def viewer_live_bytes(snapshot: dict, device: int) -> tuple[int, list[int]]:
    """``(bytes live before the trace, bytes live after each alloc/free)`` as MemoryViz.js's
    process_alloc_data computes them: frees without an alloc and active blocks that the trace
    did not allocate count as allocated before the trace."""
    live: dict[int, int] = {}
    initial = 0
    after: list[int] = []
    total = 0
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            assert e["addr"] not in live, "two live allocations at one address"
            live[e["addr"]] = e["size"]
            total += e["size"]
            after.append(total)
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                total -= live.pop(e["addr"])
            else:
                initial += e["size"]
                total -= e["size"]
            after.append(total)
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in live:
                initial += b["requested_size"]
    return initial, [initial + v for v in after]


# ------------------------------------------------------------------------------------------
# Memory snapshot
# ------------------------------------------------------------------------------------------


def test_snapshot_round_trips_through_pickle(tmp_path: Path) -> None:
    snap = to_memory_snapshot(predicted_timeline())
    path = write_memory_snapshot(predicted_timeline(), tmp_path / "snap.pickle")
    data = path.read_bytes()
    assert pickle.loads(data) == snap
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert ops <= VIEWER_OPCODES, f"opcodes memory_viz cannot read: {ops - VIEWER_OPCODES}"
    assert data[1] == PICKLE_PROTOCOL <= 4


def test_snapshot_is_accepted_by_torch_memory_viz() -> None:
    snap = to_memory_snapshot(predicted_timeline())
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)
    assert "Allocator State History" in _memory_viz.segment_plot(snap)
    assert "total_allocated" in _memory_viz.segsum(snap)
    assert "TOTAL MEM" in _memory_viz.trace(snap)
    identity = lambda lines: lines  # noqa: E731  (flamegraph.pl is not needed for the check)
    assert "model.py:10:mm" in _memory_viz.segments(snap, format_flamegraph=identity)
    assert _memory_viz.memory(snap, format_flamegraph=identity)


def test_snapshot_layout_matches_torch_2_11() -> None:
    snap = to_memory_snapshot(predicted_timeline(), device_index=1)
    assert set(snap) >= {"segments", "device_traces"}
    assert snap["device_traces"][0] == [] and len(snap["device_traces"]) == 2
    for e in snap["device_traces"][1]:
        assert {"action", "addr", "size", "stream", "frames", "time_us"} <= set(e)
        for f in e["frames"]:
            assert set(f) == {"filename", "line", "name"}
    (seg,) = snap["segments"]
    assert seg["device"] == 1
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    address = seg["address"]
    for b in seg["blocks"]:  # blocks tile the segment, as memory_viz assumes
        assert b["address"] == address
        address += b["size"]
        assert b["requested_size"] <= b["size"]


def test_snapshot_frames_name_node_and_source() -> None:
    snap = to_memory_snapshot(predicted_timeline())
    first = snap["device_traces"][0][0]
    assert first["action"] == "alloc" and first["size"] == 2 * MiB
    assert first["frames"][0] == {"filename": "model.py", "line": 10, "name": "mm"}
    assert first["frames"][1]["name"] == "aten.mm"
    assert first["category"] == "activation"


def test_snapshot_live_bytes_equal_curve() -> None:
    tl = predicted_timeline()
    initial, live = viewer_live_bytes(to_memory_snapshot(tl), 0)
    baseline = sum(tl.baseline_bytes.values())
    assert initial == baseline
    assert live == [baseline + v for _, v in tl.curve()]
    assert max(live) == tl.peak_bytes


def test_snapshot_addresses_never_overlap() -> None:
    snap = to_memory_snapshot(predicted_timeline())
    (seg,) = snap["segments"]
    trace = snap["device_traces"][0]
    allocated = {e["addr"] for e in trace if e["action"] == "alloc"}
    live = {
        b["address"]: b["size"]
        for b in seg["blocks"]  # live from the start: baseline ...
        if b["state"] == "active_allocated" and b["address"] not in allocated
    }
    for e in trace:  # ... and buffers freed before the trace allocates them
        if e["action"] == "free_completed" and e["addr"] not in allocated:
            live[e["addr"]] = max(512, -(-e["size"] // 512) * 512)
    for e in trace:
        if e["action"] == "alloc":
            span = max(512, -(-e["size"] // 512) * 512)
            for addr, size in live.items():
                assert e["addr"] + span <= addr or addr + size <= e["addr"], "overlapping buffers"
            live[e["addr"]] = span
        elif e["action"] == "free_completed":
            del live[e["addr"]]
        assert all(
            seg["address"] <= a and a + s <= seg["address"] + seg["total_size"]
            for a, s in live.items()
        )


def test_snapshot_reuses_freed_space() -> None:
    events = (
        _ev(0, "alloc", 1, 4 * MiB, "activation", "a"),
        _ev(1, "free", 1, 4 * MiB, "activation", "a"),
        _ev(2, "alloc", 2, 4 * MiB, "activation", "b"),
    )
    snap = to_memory_snapshot(Timeline("predicted", "cuda:0", events))
    addrs = [e["addr"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert addrs[0] == addrs[1]


def test_snapshot_rejects_inconsistent_timelines() -> None:
    double_alloc = (_ev(0, "alloc", 1, 8, "x", "a"), _ev(1, "alloc", 1, 8, "x", "a"))
    size_mismatch = (_ev(0, "alloc", 1, 8, "x", "a"), _ev(1, "free", 1, 16, "x", "a"))
    double_free = (
        _ev(0, "alloc", 1, 8, "x", "a"),
        _ev(1, "free", 1, 8, "x", "a"),
        _ev(2, "free", 1, 8, "x", "a"),
    )
    negative = (_ev(0, "alloc", 1, -8, "x", "a"),)
    for events in (double_alloc, size_mismatch, double_free, negative):
        with pytest.raises(ValueError):
            to_memory_snapshot(Timeline("predicted", "cuda:0", events))
    with pytest.raises(ValueError):
        to_memory_snapshot(predicted_timeline(), device_index=-1)


def test_exported_snapshot_reads_back_as_measured_timeline() -> None:
    tl = predicted_timeline()
    back = timeline_from_snapshot(to_memory_snapshot(tl), label="again")
    assert back.kind == "measured" and back.label == "again"
    assert [v for _, v in back.curve()] == [v for _, v in tl.curve()]
    assert back.baseline_bytes == {"other": sum(tl.baseline_bytes.values())}
    assert back.peak_bytes == tl.peak_bytes
    assert back.events[0].name == "mm" and back.events[0].source == "model.py:10"


# ------------------------------------------------------------------------------------------
# Chrome trace
# ------------------------------------------------------------------------------------------


def test_chrome_trace_counters_equal_curve(tmp_path: Path) -> None:
    pred, meas = predicted_timeline(), measured_timeline()
    path = write_chrome_trace([pred, meas], tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for pid, tl in ((1, pred), (2, meas)):
        counters = [e for e in events if e["ph"] == "C" and e["pid"] == pid]
        assert [(e["ts"], e["args"]["step"]) for e in counters] == tl.curve()
        assert all(e["args"]["baseline"] == sum(tl.baseline_bytes.values()) for e in counters)
    nodes = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1]
    assert [e["name"] for e in nodes] == [n[2] for n in NODES]
    assert {"block", "op", "source", "peak_bytes"} <= set(nodes[0]["args"])
    phases = {
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["ph"] == "X" and e["tid"] == 2 and e["pid"] == 2
    }
    assert phases == meas.phase_bounds
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[1].startswith("toy (predicted") and names[2].startswith("measured")


def test_chrome_trace_aligned_to_first() -> None:
    pred, meas = predicted_timeline(), measured_timeline()
    events = to_chrome_trace([pred, meas], align_to_first=True)["traceEvents"]
    ts = [e["ts"] for e in events if e["ph"] == "C" and e["pid"] == 2]
    assert ts == sorted(ts) and 0 <= ts[0] and ts[-1] <= 6
    with pytest.raises(ValueError):
        to_chrome_trace([])


# ------------------------------------------------------------------------------------------
# SVG
# ------------------------------------------------------------------------------------------


def test_svg_has_both_curves_and_peaks(tmp_path: Path) -> None:
    path = write_svg_plot(
        predicted_timeline(),
        tmp_path / "plot.svg",
        measured_timeline(),
        title="toy <model> & friends",
    )
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    curves = {p.get("class"): p.get("d") for p in root.iter(f"{SVG}path")}
    assert curves["curve curve-predicted"].startswith("M")
    assert curves["curve curve-measured"].startswith("M")
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "predicted peak 13.00 MiB" in texts
    assert "measured peak 15.00 MiB" in texts
    assert {"forward", "backward"} <= set(texts) and "optimizer" not in texts
    assert "toy <model> & friends" in texts


def test_svg_predicted_only_uses_gib_for_large_timelines(tmp_path: Path) -> None:
    GiB = 1024**3
    events = (
        _ev(0, "alloc", 1, 12 * GiB, "activation", "a"),
        _ev(1, "free", 1, 12 * GiB, "activation", "a"),
    )
    tl = Timeline(
        "predicted",
        "cuda:0",
        events,
        phase_bounds={"forward": (0, 1), "backward": (1, 2)},
        baseline_bytes={"parameter": GiB // 3},
        peak_bytes=12 * GiB + GiB // 3,
    )
    root = ET.parse(write_svg_plot(tl, tmp_path / "plot.svg")).getroot()
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "predicted peak 12.33 GiB" in texts
    assert not any(p.get("class") == "curve curve-measured" for p in root.iter(f"{SVG}path"))


def test_svg_of_empty_timeline(tmp_path: Path) -> None:
    ET.parse(write_svg_plot(Timeline("predicted", "cuda:0", ()), tmp_path / "empty.svg"))


def test_write_all(tmp_path: Path) -> None:
    paths = write_all(predicted_timeline(), tmp_path / "out", measured_timeline(), stem="toy")
    assert {p.name for p in paths.values()} == {
        "toy_predicted.pickle",
        "toy_measured.pickle",
        "toy.json",
        "toy.svg",
    }
    assert all(p.exists() for p in paths.values())
    only = write_all(predicted_timeline(), tmp_path / "only")
    assert set(only) == {"predicted_snapshot", "chrome_trace", "svg"}


# ------------------------------------------------------------------------------------------
# Measured timelines from a (hand-built) real snapshot
# ------------------------------------------------------------------------------------------

BASE = 0x7F3A_0000_0000
TRAIN = {"filename": "/home/u/train.py", "line": 0, "name": "main"}


def _frames(*inner: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": n} for f, line, n in inner] + [TRAIN]


def _entry(action: str, addr: int, size: int, frames: list[dict], t: int) -> dict:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "frames": frames,
        "time_us": 1_700_000_000_000 + t,
        "compile_context": "N/A",
        "user_metadata": "",
    }


def _marker(name: str, addr: int, t: int, with_frames: bool = True) -> list[dict]:
    frames = (
        _frames(
            ("/work/main/protrain_fx/inspect/measure.py", 80, "_leave_phase_mark"),
            ("/work/main/protrain_fx/inspect/measure.py", 75, "mark_phase"),
            ("/home/u/train.py", 30, "step"),
        )
        if with_frames
        else []
    )
    size = marker_nbytes(name)
    return [_entry(a, addr, size, frames, t) for a in ("alloc", "free_requested", "free_completed")]


def real_like_snapshot() -> dict:
    mm = _frames(
        ("/usr/lib/python3/site-packages/torch/nn/functional.py", 1, "linear"),
        ("/home/u/model.py", 12, "forward"),
    )
    relu = _frames(("/home/u/model.py", 13, "forward"))
    grad = _frames(("/usr/lib/python3/site-packages/torch/autograd/graph.py", 8, "_engine_run"))
    small = BASE + 0x1000_0000
    trace = [
        _entry("segment_alloc", BASE + 20 * MiB, 20 * MiB, mm, 0),
        *_marker("forward", small, 1),  # positions 1-3
        _entry("alloc", BASE + 20 * MiB, 4 * MiB, mm, 4),  # 4
        _entry("alloc", BASE + 24 * MiB, 4 * MiB, relu, 5),  # 5
        *_marker("backward", small, 6, with_frames=False),  # 6-8
        _entry("alloc", BASE + 28 * MiB, 4 * MiB, grad, 9),  # 9
        _entry("free_requested", BASE + 24 * MiB, 4 * MiB, relu, 10),  # 10
        _entry("free_completed", BASE + 24 * MiB, 4 * MiB, relu, 11),  # 11
        _entry("free_requested", BASE + 4 * MiB, 2 * MiB, [], 12),  # 12: input from before
        _entry("free_completed", BASE + 4 * MiB, 2 * MiB, [], 13),  # 13
        *_marker("optimizer", small, 14),  # 14-16
        _entry("free_requested", BASE + 20 * MiB, 4 * MiB, mm, 17),  # 17
        _entry("free_completed", BASE + 20 * MiB, 4 * MiB, mm, 18),  # 18
        *_marker("end", small + 512, 19),  # 19-21
    ]

    def block(offset, size, state, frames=(), requested=None):
        return {
            "address": BASE + offset,
            "size": size,
            "state": state,
            "frames": list(frames),
            "requested_size": size if requested is None else requested,
        }

    segments = [
        {
            "device": 0,
            "address": BASE,
            "total_size": 20 * MiB,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "allocated_size": 4 * MiB,
            "active_size": 4 * MiB,
            "requested_size": 4 * MiB - 100,
            "blocks": [
                block(0, 4 * MiB, "active_allocated", requested=4 * MiB - 100),  # weights
                block(4 * MiB, 16 * MiB, "inactive", requested=0),
            ],
        },
        {
            "device": 0,
            "address": BASE + 20 * MiB,
            "total_size": 20 * MiB,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": mm,
            "allocated_size": 4 * MiB,
            "active_size": 4 * MiB,
            "requested_size": 4 * MiB,
            "blocks": [
                block(20 * MiB, 8 * MiB, "inactive", requested=0),
                block(28 * MiB, 4 * MiB, "active_allocated", grad),
                block(32 * MiB, 8 * MiB, "inactive", requested=0),
            ],
        },
        {
            "device": 1,
            "address": BASE * 2,
            "total_size": 2 * MiB,
            "stream": 0,
            "segment_type": "small",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "allocated_size": 2 * MiB,
            "active_size": 2 * MiB,
            "requested_size": 2 * MiB,
            "blocks": [block(BASE, 2 * MiB, "active_allocated")],
        },
    ]
    other_device = [_entry("alloc", BASE * 3, 512, [], 0)]
    return {
        "segments": segments,
        "device_traces": [trace, other_device],
        "allocator_settings": {},
        "external_annotations": [],
    }


def test_timeline_from_snapshot_events_phases_peak() -> None:
    tl = timeline_from_snapshot(real_like_snapshot())
    assert tl.kind == "measured" and tl.device == "cuda:0" and tl.label == "measured"
    got = [(e.index, e.action, e.buffer - BASE, e.nbytes) for e in tl.events]
    assert got == [
        (4, "alloc", 20 * MiB, 4 * MiB),
        (5, "alloc", 24 * MiB, 4 * MiB),
        (9, "alloc", 28 * MiB, 4 * MiB),
        (11, "free", 24 * MiB, 4 * MiB),
        (13, "free", 4 * MiB, 2 * MiB),
        (18, "free", 20 * MiB, 4 * MiB),
    ]
    assert tl.events[0].name == "forward" and tl.events[0].source == "/home/u/model.py:12"
    assert tl.events[2].name == "main" and tl.events[2].source == "/home/u/train.py:0"
    assert tl.phase_bounds == {"forward": (1, 6), "backward": (6, 14), "optimizer": (14, 19)}
    baseline = (4 * MiB - 100) + 2 * MiB  # weights still live + the input freed during the step
    assert tl.baseline_bytes == {"other": baseline}
    assert tl.peak_bytes == baseline + 12 * MiB


def test_timeline_from_snapshot_phase_marks_and_errors() -> None:
    snap = real_like_snapshot()
    names = ["forward", "backward", "optimizer", "end"]
    assert timeline_from_snapshot(snap, phase_marks=names).phase_bounds["forward"] == (1, 6)
    custom = timeline_from_snapshot(snap, phase_marks={"forward": 1, "backward": 6, "end": 14})
    assert custom.phase_bounds == {"forward": (1, 6), "backward": (6, 14)}
    other = timeline_from_snapshot(snap, device_index=1)
    assert other.device == "cuda:1" and other.baseline_bytes == {"other": 2 * MiB}
    assert [e.nbytes for e in other.events] == [512] and other.phase_bounds == {}
    with pytest.raises(ValueError):
        timeline_from_snapshot(snap, phase_marks=["forward"])
    with pytest.raises(ValueError):
        timeline_from_snapshot(snap, device_index=2)
    with pytest.raises(ValueError):
        timeline_from_snapshot({"segments": []})


def test_source_is_innermost_user_frame() -> None:
    def source_of(*frames: tuple[str, int, str]) -> tuple[str, str]:
        trace = [
            _entry(
                "alloc",
                BASE,
                4096,
                [{"filename": f, "line": n, "name": fn} for f, n, fn in frames],
                0,
            )
        ]
        (ev,) = timeline_from_snapshot({"segments": [], "device_traces": [trace]}).events
        return ev.name, ev.source

    cpp = ("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 900, "malloc")
    fx = ("<eval_with_key>.3", 7, "forward")
    lib = ("/venv/lib/python3.11/site-packages/torch/_tensor.py", 5, "backward")
    assert source_of(cpp, fx, lib, ("/x/model.py", 3, "forward")) == ("forward", "/x/model.py:3")
    assert source_of(lib, ("<stdin>", 8, "<module>")) == ("<module>", "<stdin>:8")
    assert source_of(cpp) == ("malloc", "")
    assert source_of() == ("<unknown>", "")


def test_repeated_phases_get_suffixes() -> None:
    trace = [
        *_marker("forward", BASE, 0),
        *_marker("backward", BASE, 3),
        *_marker("forward", BASE, 6),
        *_marker("backward", BASE, 9),
    ]
    tl = timeline_from_snapshot({"segments": [], "device_traces": [trace]})
    assert tl.phase_bounds == {
        "forward": (0, 3),
        "backward": (3, 6),
        "forward.1": (6, 9),
        "backward.1": (9, 12),
    }
    assert tl.events == () and tl.peak_bytes == 0


def test_measured_snapshot_plots_and_exports(tmp_path: Path) -> None:
    snap = real_like_snapshot()
    measured = timeline_from_snapshot(snap)
    paths = write_all(predicted_timeline(), tmp_path, measured_snapshot=snap)
    assert pickle.loads(paths["measured_snapshot"].read_bytes()) == snap
    ET.parse(paths["svg"])
    assert _memory_viz.trace_plot(to_memory_snapshot(measured))


def test_recording_is_inert_without_cuda() -> None:
    mark_phase("forward")  # not recording: nothing happens
    with pytest.raises(ValueError, match="unknown phase"):
        mark_phase("fwd")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            with record_memory():
                pass
    with pytest.raises(ValueError):
        record_memory(max_entries=0)
