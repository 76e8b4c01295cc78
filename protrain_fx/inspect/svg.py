"""A self-contained SVG plot of bytes live over one step, predicted with measured overlaid.

The measured curve is mapped onto the predicted one's x axis phase by phase (linearly over the
whole range when the two share no phase), the baseline is a dashed line, peaks are labelled where
the labels do not overlap. The plot needs no plotting library: it is written as SVG text, so that
an export works on any machine that can run the backend.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from protrain_fx.analysis.timeline import Timeline
from protrain_fx.inspect.events import (
    BOTTOM,
    GIB,
    HEIGHT,
    LEFT,
    RIGHT,
    TOP,
    WIDTH,
    Bounds,
    Point,
    alignment,
    display_name,
    index_range,
    map_linear,
    phase_pairs,
)

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
            run.append((map_linear(points[i][0], src, dst), float(points[i][1])))
            i += 1
        run.append((float(dst[1]), run[-1][1]))
        runs.append(run)
    return runs


def _series(key: str, timeline: Timeline, pairs: Sequence[Any], note: str = "") -> _Series:
    runs = _runs(timeline, pairs)
    peak = max((v for run in runs for v in run), key=lambda v: v[1], default=None)
    reported = max(timeline.peak_bytes, int(peak[1]) if peak else 0)
    label = (
        f"{key} ({display_name(timeline)})" if timeline.label and timeline.label != key else key
    )
    return _Series(key, label + note, runs, peak, reported)


class _Canvas:
    """Data-to-pixel transform of the plot area."""

    def __init__(self, x_range: tuple[float, float], y_max: float) -> None:
        self.x0, self.x1 = x_range
        self.y_max = y_max

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) * (RIGHT - LEFT) / (self.x1 - self.x0)

    def py(self, y: float) -> float:
        return BOTTOM - y * (BOTTOM - TOP) / self.y_max


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
        f'<rect x="{LEFT}" y="{TOP}" width="{RIGHT - LEFT}" height="{BOTTOM - TOP}" '
        'fill="white" stroke="#444"/>'
    ]
    for v in _ticks(0, canvas.y_max / unit[1], 6):
        y = canvas.py(v * unit[1])
        parts.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{RIGHT}" y2="{y:.1f}" stroke="#e6e6e6"/>'
        )
        parts.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(v)}</text>'
        )
    for v in _ticks(canvas.x0, canvas.x1, 10, integer=True):
        x = canvas.px(v)
        parts.append(
            f'<line x1="{x:.1f}" y1="{BOTTOM}" x2="{x:.1f}" y2="{BOTTOM + 5}" stroke="#444"/>'
        )
        parts.append(
            f'<text x="{x:.1f}" y="{BOTTOM + 18}" text-anchor="middle">{_tick_label(v)}</text>'
        )
    mid_y = (TOP + BOTTOM) / 2
    parts.append(
        f'<text x="22" y="{mid_y}" text-anchor="middle" transform="rotate(-90 22 {mid_y})">'
        f"{unit[0]} live (before the step + allocated in it)</text>"
    )
    parts.append(
        f'<text x="{(LEFT + RIGHT) / 2}" y="{BOTTOM + 38}" text-anchor="middle">'
        "step position (node index of the predicted timeline)</text>"
    )
    return parts


def _svg_phases(canvas: _Canvas, bounds: Bounds) -> list[str]:
    parts = []
    for phase, (start, end) in sorted(bounds.items(), key=lambda kv: kv[1]):
        for x in (canvas.px(start), canvas.px(end)):
            if LEFT < x < RIGHT:
                parts.append(
                    f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{BOTTOM}" '
                    'stroke="#999" stroke-dasharray="4 3"/>'
                )
        middle = (canvas.px(start) + canvas.px(end)) / 2
        parts.append(
            f'<text x="{middle:.1f}" y="{TOP - 8}" text-anchor="middle" fill="#555" '
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
    if x > LEFT + 0.6 * (RIGHT - LEFT):
        sides.reverse()
    candidates = [(x + dx, y + dy, anchor) for dy in (-8, 18, -26, 36) for anchor, dx in sides]
    for cx, cy, anchor in candidates:
        box = _label_box(cx, cy, anchor, text)
        inside = LEFT <= box[0] and box[2] <= RIGHT and TOP <= box[1] and box[3] <= BOTTOM
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
    parts, x, y = [], float(LEFT), HEIGHT - 14
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
    x_range = index_range(predicted)
    series = [_series("predicted", predicted, [(x_range, x_range)])]
    if measured is not None:
        shared = phase_pairs(measured.phase_bounds, predicted.phase_bounds)
        note = "" if shared else ", x scaled linearly: no shared phase"
        series.append(_series("measured", measured, alignment(measured, predicted), note))
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
        title or f"Memory over one training step: {display_name(predicted)} on {predicted.device}"
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT}" y="22" font-size="16" font-weight="bold">{escape(title)}</text>',
        *_svg_axes(canvas, unit),
        *_svg_phases(canvas, predicted.phase_bounds),
    ]
    if baseline:
        y = canvas.py(baseline)
        parts.append(
            f'<line class="baseline" x1="{LEFT}" y1="{y:.1f}" x2="{RIGHT}" y2="{y:.1f}" '
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
