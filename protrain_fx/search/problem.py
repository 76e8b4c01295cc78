"""The search problem: one training step as plain data, and the config and estimate the cost model trades in.

:class:`Problem` holds per transformer block its times and activation bytes (:class:`BlockProfile`),
per parameter chunk its size (:class:`ChunkProfile`), the work outside the blocks and the machine's
rates (:class:`MachineProfile`); :class:`Counts` is ProTrain's counts and :class:`Estimate` what
the cost model predicts for one. Times are seconds, sizes bytes, rates per second. Kept apart from
the graph: ``planner/problem.py`` extracts a Problem from a captured graph, and nothing here imports
torch or FX, so a Problem dumped as JSON (:meth:`Problem.dump`) replays in a test with no model.
Every field is validated on construction (``ValueError`` naming it)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protrain_fx.plan import Plan, interleaved

#: Version of the :class:`Problem` JSON form; :meth:`Problem.from_dict` refuses any other.
PROBLEM_VERSION = 1


#: Device steps in flight at most (``runtime/optim/device_adam.MAX_IN_FLIGHT``; a test checks they agree).
DEVICE_STEPS_IN_FLIGHT = 2


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """Rates of the machine. ``duplex_bytes_per_s`` is the total when both copy directions run at once;
    ``gpu_bytes`` is the device's memory (informational: the search takes its budget separately).
    ``device_step_bytes_per_s``: the rate, each way, of an offloaded chunk's optimizer step streamed
    through the GPU (``runtime/optim/device_adam.py``) as measured beside the CPU optimizer; 0 = not
    measured, the shared copy rate (``min(one-way, duplex / 2)``) stands in. ``host_memory_apart``:
    a swapped block's copy leaves the device's memory (``protrain_fx.machine.Machine.host_memory_apart``);
    where it does not (the CPU device), swapping frees nothing and every walk over the activation
    counts keeps ``n_swap = 0`` (``MemoryModel.activation_pairs``)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    cpu_adam_params_per_s: float
    gpu_adam_params_per_s: float
    gpu_bytes: int = 0
    device_step_bytes_per_s: float = 0.0
    host_memory_apart: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in ("gpu_bytes", "device_step_bytes_per_s", "host_memory_apart") and not (_is_number(v) and v > 0):
                raise ValueError(f"MachineProfile: {f.name}={v!r} must be a positive number (inf allowed)")
        _check_count("MachineProfile", "gpu_bytes", self.gpu_bytes)
        v = self.device_step_bytes_per_s
        if not (_is_number(v) and v >= 0):
            raise ValueError(f"MachineProfile: device_step_bytes_per_s={v!r} must be a number >= 0 (0: not measured)")
        if not isinstance(self.host_memory_apart, bool):
            raise ValueError(f"MachineProfile: host_memory_apart={self.host_memory_apart!r} must be True or False")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MachineProfile:
        return cls(**_known(cls, d))


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """One transformer block, forward order. Times in seconds, sizes in bytes.

    ``bwd_s`` is backward without recompute; ``recompute_s`` the forward rerun a checkpointed block
    adds to backward, and ``recompute_chained_s`` (default ``recompute_s``) the same when the next
    block is checkpointed too: the partitioner then keeps this block's output as the next one's
    input, so less is rerun (``planner/problem._recompute_times``). ``saved_bytes``: activations kept for
    backward; ``checkpoint_saved_bytes``: what a checkpointed block still keeps (its input);
    ``swap_bytes``: what a swap moves to the CPU (at most ``saved_bytes``; the rest stays);
    ``transient_bytes``: peak working memory inside the block's forward or backward on top of the
    live activations. ``chunk_ids``: parameter chunks used.

    ``place_fwd_s`` / ``place_bwd_s`` (default ``fwd_s`` / ``bwd_s``): the block's forward and
    backward (without recompute) on the timeline ``passes/swap.py`` places its copies' waits by (its
    own roofline, ``analysis/estimate.start_times``). They decide where the swap rewrite frees a
    swapped block's bytes and issues its reload, hence the swap memory (``docs/DESIGN.md#the-cost-model``,
    "Swap memory"); never time.
    ``swap_parts``: ``(issue_s, use_s, bytes)`` adding up to ``swap_bytes``, one per storage the
    rewrite moves: its copy out is issued ``issue_s`` after the block's forward starts (after the
    storage's last forward use, which may lie in a later block: a residual the next block reads, a
    view the forward's end reads), and its first backward use is ``use_s`` after the block's
    backward starts (negative: in a block whose backward runs before), both on the placement
    timeline. Default: one part issued at the block's end and used at its backward's start.
    """

    name: str
    fwd_s: float
    bwd_s: float
    recompute_s: float
    saved_bytes: int
    checkpoint_saved_bytes: int
    swap_bytes: int
    transient_bytes: int
    chunk_ids: tuple[int, ...]
    recompute_chained_s: float | None = None
    place_fwd_s: float | None = None
    place_bwd_s: float | None = None
    swap_parts: tuple[tuple[float, float, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_ids", tuple(self.chunk_ids))
        if self.recompute_chained_s is None:
            object.__setattr__(self, "recompute_chained_s", self.recompute_s)
        if self.place_fwd_s is None:
            object.__setattr__(self, "place_fwd_s", self.fwd_s)
        if self.place_bwd_s is None:
            object.__setattr__(self, "place_bwd_s", self.bwd_s)
        parts = tuple(tuple(x) for x in self.swap_parts) or ((self.place_fwd_s, 0.0, self.swap_bytes),)
        object.__setattr__(self, "swap_parts", parts)
        where = f"BlockProfile {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"BlockProfile: name must be a non-empty string, got {self.name!r}")
        for n in ("fwd_s", "bwd_s", "recompute_s", "recompute_chained_s", "place_fwd_s", "place_bwd_s"):
            _check_seconds(where, n, getattr(self, n))
        for n in ("saved_bytes", "checkpoint_saved_bytes", "swap_bytes", "transient_bytes"):
            _check_count(where, n, getattr(self, n))
        if self.swap_bytes > self.saved_bytes:
            raise ValueError(f"{where}: swap_bytes ({self.swap_bytes}) exceeds saved_bytes ({self.saved_bytes})")
        for part in self.swap_parts:
            if len(part) != 3:
                raise ValueError(f"{where}: swap_parts entry {part!r} is not (issue_s, use_s, bytes)")
            issue_s, use_s, nbytes = part
            _check_seconds(where, "swap_parts issue_s", issue_s)
            if not (_is_number(use_s) and abs(use_s) < math.inf):
                raise ValueError(f"{where}: swap_parts use_s={use_s!r} must be a finite number of seconds")
            _check_count(where, "swap_parts bytes", nbytes)
        if sum(n for *_, n in self.swap_parts) != self.swap_bytes:
            raise ValueError(f"{where}: swap_parts {self.swap_parts} do not add up to swap_bytes ({self.swap_bytes})")
        for c in self.chunk_ids:
            _check_count(where, "chunk id", c)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["chunk_ids"] = list(self.chunk_ids)
        d["swap_parts"] = [list(x) for x in self.swap_parts]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockProfile:
        return cls(**_known(cls, d))


@dataclass(frozen=True, kw_only=True)
class ChunkProfile:
    """One parameter chunk: ``bytes`` of its compute-dtype working copy (padding included), ``n_params``.
    ``lean_fetch_bytes``: what one fetch moves when the chunk is lean (its fp32 master, padding
    included; ``docs/DESIGN.md#the-cost-model``, "Lean chunks"); 0 where the problem never makes it lean."""

    bytes: int
    n_params: int
    lean_fetch_bytes: int = 0

    def __post_init__(self) -> None:
        _check_count("ChunkProfile", "bytes", self.bytes)
        _check_count("ChunkProfile", "n_params", self.n_params)
        _check_count("ChunkProfile", "lean_fetch_bytes", self.lean_fetch_bytes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChunkProfile:
        return cls(**_known(cls, d))


@dataclass(frozen=True, kw_only=True)
class Problem:
    """What the search needs to know about one training step (``docs/DESIGN.md#the-cost-model`` derives the model).

    ``chunks`` are in first-use order: the first ``n_persist`` stay on the GPU. ``outside_*``: the work
    outside the blocks (embedding, head, loss), modelled as one step after the last block in forward
    and the first step of backward, using ``outside_chunk_ids``; ``outside_peak_bytes`` is its working
    memory on top of the activations. ``fixed_bytes``: always resident (inputs, workspace).

    A persistent chunk costs ``2 * bytes + n_params * (master_bytes_per_param +
    adam_state_bytes_per_param)`` GPU bytes (:meth:`persistent_bytes`): working copy, gradient (same
    layout and dtype), fp32 master copy (4 B; 0 when the working copy is the master), Adam's two fp32
    moments (8 B). ``persistent_param_bytes``: when above 0, a persistent chunk keeps its parameters
    in a dtype of that many bytes (and its gradient alike) instead of the chunk's: ``protrain_fx.offload``
    keeps persistent parameters fp32 (the user's optimizer steps them, autocast makes the compute
    copies) while the chunk buffers hold the compute dtype; ``bytes`` stays the buffer's size.
    ``device_step_bytes``: the device staging of chunks stepped on the GPU (``n_gpu_optim > 0``;
    ``DeviceAdamW.staging_bytes``).

    ``lean_chunks``: empty (no chunk is ever lean), or per ``n_persist`` in ``0..len(chunks)`` how
    many of the last chunks are lean (the chunk store's rule for the host memory there is,
    ``runtime/store/host_memory.auto_lean``), never more than are offloaded and never more with more
    persistent chunks. ``lean_staging_bytes``: device bytes of the fp32 staging lean chunks are
    fetched through (``ChunkBufferPool.staging_bytes``), resident when any chunk is lean.

    ``spill_chunks``: empty (no optimizer state on disk), or per ``n_persist`` how many chunks just
    before the lean ones keep their fp32 master and moments in the spill file
    (``runtime/store/spill.py``; the store's rule, ``runtime/store/host_memory.auto_tiers``). Such a
    chunk's CPU step takes the longer of its Adam and its state's read and write at
    ``disk_read_bytes_per_s`` / ``disk_write_bytes_per_s`` (read ahead during the chunk before, so
    the two overlap), and it is never stepped on the device. ``min_persist``: the fewest persistent
    chunks the store can be made with (fewer spill more optimizer state than the spill folder has
    free); the search keeps ``n_persist`` at or above it.

    ``device_step_s``: ``(chunk id, seconds)`` of chunks whose device step was timed in training
    (``planner/rates.TrainingRates``): that chunk's step takes those seconds instead of its bytes over
    ``machine.device_step_bytes_per_s`` (its copies in scaled alike). The steps of one plan do not
    run at one rate (the first offloaded chunk's, issued last in backward, runs markedly longer than
    the others), so priced per chunk the recorded runs replay closer to their step than at
    the median rate (``docs/results.md#the-rate-window-and-the-re-plan``).

    Swap placement (``passes/swap.py``; ``docs/DESIGN.md#the-cost-model``, "Swap memory"): ``outside_place_bwd_s`` is
    the backward of the outside work before the first block's backward on the rewrite's timeline
    (default ``outside_bwd_s``); ``place_d2h_bytes_per_s`` / ``place_h2d_bytes_per_s`` the copy rates
    it places with (``Machine.d2h_bytes`` / ``h2d_bytes``; 0: the machine profile's one-way rates),
    and ``copy_margin`` its ``Machine.copy_margin`` (copies placed as if they took that many times
    their bytes over the rate).

    ``accumulation``: micro-batches per optimizer step (gradient accumulation: the backward of all
    but the last runs inside ``OffloadHandle.accumulate()``). Each micro-batch fetches, computes and
    lands its gradients; the optimizer steps once, after the last. The cost model prices the whole
    accumulated step (``docs/DESIGN.md#the-cost-model``, "Accumulation"); 1 is one micro-batch a step.

    ``held_steps``: the loop clips gradients (``OffloadHandle.grad_clipping``), so every offloaded
    chunk's step waits for the global norm, known once backward's last gradient has landed: then the
    device streams the first ``n_gpu_optim`` chunks' held gradients through (``DeviceAdamW.step_held``)
    while the CPU steps the rest, both in the next forward's chunk order, which waits for each chunk
    only where it reads it (``docs/DESIGN.md#the-cost-model``, "Held steps").

    ``world_size``: ranks of a data-parallel training (``runtime/parallel/shard.py``), each holding 1/N of every
    offloaded chunk: a rank copies 1/N of a chunk each way and steps 1/N of its optimizer work, and
    each fetch ends with an all-gather of the whole chunk (``chunk_all_gather_s`` seconds) and each
    gradient starts with a reduce-scatter of the whole chunk's gradient (``chunk_reduce_scatter_s``),
    on a lane of their own (``docs/DESIGN.md#the-cost-model``, "Data parallelism"). Both are 0 at
    world size 1, which is a one-GPU step exactly.
    """

    blocks: tuple[BlockProfile, ...]
    chunks: tuple[ChunkProfile, ...]
    machine: MachineProfile
    outside_fwd_s: float = 0.0
    outside_bwd_s: float = 0.0
    outside_peak_bytes: int = 0
    outside_chunk_ids: tuple[int, ...] = ()
    fixed_bytes: int = 0
    master_bytes_per_param: int = 4
    adam_state_bytes_per_param: int = 8
    device_step_bytes: int = 0
    persistent_param_bytes: int = 0
    lean_chunks: tuple[int, ...] = ()
    lean_staging_bytes: int = 0
    spill_chunks: tuple[int, ...] = ()
    disk_read_bytes_per_s: float = 0.0
    disk_write_bytes_per_s: float = 0.0
    min_persist: int = 0
    device_step_s: tuple[tuple[int, float], ...] = ()
    outside_place_bwd_s: float | None = None
    place_d2h_bytes_per_s: float = 0.0
    place_h2d_bytes_per_s: float = 0.0
    copy_margin: float = 1.0
    accumulation: int = 1
    held_steps: bool = False
    world_size: int = 1
    chunk_all_gather_s: float = 0.0
    chunk_reduce_scatter_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Problem: world_size={self.world_size!r} must be an int >= 1 (ranks)")
        for n in ("chunk_all_gather_s", "chunk_reduce_scatter_s"):
            _check_seconds("Problem", n, getattr(self, n))
            if self.world_size == 1 and getattr(self, n):
                raise ValueError(f"Problem: {n}={getattr(self, n)!r} with world_size=1; one rank runs no "
                                 "collective (0, or world_size > 1)")
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise ValueError(f"Problem: accumulation={self.accumulation!r} must be an int >= 1 (micro-batches a step)")
        if self.outside_place_bwd_s is None:
            object.__setattr__(self, "outside_place_bwd_s", self.outside_bwd_s)
        _check_seconds("Problem", "outside_place_bwd_s", self.outside_place_bwd_s)
        for n in ("place_d2h_bytes_per_s", "place_h2d_bytes_per_s"):
            v = getattr(self, n)
            if not (_is_number(v) and v >= 0):
                raise ValueError(f"Problem: {n}={v!r} must be a number >= 0 (0: the machine's copy rate)")
        if not (_is_number(self.copy_margin) and 0 < self.copy_margin < math.inf):
            raise ValueError(f"Problem: copy_margin={self.copy_margin!r} must be a finite number > 0")
        for n in ("blocks", "chunks", "outside_chunk_ids", "lean_chunks", "spill_chunks"):
            object.__setattr__(self, n, tuple(getattr(self, n)))
        object.__setattr__(self, "device_step_s", tuple(tuple(x) for x in self.device_step_s))
        for pair in self.device_step_s:
            if len(pair) != 2 or not isinstance(pair[0], int) or isinstance(pair[0], bool):
                raise ValueError(f"Problem: device_step_s entry {pair!r} is not (chunk id, seconds)")
            if not 0 <= pair[0] < len(self.chunks):
                raise ValueError(f"Problem: device_step_s chunk id {pair[0]} out of range (there are "
                                 f"{len(self.chunks)} chunks)")
            if not (_is_number(pair[1]) and pair[1] > 0):
                raise ValueError(f"Problem: device_step_s of chunk {pair[0]} is {pair[1]!r}; it must be a "
                                 "number of seconds > 0")
        if len({k for k, _ in self.device_step_s}) != len(self.device_step_s):
            raise ValueError("Problem: device_step_s names a chunk twice")
        for n in ("outside_fwd_s", "outside_bwd_s"):
            _check_seconds("Problem", n, getattr(self, n))
        for n in ("outside_peak_bytes", "fixed_bytes", "master_bytes_per_param", "adam_state_bytes_per_param",
                  "device_step_bytes", "persistent_param_bytes", "lean_staging_bytes"):
            _check_count("Problem", n, getattr(self, n))
        names = [b.name for b in self.blocks]
        if len(set(names)) != len(names):
            raise ValueError(f"Problem: repeated block names {sorted({n for n in names if names.count(n) > 1})}")
        n = len(self.chunks)
        used: set[int] = set(self.outside_chunk_ids)
        for b in self.blocks:
            used.update(b.chunk_ids)
        bad = sorted(c for c in used if c >= n)
        if bad:
            raise ValueError(f"Problem: chunk ids {bad} out of range (there are {n} chunks)")
        unused = sorted(set(range(n)) - used)
        if unused:
            raise ValueError(f"Problem: chunks {unused} are used by no block and not in outside_chunk_ids")
        self._check_lean()
        self._check_spill()

    def _check_spill(self) -> None:
        spill, n = self.spill_chunks, len(self.chunks)
        _check_count("Problem", "min_persist", self.min_persist)
        if self.min_persist > n:
            raise ValueError(f"Problem: min_persist={self.min_persist} exceeds the {n} chunks")
        if not spill:
            return
        if len(spill) != n + 1:
            raise ValueError(f"Problem: spill_chunks has {len(spill)} entries; one per n_persist in 0..{n} needs {n + 1}")
        lean = self.lean_chunks or (0,) * (n + 1)
        for p, k in enumerate(spill):
            _check_count("Problem", f"spill_chunks[{p}]", k)
            if k + lean[p] > n - p:
                raise ValueError(f"Problem: spill_chunks[{p}]={k} and lean_chunks[{p}]={lean[p]} exceed the {n - p} "
                                 f"chunks offloaded with n_persist={p}")
        if any(spill):
            for name in ("disk_read_bytes_per_s", "disk_write_bytes_per_s"):
                v = getattr(self, name)
                if not (_is_number(v) and v > 0):
                    raise ValueError(f"Problem: {name}={v!r} must be a positive number when chunks are spilled")

    def _check_lean(self) -> None:
        lean, n = self.lean_chunks, len(self.chunks)
        if not lean:
            return
        if len(lean) != n + 1:
            raise ValueError(
                f"Problem: lean_chunks has {len(lean)} entries; one per n_persist in 0..{n} needs {n + 1}"
            )
        for p, k in enumerate(lean):
            _check_count("Problem", f"lean_chunks[{p}]", k)
            if k > n - p:
                raise ValueError(
                    f"Problem: lean_chunks[{p}]={k} exceeds the {n - p} chunks offloaded with n_persist={p}"
                )
            if p and k > lean[p - 1] and not any(self.spill_chunks):  # (fewer spilled: more may be lean)
                raise ValueError(
                    f"Problem: lean_chunks must not grow with n_persist (lean_chunks[{p}]={k} > {lean[p - 1]})"
                )
        bad = [c for c in range(n - max(lean), n) if not self.chunks[c].lean_fetch_bytes]
        if bad:
            raise ValueError(f"Problem: chunks {bad} can be lean but have no lean_fetch_bytes")

    def persistent_bytes(self, chunk_id: int) -> int:
        """GPU bytes of chunk ``chunk_id`` when persistent (see the class docstring)."""
        c = self.chunks[chunk_id]
        working = 2 * c.n_params * self.persistent_param_bytes if self.persistent_param_bytes else 2 * c.bytes
        return working + c.n_params * (self.master_bytes_per_param + self.adam_state_bytes_per_param)

    def shard_bytes(self, nbytes: int) -> int:
        """A rank's part of ``nbytes`` of a chunk (its 1/N, rounded up: the runtime pads chunks to N
        equal parts)."""
        return -(-nbytes // self.world_size)

    @property
    def buffer_bytes(self) -> int:
        """Size of one chunk staging buffer: the largest chunk."""
        return max((c.bytes for c in self.chunks), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROBLEM_VERSION,
            "blocks": [b.to_dict() for b in self.blocks],
            "chunks": [c.to_dict() for c in self.chunks],
            "machine": self.machine.to_dict(),
            "outside_fwd_s": self.outside_fwd_s,
            "outside_bwd_s": self.outside_bwd_s,
            "outside_peak_bytes": self.outside_peak_bytes,
            "outside_chunk_ids": list(self.outside_chunk_ids),
            "fixed_bytes": self.fixed_bytes,
            "master_bytes_per_param": self.master_bytes_per_param,
            "adam_state_bytes_per_param": self.adam_state_bytes_per_param,
            "device_step_bytes": self.device_step_bytes,
            "persistent_param_bytes": self.persistent_param_bytes,
            "lean_chunks": list(self.lean_chunks),
            "lean_staging_bytes": self.lean_staging_bytes,
            "spill_chunks": list(self.spill_chunks),
            "disk_read_bytes_per_s": self.disk_read_bytes_per_s,
            "disk_write_bytes_per_s": self.disk_write_bytes_per_s,
            "min_persist": self.min_persist,
            "device_step_s": [list(x) for x in self.device_step_s],
            "outside_place_bwd_s": self.outside_place_bwd_s,
            "place_d2h_bytes_per_s": self.place_d2h_bytes_per_s,
            "place_h2d_bytes_per_s": self.place_h2d_bytes_per_s,
            "copy_margin": self.copy_margin,
            "accumulation": self.accumulation,
            "held_steps": self.held_steps,
            "world_size": self.world_size,
            "chunk_all_gather_s": self.chunk_all_gather_s,
            "chunk_reduce_scatter_s": self.chunk_reduce_scatter_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Problem:
        version = d.get("version", PROBLEM_VERSION)
        if version != PROBLEM_VERSION:
            raise ValueError(f"Problem: version {version!r} is not supported; accepted: {PROBLEM_VERSION}")
        rest = _known(cls, {k: v for k, v in d.items() if k != "version"})
        rest["blocks"] = [BlockProfile.from_dict(b) for b in d["blocks"]]
        rest["chunks"] = [ChunkProfile.from_dict(c) for c in d["chunks"]]
        rest["machine"] = MachineProfile.from_dict(d["machine"])
        return cls(**rest)

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON form to ``path`` (floats round-trip exactly)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Problem:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


@dataclass(frozen=True, order=True)
class Counts:
    """ProTrain's four counts (its "configuration"), and ``n_gpu_optim``: the first non-persistent
    chunks stepped on the GPU (ours; 0 is ProTrain). Not :class:`protrain_fx.plan.Plan`:
    :func:`block_plan` maps the two activation counts to per-block policies with
    :func:`protrain_fx.plan.interleaved`; not the backend's options (:class:`protrain_fx.config.ProtrainConfig`)."""

    n_persist: int
    n_buffer: int
    n_swap: int
    n_checkpoint: int
    n_gpu_optim: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Counts:
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` predicts for one config. ``step_s = accumulated_s + fwd_s + bwd_s + opt_s``;
    ``accumulated_s`` is the micro-batches before the last (0 without accumulation), ``fwd_s`` and
    ``bwd_s`` the last micro-batch's, ``opt_s`` what follows its backward on the critical path (GPU
    Adam, or waiting for the CPU Adam the next forward needs). ``compute_s``, ``recompute_s`` and the
    link bytes count every micro-batch of the step. ``peak_bytes = static_bytes + activation_peak_bytes``."""

    step_s: float
    peak_bytes: int
    fwd_s: float
    bwd_s: float
    opt_s: float
    static_bytes: int
    activation_peak_bytes: int
    compute_s: float  # forward + backward compute without recompute
    recompute_s: float
    gpu_adam_s: float
    cpu_adam_s: float
    h2d_bytes: int
    d2h_bytes: int
    device_steps: int = 0
    accumulated_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def block_plan(problem: Problem, config: Counts) -> Plan:
    """The per-block activation plan of ``config``: ProTrain's interleaved layout over the blocks."""
    return interleaved([b.name for b in problem.blocks], config.n_swap, config.n_checkpoint)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _check_seconds(where: str, name: str, v: Any) -> None:
    if not (_is_number(v) and 0 <= v < math.inf):
        raise ValueError(f"{where}: {name}={v!r} must be a finite number of seconds >= 0")


def _check_count(where: str, name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: {name}={v!r} must be an int >= 0")


def _known(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - names)
    if extra:
        raise ValueError(f"{cls.__name__}: unknown keys {extra}; accepted: {sorted(names)}")
    return dict(d)
