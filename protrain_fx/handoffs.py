"""What the planner and the offload runtime hand each other: data only, no live object.

The planner decides from data and hands back decisions; the backend holds the offload handle and
applies them (``backend.py``). The runtime fills these records (``runtime/offload/handle.py``:
``OffloadHandle.facts``; ``runtime/offload/step_window.py``), the planner reads them
(``planner/offload.py``, ``planner/plan_cache.py``, ``planner/fit.py``, ``planner/rates.py``), and
neither imports the other's live objects for them:

* :class:`ChunkFacts`: what the cost model prices an offloaded model by (its chunk layout, dtypes,
  clipping, the host store's tiers at every ``n_persist``, the spill folder, the counts placed);
* :class:`Placement`: the chunk counts a placement has, the planner's decision;
* :class:`StepReadings`: what an offload's optimizer steps did over a window of training calls, the
  planner's measure of the rates training reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from protrain_fx.chunks import ChunkLayout


@dataclass(frozen=True)
class Placement:
    """An offload's chunk counts: ``n_persist`` chunks on the device, ``n_buffer`` device buffers the
    others are gathered into, ``n_gpu_optim`` offloaded chunks stepped on the device."""

    n_persist: int
    n_buffer: int
    n_gpu_optim: int = 0


@dataclass(frozen=True)
class ChunkFacts:
    """What the planner knows of an offloaded model, read from its handle at one moment.

    ``layout``: the chunks the runtime moves; ``param_dtype`` / ``compute_dtype``: the fp32 master's
    and the chunk buffers' dtypes; ``device``: where the chunks are gathered; ``ranks``: ``(world
    size, ranks per node, backend)`` when data-parallel, else ``None``; ``grad_clipping``: whether
    the loop clips (``None``: not known until its first optimizer step). ``tiers``: per ``n_persist``
    in ``0..`` the layout's chunks, ``(n_lean, n_spill)`` the host store would make with the host
    memory available when read (``runtime/store/host_memory.auto_tiers``); ``trainable``: per chunk,
    whether it holds a trainable parameter (so Adam moments); ``landing_pool``: the landing buffers the
    store plans for lean chunks' gradients; ``spill_dir``: the folder a spilled store writes to.
    ``placed``: the counts placed, when the backend chose them at an earlier compile."""

    layout: ChunkLayout
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    device: torch.device
    grad_clipping: bool | None
    tiers: tuple[tuple[int, int], ...]
    trainable: tuple[bool, ...]
    landing_pool: int
    spill_dir: Path
    ranks: tuple[int, int, str] | None = None
    placed: Placement | None = None

    @property
    def chunk_params(self) -> int:
        """Parameters one chunk holds (its bytes in the parameters' dtype)."""
        return self.layout.chunk_bytes // self.param_dtype.itemsize

    @property
    def lean_counts(self) -> tuple[int, ...]:
        """Per ``n_persist``, how many offloaded chunks the store would make lean (no host working
        copy: fetched from their fp32 master)."""
        return tuple(lean for lean, _ in self.tiers)


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
