"""Exact ``clip_grad_norm_`` over an offloaded model: persistent ``.grad`` and held chunk gradients.

An offloaded chunk's gradient lives in the host store, not in ``.grad``, so torch's own function
would see only the persistent chunks. :func:`install_clip_dispatch` routes
``torch.nn.utils.clip_grad_norm_`` to :func:`clip_grad_norm` when it is given an offloaded model's
parameters; every other call reaches torch unchanged. The norm is taken over every gradient (the
chunks' per-parameter norms kept by :class:`HeldNorms` as their gradients land), the persistent
gradients are scaled as torch scales them, and ``optimizer.step()`` steps the held chunks with the
same scale. A non-finite norm skips the step everywhere. Clipping needs the chunks' steps held until the norm
is known (``offload(..., grad_clipping=...)``); a clip that cannot be exact is refused with the
way out.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.store.chunk_store import ChunkStore


class HeldNorms:
    """Per-parameter gradient norms of held chunks, for :meth:`OffloadHandle.clip_grad_norm_`:
    the 2-norm taken where a chunk's gradient first lands (on the device, beside the copy to the
    host), or, for a chunk whose held gradient was added to since (micro-batches, a chunk split by
    a graph break) or another norm type, read back from the host store."""

    def __init__(self) -> None:
        self._norms: dict[Any, torch.Tensor] = {}
        self._stale: set[int] = set()

    def note(self, store: ChunkStore, chunk: int, names: list[str], grads: list[torch.Tensor], *,
             fresh: bool) -> None:
        if not fresh:
            self._stale.add(chunk)
            return
        by_slot = store.grads_by_slot(dict(zip(names, grads)))
        if not by_slot:  # (sharded: no piece of these parameters on this rank)
            return
        values = [g.detach() for g in by_slot.values()]
        wide = any(v.dtype != torch.float32 for v in values)  # bf16 gradients: summed in fp32
        norms = torch._foreach_norm(values, 2.0, dtype=torch.float32) if wide else torch._foreach_norm(values, 2.0)
        self._norms.update(zip(by_slot, norms))

    def of(self, store: ChunkStore, slot: Any, norm_type: float) -> torch.Tensor | None:
        """The norm of ``slot``'s held gradient; ``None`` when it holds none (skipped, as torch
        skips a ``.grad`` of ``None``)."""
        if slot not in store.grad_slots(slot.chunk):
            return None
        if norm_type == 2.0 and slot.chunk not in self._stale and slot in self._norms:
            return self._norms[slot]
        store.wait_grad(slot.chunk)
        view = store.grad_flat(slot.chunk)[slot.offset : slot.offset + slot.numel]
        if view.dtype != torch.float32:
            return torch.linalg.vector_norm(view, norm_type, dtype=torch.float32)
        return torch._foreach_norm([view], norm_type)[0]  # as clip_grad_norm_ takes a CPU gradient's

    def clear(self) -> None:
        self._norms.clear()
        self._stale.clear()


def _group_norms(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """Each gradient's norm, computed as ``torch.nn.utils.get_total_norm`` computes it (foreach per
    device and dtype where supported), in the order given."""
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )

    out: list[torch.Tensor | None] = [None] * len(grads)
    if not grads:
        return []
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    for (device, _), ([tensors], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
            norms = torch._foreach_norm(tensors, norm_type)
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        for i, n in zip(indices, norms):
            out[i] = n
    return out  # type: ignore[return-value]


log = logging.getLogger("protrain_fx")

_TORCH_CLIP_GRAD_NORM: Callable[..., torch.Tensor] | None = None


def install_clip_dispatch() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` to :meth:`OffloadHandle.clip_grad_norm_` when it is
    given an offloaded model's parameters (their gradients are in the chunk store, not in
    ``.grad``); any other call goes to torch's own function unchanged. Installed once, by the first
    ``offload``; a name bound before it (``from torch.nn.utils import clip_grad_norm_``) still holds
    torch's, which sees only the persistent chunks' gradients: it is refused before it scales any
    (:func:`_refuse_partial_clips`), as are ``clip_grads_with_norm_`` and ``clip_grad_value_`` over
    offloaded parameters."""
    global _TORCH_CLIP_GRAD_NORM
    if _TORCH_CLIP_GRAD_NORM is not None:
        return
    from torch.nn.utils import clip_grad

    original = _TORCH_CLIP_GRAD_NORM = clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        handles = {}
        for p in params:
            found = chunk_ops.offloaded(p)
            if found is not None:
                handles[found[0]] = chunk_ops.handle(found[0])
        if not handles:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if len(handles) > 1:
            raise UnsupportedError("protrain_fx: clip_grad_norm_ over the parameters of several offloaded models; "
                                   "clip each model's parameters on their own")
        (handle,) = handles.values()
        return handle.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    _refuse_partial_clips(clip_grad)


