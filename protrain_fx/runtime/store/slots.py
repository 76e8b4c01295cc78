"""The slots of a chunk store: where each stored parameter (or piece of one) lives in its chunk.

Plain data and pure functions over the chunk layout (``chunks.py``); ``runtime/store/chunk_store.py``
allocates buffers for them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from protrain_fx.chunks import ChunkLayout


@dataclass(frozen=True)
class ParamSlot:
    """One stored parameter: its names (several when tied), where it lives and what it looks like.

    ``offset`` is in elements from the start of the chunk's flat buffers; ``dtype`` is the
    parameter's own dtype (the store's buffers have their own). In a sharded store a slot may be a
    *piece* of its parameter: ``start`` is the parameter's (flattened) element it begins at, and
    ``shape`` is ``(elements,)`` unless the piece is the whole parameter.
    """

    names: tuple[str, ...]
    chunk: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    start: int = 0

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def piece_of(value: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """The part of a whole parameter's ``value`` that ``slot`` (maybe a piece) holds, in its shape."""
    return value.reshape(-1)[slot.start : slot.start + slot.numel].view(slot.shape)


def _pieces(slots: tuple[ParamSlot, ...], lo: int, numel: int) -> tuple[ParamSlot, ...]:
    """The parts of ``slots`` inside elements ``[lo, lo + numel)`` of their chunk, with offsets from
    ``lo``: a parameter cut by a shard boundary becomes a flat piece (``ParamSlot.start``)."""
    out = []
    for s in slots:
        a, b = max(s.offset, lo), min(s.offset + s.numel, lo + numel)
        if a >= b:
            continue
        shape = s.shape if b - a == s.numel else (b - a,)
        out.append(dataclasses.replace(s, offset=a - lo, shape=shape, start=a - s.offset))
    return tuple(out)


def _slot_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)


def _layout_itemsize(layout: ChunkLayout, params: Mapping[str, torch.Tensor]) -> int:
    """Bytes per element the layout was sized with (one for all parameters: offsets become elements)."""
    sizes = set()
    for chunk in layout.chunks:
        for slot in chunk.slots:
            numel = (
                params[slot.param.names[0]].numel()
                if slot.param.names[0] in params
                else 0
            )
            if numel == 0 or slot.param.nbytes % numel:
                raise ValueError(
                    f"layout parameter {slot.param.names[0]!r} ({slot.param.nbytes} bytes) does not "
                    "match a parameter of the model"
                )
            sizes.add(slot.param.nbytes // numel)
    if len(sizes) != 1:
        raise ValueError(
            f"the layout mixes element sizes {sorted(sizes)}; size every parameter in one dtype"
        )
    (itemsize,) = sizes
    if layout.chunk_bytes % itemsize:
        raise ValueError(
            f"chunk size {layout.chunk_bytes} is not a multiple of the element size {itemsize}"
        )
    return itemsize


def _slots(
    layout: ChunkLayout, params: Mapping[str, torch.Tensor], itemsize: int
) -> tuple[ParamSlot, ...]:
    """One slot per layout parameter; every model parameter must be in the layout exactly once."""
    slots = []
    for chunk in layout.chunks:
        for cs in chunk.slots:
            names = cs.param.names
            missing = [n for n in names if n not in params]
            if missing:
                raise ValueError(
                    f"layout parameter {missing[0]!r} is not a parameter of the model"
                )
            tensor = params[names[0]]
            if any(params[n] is not tensor for n in names):
                raise ValueError(
                    f"layout ties {names} but the model holds different tensors under these names"
                )
            if cs.offset % itemsize:
                raise ValueError(
                    f"offset of {names[0]!r} is not a whole number of elements"
                )
            slots.append(
                ParamSlot(
                    names=names,
                    chunk=chunk.index,
                    offset=cs.offset // itemsize,
                    shape=tuple(tensor.shape),
                    dtype=tensor.dtype,
                    trainable=tensor.requires_grad,
                )
            )
    named = [n for s in slots for n in s.names]
    if len(named) != len(set(named)):
        raise ValueError("the layout names a parameter twice")
    by_tensor: dict[int, str] = {}
    for s in slots:
        other = by_tensor.setdefault(id(params[s.name]), s.name)
        if other != s.name:
            raise ValueError(
                f"{other!r} and {s.name!r} are one tensor (tied) but have two slots; merge them with dedupe_tied"
            )
    unplaced = sorted(set(params) - set(named))
    if unplaced:
        raise ValueError(f"parameter {unplaced[0]!r} is not in the chunk layout")
    return tuple(slots)


def grads_by_slot(slot_of: Callable[[str], ParamSlot], grads: Mapping[str, torch.Tensor]) -> dict[ParamSlot, torch.Tensor]:
    """Gradients by parameter name -> by slot (``slot_of(name)``), refusing a frozen parameter's, two
    for one tied tensor, or a wrong shape."""
    by_slot: dict[ParamSlot, torch.Tensor] = {}
    for name, grad in grads.items():
        s = slot_of(name)
        if not s.trainable:
            raise ValueError(f"parameter {name!r} is frozen (requires_grad=False) but got a gradient")
        if s in by_slot:
            raise ValueError(f"tied parameter {s.names} got two gradients; give one per tensor")
        if tuple(grad.shape) != s.shape:
            raise ValueError(f"gradient of {name!r} has shape {tuple(grad.shape)}, expected {s.shape}")
        by_slot[s] = grad
    return by_slot
