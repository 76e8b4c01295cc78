"""Measured memory timelines: record the CUDA caching allocator over a training step.

``record_memory`` turns on the allocator's history (``torch.cuda.memory._record_memory_history``)
and takes ``torch.cuda.memory._snapshot()`` at exit; ``timeline_from_snapshot`` turns such a
snapshot into a ``Timeline`` of kind ``"measured"`` that can be laid over a predicted one.
``mark_phase`` leaves phase marks in the allocator trace while recording, and costs next to
nothing otherwise.

Everything but the recording itself is plain Python over the snapshot dict, so it is testable
without a GPU.

Why phase marks are tiny allocations: a mark must sit at an exact position in the device trace,
which is the only axis a measured timeline has. ``mark_phase`` therefore allocates and at once
frees a small uint8 CUDA tensor whose byte count encodes the phase, from a function of this file
(``_leave_phase_mark``), so the mark is found by its stack frame and, without frames, by its size.
The alternatives in torch 2.11 place marks less precisely or less surely:
``_set_memory_metadata`` only tags allocations made after it (a phase is seen at its first
allocation, not where it starts, and one that allocates nothing leaves no trace), and
record_function annotations (``global_record_annotations``) go to a separate list
(``external_annotations``) keyed by a microsecond clock, too coarse to order them among
allocations made in the same microsecond. A marker costs one cached small-block malloc and free
(microseconds), adds at most a few KiB at a phase boundary, and is left out of the events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from protrain_fx import settings
from protrain_fx.analysis.timeline import BufferEvent, Timeline

#: Names ``mark_phase`` accepts, in the order their marker sizes encode them.
PHASE_NAMES = ("setup", "forward", "backward", "optimizer", "end")
_PHASE_SET = frozenset(PHASE_NAMES)
_MARK_FUNCTION = "_leave_phase_mark"
_MARK_FILE_SUFFIX = "protrain_fx/inspect/measure.py"  # this file, where the marker is left
_MARK_UNIT = 512  # marker sizes step by the allocator's rounding unit ...
_MARK_OFFSET = 37  # ... plus an odd offset that real float tensors never have
#: Frames whose file contains one of these are library code, not the user's source.
_LIBRARY_PARTS = ("/torch/", "/protrain_fx/", "/torchinductor_", "/site-packages/torch")
#: Pseudo file names of generated code (FX graph modules, frozen modules, torch.package) and of
#: the frames ``inspect/snapshot.py`` writes for what it does not know a source line of.
_GENERATED_PREFIXES = (
    "<eval_with_key>",
    "<frozen ",
    "<torch_package_",
    "<fx_",
    "<protrain_fx",
    "<unknown source>",
    "<live before the step>",
)

_active: "record_memory | record_cpu_memory | None" = None


def marker_nbytes(name: str) -> int:
    """Byte count of the marker allocation ``mark_phase(name)`` leaves in the trace."""
    return _MARK_UNIT * (PHASE_NAMES.index(name) + 1) + _MARK_OFFSET


def _decode_marker_size(size: int, *, rounded_too: bool) -> str | None:
    """Phase name a marker of ``size`` bytes encodes (also from a 512-rounded size if asked)."""
    if size > _MARK_OFFSET and (size - _MARK_OFFSET) % _MARK_UNIT == 0:
        code = (size - _MARK_OFFSET) // _MARK_UNIT - 1
    elif rounded_too and size % _MARK_UNIT == 0:
        code = size // _MARK_UNIT - 2
    else:
        return None
    return PHASE_NAMES[code] if 0 <= code < len(PHASE_NAMES) else None


def mark_phase(name: str) -> None:
    """Mark the start of phase ``name`` ("forward", "backward", "optimizer", or "end" after the
    step) in the allocator trace of the running ``record_memory``; a no-op when none runs."""
    if name not in _PHASE_SET:
        raise ValueError(f"unknown phase {name!r}; expected one of {', '.join(PHASE_NAMES)}")
    recorder = _active
    if recorder is None:
        return
    recorder.marks.append(name)
    recorder.mark(name)


def _leave_phase_mark(nbytes: int, device_index: int) -> None:
    # Found in the trace by this function's name in the allocation's stack: keep the name.
    marker = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device_index))
    del marker


class record_memory:
    """Record the CUDA caching allocator over a block of code.

    ``with record_memory() as rec: ...`` then ``rec.snapshot`` (the raw
    ``torch.cuda.memory._snapshot()`` dict) and ``rec.timeline()``. Recording clears the
    allocator's earlier history and switches history off at exit.
    """

    def __init__(
        self, device: torch.device | str | int | None = None, max_entries: int = 1_000_000
    ):
        if not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.device = device
        self.max_entries = max_entries
        self.device_index = 0
        self.marks: list[str] = []
        self.snapshot: dict[str, Any] | None = None

    def __enter__(self) -> record_memory:
        global _active
        if not torch.cuda.is_available():
            raise RuntimeError(
                "record_memory needs a CUDA GPU: torch.cuda.is_available() is False on this "
                "machine, so there is no caching allocator to record"
            )
        if _active is not None:
            raise RuntimeError("record_memory is already recording; recordings cannot be nested")
        self.device_index = _device_index(self.device)
        self.marks = []
        self.snapshot = None
        torch.cuda.memory._record_memory_history(
            enabled="all",
            context="all",
            stacks="python",
            max_entries=self.max_entries,
            clear_history=True,
        )
        _active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _active
        _active = None
        try:
            self.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def mark(self, name: str) -> None:
        _leave_phase_mark(marker_nbytes(name), self.device_index)

    def timeline(self, *, label: str = "measured") -> Timeline:
        """The recorded step as a measured ``Timeline``."""
        if self.snapshot is None:
            raise RuntimeError("nothing recorded yet: use record_memory as a context manager first")
        return timeline_from_snapshot(self.snapshot, device_index=self.device_index, label=label)


def _device_index(device: torch.device | str | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"record_memory records CUDA memory, got device {device}")
    return torch.cuda.current_device() if device.index is None else device.index


# --------------------------------------------------------------------------------------------
# Snapshot -> Timeline (pure Python)
# --------------------------------------------------------------------------------------------


def _device_trace(snapshot: Mapping[str, Any], device_index: int) -> list[Mapping[str, Any]]:
    if (
        not isinstance(snapshot, Mapping)
        or "device_traces" not in snapshot
        or "segments" not in snapshot
    ):
        raise ValueError(
            "not a torch.cuda.memory._snapshot() dict: it needs 'segments' and 'device_traces'"
        )
    traces = snapshot["device_traces"]
    if not 0 <= device_index < len(traces):
        raise ValueError(
            f"device_index {device_index} out of range: the snapshot has traces for "
            f"{len(traces)} device(s)"
        )
    return list(traces[device_index])


def _frame_file(frame: Mapping[str, Any]) -> str:
    return str(frame.get("filename", "")).replace("\\", "/")


def _is_user_frame(frame: Mapping[str, Any]) -> bool:
    """A Python frame of the user's code: not C++ (stacks="all"), torch, protrain_fx, or code
    that FX / inductor / importlib generated; "<stdin>", "<string>" and notebook cells count."""
    filename = _frame_file(frame)
    if filename.startswith("<"):
        return not filename.startswith(_GENERATED_PREFIXES)
    if not filename.endswith(".py"):
        return False
    return not any(part in filename for part in _LIBRARY_PARTS)


def _name_and_source(frames: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The innermost user frame's function and ``"file:line"`` (innermost frame first)."""
    user = next((f for f in frames if _is_user_frame(f)), None)
    if user is not None:
        return str(user.get("name", "")), f"{user.get('filename', '')}:{user.get('line', 0)}"
    if frames:
        return str(frames[0].get("name", "<unknown>")), ""
    return "<unknown>", ""


