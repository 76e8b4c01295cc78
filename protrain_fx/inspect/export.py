"""One call that writes every view of a predicted (and optionally measured) step's memory.

:func:`write_all` puts into one directory the memory snapshots (for pytorch.org/memory_viz), the
Chrome trace (chrome://tracing, ui.perfetto.dev) and the SVG plot, named from one stem. It is
separate from the three writers so that each stays usable alone and this module is the only one
that knows the file names. A real ``torch.cuda.memory._snapshot()`` dict, when given, is written
as it is, with its own addresses and stacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protrain_fx.analysis.timeline import Timeline
from protrain_fx.inspect.measure import timeline_from_snapshot
from protrain_fx.inspect.snapshot import write_memory_snapshot, write_snapshot_pickle
from protrain_fx.inspect.svg import write_svg_plot
from protrain_fx.inspect.trace import write_chrome_trace


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
