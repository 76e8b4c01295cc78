"""What the timeline exporters share: event order, fake-address alignment, phase alignment.

A :class:`~protrain_fx.analysis.timeline.Timeline` is exported three ways (memory snapshot,
Chrome trace, SVG plot); this module holds what all three read the same way, so that they agree:
the order in which events apply (allocs before frees at one index, as ``Timeline.curve()``), the
512-byte block rounding of fake addresses, ``"file:line"`` source splitting, and the phase-by-phase
map of a measured timeline's step indices onto a predicted one's. It also holds the SVG canvas
geometry. Everything here reads timelines; nothing writes files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from protrain_fx.analysis.timeline import BufferEvent, Timeline


def ordered_events(timeline: Timeline) -> list[BufferEvent]:
    """The events in the order ``Timeline.curve()`` applies them (allocs first at equal index)."""
    return sorted(timeline.events, key=lambda e: (e.index, e.action == "free"))


def align_bytes(nbytes: int) -> int:
    return max(BLOCK_ALIGN, -(-nbytes // BLOCK_ALIGN) * BLOCK_ALIGN)


def split_source(source: str) -> tuple[str, int]:
    """``"path/model.py:12"`` (or ``"path:12:4"``) into ``("path/model.py", 12)``."""
    parts = source.split(":")
    numbers: list[int] = []
    while len(parts) > 1 and parts[-1].strip().isdigit():
        numbers.insert(0, int(parts.pop()))
    filename = ":".join(parts)
    return (filename or "<unknown source>", numbers[0] if numbers else 0)


def check_events(timeline: Timeline) -> None:
    for ev in timeline.events:
        if ev.action not in ("alloc", "free"):
            raise ValueError(f"event {ev!r}: action must be 'alloc' or 'free'")
        if not isinstance(ev.nbytes, int) or ev.nbytes < 0:
            raise ValueError(f"event {ev!r}: nbytes must be a non-negative int")
        if not isinstance(ev.index, int):
            raise ValueError(f"event {ev!r}: index must be an int")


def as_timelines(timelines: Timeline | Iterable[Timeline]) -> list[Timeline]:
    result = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not result:
        raise ValueError("no timeline given")
    for tl in result:
        if not isinstance(tl, Timeline):
            raise ValueError(f"expected Timeline objects, got {type(tl).__name__}")
    return result


def display_name(timeline: Timeline) -> str:
    return timeline.label or timeline.kind


#: The SVG plot's size in pixels.
WIDTH, HEIGHT = 1000, 500


#: The SVG plot area's edges in pixels (room for axis labels, title and legend around it).
LEFT, RIGHT, TOP, BOTTOM = 80, 970, 56, 420


#: The caching allocator rounds every block to 512 bytes; fake addresses keep that alignment.
BLOCK_ALIGN = 512


GIB = 1024**3


#: Maps a step index to a trace timestamp, or None to leave the point out.
ToTs = Callable[[float], float | None]


def phase_pairs(src: Bounds, dst: Bounds) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``(src range, dst range)`` of each phase both have, in destination order."""
    pairs = [
        (tuple(src[p]), tuple(dst[p]))
        for p in dst
        if p in src and src[p][1] >= src[p][0] and dst[p][1] >= dst[p][0]
    ]
    return sorted(pairs, key=lambda pair: pair[1])  # type: ignore[return-value]


def map_linear(x: float, src: tuple[float, float], dst: tuple[float, float]) -> float:
    if src[1] == src[0]:
        return float(dst[0])
    return dst[0] + (x - src[0]) * (dst[1] - dst[0]) / (src[1] - src[0])


def map_x(x: float, pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]]) -> float | None:
    for src, dst in pairs:
        if src[0] <= x < src[1]:
            return map_linear(x, src, dst)
    return None


def index_range(timeline: Timeline) -> tuple[int, int]:
    """``[first, last + 1)`` over events, nodes and phases (``(0, 1)`` for an empty timeline)."""
    xs = [e.index for e in timeline.events] + [e.index for e in timeline.entries]
    lo = min([*xs, *(b[0] for b in timeline.phase_bounds.values())], default=0)
    hi = max([*(x + 1 for x in xs), *(b[1] for b in timeline.phase_bounds.values())], default=1)
    return lo, max(hi, lo + 1)


def alignment(
    timeline: Timeline, reference: Timeline
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """How ``timeline``'s x maps onto ``reference``'s: phase by phase, or whole range if no phase
    is shared."""
    pairs = phase_pairs(timeline.phase_bounds, reference.phase_bounds)
    return pairs or [(index_range(timeline), index_range(reference))]


def identity(x: float) -> float:
    return x


Bounds = Mapping[str, tuple[int, int]]


Point = tuple[float, float]