def _marker_name(entry: Mapping[str, Any]) -> str | None:
    """The phase a marker's alloc entry encodes ("" if its size encodes none); None: no marker."""
    frames = entry.get("frames") or []
    size = int(entry.get("size", 0))
    if frames:
        is_marker = any(
            f.get("name") == _MARK_FUNCTION and _frame_file(f).endswith(_MARK_FILE_SUFFIX)
            for f in frames
        )
        return (_decode_marker_size(size, rounded_too=True) or "") if is_marker else None
    return _decode_marker_size(size, rounded_too=False)


def _events_and_marks(
    trace: Sequence[Mapping[str, Any]],
) -> tuple[list[BufferEvent], list[tuple[int, str]], int, set[int]]:
    """Buffer events (markers left out), marks ``(position, name)``, bytes freed that were live
    before recording (orphan frees), and the addresses allocated in the trace."""
    events: list[BufferEvent] = []
    marks: list[tuple[int, str]] = []
    live: dict[int, tuple[int, str, str]] = {}
    markers: set[int] = set()
    allocated: set[int] = set()
    orphan_bytes = 0
    for pos, entry in enumerate(trace):
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc":
            mark = _marker_name(entry)
            if mark is not None:
                marks.append((pos, mark))
                markers.add(addr)
                continue
            markers.discard(addr)
            allocated.add(addr)
            name, source = _name_and_source(entry.get("frames") or [])
            live[addr] = (int(entry["size"]), name, source)
            events.append(
                BufferEvent(pos, "alloc", addr, int(entry["size"]), "other", name, source)
            )
        elif action == "free_completed":
            if addr in markers:
                markers.discard(addr)
                continue
            if addr in live:
                size, name, source = live.pop(addr)
            else:
                size = int(entry["size"])
                name, source = _name_and_source(entry.get("frames") or [])
                orphan_bytes += size
            events.append(BufferEvent(pos, "free", addr, size, "other", name, source))
    return events, marks, orphan_bytes, allocated


