"""What protrain_fx keeps between compiles in one process: one owner, one ``reset()``.

Lifetime: the :data:`STATE` lives as long as the process. What it holds is made by compiles and
first steps and read by later ones:

* ``records``: every graph the backend captured, in order (``capture.CapturedGraph``), and the
  graph-break bookkeeping that attributes Dynamo's breaks to them;
* ``measured_outside``: per device, the bytes a first step held above its graph's analysed peak
  (the user's code around the graph); later plans keep that much under their cap
  (``planner/reserve.py``);
* ``reset_after_miss``: devices whose next planned graph resets the peak statistics before its
  first step (``planner/first_step.py``);
* ``faster_plan``: per device and Dynamo code object, the plan a first step ran and the one it found
  faster with the reserve it measured; the graph compiled again judges that one first
  (``planner/verify.faster_after_first_step``);
* ``warned_not_averaged``: whether the warning that nothing averages a data-parallel graph's
  gradients was given (``backend.py``; once a process);
* ``break_lines``: the user's line of each graph break Dynamo logged, by reason (``capture.py``);
* what runtime components register with :meth:`ProcessState.on_reset` (the swap ops' pinned host pool);
* per thread, the graph a thread compiles again beside training (:func:`compiling_beside`).

``protrain_fx.reset()`` (that is, :meth:`ProcessState.reset`) forgets all of it; ``torch._dynamo.reset()``
is still needed to compile again. Offloaded models are not forgotten: their chunk stores belong to
their handles and live as long as the handles do.

This module imports nothing from the rest of the package, so every layer (the runtime too) may use it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProcessState:
    """The process-wide state of protrain_fx (module docstring)."""

    #: Captured graphs, in capture order (``capture.CapturedGraph``).
    records: list[Any] = field(default_factory=list)
    #: Dynamo's graph-break counter as last seen, to attribute new breaks to the next graph.
    breaks_seen: Counter[str] = field(default_factory=Counter)
    #: Entries of Dynamo's ``graph_break_reasons`` already attributed.
    break_stacks_seen: int = 0
    #: Per device (``"cuda:0"``): bytes a first step held above its graph's analysed peak.
    measured_outside: dict[str, int] = field(default_factory=dict)
    #: Devices whose next planned graph resets the peak statistics before its first step.
    reset_after_miss: dict[str, bool] = field(default_factory=dict)
    #: Per ``(device, code)``: ``(config that ran, its how, config predicted faster)`` after a first step.
    faster_plan: dict[tuple[str, Any], tuple[Any, str, Any]] = field(default_factory=dict)
    #: Whether the once-a-process warning that nothing averages a data-parallel graph was given.
    warned_not_averaged: bool = False
    #: Per graph-break reason (its first line): ``file:line in function`` of the user's code where
    #: Dynamo last logged it (``capture.watch_break_lines``); a break that made Dynamo skip a frame
    #: leaves no other line.
    break_lines: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _on_reset: list[Callable[[], None]] = field(default_factory=list)

    def on_reset(self, forget: Callable[[], None]) -> None:
        """Have ``forget()`` called by every :meth:`reset` (a component's own process-wide state)."""
        self._on_reset.append(forget)

    def reset(self) -> None:
        """Forget everything listed in the module docstring."""
        with self.lock:
            self.records.clear()
            self.breaks_seen.clear()
            self.break_stacks_seen = 0
            self.measured_outside.clear()
            self.reset_after_miss.clear()
            self.faster_plan.clear()
            self.warned_not_averaged = False
            self.break_lines.clear()
        for forget in self._on_reset:
            forget()


#: The one state of this process.
STATE = ProcessState()

_THREAD = threading.local()


def set_compiling_beside(code: Any) -> None:
    """Mark this thread as compiling the graph of Dynamo's ``code`` again beside training
    (``beside.py``; ``None``: no longer). Read below the backend (capture, the profile), which must not
    import it."""
    _THREAD.code = code


def compiling_beside() -> Any:
    """The Dynamo code object whose graph this thread compiles again beside training, else ``None``."""
    return getattr(_THREAD, "code", None)


class MeasuringBeside(RuntimeError):
    """A compile beside training was about to measure the machine or the model's ops: readings taken
    while training runs are not the machine's, and they would be cached."""


def refuse_measuring(what: str) -> None:
    """Raise :class:`MeasuringBeside` on a thread that compiles beside training (the profile's and the
    op timings' entry points call this before they measure ``what``). Compiled again, a graph finds
    its rates cached by its first compile; a compile that would measure gives up instead."""
    if compiling_beside() is not None:
        raise MeasuringBeside(f"the compile beside training would measure {what} while training runs")
