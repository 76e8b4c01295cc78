"""Custom ops the parameter-chunk rewrite inserts, and the registry that connects them to the
offload handles (``runtime/offload/handle.py``) they serve.

* ``protrain::chunk_gather(handle, chunk, span)`` → the chunk's flat device buffer (fetched from the
  host store into one of the pool's ``n_buffer`` buffers if it is not resident; waits for the
  chunk's pending CPU optimizer step first). The graph reads its parameters as views of it.
* ``protrain::chunk_prefetch(buf, handle, chunk)`` right after a gather: starts fetching the
  chunk of the next gather into an idle buffer (if one is idle), so that copy overlaps this
  chunk's compute.
* ``protrain::chunk_release(buf, after, handle, chunk)`` after the chunk's last use in this graph: the
  buffer may be given to another chunk from then on. Declared to mutate ``buf``, which keeps it in
  the graph and after every reader.
* ``protrain::chunk_grads(token, grads, handle, chunk, names)`` in backward, once every gradient of the
  chunk's parameters in this graph exists: lands them in the store (adding to a held gradient) and,
  unless the handle is accumulating micro-batches, queues the chunk's CPU optimizer step, which
  then overlaps the rest of backward. Declared to mutate ``token`` (an empty tensor) so that it
  stays in the graph.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

#: What the registry keeps: ``runtime.offload.OffloadHandle`` objects (typed loosely here: the handle
#: module imports this one to register itself).
OffloadHandle = Any

_handles: dict[int, weakref.ref[OffloadHandle]] = {}
#: id(parameter) -> (the parameter, weakly; handle id, chunk, slot offset, name).
_params: dict[int, tuple[weakref.ref, int, int, int, str]] = {}
_ids = itertools.count()
#: handle id -> chunk -> the storages (``StorageImpl`` addresses) of its parameters' shells.
_shells: dict[int, dict[int, set[int]]] = {}


def register(handle: OffloadHandle, params: list[tuple[torch.Tensor, int, int, str]]) -> int:
    """Register a handle and its offloaded parameters ``(param, chunk, offset, name)``; forgotten
    when the handle is garbage-collected."""
    hid = next(_ids)
    _handles[hid] = weakref.ref(handle)
    storages: dict[int, set[int]] = {}
    for param, chunk, offset, name in params:
        _params[id(param)] = (weakref.ref(param), hid, chunk, offset, name)
        storages.setdefault(chunk, set()).add(param.untyped_storage()._cdata)
    _shells[hid] = storages
    weakref.finalize(handle, unregister, hid)
    return hid


def unregister(hid: int) -> None:
    _handles.pop(hid, None)
    _shells.pop(hid, None)
    for key in [k for k, v in _params.items() if v[1] == hid]:
        _orphan(_params.pop(key)[0])


#: id(parameter) -> the parameter, weakly: empty shells whose offload handle is closed or was
#: garbage-collected (with the optimizer given to ``offload``): their values went with its store.
_orphans: dict[int, weakref.ref] = {}


def _orphan(ref: weakref.ref) -> None:
    p = ref()
    if p is not None and p.numel() and p.untyped_storage().nbytes() == 0:
        _orphans[id(p)] = ref


def orphaned(t: Any) -> bool:
    """Whether ``t`` is an offloaded parameter's empty shell whose handle is gone."""
    ref = _orphans.get(id(t)) if isinstance(t, torch.Tensor) else None
    if ref is None or ref() is not t or t.untyped_storage().nbytes():
        return False
    return offloaded(t) is None and deferred(t) is None  # not placed or waiting again (unplace, configure)


#: id(parameter) -> (the parameter, weakly; its handle, weakly), for handles whose counts the
#: backend has not chosen yet (``offload`` with automatic counts; ``planner/offload.py``).
_deferred: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _stores() -> list[Any]:
    stores = (getattr(ref(), "store", None) for ref in list(_handles.values()))
    return [s for s in stores if s is not None]