#: Where torch's own clipping of an offloaded model's parameters would be silently partial.
_PARTIAL_CLIP = (
    "the offloaded chunks' gradients never reach .grad (they live in the chunk store), so a norm or clip "
    "taken over .grad leaves them out: call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) "
    "by its module path (it takes the norm over every chunk); a name imported before protrain_fx.offload(...) "
    "(from torch.nn.utils import clip_grad_norm_) is torch's own"
)


def _refuse_partial_clips(clip_grad: Any) -> None:
    """torch's clipping functions that would clip an offloaded model's parameters from ``.grad`` alone
    refuse them instead: ``clip_grads_with_norm_`` (also what torch's own ``clip_grad_norm_`` calls
    after taking its norm, so a ``clip_grad_norm_`` bound before the dispatch was installed is caught
    before it scales anything) and ``clip_grad_value_``."""
    with_norm, by_value = clip_grad._clip_grads_with_norm_, clip_grad.clip_grad_value_

    def refuse_offloaded(parameters: Any, what: str) -> list[torch.Tensor]:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(chunk_ops.offloaded(p) is not None for p in params):
            raise UnsupportedError(f"protrain_fx: {what} over an offloaded model's parameters: {_PARTIAL_CLIP}")
        return params

    @functools.wraps(with_norm)
    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        return with_norm(refuse_offloaded(parameters, "a gradient clip by a norm taken over .grad"), max_norm,
                         total_norm, foreach)

    @functools.wraps(by_value)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        return by_value(refuse_offloaded(parameters, "clip_grad_value_"), clip_value, foreach)

    clip_grad._clip_grads_with_norm_ = torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    clip_grad.clip_grad_value_ = torch.nn.utils.clip_grad_value_ = clip_grad_value_


def clip_grad_norm(
    handle: Any,
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``parameters``, offloaded ones included: the norm
    of every gradient, the persistent ones' ``.grad`` scaled in place and the offloaded chunks'
    held steps queued at ``optimizer.step()`` with the same scale. ``torch.nn.utils.clip_grad_norm_`` comes here when
    given parameters of this model (``offload`` installs the dispatch), so the loop is unchanged.

    The offloaded chunks' steps run as their gradients land in backward, before a norm over all
    of them exists; so the handle holds them (``grad_clipping``): always with ``True``; with
    ``None`` (default) at the first step, and from then on when that step clipped. Held steps
    start at ``optimizer.step()`` (its pre-hook: a loop may still skip the step, and
    ``zero_grad()`` then drops them), overlapping the optimizer's step of the persistent chunks
    and the next forward.
    A non-finite norm skips the step everywhere (as ``GradScaler`` does): no offloaded chunk is
    stepped and the persistent gradients are set to ``None``, so ``optimizer.step()`` leaves
    those parameters too; ``error_if_nonfinite=True`` raises instead, as torch does."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _check_clip(handle, params)
    handle.wait_reductions()  # sharded on CUDA: the held norms were taken on the reduction stream
    norm_type = float(norm_type)
    norms: list[torch.Tensor] = []
    offloaded: list[torch.Tensor] = []  # (sharded: this rank's pieces only)
    persistent: list[torch.Tensor] = []
    grads = [p.grad for p in params if chunk_ops.offloaded(p) is None and p.grad is not None]
    by_id = dict(zip(map(id, grads), _group_norms(grads, norm_type, foreach)))
    for p in params:
        if chunk_ops.offloaded(p) is not None:
            name = chunk_ops.offloaded(p)[3]
            if not handle.store.holds(name):  # sharded: its pieces are on other ranks
                continue
            norm = handle._norms.of(handle.store, handle.store.slot(name), norm_type)
            if norm is not None:
                norms.append(norm)
                offloaded.append(norm)
        elif p.grad is not None:
            norms.append(by_id[id(p.grad)])
            persistent.append(p)
    if handle.group is not None:
        total = _total_over_ranks(offloaded, [by_id[id(p.grad)] for p in persistent], norm_type, handle.device)
    elif not norms:
        return torch.tensor(0.0)
    else:
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    finite = bool(torch.isfinite(total))  # (a device sync: the skip below is decided on the host)
    if not finite and error_if_nonfinite:
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    handle._clipped = True
    if handle.grad_clipping is None:
        handle.grad_clipping = True
    if not finite:
        _skip_held_steps(handle, persistent, total)
        return total
    torch.nn.utils.clip_grads_with_norm_(persistent, max_norm, total, foreach)  # as torch scales them
    # the held chunks are stepped with it at optimizer.step() (a loop may still skip the step)
    handle._held_scale = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0).to("cpu", torch.float32)
    return total