def _preexisting_bytes(snapshot: Mapping[str, Any], device_index: int, allocated: set[int]) -> int:
    """Bytes of blocks still active at snapshot time that the trace never allocated: they were
    allocated before recording began (and never freed during it)."""
    total = 0
    for segment in snapshot["segments"]:
        if segment.get("device", device_index) != device_index:
            continue
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", []):
            block_address = int(block.get("address", address))
            address = block_address + int(block["size"])
            if block.get("state") not in ("active_allocated", "active_pending_free"):
                continue
            if block_address not in allocated:
                total += int(block.get("requested_size", block["size"]))
    return total


def _named_marks(
    marks: list[tuple[int, str]], phase_marks: Sequence[str] | Mapping[str, int] | None
) -> list[tuple[int, str]]:
    """Marks with their names: decoded from the trace, or given by ``phase_marks``."""
    if phase_marks is None:
        unknown = [pos for pos, name in marks if not name]
        if unknown:
            raise ValueError(
                f"phase markers at trace positions {unknown} have sizes that encode no phase; "
                "pass their names as phase_marks"
            )
        return marks
    if isinstance(phase_marks, Mapping):
        return sorted(((int(pos), str(name)) for name, pos in phase_marks.items()))
    if isinstance(phase_marks, str) or len(phase_marks) != len(marks):
        raise ValueError(
            f"phase_marks names {len(phase_marks)} mark(s) but the trace holds {len(marks)} "
            "(a trace cut short by max_entries loses its first marks)"
        )
    return [(pos, str(name)) for (pos, _), name in zip(marks, phase_marks, strict=True)]


def _phase_bounds(marks: list[tuple[int, str]], trace_length: int) -> dict[str, tuple[int, int]]:
    """Each mark opens a phase that the next mark (or the trace's end) closes; "end" opens none.
    A phase marked again gets a suffix: "forward", "forward.1", ..."""
    bounds: dict[str, tuple[int, int]] = {}
    for i, (pos, name) in enumerate(marks):
        if name == "end":
            continue
        end = marks[i + 1][0] if i + 1 < len(marks) else trace_length
        key, n = name, 0
        while key in bounds:
            n += 1
            key = f"{name}.{n}"
        bounds[key] = (pos, end)
    return bounds


def _peak(events: Sequence[BufferEvent], baseline: int) -> int:
    live = peak = baseline
    for ev in sorted(events, key=lambda e: (e.index, e.action == "free")):
        live += ev.nbytes if ev.action == "alloc" else -ev.nbytes
        peak = max(peak, live)
    return peak


def timeline_from_snapshot(
    snapshot: Mapping[str, Any],
    *,
    device_index: int = 0,
    phase_marks: Sequence[str] | Mapping[str, int] | None = None,
    label: str = "measured",
) -> Timeline:
    """A measured ``Timeline`` from a ``torch.cuda.memory._snapshot()`` dict.

    One event per ``alloc`` / ``free_completed`` entry of the device's trace (index = position
    in the trace, buffer = address), named by the innermost frame outside torch/ and protrain_fx/.
    ``baseline_bytes["other"]`` is what was allocated when recording began: blocks still active
    that the trace never allocated, plus frees of blocks it never allocated. ``phase_marks``
    names the ``mark_phase`` markers in trace order (by default their sizes name them), or maps
    phase names to trace positions for a trace without markers.
    """
    trace = _device_trace(snapshot, device_index)
    events, marks, orphan_bytes, allocated = _events_and_marks(trace)
    baseline = _preexisting_bytes(snapshot, device_index, allocated) + orphan_bytes
    bounds = _phase_bounds(_named_marks(marks, phase_marks), len(trace))
    return Timeline(
        kind="measured",
        device=f"cuda:{device_index}",
        events=tuple(events),
        phase_bounds=bounds,
        baseline_bytes={"other": baseline},
        peak_bytes=_peak(events, baseline),
        label=label,
    )


