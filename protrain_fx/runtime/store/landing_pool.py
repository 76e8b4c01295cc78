"""The host buffers lean chunks' gradients land in: a pool of ``grad_pool``, shared.

A lean chunk has no host working copy (``runtime/store/chunk_store.py``), so its gradient lands in a
buffer of the pool, held from the landing until the chunk's optimizer step gives it back. The pool
makes buffers as they are first needed, ``grad_pool`` of them; a landing that finds all of them held
(accumulated micro-batches hold theirs across backward passes, and a caller that cannot wait for a
step) makes one more, after checking the host has room for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from protrain_fx.runtime.store.host_memory import available_host_bytes, check_host_memory


class LandingPool:
    """Landing buffers of ``nbytes`` each, made by ``empty()``: ``size`` planned, more only when needed."""

    def __init__(self, size: int, nbytes: int, empty: Callable[[], torch.Tensor]) -> None:
        self.size = size
        self._nbytes = nbytes
        self._empty = empty
        self._held: dict[int, torch.Tensor] = {}  # chunk -> its buffer
        self._free: list[torch.Tensor] = []
        self.made = 0  # buffers made so far
        self._lock = threading.Lock()  # (the optimizer's thread gives buffers back)

    def held(self, chunk_id: int) -> torch.Tensor | None:
        return self._held.get(chunk_id)

    def full(self) -> bool:
        """Every buffer of the planned pool is held: the next chunk to take one would make a new one."""
        with self._lock:
            return not self._free and self.made >= self.size

    def take(self, chunk_id: int) -> torch.Tensor:
        """The chunk's buffer: the one it holds, else a free one, else a new one."""
        if chunk_id in self._held:
            return self._held[chunk_id]
        with self._lock:
            buffer = self._free.pop() if self._free else None
            made = self.made
        if buffer is None:
            if made >= self.size:  # past the planned pool: check what the host has now
                check_host_memory(self._nbytes, available_host_bytes(),
                                  f"landing buffer {made + 1} of the lean chunks' gradients (the pool has {self.size})")
            buffer = self._empty()
            with self._lock:
                self.made += 1
        self._held[chunk_id] = buffer
        return buffer

    def give_back(self, chunk_id: int) -> None:
        buffer = self._held.pop(chunk_id, None)
        if buffer is not None:
            with self._lock:
                self._free.append(buffer)