def _total_over_ranks(offloaded: list[torch.Tensor], persistent: list[torch.Tensor], norm_type: float,
                      device: torch.device) -> torch.Tensor:
    """The norm over every rank's offloaded pieces (summed powers, or the maximum for ``inf``, all-
    reduced) and the replicated persistent gradients (equal on every rank, counted once). Every
    rank gets the same value, so a non-finite norm skips the step on every rank."""
    def stacked(norms: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([n.to(device, torch.float32) for n in norms]) if norms else torch.zeros(0, device=device)

    mine, shared = stacked(offloaded), stacked(persistent)
    if math.isinf(norm_type):
        local = mine.max() if mine.numel() else torch.zeros((), device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return torch.maximum(local, shared.max()) if shared.numel() else local
    local = (mine**norm_type).sum()
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return (local + (shared**norm_type).sum()) ** (1.0 / norm_type)


def lean_chunks_clip_warning(store: Any, grad_clipping: bool | None) -> str | None:
    """What to tell the user before any compile when a loop that clips would be refused at its first
    step (``None``: nothing): lean chunks beyond the landing pool, and ``grad_clipping`` not given (the
    first step, learning it, steps lean chunks as their gradients land once the pool is full:
    :func:`_check_clip`)."""
    if store is None or grad_clipping is not None or len(store.lean) <= store.grad_pool:
        return None
    return (f"protrain_fx: {len(store.lean)} of the {store.num_chunks} offloaded chunks are lean (host memory is short: "
            "they keep no host copy of their parameters) and grad_clipping was not given: a loop that calls "
            f"clip_grad_norm_ is refused at its first step, whose lean chunks are stepped as their gradients land once "
            f"{store.grad_pool} of them wait. Pass grad_clipping=True to protrain_fx.offload(...) if the loop clips "
            "(every lean chunk's gradient then waits for the norm in host memory, and the store spills more to disk "
            "to make room), or grad_clipping=False to say it does not")


def _check_clip(handle: Any, params: list[torch.Tensor]) -> None:
    """Refuse a clip this handle cannot make exact (see :meth:`clip_grad_norm_`)."""
    fix = ("pass grad_clipping=True to protrain_fx.offload(...), which holds the offloaded chunks' steps "
           "until the norm is known (a loop that clips from its first step needs nothing)")
    if handle._clipped:
        raise UnsupportedError(
            "protrain_fx: clip_grad_norm_ ran twice in one step on an offloaded model: the offloaded chunks take "
            "one scale, from the first clip's norm, at optimizer.step(); clip once per step"
        )
    stepped = sorted(handle._submitted)
    if stepped:
        if handle._released_early:
            lean = handle.store.num_chunks - min(handle.store.lean, default=handle.store.num_chunks)
            fix = (f"pass grad_clipping=True to protrain_fx.offload(...): every one of the {lean} lean chunks then "
                   f"holds its gradient in a landing buffer of {handle.store.chunk_numel * handle.store.compute_dtype.itemsize} "
                   "bytes of host memory until the norm is known, and the store is sized for them (more chunks spill "
                   "to disk where host memory is short)")
            why = "at the first step, its lean chunks' gradients could not all wait in the landing pool"
        else:
            why = "this model's loop did not clip at its first step, so its chunks are stepped as their gradients land"
        raise UnsupportedError(
            f"protrain_fx: clip_grad_norm_ on an offloaded model whose chunks {stepped} were already "
            f"stepped in this step, without clipping ({why}); {fix}"
        )
    given = {chunk_ops.offloaded(p)[3] for p in params if chunk_ops.offloaded(p) is not None}
    held = {n for names in handle._landed.values() for n in names}
    missing = sorted(held - {n for name in given for n in handle.store.full_slot(name).names})
    if missing:
        raise UnsupportedError(
            f"protrain_fx: clip_grad_norm_ over part of an offloaded model's parameters ({missing[0]!r} has a "
            "gradient but is not among them): the offloaded chunks are stepped together, with one "
            "scale; clip over every parameter (model.parameters())"
        )

def _skip_held_steps(handle: Any, persistent: list[torch.Tensor], total: torch.Tensor) -> None:
    """A non-finite gradient norm: drop every held gradient, leave the persistent parameters
    without one (``optimizer.step()`` skips them), count and say so."""
    handle.drop_held_grads()
    for p in persistent:
        p.grad = None
    handle.skipped_steps += 1
    log.warning("protrain_fx: the gradient norm is %s: this optimizer step is skipped (no offloaded chunk is "
                "stepped and the persistent parameters' gradients were set to None); %d step(s) skipped so far",
                float(total), handle.skipped_steps)

