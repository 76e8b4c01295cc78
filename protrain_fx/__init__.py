"""protrain_fx: a torch.compile backend that plans and analyses the memory of a training step.

Use it with ``torch.compile(model, backend="protrain", options={...})`` (no import needed once the
package is installed). This module exposes inspection: the captured graphs, their block tables and
memory timelines.
"""

from protrain_fx.analysis.timeline import BufferEvent, Timeline, TimelineEntry
from protrain_fx.capture import (
    CapturedGraph,
    captured_graphs,
    graph_break_reasons,
    reset,
)
from protrain_fx.config import ProtrainConfig, parse_bytes, parse_options
from protrain_fx.logs import register as _register_logs
from protrain_fx.version import __version__ as __version__

_register_logs()  # torch._logging.set_logs(modules={"protrain": ...}) (protrain_fx/logs.py)


def offload(model, optimizer, **kwargs):
    """Put ``model``'s parameters into chunks, most in host memory; see :mod:`protrain_fx.runtime.offload`."""
    from protrain_fx.runtime.offload import offload as _offload

    return _offload(model, optimizer, **kwargs)


def what_fits(model, *args, **kwargs):
    """The plan and the smallest memory budget of ``model`` on these inputs, without training; see
    :mod:`protrain_fx.planner.fit`."""
    from protrain_fx.backend import register
    from protrain_fx.planner.fit import what_fits as _what_fits

    register()  # it compiles with backend="protrain": the name resolves from a source tree not installed too
    return _what_fits(model, *args, **kwargs)


def step_report():
    """A :class:`~protrain_fx.inspect.report.StepReport` of every graph captured so far (print it for the
    per-block tables, predicted peaks and graph breaks)."""
    from protrain_fx.inspect.report import StepReport

    return StepReport(graphs=captured_graphs())


__all__ = [
    "offload",
    "step_report",
    "what_fits",
    "CapturedGraph",
    "ProtrainConfig",
    "BufferEvent",
    "Timeline",
    "TimelineEntry",
    "captured_graphs",
    "graph_break_reasons",
    "parse_bytes",
    "parse_options",
    "reset",
]
