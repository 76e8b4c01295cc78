"""Progress of a first compile's long phases: one line on stderr, and the time each phase took.

A compile (``backend.py``) opens a :func:`recording`; the code that does the long work opens a
:func:`phase` around it (``profile/`` around its measurements, ``planner/`` around the search and
the machine's rates, the backend around capture, trial lowerings and codegen)::

    with progress.phase("ops", "profiling ops", total=len(missing)) as ops:
        for sig in missing:
            ...
            ops.advance()

Two things come of it:

* **Times.** Each phase's seconds, measured with ``time.perf_counter`` around the real calls, are
  added to the recording's ``seconds`` dict under the phase's key, in the order phases first ran.
  A phase opened inside another counts for itself only: the outer one pauses meanwhile, so the
  phases never overlap and their sum is at most the recording's wall time. A phase entered many
  times (every trial lowering) adds up.
* **A line.** While a recording runs, one line on stderr shows the innermost phase, its item count
  where it has one (``profiling ops 37/120``; ``trial lowerings 3``), its seconds and the
  recording's; it is redrawn in place (carriage return) on every change and every
  :data:`TICK_S` seconds, and ends, when the recording closes, as the phases' times and a newline.
  Shown only when stderr is a terminal, unless ``PROTRAIN_PROGRESS`` says otherwise (``0``: never,
  ``1``: always; ``docs/options.md``). Off, nothing is written: the log lines are all there is.
  :func:`note` writes a message line under the progress line (or as it always was, when none is shown).

A phase opened with no recording around it (a profile function called on its own) records into a
recording of its own, shown the same way. The current recording is a context variable: a phase in
another thread is not part of the compile's.

This module imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, ParamSpec, TypeVar

from protrain_fx import settings

#: The environment variable that forces the line off (``0``) or on (``1``) whatever stderr is.
ENV = settings.PROGRESS

#: Seconds between redraws of a line whose phase has no item to count (its seconds still move).
TICK_S = 0.5

P = ParamSpec("P")
R = TypeVar("R")


def shown(stream: IO[str]) -> bool:
    """Whether a progress line goes to ``stream``: ``PROTRAIN_PROGRESS`` when set to ``0`` or ``1``
    (or ``false``/``true``, ``off``/``on``, ``no``/``yes``), else whether ``stream`` is a terminal."""
    chosen = settings.progress()
    if chosen is not None:
        return chosen
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def seconds_line(seconds: dict[str, float]) -> str:
    """``"capture 12.3 s, ops 20.1 s, search 0.05 s"``: each phase's seconds, two significant digits
    under a second, one decimal above."""
    return ", ".join(f"{key} {s:.2g} s" if s < 1 else f"{key} {s:.1f} s" for key, s in seconds.items())


@dataclass
class _Frame:
    key: str
    label: str
    resumed: float  # perf_counter when this phase last became the innermost one


@dataclass
class Recording:
    """One run of phases (a compile): their seconds, and the line that shows them (module docstring)."""

    seconds: dict[str, float]
    title: str
    stream: IO[str] | None  # None: no line is shown
    started: float
    _stack: list[_Frame] = field(default_factory=list)
    _counts: dict[str, int] = field(default_factory=dict)
    _totals: dict[str, int | None] = field(default_factory=dict)
    _width: int = 0  # characters of the line now drawn (0: none)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # -- phases ---------------------------------------------------------------------------------

    def begin(self, key: str, label: str | None = None, *, total: int | None = None,
              since: float | None = None) -> None:
        """Open phase ``key`` inside the current one (which pauses); ``since``: the
        ``perf_counter`` time it began, when that was before this call (and after the current phase
        last resumed). Closed by :meth:`end`."""
        with self._lock:
            now = time.perf_counter()
            start = now if since is None else min(now, since)
            if self._stack:
                top = self._stack[-1]
                start = max(start, top.resumed)
                self._accrue(top, start)
            self.seconds.setdefault(key, 0.0)
            self._counts.setdefault(key, 0)  # also: the phases this recording ran, for its last line
            if total is not None or key not in self._totals:
                self._totals[key] = total
            self._stack.append(_Frame(key, label or key, start))
            self._draw()

    def end(self, key: str) -> None:
        """Close phase ``key`` and any phase still open inside it; nothing when it is not open."""
        with self._lock:
            if all(f.key != key for f in self._stack):
                return
            now = time.perf_counter()
            while self._stack:
                frame = self._stack.pop()
                self._accrue(frame, now)
                if frame.key == key:
                    break
            if self._stack:  # the outer phase resumes (with none open, the line waits for the next)
                self._stack[-1].resumed = now
                self._draw()

    def advance(self, key: str, n: int = 1) -> None:
        """``n`` more items of phase ``key`` done (or started: the phase's own choice)."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n
            self._draw()

    def set_total(self, key: str, total: int | None) -> None:
        """Phase ``key`` has ``total`` items (``None``: uncounted)."""
        with self._lock:
            self._totals[key] = total
            self._draw()

    def _accrue(self, frame: _Frame, until: float) -> None:
        self.seconds[frame.key] = self.seconds.get(frame.key, 0.0) + max(0.0, until - frame.resumed)
        frame.resumed = until

    # -- the line -------------------------------------------------------------------------------

    def text(self) -> str:
        """The line as drawn now: the innermost phase, its items and seconds, and the recording's."""
        with self._lock:
            now = time.perf_counter()
            total_s = now - self.started
            if not self._stack:
                return f"{self.title}: {total_s:.1f} s"
            top = self._stack[-1]
            spent = self.seconds.get(top.key, 0.0) + max(0.0, now - top.resumed)
            count, total = self._counts.get(top.key, 0), self._totals.get(top.key)
            items = f" {count}/{total}" if total is not None else (f" {count}" if count else "")
            return f"{self.title}: {top.label}{items}, {spent:.1f} s ({total_s:.1f} s in all)"

    def _draw(self, text: str | None = None, *, final: bool = False) -> None:
        if self.stream is None:
            return
        text = self.text() if text is None else text
        columns = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
        text = text[:columns] if not final else text
        pad = " " * max(0, self._width - len(text))
        try:
            self.stream.write("\r" + text + pad + ("\n" if final else ""))
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream: stop drawing
            self.stream = None
            return
        self._width = 0 if final else len(text)

    def note(self, message: str) -> None:
        """Write ``message`` as a line of its own under the progress line, which is drawn again under it."""
        with self._lock:
            if self.stream is None or not self._width:
                print(message, file=sys.stderr, flush=True)
                return
            self._draw(message, final=True)
            self._draw()

    def close(self) -> None:
        """Close every phase still open and end the line with the times of the phases it ran (and a
        newline; ``seconds`` may hold earlier ones too)."""
        with self._lock:
            if self._stack:
                self.end(self._stack[0].key)
            done = seconds_line({k: s for k, s in self.seconds.items() if k in self._counts})
            total_s = time.perf_counter() - self.started
            self._draw(f"{self.title}: {done or 'done'} ({total_s:.1f} s in all)", final=True)
            self.stream = None


_CURRENT: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("protrain_fx_progress", default=None)


def current() -> Recording | None:
    """The recording open in this context, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def recording(seconds: dict[str, float] | None = None, *, title: str = "protrain_fx",
              stream: IO[str] | None = None, since: float | None = None) -> Iterator[Recording]:
    """Record the phases opened inside into ``seconds`` (a new dict when ``None``), and show them on
    ``stream`` (default ``sys.stderr``) when :func:`shown`. ``since``: the ``perf_counter`` time the
    recording's work began, when that was before this call."""
    stream = sys.stderr if stream is None else stream
    now = time.perf_counter()
    rec = Recording({} if seconds is None else seconds, title, stream if shown(stream) else None,
                    now if since is None else min(now, since))
    token = _CURRENT.set(rec)
    stop = threading.Event()
    ticker = None
    if rec.stream is not None:
        def tick() -> None:
            while not stop.wait(TICK_S):
                with rec._lock:
                    if rec.stream is None:
                        return
                    rec._draw()

        ticker = threading.Thread(target=tick, name="protrain_fx-progress", daemon=True)
        ticker.start()
    try:
        yield rec
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        rec.close()
        _CURRENT.reset(token)


class Phase:
    """An open phase (:func:`phase`): :meth:`advance` counts its items."""

    def __init__(self, rec: Recording, key: str) -> None:
        self._rec, self.key = rec, key

    def advance(self, n: int = 1) -> None:
        self._rec.advance(self.key, n)

    def set_total(self, total: int | None) -> None:
        self._rec.set_total(self.key, total)


@contextlib.contextmanager
def phase(key: str, label: str | None = None, *, total: int | None = None) -> Iterator[Phase]:
    """Time the block as phase ``key`` of the current recording (shown as ``label``; ``total``: how
    many items it has, when known); with none open, in a recording of its own (module docstring)."""
    rec = current()
    if rec is None:
        with recording(title="protrain_fx"), phase(key, label, total=total) as p:
            yield p
        return
    rec.begin(key, label, total=total)
    try:
        yield Phase(rec, key)
    finally:
        rec.end(key)


def timed(key: str, label: str | None = None, *, counted: bool = False
          ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: every call of the function is a :func:`phase` ``key`` (``counted``: one item more
    per call)."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            with phase(key, label) as p:
                if counted:
                    p.advance()
                return fn(*args, **kwargs)

        return call

    return wrap


def end(key: str) -> None:
    """Close phase ``key`` of the current recording (one :meth:`Recording.begin` opened), if open."""
    rec = current()
    if rec is not None:
        rec.end(key)


def note(message: str) -> None:
    """Print ``message`` to stderr as a line of its own, under the progress line when one is shown."""
    rec = current()
    if rec is None:
        print(message, file=sys.stderr, flush=True)
    else:
        rec.note(message)