#: Profiler annotations ``mark_phase`` leaves while ``record_cpu_memory`` records.
_CPU_MARK_PREFIX = "protrain_fx.phase."


class record_cpu_memory:
    """Record CPU memory allocations over a block of code (the CPU counterpart of ``record_memory``).

    Uses the profiler's allocation events (``torch.profiler.profile(profile_memory=True)``): one
    event per allocation and free, with its address and size. ``baseline_bytes["other"]`` is the
    bytes of all CPU tensor storages alive when recording began (found through the garbage
    collector: parameters, optimizer state, inputs, and whatever else the process holds).
    """

    def __init__(self) -> None:
        self.marks: list[str] = []
        self.allocations: list[tuple[int, int, int]] = []  # (time ns, address, +/- bytes)
        self.mark_times: list[tuple[int, str]] = []
        self.baseline = 0

    def __enter__(self) -> "record_cpu_memory":
        global _active
        if _active is not None:
            raise RuntimeError("a memory recording is already running; recordings cannot be nested")
        self.baseline = _live_cpu_storage_bytes()
        if not torch.cuda.is_available():
            # A CUDA build of torch on a machine without a GPU: Kineto logs an ERROR line about the
            # GPU count when it starts, which reads as ours and says nothing about CPU memory.
            settings.quiet_kineto()
        self._profiler = torch.profiler.profile(
            # acc_events: one recording is one cycle; without it torch warns that it keeps one cycle only
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, acc_events=True,
        )
        self._profiler.__enter__()
        _active = self
        return self

    def mark(self, name: str) -> None:
        with torch.profiler.record_function(_CPU_MARK_PREFIX + name):
            pass

    def __exit__(self, *exc_info: object) -> None:
        global _active
        _active = None
        self._profiler.__exit__(*exc_info)
        from torch._C._profiler import _ExtraFields_Allocation

        stack = list(self._profiler.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            fields = event.extra_fields
            if isinstance(fields, _ExtraFields_Allocation):
                if fields.device.type == "cpu" and fields.alloc_size != 0:
                    self.allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            elif event.name.startswith(_CPU_MARK_PREFIX):
                self.mark_times.append((event.start_time_ns, event.name[len(_CPU_MARK_PREFIX):]))
        self.allocations.sort()
        self.mark_times.sort()

    def timeline(self, *, label: str = "measured") -> Timeline:
        """The recorded allocations as a measured ``Timeline`` (index = allocation event number)."""
        events: list[BufferEvent] = []
        live: dict[int, int] = {}
        serial = 0
        ids: dict[int, int] = {}
        orphan = 0
        for i, (_, ptr, size) in enumerate(self.allocations):
            if size > 0:
                serial += 1
                ids[ptr], live[ptr] = serial, size
                events.append(BufferEvent(i, "alloc", serial, size, "other", "cpu"))
            elif ptr in live:
                events.append(BufferEvent(i, "free", ids.pop(ptr), live.pop(ptr), "other", "cpu"))
            else:  # freed a block allocated before recording: it was part of the baseline
                orphan += -size
                serial += 1
                events.append(BufferEvent(i, "free", serial, -size, "other", "cpu"))
        times = [t for t, _, _ in self.allocations]
        import bisect

        marks = [(bisect.bisect_left(times, t), name) for t, name in self.mark_times]
        baseline = max(self.baseline, orphan)
        return Timeline(
            kind="measured",
            device="cpu",
            events=tuple(events),
            phase_bounds=_phase_bounds(marks, len(self.allocations)),
            baseline_bytes={"other": baseline},
            peak_bytes=_peak(events, baseline),
            label=label,
        )


def _live_cpu_storage_bytes() -> int:
    """Bytes of distinct CPU tensor storages reachable from Python's garbage collector."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            # Plain tensors only: fake and functional tensors (compiler internals) own no memory.
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                if storage.data_ptr():
                    seen[storage.data_ptr()] = storage.nbytes()
        except (ReferenceError, RuntimeError, NotImplementedError):  # dead proxies, odd tensors
            continue
    return sum(seen.values())
