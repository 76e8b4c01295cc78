"""Parameter chunk layout: parameters packed into equal-size chunks (plain data, no FX).

ProTrain keeps model states in chunks: the first chunks (in execution order) stay on the GPU, the
others live in host memory and are streamed in. This module decides the layout only:

* parameters are packed in first-use order (the order the forward pass needs them);
* a block's parameters stay in one chunk: a block that does not fit in what is left of the current
  chunk starts a new one (unless the block alone is larger than a chunk, then it spans chunks);
* a parameter never straddles two chunks, so the chunk size is at least the largest parameter;
* tied parameters (one storage, several names) take one slot, at their first use;
* the chunk size is the candidate that wastes the fewest bytes (ties go to the smaller chunk): 32, 64,
  128, 256 MiB (ProTrain's), the largest parameter when it is bigger, and whole multiples of the
  most common block's bytes of at least 32 MiB (1-4 blocks, plus room for the small parameters
  outside blocks, such as a final norm). A large model's blocks outgrow the fixed sizes: a 4.2B GPT block (453 MB in fp32)
  next to a 618 MB embedding would waste 27% of every chunk at the embedding's size, against 3% with
  chunks of two blocks (tests/runtime/test_chunks.py).

Sizes are in bytes of the parameters' working copy; the fp32 master, optimizer state and gradient
of a chunk follow the same layout, scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

MiB = 2**20
#: The block label of parameters outside any block (embeddings, a final norm).
OUTSIDE = "outside"
#: ProTrain's chunk sizes (paper): the one wasting least is chosen.
DEFAULT_CANDIDATES = (32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB)


@dataclass(frozen=True)
class ParamInfo:
    """A parameter as the layout sees it: ``names`` (several when tied), bytes, block, first use."""

    names: tuple[str, ...]
    nbytes: int
    block: str
    first_use: int


@dataclass(frozen=True)
class ChunkSlot:
    param: ParamInfo
    offset: int  # bytes from the start of the chunk


@dataclass(frozen=True)
class Chunk:
    index: int
    slots: tuple[ChunkSlot, ...]

    @property
    def used_bytes(self) -> int:
        return sum(s.param.nbytes for s in self.slots)


@dataclass(frozen=True)
class ChunkLayout:
    chunk_bytes: int
    chunks: tuple[Chunk, ...]

    @property
    def waste_bytes(self) -> int:
        return sum(self.chunk_bytes - c.used_bytes for c in self.chunks)

    def chunk_of(self, name: str) -> int:
        """Index of the chunk holding parameter ``name`` (any of a tied parameter's names)."""
        for chunk in self.chunks:
            for slot in chunk.slots:
                if name in slot.param.names:
                    return chunk.index
        raise KeyError(f"no parameter named {name!r} in the layout")

    def table(self) -> str:
        lines = [f"{len(self.chunks)} chunks of {self.chunk_bytes / MiB:g} MiB, {self.waste_bytes / MiB:.1f} MiB unused"]
        for c in self.chunks:
            blocks = list(dict.fromkeys(s.param.block for s in c.slots))
            lines.append(f"  chunk {c.index}: {c.used_bytes / MiB:.1f} MiB used, {len(c.slots)} params, blocks {', '.join(blocks)}")
        return "\n".join(lines)


def pack(params: Sequence[ParamInfo], chunk_bytes: int) -> ChunkLayout:
    """Pack ``params`` (first-use order) into chunks of ``chunk_bytes``."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk_bytes}")
    ordered = sorted(params, key=lambda p: p.first_use)
    too_big = [p for p in ordered if p.nbytes > chunk_bytes]
    if too_big:
        largest = max(too_big, key=lambda p: p.nbytes)
        raise ValueError(
            f"parameter {too_big[0].names[0]!r} ({too_big[0].nbytes} bytes) does not fit a chunk of {chunk_bytes} "
            f"bytes: use chunk_bytes >= {largest.nbytes} (the largest parameter, {largest.names[0]!r}), or leave "
            "chunk_bytes out to have it chosen"
        )
    chunks: list[list[ChunkSlot]] = [[]]
    used = 0
    for block_params in _by_block(ordered):
        block_bytes = sum(p.nbytes for p in block_params)
        if used and used + block_bytes > chunk_bytes and block_bytes <= chunk_bytes:
            chunks.append([])  # keep the block together
            used = 0
        for p in block_params:
            if used + p.nbytes > chunk_bytes:
                chunks.append([])
                used = 0
            chunks[-1].append(ChunkSlot(p, used))
            used += p.nbytes
    return ChunkLayout(chunk_bytes, tuple(Chunk(i, tuple(s)) for i, s in enumerate(chunks) if s))


def _by_block(ordered: Sequence[ParamInfo]) -> Iterable[list[ParamInfo]]:
    """Consecutive runs of parameters of one block (first-use order kept)."""
    run: list[ParamInfo] = []
    for p in ordered:
        if run and p.block != run[-1].block:
            yield run
            run = []
        run.append(p)
    if run:
        yield run


def choose_layout(params: Sequence[ParamInfo], candidates: Sequence[int] = DEFAULT_CANDIDATES) -> ChunkLayout:
    """The layout of the candidate chunk size that wastes the fewest bytes (ties: the smaller size)."""
    if not params:
        raise ValueError("no parameters to lay out")
    largest = max(p.nbytes for p in params)
    extra = set()
    if candidates is DEFAULT_CANDIDATES:  # only where blocks outgrow the fixed sizes: no tiny chunks
        extra = {c for c in _block_multiples(params) if c >= min(candidates)}
    if largest > max(candidates):
        extra.add(largest)
    sizes = sorted({c for c in (*candidates, *extra) if c >= largest})
    layouts = [pack(params, size) for size in sizes]
    return min(layouts, key=lambda layout: (layout.waste_bytes, layout.chunk_bytes))


def _block_multiples(params: Sequence[ParamInfo], most: int = 4) -> list[int]:
    """1..``most`` times the bytes of the most common block size, each also with room for the
    small parameters outside blocks (smaller than one block), and at most a quarter of the blocks:
    a chunk of a model's every block wastes nothing and offloads nothing (a model built with a few
    layers would get one chunk)."""
    sizes: dict[str, int] = {}
    for p in params:
        if p.block != OUTSIDE:
            sizes[p.block] = sizes.get(p.block, 0) + p.nbytes
    if not sizes:
        return []
    most = max(1, min(most, len(sizes) // 4))
    counts: dict[int, int] = {}
    for size in sizes.values():
        counts[size] = counts.get(size, 0) + 1
    block = max(counts, key=lambda size: (counts[size], size))
    small = sum(p.nbytes for p in params if p.block == OUTSIDE and p.nbytes < block)
    return [k * block + r for k in range(1, most + 1) for r in {0, small}]


def dedupe_tied(params: Iterable[tuple[str, int, int, str, int]]) -> list[ParamInfo]:
    """``(name, storage id, nbytes, block, first use)`` rows → one ``ParamInfo`` per storage
    (tied names merged, at the earliest first use)."""
    merged: dict[int, ParamInfo] = {}
    for name, storage, nbytes, block, first_use in params:
        if storage in merged:
            old = merged[storage]
            keep_first = old.first_use <= first_use
            merged[storage] = ParamInfo(
                names=old.names + (name,),
                nbytes=old.nbytes,
                block=old.block if keep_first else block,
                first_use=min(old.first_use, first_use),
            )
        else:
            merged[storage] = ParamInfo((name,), nbytes, block, first_use)
    return list(merged.values())
