"""What the planner and the offload runtime hand each other: data only, no live object.

The planner decides from data; the backend holds the offload handle and hands the planner what the
runtime measured (``backend.py``). The runtime fills these records (``runtime/offload/step_window.py``),
the planner reads them (``planner/rates.py``):

* :class:`StepReadings`: what an offload's optimizer steps did over a window of training calls, the
  planner's measure of the rates training reaches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepReadings:
    """What an offload's optimizer steps did between a window's opening and its close: ``cpu_params``
    parameters stepped by the CPU worker in ``cpu_s`` seconds of its compute; ``device_steps``:
    (chunk in the host store's numbering, seconds) of each device step finished (CUDA only); the spill
    file's bytes read and written and the I/O thread's seconds in them (0: nothing spilled)."""

    cpu_s: float = 0.0
    cpu_params: int = 0
    device_steps: tuple[tuple[int, float], ...] = ()
    disk_read_bytes: float = 0.0
    disk_read_s: float = 0.0
    disk_written_bytes: float = 0.0
    disk_write_s: float = 0.0
