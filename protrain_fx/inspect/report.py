"""Inspection: what the backend sees of a model's training step, as tables and readable graphs.

``inspect_model(model, *inputs)`` compiles the model with ``backend="protrain"``, runs one forward
and backward (restoring the gradients it found), and returns a :class:`StepReport`: per graph, the
block table (parameter bytes, saved activation bytes, transient peak, forward/backward node counts,
measured time share when asked for), the readable forward and backward graphs after our passes,
graph breaks, and the predicted memory timeline ready to export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from protrain_fx import capture
from protrain_fx.analysis.params import parameter_infos
from protrain_fx.analysis.timeline import Timeline
from protrain_fx.backend import register
from protrain_fx.capture import CapturedGraph
from protrain_fx.chunks import choose_layout
from protrain_fx.inspect.block_times import profile_block_times
from protrain_fx.inspect.export import write_all
from protrain_fx.inspect.tables import block_table


@dataclass
class StepReport:
    """What :func:`inspect_model` found. ``graphs`` are all captured graphs, in order."""

    graphs: list[CapturedGraph]
    block_seconds: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def train_graphs(self) -> list[CapturedGraph]:
        return [g for g in self.graphs if g.memory is not None and g.backward is not None]

    @property
    def graph_breaks(self) -> list[str]:
        return [r for g in self.graphs for r in g.graph_breaks_after]

    @property
    def predicted_peak_bytes(self) -> int:
        """Largest predicted peak over the captured graphs (each includes the model states)."""
        return max((g.memory.peak_bytes for g in self.graphs if g.memory is not None), default=0)

    def timeline(self, index: int | None = None) -> Timeline:
        """The predicted timeline of graph ``index`` (default: the first training graph)."""
        graph = self._graph(index)
        assert graph.memory is not None
        return graph.memory.timeline

    def forward_graph(self, index: int | None = None) -> str:
        """Readable forward graph (or inference graph) after our passes."""
        return self._graph(index).readable.get("forward", "")

    def backward_graph(self, index: int | None = None) -> str:
        """Readable backward graph after our passes (empty for graphs without backward)."""
        return self._graph(index).readable.get("backward", "")

    def _graph(self, index: int | None) -> CapturedGraph:
        if index is not None:
            return self.graphs[index]
        candidates = self.train_graphs or [g for g in self.graphs if g.memory is not None]
        if not candidates:
            raise ValueError("no analysed graph was captured")
        return candidates[0]

    def block_table(self, index: int | None = None) -> str:
        """The per-block table of one graph (default: the first training graph)."""
        graph = self._graph(index)
        return block_table(graph, self.block_seconds.get(graph.index, {}))

    def chunk_layout(self, index: int | None = None):
        """The parameter chunk layout (``protrain_fx.chunks``) this graph's parameters would get."""
        graph = self._graph(index)
        if graph.step is None:
            raise ValueError(f"graph {graph.index} was not analysed")
        return choose_layout(parameter_infos(graph.step, graph.dynamo_graph))

    def summary(self) -> str:
        """All graphs: kinds, graph breaks, and the block table of each training graph."""
        breaks = [b for g in self.graphs for b in g.breaks]
        inside = [b for b in breaks if b.inside_block]
        lines = [f"protrain_fx: {len(self.graphs)} graph(s) captured, {len(self.graph_breaks)} graph break(s)"
                 + (f", {len(inside)} inside transformer blocks" if inside else "")]
        lines += [f"  graph break: {b.line()}" for b in breaks]
        if inside:
            lines.append("  a break inside a block splits the blocks over graphs (or leaves the rest to run outside "
                         "the backend): they are not planned together; remove it (a print, .item(), data-dependent "
                         "control flow)")
        lines += [f"  {g.describe()}" for g in self.graphs]
        for g in self.graphs:
            if g.memory is not None:
                lines += ["", self.block_table(g.index)]
        return "\n".join(lines)

    __str__ = summary

    def write_timelines(self, out_dir: str | Path, measured: Timeline | None = None, *, stem: str = "timeline",
                        index: int | None = None) -> dict[str, Path]:
        """Write the predicted timeline (and a measured one, overlaid) as snapshot, Chrome trace and SVG."""
        return write_all(self.timeline(index), Path(out_dir), measured=measured, stem=stem)


def inspect_model(
    model: torch.nn.Module,
    *example_inputs: Any,
    options: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    measure_time: bool = False,
) -> StepReport:
    """Compile ``model`` with the protrain backend, run one forward+backward, and report what was seen.

    ``loss_fn`` turns the model's output into a scalar (default: the output itself, which must then
    be a scalar). Gradients already on the parameters are restored afterwards. ``measure_time`` times
    every node per block (``inspect/block_times.py``) to fill the table's time column.
    Resets Dynamo's compile cache (``torch._dynamo.reset()``) so the model is captured afresh.
    """
    torch._dynamo.reset()
    capture.reset()
    saved_grads = {p: p.grad for p in model.parameters()}

    register()  # the name resolves from a source tree that is not installed too
    compiled = torch.compile(model, backend="protrain", options=dict(options or {}))
    out = compiled(*example_inputs)
    loss = loss_fn(out) if loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "inspect_model needs a scalar to run backward: the model returned "
            f"{type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}; pass loss_fn="
        )
    loss.backward()
    report = StepReport(graphs=capture.captured_graphs())
    if measure_time:
        for g in report.train_graphs:
            report.block_seconds[g.index] = profile_block_times(g)
    for p, g in saved_grads.items():
        p.grad = g
    return report

