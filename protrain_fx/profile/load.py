"""Loads run beside a measured rate, so it is read under the traffic training puts beside it.

Each ``*_until(done)`` function keeps one kind of work going on this thread until ``done()`` is true:
matrix products (backward's compute-bound kernels), a kernel queue kept full, small launches from
Python (the training loop's share of the CPU), or nothing; :class:`_CopyLoad` runs pinned copies
both ways on side streams. :mod:`protrain_fx.profile.device` and :mod:`protrain_fx.profile.host`
measure beside them; this module measures nothing itself. CUDA only, except :func:`_sync_until`."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from protrain_fx.profile.cache import MiB


def _sync_until(done: Callable[[], bool]) -> None:
    """Wait until ``done()``, checking every millisecond (nothing else beside the measured work)."""
    while not done():
        time.sleep(1e-3)


def _matmuls_until(done: Callable[[], bool], size: int = 8192) -> None:
    """Run bf16 matrix products of ``size`` x ``size`` (at 8192, about as long as a large model's
    backward products) on this thread's stream until ``done()``: a stand-in for backward's kernels,
    which hold the SMs that the device steps' update kernels queue for."""
    x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    while not done():
        for _ in range(4):
            torch.mm(x, x)
        torch.cuda.current_stream().synchronize()


def _deep_queue_until(done: Callable[[], bool], size: int = 8192, depth: int = 48, drain: bool = True) -> None:
    """Keep about ``depth`` kernels queued on this thread's stream until ``done()``: bf16 matrix
    products and memory-bound elementwise kernels (2 GiB read and written, as backward's norms,
    activations and casts), launched ahead of the GPU the way a training loop runs ahead of it. Unlike
    :func:`_matmuls_until`, which waits after every four products, the queue does not drain while it
    runs; with ``drain``, it does when it returns (so a caller that returns often, as ``while_waiting``
    does, is held up by that drain); without, the kernels still queued run on after it returns, as
    backward's do while its thread waits for room for the next device step."""
    x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    big = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    marks: list[torch.cuda.Event] = []
    while not done():
        torch.mm(x, x)
        big.mul_(1.0)
        torch.mm(x, x)
        big.add_(0.0)
        mark = torch.cuda.Event()
        mark.record()
        marks.append(mark)
        if len(marks) * 4 >= depth:
            marks.pop(0).synchronize()
    if drain:
        torch.cuda.current_stream().synchronize()


def _launch_until(done: Callable[[], bool]) -> None:
    """Launch small CUDA kernels from Python on this thread until ``done()``: a stand-in for the
    training loop (the compiled step's wrapper code, the chunk runtime's hooks) that shares the CPU
    and the interpreter with the optimizer's worker."""
    x = torch.zeros(1 << 16, device="cuda")
    while not done():
        for _ in range(64):
            x.add_(1.0)
        torch.cuda.synchronize()


#: Largest buffer of the copy traffic laid under a measured CPU chunk step (:class:`_CopyLoad`).
_COPY_LOAD_BYTES = 256 * MiB


class _CopyLoad:
    """Pinned copies both ways on side streams while the CPU steps a chunk, as in training (chunk
    fetches, gradient landings): they share the host's memory bandwidth with the CPU Adam, which
    steps markedly faster alone than beside them (``docs/results.md#the-cpu-optimizer``)."""

    def __init__(self, nbytes: int) -> None:
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def start(self, rounds: int = 8) -> None:
        with torch.cuda.stream(self.streams[0]):
            for _ in range(rounds):
                self.dev[0].copy_(self.host[0], non_blocking=True)
        with torch.cuda.stream(self.streams[1]):
            for _ in range(rounds):
                self.host[1].copy_(self.dev[1], non_blocking=True)

    def stop(self) -> None:
        for s in self.streams:
            s.synchronize()
