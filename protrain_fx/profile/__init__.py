"""Measurements of the machine (copy bandwidth, optimizer step rates, op times), cached per device.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def keeps_rng(measure: F) -> F:
    """``measure`` run with torch's random streams forked (the CPU's, and the current CUDA device's
    once CUDA is up): the random inputs a measurement draws leave the caller's streams where they
    were. A seeded script then draws the same numbers (dropout masks, a model initialised when its
    chunks are placed) after a compile that measured the machine as after one that read the
    measurements from the cache."""

    @functools.wraps(measure)
    def forked(*args, **kwargs):
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return measure(*args, **kwargs)

    return forked  # type: ignore[return-value]
