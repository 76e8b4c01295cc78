"""Activation swap ops: copy a saved activation to host memory in forward, back in backward.

Four custom ops, inserted into the partitioned graphs by ``passes/swap.py``:

* ``protrain::offload(t, slot)`` starts copying ``t`` into a pinned host buffer on the device's D2H
  copy stream and returns the host buffer (its contents are valid once the copy finished);
* ``protrain::offload_wait(host, src, slot)`` makes the compute stream wait for that copy. ``src`` is
  an argument so that the graph keeps ``t`` alive up to here: neither Inductor's buffer reuse nor the
  caching allocator can hand its memory to another tensor while the copy still reads it;
* ``protrain::reload(host, slot, device)`` allocates the device copy and starts filling it on the
  H2D copy stream (a separate stream: the link carries both directions at once);
* ``protrain::reload_wait(dev, slot)`` makes the compute stream wait for that copy, right before the
  first use of ``dev``.

The waits are declared to mutate their first argument, which is what keeps them in the graph and
orders every later reader of the tensor after them, in eager FX code and in Inductor alike.

Host buffers come from a pool with exact sizes, one list per ``slot`` (a name the rewrite gives each
swapped value), reused across steps: a buffer is reused once nothing references the tensor the
previous ``offload`` returned (the autograd graph that saved it was run or dropped). Two forwards
before a backward therefore get two buffers, never the same one. On the CPU the copies are ordinary
synchronous copies into a separate buffer, so the semantics are testable without a GPU.
"""

from __future__ import annotations

import threading

import torch

from protrain_fx.runtime.store.pinned import host_empty
from protrain_fx.state import STATE


class HostPool:
    """Exact-size (pinned, for CUDA sources) host buffers, reused across steps per slot.

    The pool keeps only the storages. A buffer is free when the pool's handle is its storage's only
    reference: the tensor handed out last (saved by autograd for a backward) and any view of it are
    gone. Each hand-out is a new tensor on the storage, so it has its own version counter.
    """

    def __init__(self) -> None:
        self._slots: dict[str, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()

    def take(self, slot: str, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor shaped and typed like ``like`` that nothing else references."""
        pin = like.device.type == "cuda"
        nbytes = like.numel() * like.element_size()
        with self._lock:
            storages = self._slots.setdefault(slot, [])
            free = (
                s
                for s in storages
                if torch._C._storage_Use_Count(s._cdata) == 1 and s.nbytes() == nbytes and s.is_pinned() == pin
            )
            storage = next(free, None)
            if storage is None:
                storage = host_empty(nbytes, torch.uint8, pin).untyped_storage()  # exact size
                storages.append(storage)
            return torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape)

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for storages in self._slots.values() for s in storages)

    def buffers(self) -> int:
        with self._lock:
            return sum(len(storages) for storages in self._slots.values())

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()


POOL = HostPool()
STATE.on_reset(POOL.clear)  # protrain_fx.reset(): the forgotten graphs' host buffers go
_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
_events: dict[tuple[str, str], torch.cuda.Event] = {}


def copy_stream(direction: str, device: torch.device) -> torch.cuda.Stream:
    """The D2H (``"d2h"``) or H2D (``"h2d"``) copy stream of ``device``, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (direction, index)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=index)
    return _streams[key]


def _start_copy(
    direction: str,
    slot: str,
    dst: torch.Tensor,
    src: torch.Tensor,
    device: torch.device,
) -> None:
    stream = copy_stream(direction, device)
    # Everything queued on the compute stream so far (the producer of ``src``, the last users of the
    # memory ``dst`` got from the caching allocator) comes before the copy.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    _events[(direction, slot)] = event


def _wait(direction: str, slot: str, device: torch.device) -> None:
    event = _events.pop((direction, slot), None)
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


@torch.library.custom_op("protrain::offload", mutates_args=())
def offload(t: torch.Tensor, slot: str) -> torch.Tensor:
    """Start copying ``t`` to a host buffer of the pool; returns the buffer."""
    host = POOL.take(slot, t)
    if t.device.type == "cuda":
        _start_copy("d2h", slot, host, t, t.device)
    else:
        host.copy_(t)
    return host


@offload.register_fake
def _offload_fake(t: torch.Tensor, slot: str) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


@torch.library.custom_op("protrain::offload_wait", mutates_args=("host",))
def offload_wait(host: torch.Tensor, src: torch.Tensor, slot: str) -> None:
    """The compute stream waits until ``offload`` of ``slot`` finished reading ``src``."""
    if src.device.type == "cuda":
        _wait("d2h", slot, src.device)


@offload_wait.register_fake
def _offload_wait_fake(host: torch.Tensor, src: torch.Tensor, slot: str) -> None:
    return None


@torch.library.custom_op("protrain::reload", mutates_args=())
def reload(host: torch.Tensor, slot: str, device: torch.device) -> torch.Tensor:
    """Start copying ``host`` to a new tensor on ``device``; returns it (valid after ``reload_wait``)."""
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    if out.device.type == "cuda":
        _start_copy("h2d", slot, out, host, out.device)
    else:
        out.copy_(host)
    return out


@reload.register_fake
def _reload_fake(host: torch.Tensor, slot: str, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


@torch.library.custom_op("protrain::reload_wait", mutates_args=("dev",))
def reload_wait(dev: torch.Tensor, slot: str) -> None:
    """The compute stream waits until ``reload`` of ``slot`` finished writing ``dev``."""
    if dev.device.type == "cuda":
        _wait("h2d", slot, dev.device)


@reload_wait.register_fake
def _reload_wait_fake(dev: torch.Tensor, slot: str) -> None:
    return None
