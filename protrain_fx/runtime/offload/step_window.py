"""A window on an offload's optimizer steps: what they did between its opening and its close, as data.

The planner measures the rates training reaches from it (``planner/rates.py``, ``training_rates``);
the backend opens one on the handle whose chunks a plan placed, over the timed training calls
(``planner/first_step.py``), and hands the planner its :class:`~protrain_fx.handoffs.StepReadings`:

* the CPU worker's chunk steps: seconds from each step's gradient landed on the host to its new
  working copy written, and the parameters stepped (``ChunkAdamW.computed``, counted from the opening);
* each device step on CUDA: from its first copy in to its last copy out (CUDA events recorded
  while the window is open, ``DeviceAdamW.window``); one still running at the close is left out;
* the spill file's reads and writes (``SpillResidency.stats``, counted from the opening).
"""

from __future__ import annotations

from typing import Any

from protrain_fx.handoffs import StepReadings


class StepWindow:
    """Times ``handle``'s CPU and device optimizer steps and its spill file's traffic from its
    creation to :meth:`close` (``handle``: an ``OffloadHandle``, or what has its ``adam``,
    ``device_adam`` and ``store``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._cpu_start = handle.adam.computed if handle.adam is not None else (0.0, 0)
        self._device = handle.device_adam if handle.device_adam is not None and handle.device_adam.cuda else None
        if self._device is not None:
            self._device.window = []
        self._disk_start = self._disk_stats()

    def _disk_stats(self) -> dict[str, float] | None:
        residency = self.handle.store.residency if self.handle.store is not None else None
        return residency.stats() if residency is not None else None

    def close(self) -> StepReadings:
        """What the steps did since the window opened; the device steps are no longer timed after."""
        adam = self.handle.adam
        seconds, params = adam.computed if adam is not None else (0.0, 0)
        timed: tuple[tuple[int, float], ...] = ()
        if self._device is not None:
            entries, self._device.window = self._device.window or [], None
            timed = tuple((c, start.elapsed_time(done) / 1e3) for c, start, done in entries if done.query())
        disk = {}
        end = self._disk_stats()
        if end is not None and self._disk_start is not None:
            moved = {k: end[k] - self._disk_start[k] for k in end}
            disk = {"disk_read_bytes": moved["read_bytes"], "disk_read_s": moved["read_s"],
                    "disk_written_bytes": moved["written_bytes"], "disk_write_s": moved["write_s"]}
        return StepReadings(cpu_s=seconds - self._cpu_start[0], cpu_params=params - self._cpu_start[1],
                            device_steps=timed, **disk)