def filling() -> bool:
    """Whether a live handle's chunk store is filling in the background (``ChunkStore.fill``)."""
    return any(s.filling for s in _stores())


def filling_host_bytes() -> int:
    """Host bytes of the live handles' chunk stores still filling in the background (the whole store's:
    what it has taken so far is already out of the host's available memory, so this over-counts)."""
    return sum(s.planned_bytes() for s in _stores() if s.filling)


def wait_filled() -> None:
    """Wait for every live handle's chunk store filling in the background and raise a fill's error:
    the backend calls it once the step is compiled, before the first step."""
    for store in _stores():
        store.wait_filled()


def register_deferred(handle: OffloadHandle, params: list[torch.Tensor]) -> None:
    """``params`` wait for ``handle.configure`` (the backend places their chunks at the first compile)."""
    ref = weakref.ref(handle)
    refs = [weakref.ref(p) for p in params]
    for p, r in zip(params, refs):
        _deferred[id(p)] = (r, ref)
    weakref.finalize(handle, _orphan_all, refs)


def _orphan_all(refs: list[weakref.ref]) -> None:
    for r in refs:
        _orphan(r)


def unregister_deferred(handle: OffloadHandle) -> None:
    for key in [k for k, (_, ref) in _deferred.items() if ref() is handle or ref() is None]:
        _orphan(_deferred.pop(key)[0])


def any_live_handle() -> bool:
    """Whether some offload handle (placed or waiting for its counts) is alive in this process."""
    return any(r() is not None for r in _handles.values()) or any(r() is not None for _, r in _deferred.values())


def deferred(t: Any) -> OffloadHandle | None:
    """The handle of ``t`` when it is a parameter of an offload whose counts are not chosen yet."""
    entry = _deferred.get(id(t)) if isinstance(t, torch.Tensor) else None
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]()


def handle(hid: int) -> OffloadHandle:
    ref = _handles.get(hid)
    h = ref() if ref is not None else None
    if h is None:
        raise RuntimeError(f"protrain_fx: offload handle {hid} is gone (the model was offloaded again or closed)")
    return h


def offloaded(t: Any) -> tuple[int, int, int, str] | None:
    """``(handle id, chunk, offset, name)`` when ``t`` is a parameter held in a chunk store."""
    entry = _params.get(id(t)) if isinstance(t, torch.Tensor) else None
    if entry is None or entry[0]() is not t:  # an id reused by another tensor
        return None
    return entry[1:]


def counts_by_hand(t: Any) -> bool:
    """Whether ``t`` is a parameter held in a chunk store whose counts the backend has not chosen:
    given to ``offload(...)`` by hand (or placed for a trial of the planner's, not final yet). A bool,
    so that the planner asks it without holding the handle."""
    found = offloaded(t)
    return found is not None and not handle(found[0]).counts_chosen


def check_shell(hid: int, chunk: int, shell: torch.Tensor) -> None:
    """Refuse a graph called with parameters that are not the handle's (see :func:`chunk_gather`)."""
    if shell.untyped_storage()._cdata not in _shells.get(hid, {}).get(chunk, ()):
        raise RuntimeError(
            f"protrain_fx: this compiled graph reads the parameter chunks of offload handle {hid}, but it "
            "was called with another model's parameters. torch.compile shares compiled code among the "
            "instances of one module class and cannot tell which offload holds their parameters. Use one "
            "offloaded model per process, or call torch._dynamo.reset() before calling this model (it is "
            "then compiled again, for its own parameters). offload() gives each model a forward of its "
            "own to avoid this: was model.forward replaced after offload()?"
        )


