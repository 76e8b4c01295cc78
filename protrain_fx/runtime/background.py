"""Work on a thread of its own that readers wait for: the chunk store's fill beside the compile.

:class:`Background` starts ``work()`` at once; :meth:`Background.wait` joins it (at once when it is
done, never from its own thread) and raises its error, at every call, so that no reader goes on
with what a failed fill left half-made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Background:
    """``work()`` running on a thread named ``name``."""

    def __init__(self, work: Callable[[], None], name: str) -> None:
        self._work = work
        self._error: BaseException | None = None
        #: Seconds the first :meth:`wait` that found the work still running waited (``None``: none did).
        self.waited_s: float | None = None
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as error:  # noqa: BLE001 -- raised to the readers (wait)
            self._error = error

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Until the work is done; raise its error if it raised."""
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            started = time.monotonic()
            self._thread.join()
            if self.waited_s is None:
                self.waited_s = time.monotonic() - started
        if self._error is not None:
            raise self._error
