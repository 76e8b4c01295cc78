"""Measurements of the machine (copy bandwidth, optimizer step rates, op times), cached per device.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

#: Set on the thread that measures the machine beside a compile's capture (``machine_profile.measure_ahead``).
_ahead = threading.local()


def on_ahead_thread() -> bool:
    """Whether this thread is the one measuring the machine ahead of a compile's plan."""
    return getattr(_ahead, "on", False)


def data_generator(device: torch.device | str) -> torch.Generator:
    """A generator of the measurements' own for ``device``, seeded alike every time: the random
    inputs of a timing are drawn from it, never from torch's default streams, which the thread
    measuring beside a compile (:func:`on_ahead_thread`) shares with the caller."""
    return torch.Generator(device=torch.device(device)).manual_seed(0)


def keeps_rng(measure: F) -> F:
    """``measure`` run with torch's random streams forked (the CPU's, and the current CUDA device's
    once CUDA is up): the random inputs a measurement draws leave the caller's streams where they
    were. A seeded script then draws the same numbers (dropout masks, a model initialised when its
    chunks are placed) after a compile that measured the machine as after one that read the
    measurements from the cache. Not forked on the thread measuring ahead (:func:`on_ahead_thread`):
    restoring the streams there would undo what the caller's thread drew meanwhile, and what it
    measures draws from :func:`data_generator` alone."""

    @functools.wraps(measure)
    def forked(*args, **kwargs):
        if on_ahead_thread():
            return measure(*args, **kwargs)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return measure(*args, **kwargs)

    return forked  # type: ignore[return-value]