@torch.library.custom_op("protrain::chunk_gather", mutates_args=())
def chunk_gather(
    hid: int, chunk: int, span: int, shell: torch.Tensor | None, after: list[torch.Tensor]
) -> torch.Tensor:
    """``span`` numbers the gathers of one graph: no two calls look alike, so no pass merges them.

    ``shell``: a parameter of the chunk as the graph received it (storage of 0 bytes). It must be
    the handle's own: Dynamo reuses a graph for another instance of the module class when shapes
    and dtypes match, and the handle id baked into the graph would then hand it this model's
    chunks, silently (found with two offloaded GPTs of one config).

    ``after``: what the releases before it in the graph return. Taking them keeps the gather after
    those releases in Inductor's schedule too (a fusion across a release would otherwise hoist a
    gather above it, and the gather would find every buffer in use). Not read."""
    if shell is not None:
        check_shell(hid, chunk, shell)
    return handle(hid).gather(chunk)


#: Handle id -> (buffer numel, dtype, device) of handles that live in another process: a child that
#: lowers a graph of this process's handles (``protrain_fx/codegen_child.py``) propagates fake
#: values through their gathers.
_buffer_shapes: dict[int, tuple[int, torch.dtype, torch.device]] = {}


def buffer_shapes(hids: Any) -> dict[int, tuple[int, torch.dtype, torch.device]]:
    """What :func:`chunk_gather`'s fake values need of each handle in ``hids``, for another process."""
    return {hid: (handle(hid).store.full_numel, handle(hid).store.compute_dtype, handle(hid).device) for hid in hids}


def adopt_buffer_shapes(shapes: dict[int, tuple[int, torch.dtype, torch.device]]) -> None:
    """In a process without the handles: :func:`chunk_gather`'s fake values from ``shapes``."""
    _buffer_shapes.update(shapes)


@chunk_gather.register_fake
def _chunk_gather_fake(
    hid: int, chunk: int, span: int, shell: torch.Tensor | None, after: list[torch.Tensor]
) -> torch.Tensor:
    if hid in _buffer_shapes and _handles.get(hid) is None:
        numel, dtype, device = _buffer_shapes[hid]
        return torch.empty(numel, dtype=dtype, device=device)
    h = handle(hid)
    return torch.empty(h.store.full_numel, dtype=h.store.compute_dtype, device=h.device)


@torch.library.custom_op("protrain::chunk_prefetch", mutates_args=("after",))
def chunk_prefetch(after: torch.Tensor, hid: int, chunk: int) -> None:
    """Start fetching ``chunk`` if a buffer is idle (a hint). ``after`` is the buffer of the chunk
    in use when it is issued: the data dependency places it right after that gather."""
    handle(hid).prefetch(chunk)


@chunk_prefetch.register_fake
def _chunk_prefetch_fake(after: torch.Tensor, hid: int, chunk: int) -> None:
    return None


@torch.library.custom_op("protrain::chunk_release", mutates_args=("buf",))
def chunk_release(buf: torch.Tensor, after: list[torch.Tensor], hid: int, chunk: int) -> torch.Tensor:
    """``after``: outputs of the nodes that read the buffer. A data dependency on them is what
    keeps every reader (fused into any kernel) before the release, in Inductor's schedule too.
    Returns an empty token the later gathers take (:func:`chunk_gather`)."""
    handle(hid).release(chunk)
    return torch.empty(0, dtype=torch.uint8, device=buf.device)


@chunk_release.register_fake
def _chunk_release_fake(buf: torch.Tensor, after: list[torch.Tensor], hid: int, chunk: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=buf.device)


@torch.library.custom_op("protrain::chunk_grads", mutates_args=("token",))
def chunk_grads(token: torch.Tensor, grads: list[torch.Tensor], hid: int, chunk: int, names: str) -> None:
    """``names``: the parameters' names joined by newlines (schemas have no string lists).

    ``token`` is an empty tensor made for this call; declaring it mutated keeps the op in the graph.
    The gradients are only read: declared mutated, Inductor would keep every one of them allocated
    to the end of backward (it never frees a mutated buffer early), which at 4.2B held all the
    offloaded chunks' fp32 gradients at once."""
    handle(hid).land_grads(chunk, names.split("\n"), grads)


@chunk_grads.register_fake
def _chunk_grads_fake(token: torch.Tensor, grads: list[torch.Tensor], hid: int, chunk: int, names: str) -> None:
    return None
