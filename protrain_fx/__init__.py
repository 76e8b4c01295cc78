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

#: Why the functions below import where they are called: every import of a submodule runs this
#: module first, so it imports only the light record and option modules, not the backend, the
#: planner or the runtime behind them.
LAZY = "offload, what_fits and step_report import their modules when called"


def offload(model, optimizer, options=None, **keywords):
    """Put ``model``'s parameters into chunks, most in host memory; see :func:`protrain_fx.api.offload`."""
    from protrain_fx.api import offload as _offload  # (the root stays light: see LAZY)

    return _offload(model, optimizer, options, **keywords)


def what_fits(model, *args, **kwargs):
    """The plan and the smallest memory budget of ``model`` on these inputs, without training; see
    :mod:`protrain_fx.planner.fit`."""
    # (the root stays light: see LAZY)
    from protrain_fx.backend import register
    from protrain_fx.planner.fit import what_fits as _what_fits

    register()  # it compiles with backend="protrain": the name resolves from a source tree not installed too
    return _what_fits(model, *args, **kwargs)


def step_report():
    """A :class:`~protrain_fx.inspect.report.StepReport` of every graph captured so far (print it for the
    per-block tables, predicted peaks and graph breaks)."""
    from protrain_fx.inspect.report import StepReport  # (the root stays light)

    return StepReport(graphs=captured_graphs())


__all__ = [
    "BufferEvent",
    "CapturedGraph",
    "ProtrainConfig",
    "Timeline",
    "TimelineEntry",
    "captured_graphs",
    "graph_break_reasons",
    "offload",
    "parse_bytes",
    "parse_options",
    "reset",
    "step_report",
    "what_fits",
]
