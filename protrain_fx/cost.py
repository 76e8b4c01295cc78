# ruff: noqa: PLR1730, FURB136
# (the simulation's hot loops keep `x if x > y else y`: twice as fast as max() in CPython)
"""ProTrain's cost model as plain data in, numbers out: no FX, no torch, replayable from a JSON dump.

A :class:`Problem` describes one training step the way the search sees it: per transformer block its
times and activation bytes (:class:`BlockProfile`), per parameter chunk its size (:class:`ChunkProfile`),
the work outside the blocks (embedding, head, loss) and the machine (:class:`MachineProfile`).
:func:`estimate` turns a :class:`Config` (ProTrain's four counts) into an :class:`Estimate`: step time
and peak GPU memory.

Memory (bytes), exactly ``peak = static(n_persist, n_buffer) + activations(n_swap, n_checkpoint)``:

* static = ``fixed_bytes`` + per persistent chunk ``2 * bytes + n_params * (master_bytes_per_param +
  adam_state_bytes_per_param)`` (working copy, its gradient in the same layout and dtype, fp32 master,
  two Adam moments; ``2 * n_params * persistent_param_bytes`` for the first two when that is set)
  + ``n_buffer * max(chunk bytes)`` (the staging buffers; a non-persistent chunk's gradient is
  produced in its buffer and offloaded from there, so it costs nothing more).
* activations: a per-block walk. ``keep_i`` = what block ``i`` leaves on the GPU after its forward:
  ``saved_bytes`` (none), ``checkpoint_saved_bytes`` (checkpoint), ``saved_bytes - swap_bytes`` (swap).
  Forward of block ``i``: ``Σ_{j<i} keep_j + out_i + transient_i + (checkpoint_saved_i if checkpoint
  else saved_i)``, where ``out_i`` is the bytes of earlier swapped blocks whose copy out is not yet
  waited for (below). End of forward: ``Σ keep + out_N + outside_peak_bytes``. Backward of block
  ``i``: ``Σ_{j<i} keep_j + saved_i (+ checkpoint_saved_i when recomputed) + in_i + transient_i``,
  where ``in_i`` is the bytes of earlier swapped blocks already reloaded; and the outside work
  before the blocks' backward: ``Σ keep + in_N + outside_peak_bytes``.

Swap memory follows what ``passes/swap.py`` builds, not when the copies may really end (which moves
no byte: the graph frees a value where its wait is, whatever the link does). The rewrite queues the
copies out on one stream in forward order, each issued at its block's end (here) or when the one
before is placed done, each lasting ``copy_margin * swap_bytes / rate`` on its own roofline timeline
(:attr:`BlockProfile.place_fwd_s`, :attr:`Problem.place_d2h_bytes_per_s`); the bytes are freed before
the first block starting after that (:meth:`CostModel.swap_freed_at`). So when the copies take
longer than the blocks after them, the bytes of every swapped block queued behind stay on the device
too, and one more swapped block saves only what the link moves meanwhile (B4 x 2048 at a width of
4096: about 1 GiB per block against a tenth of that moved during one block's forward). In backward
the reloads are laid out latest first, each done by its block's backward and before the next later
one starts (:meth:`CostModel.swap_reloaded_at`); a reload is on the device from the block whose
backward issues it. A swap leaves on the device what the rewrite does not move (values under
``Machine.min_swap_bytes``, values computed from the model state alone such as the compute-dtype
casts of weights, storages no contiguous value covers): ``swap_bytes`` counts only what it moves
(``profiler.problem_from_record``).

Time (seconds): an event simulation over four resources: the GPU stream (sequential compute), the
host-to-device and device-to-host copy queues (each FIFO in a fixed order) and one CPU Adam worker.

* Forward, step ``j`` = block ``j`` (and last the outside work, step ``N``): the non-persistent chunks
  a step uses are fetched in *runs* (a chunk used by consecutive steps is fetched once). Fetch ``k``
  (runs in forward order) needs a buffer: with ``B`` buffers it waits for the end of the step that
  releases the ``(k-B+1)``-th earliest-released earlier run. A step starts when the previous one ended
  and its runs are fetched. A swap block's offload enters the D2H queue at the end of its forward;
  the forward ends no earlier than its last offload (the graph waits for each where it is estimated
  done, and by its output at the latest: ``passes/swap.py``).
* Backward, reverse order, starting with the outside work: the ``B`` runs last released in forward are
  still resident and are not re-fetched; every other run is re-fetched into the buffer whose gradient
  offload finished earliest (the same rank rule). A swap block's reload is issued when the previous
  backward step starts (one block ahead) and after its offload ended. A checkpoint block adds
  ``recompute_s`` (``recompute_chained_s`` when the next block is checkpointed too). When a step
  ends, the gradients of the runs it finishes enter the D2H queue; when a chunk's last gradient
  lands, CPU Adam runs on it (``n_params / cpu_adam_params_per_s``, one chunk at a time). GPU Adam
  of the persistent chunks runs after backward on the GPU stream.
* Link: a copy runs at the one-way rate, or at ``min(one-way, duplex_bytes_per_s / 2)`` when the other
  direction is busy. "Busy" is decided on a static reference timeline (compute only, no recompute):
  a copy is shared when its reference interval (issued one step before use, lasting bytes / one-way
  rate) overlaps a reference interval of a copy in the other direction that the config performs.
* Step time ``= max(E, cpu_adam_total, max_c(adam_done_c + fetch_c - ref_start_c))`` where ``E`` is
  the end of GPU work (backward + GPU Adam), and the last term lets the next forward start while the
  CPU still updates chunks, waiting only for chunk ``c`` to be updated and fetched before the step
  that first uses it (``ref_start_c``: the compute-only time at which the next forward reaches it).
* Device steps (``n_gpu_optim = g``, ``runtime/device_adam.py``): the first ``g`` non-persistent
  chunks (``n_persist .. n_persist + g - 1``) are stepped on the GPU instead of the CPU. Their
  gradients are not offloaded (their buffers are free when their backward step ends); when a chunk's
  last gradient is made, its step is issued: ``n_params * (4 + adam_state_bytes_per_param)`` bytes
  (fp32 master and moments) are copied in and, starting with them, the same plus the chunk's
  working copy (``bytes``) out, on the steps' own copy lanes (the runtime's load and drain streams:
  one step after another in each direction, beside the fetches and gradient offloads, which they do
  not hold up), at :attr:`MachineProfile.device_step_bytes_per_s` where that was measured (beside
  the CPU step and the model's own kernels), else at the shared rate;
  the chunk is updated when both end (that is its ``adam_done``). (Until the twelfth session the
  steps' copies queued in the fetches' FIFO: each backward re-fetch then waited behind a whole step's
  copies in, and B24 4.2B@16 GiB's backward was predicted at 1033 ms against 879 measured.) At most
  :data:`DEVICE_STEPS_IN_FLIGHT` steps run at once: issuing one more waits for the oldest, and the
  GPU stream waits with it (the thread that issues GPU work is the one blocked). The device steps
  share the link with swap traffic, decided on a reference timeline of their own
  (``CostModel._device_chain``: compute only, each step ``max(in, out)`` long after the one before,
  backward held up by the in-flight limit): a swap-in (issued when the next block's backward starts,
  lasting bytes / one-way rate) that overlaps a step there lengthens that step's copies in by its
  duration (B24 1.3B at 16 GiB on the H200: the step in flight during the swap-ins took 61-71 ms,
  the others 33-39; 4.2B at 24 GiB: 113-116 against 67-90), and so does a backward re-fetch, by
  its whole duration on both lanes (``CostModel._dev_refetch``: the steps copy near the link's
  duplex rate; 4.2B at 24 GiB: 67-70 ms for the two issued after backward's last re-fetch, where
  69 was priced, and 72-85 for the others).
  A step timed in training (:attr:`Problem.device_step_s`) has its re-fetches in its seconds. Not
  modelled: the reference backward leaves out recompute, so it places the steps earlier against
  backward than they run (it gives the first step issued more re-fetches than ran beside it). The
  link-sharing of the other copies is decided on the reference timeline without device steps.

Every time is built from ``max`` and ``+`` of non-negative durations in a fixed order decided by the
config alone (never by timing). Hence (and the tests check it on random problems):

* more bandwidth (or removing a copy, a constraint or a duration) never increases the step time;
* the step time is non-increasing in ``n_buffer`` (earlier buffers, fewer re-fetches);
* ``T(p+1, b) <= T(p, b) + gpu_adam(chunk p)``: one more persistent chunk only adds its GPU Adam time,
  so the time never increases when GPU Adam is free;
* ``T(p, b, s, c) >= T(p, b, 0, 0)`` and ``>= T_act(s, c)`` (all chunks persistent, no optimizer):
  swap and checkpoint only add copies and compute; and ``T >= cpu_adam`` of the chunks stepped on
  the CPU. :mod:`protrain_fx.search` prunes with these.

Memory: device steps add :attr:`Problem.device_step_bytes` (the staging slices) and
:data:`DEVICE_STEPS_IN_FLIGHT` gradient buffers of the largest chunk to the static bytes when
``g > 0``.

Lean chunks (``runtime/chunk_store.py``: no compute-dtype copy on the host, made when the host
cannot hold every offloaded chunk's): with ``n_persist = p`` the last ``Problem.lean_chunks[p]``
chunks are lean. Each fetch of a lean chunk (forward and backward) moves its fp32 master,
:attr:`ChunkProfile.lean_fetch_bytes`, where other chunks move ``bytes``; its device step copies no
working copy out; and :attr:`Problem.lean_staging_bytes` (the fp32 fetch staging) joins the static
bytes. The link-sharing decision keeps the reference timeline of ``bytes``. Not modelled: backward
waiting for a gradient landing buffer when more lean chunks than ``grad_pool`` await their CPU step.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protrain_fx.plan import Plan, _segment_starts, interleaved

#: Version of the :class:`Problem` JSON form; :meth:`Problem.from_dict` refuses any other.
PROBLEM_VERSION = 1

_NONE, _CKPT, _SWAP = 0, 1, 2
#: Device steps in flight at most (``runtime/device_adam.MAX_IN_FLIGHT``; a test checks they agree).
DEVICE_STEPS_IN_FLIGHT = 2
_Forward = tuple[list[float], list[float], list[float], float, float, float]


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """Rates of the machine. ``duplex_bytes_per_s`` is the total when both copy directions run at once;
    ``gpu_bytes`` is the device's memory (informational: the search takes its budget separately).
    ``device_step_bytes_per_s``: the rate, each way, of an offloaded chunk's optimizer step streamed
    through the GPU (``runtime/device_adam.py``) as measured beside the CPU optimizer; 0 = not
    measured, the shared copy rate (``min(one-way, duplex / 2)``) stands in."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    cpu_adam_params_per_s: float
    gpu_adam_params_per_s: float
    gpu_bytes: int = 0
    device_step_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in ("gpu_bytes", "device_step_bytes_per_s") and not (_is_number(v) and v > 0):
                raise ValueError(f"MachineProfile: {f.name}={v!r} must be a positive number (inf allowed)")
        _check_count("MachineProfile", "gpu_bytes", self.gpu_bytes)
        v = self.device_step_bytes_per_s
        if not (_is_number(v) and v >= 0):
            raise ValueError(f"MachineProfile: device_step_bytes_per_s={v!r} must be a number >= 0 (0: not measured)")

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
    input, so less is rerun (``profiler._recompute_times``). ``saved_bytes``: activations kept for
    backward; ``checkpoint_saved_bytes``: what a checkpointed block still keeps (its input);
    ``swap_bytes``: what a swap moves to the CPU (at most ``saved_bytes``; the rest stays);
    ``transient_bytes``: peak working memory inside the block's forward or backward on top of the
    live activations. ``chunk_ids``: parameter chunks used.

    ``place_fwd_s`` / ``place_bwd_s`` (default ``fwd_s`` / ``bwd_s``): the block's forward and
    backward (without recompute) on the timeline ``passes/swap.py`` places its copies' waits by (its
    own roofline, ``passes/estimate.start_times``). They decide where the swap rewrite frees a
    swapped block's bytes and issues its reload, hence the swap memory (module docstring); never time.
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
    included; see the module docstring); 0 where the problem never makes it lean."""

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
    """What the search needs to know about one training step (see the module docstring for the model).

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
    ``runtime/chunk_store.auto_lean``), never more than are offloaded and never more with more
    persistent chunks. ``lean_staging_bytes``: device bytes of the fp32 staging lean chunks are
    fetched through (``ChunkBufferPool.staging_bytes``), resident when any chunk is lean.

    ``device_step_s``: ``(chunk id, seconds)`` of chunks whose device step was timed in training
    (``calibrate.TrainingRates``): that chunk's step takes those seconds instead of its bytes over
    ``machine.device_step_bytes_per_s`` (its copies in scaled alike). On the H200 the device step of
    the first offloaded chunk, issued last in backward, ran 47 ms where the others ran 34; priced per
    chunk, 23 of the 24 recorded runs with device steps replay within 5% of their step, against 20 at
    the median rate (``docs/results.md``, seventeenth session).

    Swap placement (``passes/swap.py``, module docstring "Swap memory"): ``outside_place_bwd_s`` is
    the backward of the outside work before the first block's backward on the rewrite's timeline
    (default ``outside_bwd_s``); ``place_d2h_bytes_per_s`` / ``place_h2d_bytes_per_s`` the copy rates
    it places with (``Machine.d2h_bytes`` / ``h2d_bytes``; 0: the machine profile's one-way rates),
    and ``copy_margin`` its ``Machine.copy_margin`` (copies placed as if they took that many times
    their bytes over the rate).
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
    device_step_s: tuple[tuple[int, float], ...] = ()
    outside_place_bwd_s: float | None = None
    place_d2h_bytes_per_s: float = 0.0
    place_h2d_bytes_per_s: float = 0.0
    copy_margin: float = 1.0

    def __post_init__(self) -> None:
        if self.outside_place_bwd_s is None:
            object.__setattr__(self, "outside_place_bwd_s", self.outside_bwd_s)
        _check_seconds("Problem", "outside_place_bwd_s", self.outside_place_bwd_s)
        for n in ("place_d2h_bytes_per_s", "place_h2d_bytes_per_s"):
            v = getattr(self, n)
            if not (_is_number(v) and v >= 0):
                raise ValueError(f"Problem: {n}={v!r} must be a number >= 0 (0: the machine's copy rate)")
        if not (_is_number(self.copy_margin) and 0 < self.copy_margin < math.inf):
            raise ValueError(f"Problem: copy_margin={self.copy_margin!r} must be a finite number > 0")
        for n in ("blocks", "chunks", "outside_chunk_ids", "lean_chunks"):
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
            if p and k > lean[p - 1]:
                raise ValueError(
                    f"Problem: lean_chunks must not grow with n_persist (lean_chunks[{p}]={k} > {lean[p - 1]})"
                )
        bad = [c for c in range(n - lean[0], n) if not self.chunks[c].lean_fetch_bytes]
        if bad:
            raise ValueError(f"Problem: chunks {bad} can be lean but have no lean_fetch_bytes")

    def persistent_bytes(self, chunk_id: int) -> int:
        """GPU bytes of chunk ``chunk_id`` when persistent (see the class docstring)."""
        c = self.chunks[chunk_id]
        working = 2 * c.n_params * self.persistent_param_bytes if self.persistent_param_bytes else 2 * c.bytes
        return working + c.n_params * (self.master_bytes_per_param + self.adam_state_bytes_per_param)

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
            "device_step_s": [list(x) for x in self.device_step_s],
            "outside_place_bwd_s": self.outside_place_bwd_s,
            "place_d2h_bytes_per_s": self.place_d2h_bytes_per_s,
            "place_h2d_bytes_per_s": self.place_h2d_bytes_per_s,
            "copy_margin": self.copy_margin,
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
class Config:
    """ProTrain's four counts, and ``n_gpu_optim``: the first non-persistent chunks stepped on the GPU
    (ours; 0 is ProTrain). Not :class:`protrain_fx.plan.Plan`: :func:`block_plan` maps the two
    activation counts to per-block policies with :func:`protrain_fx.plan.interleaved`."""

    n_persist: int
    n_buffer: int
    n_swap: int
    n_checkpoint: int
    n_gpu_optim: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` predicts for one config. ``step_s = fwd_s + bwd_s + opt_s``; ``opt_s`` is
    what follows backward on the critical path (GPU Adam, or waiting for the CPU Adam the next forward
    needs). ``peak_bytes = static_bytes + activation_peak_bytes``."""

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- API


def block_plan(problem: Problem, config: Config) -> Plan:
    """The per-block activation plan of ``config``: ProTrain's interleaved layout over the blocks."""
    return interleaved([b.name for b in problem.blocks], config.n_swap, config.n_checkpoint)


def estimate(problem: Problem, config: Config) -> Estimate:
    """Predicted step time and peak memory of ``config``. Raises ``ValueError`` for an invalid config."""
    return CostModel(problem).estimate(config)


#: How far each host rate an offloaded step rests on may be from the profile's reading, as a fraction:
#: over the recorded B24 runs on the H200 (``bench/device_rate_definitions.py``, 2026-12-02), the CPU
#: chunk step reached in training 11% (1.3B) and 18% (4.2B) away from its profiled rate on average, and
#: training's own rate spread 27% across hosts at 4.2B; the device steps 7-10% away. The profile cannot
#: do better on those hosts: the CPU step's rate moved 0.6-1.6 G params/s within a minute with nothing
#: else running (twenty-first session). :func:`expected_estimate` and :func:`steadiest_gpu_optim` price
#: a config at the reading and at each rate this fraction either side of it.
RATE_SPREAD: dict[str, float] = {"cpu_adam_params_per_s": 0.25, "device_step_bytes_per_s": 0.10}


def rate_scenarios(problem: Problem, spread: Mapping[str, float] = RATE_SPREAD) -> list[Problem]:
    """``problem`` with its machine's rates named in ``spread`` each at (1 - u, 1, 1 + u) times the
    reading, every combination (9 for two rates): equally likely cases of where training's rates may
    fall. Without spread, ``[problem]``."""
    cases = [{}]
    for name, u in spread.items():
        if u <= 0:
            continue
        base = getattr(problem.machine, name)
        cases = [{**c, name: base * f} for c in cases for f in (1 - u, 1.0, 1 + u)]
    return [dataclasses.replace(problem, machine=dataclasses.replace(problem.machine, **c)) for c in cases]


def expected_estimate(problem: Problem, config: Config, spread: Mapping[str, float] = RATE_SPREAD) -> Estimate:
    """:func:`estimate` of ``config`` with its times (step, forward, backward, after backward) the mean
    over :func:`rate_scenarios`: the step to expect when the host rates are known only to ``spread``.
    A step mostly slows by more when a rate falls than it gains when the rate rises (the critical
    path moves onto the slow work), so this mean mostly lies above the step at the readings; not
    always, since the cost model's overlaps are not convex in the rates. Memory is the reading's: the
    rates move no bytes. A config that keeps every chunk on the device, or with a
    zero spread, gets the plain estimate."""
    plain = estimate(problem, config)
    if config.n_persist >= len(problem.chunks) or not any(u > 0 for u in spread.values()):
        return plain
    cases = [estimate(q, config) for q in rate_scenarios(problem, spread)]

    def mean(name: str) -> float:
        return sum(getattr(e, name) for e in cases) / len(cases)

    return dataclasses.replace(plain, step_s=mean("step_s"), fwd_s=mean("fwd_s"), bwd_s=mean("bwd_s"),
                               opt_s=mean("opt_s"))


def steadiest_gpu_optim(
    problem: Problem, config: Config, *, room_bytes: int, spread: Mapping[str, float] = RATE_SPREAD
) -> Config:
    """``config`` with the ``n_gpu_optim`` of the least expected step (:func:`expected_estimate`'s mean
    over :func:`rate_scenarios`), its other counts kept; only counts whose static bytes add at most
    ``room_bytes`` to ``config``'s are tried (the memory the plan was judged to leave). Ties keep
    ``config``'s own count.

    Why: the search takes the count fastest at the rates read, and a rate read a little high makes it
    step too much on that side, where the step then slows by more than a rate read low would cost.
    Replayed on the 48 recorded offloaded runs of the H200 (``bench/gpu_optim_rules.py``, 2026-12-02),
    each priced at the rates its training reached: this count's step was 2.9% slower than the best
    count's on average and 13.4% at most, against 3.7% and 31.6% for the count fastest at the
    readings; and the first plan's prediction (:func:`expected_estimate`) was within 5% of that
    price on 25 runs, against 19 (mean error 4.8% against 7.2%)."""
    if config.n_persist >= len(problem.chunks):
        return config
    models = [CostModel(q) for q in rate_scenarios(problem, spread)]
    plain = models[len(models) // 2]  # the middle case: every rate at its reading
    p, b, s, c, g0 = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint, config.n_gpu_optim
    here = plain.static_bytes(p, b, g0)

    def expected(g: int) -> float:
        return sum(m.step_time(p, b, s, c, g) for m in models) / len(models)

    best_g, best = g0, expected(g0)
    for g in range(plain.n_chunks - p + 1):
        if g == g0 or plain.static_bytes(p, b, g) - here > room_bytes:
            continue
        t = expected(g)
        if t < best:
            best_g, best = g, t
    return config if best_g == g0 else dataclasses.replace(config, n_gpu_optim=best_g)


class CostModel:
    """:func:`estimate` with the per-problem precomputation kept (the search calls it many times)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        p = problem
        m = p.machine
        self.n_blocks = N = len(p.blocks)
        self.n_chunks = len(p.chunks)
        self._labels = [b.name for b in p.blocks]
        # Forward steps 0..N (N = outside); backward visits j = N, N-1, ..., 0.
        self.cf = [b.fwd_s for b in p.blocks] + [p.outside_fwd_s]
        self.cb = [b.bwd_s for b in p.blocks] + [p.outside_bwd_s]
        self.rc = [b.recompute_s for b in p.blocks] + [0.0]
        self.rc_chained = [b.recompute_chained_s for b in p.blocks] + [0.0]
        self._recomputes: dict[tuple[int, int], tuple[float, ...]] = {}
        step_chunks = [sorted(set(b.chunk_ids)) for b in p.blocks] + [sorted(set(p.outside_chunk_ids))]
        self.compute_s = sum(self.cf) + sum(self.cb)

        # Runs: maximal ranges of consecutive forward steps using one chunk, sorted by (first, chunk).
        runs: list[tuple[int, int, int]] = []  # (first, chunk, last)
        open_run: dict[int, list[int]] = {}
        for j in range(N + 1):
            for c in step_chunks[j]:
                if c in open_run and open_run[c][1] == j - 1:
                    open_run[c][1] = j
                else:
                    if c in open_run:
                        runs.append((open_run[c][0], c, open_run[c][1]))
                    open_run[c] = [j, j]
        runs += [(f, c, last) for c, (f, last) in open_run.items()]
        runs.sort()
        self.run_first = [r[0] for r in runs]
        self.run_chunk = [r[1] for r in runs]
        self.run_last = [r[2] for r in runs]
        self.run_bytes = [p.chunks[c].bytes for c in self.run_chunk]
        R = len(runs)
        self.step_runs = [[r for r in range(R) if self.run_first[r] <= j <= self.run_last[r]] for j in range(N + 1)]
        # The run whose gradient lands last in backward (the chunk's earliest run) triggers CPU Adam.
        self.adam_run = {}
        for r in range(R):
            self.adam_run.setdefault(self.run_chunk[r], r)
        self.adam_s = [c.n_params / m.cpu_adam_params_per_s for c in p.chunks]
        self.gpu_adam_s = [c.n_params / m.gpu_adam_params_per_s for c in p.chunks]
        # device steps: fp32 master and moments in; the same and the working copy out (shared rates)
        self.dev_in_bytes = [c.n_params * (4 + p.adam_state_bytes_per_param) for c in p.chunks]
        self.dev_out_bytes = [x + c.bytes for x, c in zip(self.dev_in_bytes, p.chunks)]
        self._lean = p.lean_chunks or (0,) * (len(p.chunks) + 1)
        self._cpu_after = [sum(self.adam_s[k:]) for k in range(len(p.chunks) + 1)]  # CPU Adam of chunks >= k
        self._gpu_before = [sum(self.gpu_adam_s[:k]) for k in range(len(p.chunks) + 1)]  # GPU Adam of chunks < k
        h2d_shared = min(m.h2d_bytes_per_s, m.duplex_bytes_per_s / 2)
        d2h_shared = min(m.d2h_bytes_per_s, m.duplex_bytes_per_s / 2)
        if m.device_step_bytes_per_s:  # measured: the steps' copies and the CPU step share the host
            h2d_shared = d2h_shared = m.device_step_bytes_per_s
        self._d2h_dev = d2h_shared
        self.dev_in_s = [x / h2d_shared for x in self.dev_in_bytes]
        self.dev_out_s = [x / d2h_shared for x in self.dev_out_bytes]  # a lean chunk's: _PerPersist.dev_out_s
        for k, seconds in p.device_step_s:  # timed in training: its copies in scaled as its step
            if self.dev_out_s[k] > 0:
                self.dev_in_s[k] *= seconds / self.dev_out_s[k]
        self._step_timed = [False] * len(p.chunks)  # its re-fetches are in its seconds (_dev_refetch)
        for k, _ in p.device_step_s:
            self._step_timed[k] = True
        self.dev_out_s = self.timed_steps(self.dev_out_s)

        # Static reference timeline (compute only, no recompute) and the copies' reference intervals.
        fs = [0.0] * (N + 1)
        for j in range(1, N + 1):
            fs[j] = fs[j - 1] + self.cf[j - 1]
        fe = [fs[j] + self.cf[j] for j in range(N + 1)]
        bs = [0.0] * (N + 1)  # indexed by forward step j
        t = fe[N]
        for j in range(N, -1, -1):
            bs[j] = t
            t += self.cb[j]
        be = [bs[j] + self.cb[j] for j in range(N + 1)]
        self.fwd_ref_start = fs
        self._fwd_ref_end = fe[N]
        h2d, d2h = m.h2d_bytes_per_s, m.d2h_bytes_per_s

        def iv(start: float, nbytes: int, rate: float) -> tuple[float, float]:
            return (start, start + nbytes / rate)

        blocks = p.blocks
        ff = [iv(fs[self.run_first[r] - 1] if self.run_first[r] else 0.0, self.run_bytes[r], h2d) for r in range(R)]
        bf = [iv(bs[self.run_last[r] + 1] if self.run_last[r] < N else bs[N], self.run_bytes[r], h2d) for r in range(R)]
        rl = [iv(bs[i + 1], blocks[i].swap_bytes, h2d) for i in range(N)]
        so = [iv(fe[i], blocks[i].swap_bytes, d2h) for i in range(N)]
        go = [iv(be[self.run_first[r]], self.run_bytes[r], d2h) for r in range(R)]

        def hit(a: tuple[float, float], b: tuple[float, float]) -> bool:
            return a[0] < b[1] and b[0] < a[1]

        inf = math.inf
        # An H2D copy is shared iff a performed swap offload (block < n_swap) or gradient offload
        # (chunk >= n_persist) overlaps it: keep the smallest such block and the largest such chunk.
        def h2d_keys(x: tuple[float, float]) -> tuple[float, int]:
            return (
                min((i for i in range(N) if hit(x, so[i])), default=inf),
                max((self.run_chunk[r] for r in range(R) if hit(x, go[r])), default=-1),
            )

        self.ff_key = [h2d_keys(x) for x in ff]
        self.bf_key = [h2d_keys(x) for x in bf]
        self.rl_key = [h2d_keys(x) for x in rl]

        # A D2H copy is shared iff a performed forward fetch (chunk >= n_persist), swap reload
        # (block < n_swap) or backward re-fetch (config dependent: listed) overlaps it.
        def d2h_keys(x: tuple[float, float]) -> tuple[int, float, list[int]]:
            return (
                max((self.run_chunk[r] for r in range(R) if hit(x, ff[r])), default=-1),
                min((i for i in range(N) if hit(x, rl[i])), default=inf),
                [r for r in range(R) if hit(x, bf[r])],
            )

        self.so_key = [d2h_keys(x) for x in so]
        self.go_key = [d2h_keys(x) for x in go]
        # Copy durations alone (d1) and sharing the link (d2).
        h2d_sh = min(h2d, m.duplex_bytes_per_s / 2)
        d2h_sh = min(d2h, m.duplex_bytes_per_s / 2)
        self._h2d, self._h2d_sh = h2d, h2d_sh
        self.h_d1 = [x / h2d for x in self.run_bytes]  # fetch durations; lean chunks': _PerPersist.h_d1
        self.h_d2 = [x / h2d_sh for x in self.run_bytes]
        self.g_d1 = [x / d2h for x in self.run_bytes]
        self.g_d2 = [x / d2h_sh for x in self.run_bytes]
        swap = [b.swap_bytes for b in blocks]
        self.rl_d1 = [x / h2d for x in swap]
        self.rl_d2 = [x / h2d_sh for x in swap]
        self.so_d1 = [x / d2h for x in swap]
        self.so_d2 = [x / d2h_sh for x in swap]
        self._saved = [b.saved_bytes for b in blocks]
        self._ck = [b.checkpoint_saved_bytes for b in blocks]
        self._swap = swap
        self._transient = [b.transient_bytes for b in blocks]
        # Where passes/swap.py frees and reloads swapped bytes: its own timeline, copies with its margin.
        place_fwd_start = [0.0] * (N + 1)  # block j's forward starts; [N]: the outside work after the blocks
        for j in range(N):
            place_fwd_start[j + 1] = place_fwd_start[j] + blocks[j].place_fwd_s
        self._place_fwd_start = place_fwd_start
        self._place_bwd = [b.place_bwd_s for b in blocks]
        self._place_rc_scale = [b.place_fwd_s / b.fwd_s if b.fwd_s > 0 else 0.0 for b in blocks]
        margin = p.copy_margin
        out_rate = p.place_d2h_bytes_per_s or d2h
        in_rate = p.place_h2d_bytes_per_s or h2d
        # the parts of swapped blocks in the rewrite's queue order: (issued at, block, copy s, bytes)
        self._swap_out = sorted((place_fwd_start[i] + t, i, x * margin / out_rate, x)
                                for i, b in enumerate(blocks) for t, _, x in b.swap_parts if x)
        self._swap_in = [[(u, x * margin / in_rate, x) for _, u, x in b.swap_parts if x] for b in blocks]
        self._freed_at: dict[int, tuple[tuple[int, int, int], ...]] = {}
        self._reloaded_at: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}

        self._per_p: dict[tuple[int, int], _PerPersist] = {}
        self._per_pb: dict[tuple[int, int], _PerBuffer] = {}
        self._per_pbg: dict[tuple[int, int, int], list[float]] = {}
        self._policies: dict[tuple[int, int], tuple[int, ...]] = {}
        self._fwd_cache: dict[tuple[int, int, int], _Forward] = {}
        static_persist = [0]
        for c in range(self.n_chunks):
            static_persist.append(static_persist[-1] + p.persistent_bytes(c))
        self._static_persist = static_persist
        self._buffer_bytes = p.buffer_bytes
        self._min_buffers = [max(sum(1 for x in cs if x >= q) for cs in step_chunks) for q in range(self.n_chunks + 1)]

    # ------------------------------------------------------------------ memory

    def static_bytes(self, n_persist: int, n_buffer: int, n_gpu_optim: int = 0) -> int:
        """Model-state bytes resident all step: fixed + persistent chunks + chunk buffers (+ the
        device steps' staging and gradients in flight)."""
        device = self.device_step_bytes if n_gpu_optim else 0
        lean = self.problem.lean_staging_bytes if self._lean[n_persist] else 0
        return (self.problem.fixed_bytes + self._static_persist[n_persist] + n_buffer * self._buffer_bytes
                + device + lean)

    def lean_from(self, n_persist: int) -> int:
        """The first lean chunk with ``n_persist`` persistent chunks (``n_chunks``: none is lean)."""
        return self.n_chunks - self._lean[n_persist]

    @property
    def device_step_bytes(self) -> int:
        """What ``n_gpu_optim > 0`` adds: staging and :data:`DEVICE_STEPS_IN_FLIGHT` gradient buffers."""
        return self.problem.device_step_bytes + DEVICE_STEPS_IN_FLIGHT * self._buffer_bytes

    def activation_peak(self, n_swap: int, n_checkpoint: int) -> int:
        """Peak activation bytes of the per-block walk in the module docstring ("Swap memory": a
        swapped block's bytes stay on the device until the rewrite's wait for their copy out, and
        are back from where it issues their reload)."""
        pol = self.policies(n_swap, n_checkpoint)
        saved, ck, sw, tr = self._saved, self._ck, self._swap, self._transient
        N = self.n_blocks
        keep = [ck[i] if pol[i] == _CKPT else saved[i] - sw[i] if i < n_swap else saved[i] for i in range(N)]
        back = self.swap_reloaded_at(n_swap, n_checkpoint)
        out = [0] * (N + 3)  # difference array over forward steps 0..N (N: the outside work after the blocks)
        inn = [0] * (N + 2)  # ... over backward steps 0..N (N: the outside work before the blocks)
        for i, k, x in self.swap_freed_at(n_swap):
            out[i + 1] += x  # on the device after block i's forward (which counts it as saved)
            out[k] -= x  # up to the step before which its wait frees it
        for i, m, x in back:
            inn[i + 1] += x  # back from the step whose backward issues its reload down to block i
            inn[m + 1] -= x
        peak = base = flight = 0
        for i in range(N):
            flight += out[i]
            x = base + flight + tr[i] + (ck[i] if pol[i] == _CKPT else saved[i])
            if x > peak:
                peak = x
            base += keep[i]
        flight += out[N]
        x = base + flight + self.problem.outside_peak_bytes
        if x > peak:
            peak = x
        back_bytes = [0] * (N + 1)
        acc = 0
        for k in range(N + 1):
            acc += inn[k]
            back_bytes[k] = acc
        x = base + back_bytes[N] + self.problem.outside_peak_bytes  # the outside backward, reloads issued there
        if x > peak:
            peak = x
        below = base
        for i in range(N - 1, -1, -1):
            below -= keep[i]
            x = below + saved[i] + tr[i] + (ck[i] if pol[i] == _CKPT else 0) + back_bytes[i]
            if x > peak:
                peak = x
        return peak

    def swap_freed_at(self, n_swap: int) -> tuple[tuple[int, int, int], ...]:
        """``(block, step, bytes)`` per :attr:`BlockProfile.swap_parts` part of the swapped blocks
        (``block < n_swap``): ``passes/swap.py`` frees those bytes before forward step ``step``
        (``N``: the outside work after the blocks; ``N + 1``: at the forward's end). The rewrite
        queues the copies out on one stream in the order they are issued, each starting when issued
        or when the one before it is placed done and lasting ``copy_margin`` times its bytes over
        the placement rate, and waits for each (freeing the device copy) before the first node
        estimated to start after it ends; the estimate is its roofline (``place_fwd_s``). So a
        copy longer than the blocks after it keeps its bytes, and those of every swap queued behind
        it, on the device. Here a wait inside a block frees its bytes only after that block."""
        got = self._freed_at.get(n_swap)
        if got is None:
            starts = self._place_fwd_start
            N = self.n_blocks
            free = []
            queue = 0.0
            for issued, i, seconds, x in self._swap_out:
                if i >= n_swap:
                    continue
                queue = (queue if queue > issued else issued) + seconds
                k = bisect.bisect_left(starts, queue, i + 1)  # the first step starting at or after it
                free.append((i, k if k <= N else N + 1, x))
            got = self._freed_at[n_swap] = tuple(free)
        return got

    def swap_reloaded_at(self, n_swap: int, n_checkpoint: int) -> tuple[tuple[int, int, int], ...]:
        """``(block, step, bytes)`` per part of the swapped blocks: the step (forward index; ``N``:
        the outside work, which backward runs first) whose backward issues its reload in
        ``passes/swap.py``. The rewrite lays the reloads out latest first, each ending by its first
        use and before the later one starts, each ``copy_margin`` times its bytes over the placement
        rate long, on its backward timeline (``place_bwd_s``, a checkpointed block's recompute
        scaled as its forward). From there to its block's backward the bytes are on the device."""
        key = (n_swap, n_checkpoint)
        got = self._reloaded_at.get(key)
        if got is None:
            N = self.n_blocks
            rc = self.recomputes(n_swap, n_checkpoint)
            starts = [0.0] * N  # block j's backward starts (placement timeline)
            t = self.problem.outside_place_bwd_s
            for j in range(N - 1, -1, -1):
                starts[j] = t
                t += self._place_bwd[j] + rc[j] * self._place_rc_scale[j]
            parts = sorted(
                ((starts[i] + u, i, seconds, x) for i in range(n_swap) for u, seconds, x in self._swap_in[i]),
                reverse=True,
            )
            issued = []
            latest = math.inf
            for use, i, seconds, x in parts:  # the last used first
                latest = (use if use < latest else latest) - seconds
                m = next((j for j in range(i, N) if starts[j] <= latest), N)
                issued.append((i, m, x))
            got = self._reloaded_at[key] = tuple(issued)
        return got

    def min_buffers(self, n_persist: int) -> int:
        """Fewest buffers with ``n_persist`` persistent chunks: the most non-persistent chunks one step uses."""
        return self._min_buffers[n_persist]

    def buffer_range(self, n_persist: int) -> range:
        """Valid ``n_buffer`` values: ``[0]`` when all chunks persist, else ``min_buffers .. n_chunks - n_persist``."""
        if n_persist == self.n_chunks:
            return range(1)
        return range(self.min_buffers(n_persist), self.n_chunks - n_persist + 1)

    def policies(self, n_swap: int, n_checkpoint: int) -> tuple[int, ...]:
        """Per-block policy codes (0 none, 1 checkpoint, 2 swap) of :func:`block_plan`.

        Built from :func:`protrain_fx.plan._segment_starts`, the rule :func:`~protrain_fx.plan.interleaved`
        applies (a test checks both agree), because building a validated ``Plan`` per pair would cost
        the search more than all its simulations.
        """
        key = (n_swap, n_checkpoint)
        pol = self._policies.get(key)
        if pol is None:
            N = self.n_blocks
            codes = [_SWAP] * n_swap + [_NONE] * (N - n_swap)
            for i in _segment_starts(N - n_swap, n_checkpoint):
                codes[n_swap + i] = _CKPT
            pol = self._policies[key] = tuple(codes)
        return pol

    def recomputes(self, n_swap: int, n_checkpoint: int) -> tuple[float, ...]:
        """Per block, the recompute it adds to backward under :meth:`policies`: 0 unless checkpointed;
        ``recompute_chained_s`` when the next block is checkpointed too, else ``recompute_s``."""
        key = (n_swap, n_checkpoint)
        got = self._recomputes.get(key)
        if got is None:
            pol = self.policies(n_swap, n_checkpoint)
            N = self.n_blocks
            got = self._recomputes[key] = tuple(
                0.0 if pol[i] != _CKPT else self.rc_chained[i] if i + 1 < N and pol[i + 1] == _CKPT else self.rc[i]
                for i in range(N)
            )
        return got

    # ------------------------------------------------------------------ time

    def validate(self, config: Config) -> Config:
        p, b, s, c, g = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint, config.n_gpu_optim
        for name, v in config.to_dict().items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Config: {name}={v!r} must be an int >= 0")
        if p > self.n_chunks:
            raise ValueError(f"Config: n_persist={p} exceeds the {self.n_chunks} chunks")
        if b not in self.buffer_range(p):
            r = self.buffer_range(p)
            raise ValueError(f"Config: n_buffer={b} with n_persist={p}; accepted: {r.start}..{r.stop - 1}")
        if s + c > self.n_blocks:
            raise ValueError(f"Config: n_swap + n_checkpoint = {s + c} exceeds the {self.n_blocks} blocks")
        if p + g > self.n_chunks:
            raise ValueError(f"Config: n_gpu_optim={g} with n_persist={p}; accepted: 0..{self.n_chunks - p}")
        return config

    def estimate(self, config: Config) -> Estimate:
        self.validate(config)
        p, b, s, c, g = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint, config.n_gpu_optim
        return self._simulate(p, b, s, c, g, optimizer=True, detail=True)  # type: ignore[return-value]

    def step_time(self, p: int, b: int, s: int, c: int, g: int = 0, *, optimizer: bool = True) -> float:
        """:attr:`Estimate.step_s` without building the Estimate (no validation: the search's fast path)."""
        return self._simulate(p, b, s, c, g, optimizer=optimizer, detail=False)[0]  # type: ignore[index]

    def step_and_forward_time(self, p: int, b: int, s: int, c: int, g: int = 0) -> tuple[float, float]:
        """``(step_s, fwd_s)`` of a config, unvalidated. The forward does not depend on ``n_checkpoint``
        (recompute happens in backward) or ``n_gpu_optim`` and only slows down with ``n_swap``, so
        ``fwd_s`` of ``(p, b, 0, 0)`` bounds the forward of every ``(p, b, s, c, g)`` from below."""
        return self._simulate(p, b, s, c, g, optimizer=True, detail=False)  # type: ignore[return-value]

    def cpu_adam_time(self, n_persist: int, n_gpu_optim: int = 0) -> float:
        """Seconds of CPU Adam in a step: the chunks neither persistent nor stepped on the GPU."""
        return self._cpu_after[n_persist + n_gpu_optim]

    def gpu_adam_time(self, n_persist: int) -> float:
        """Seconds of GPU Adam of the persistent chunks in a step."""
        return self._gpu_before[n_persist]

    def timed_steps(self, dev_out_s: list[float]) -> list[float]:
        """``dev_out_s`` (seconds per chunk of its device step's copies out) with each chunk timed in
        training (:attr:`Problem.device_step_s`) at its own seconds."""
        timed = dict(self.problem.device_step_s)
        return [timed.get(k, x) for k, x in enumerate(dev_out_s)]

    def device_step_bound(self, n_persist: int, n_gpu_optim: int) -> float:
        """A lower bound of the step time of every config with these two counts: the device steps'
        copies queue one after another in each direction, so the last one issued ends no earlier
        than all of one direction's; the next forward needs that chunk at its reference start
        (at most the latest reference start of these chunks' first use)."""
        if not n_gpu_optim:
            return 0.0
        chunks = range(n_persist, n_persist + n_gpu_optim)
        out_s = self._pp(n_persist).dev_out_s
        copies = max(sum(self.dev_in_s[c] for c in chunks), sum(out_s[c] for c in chunks))
        ref = max(self.fwd_ref_start[self.run_first[self.adam_run[c]]] for c in chunks)
        return max(copies - ref, 0.0)

    def _device_chain(
        self, dev_trigger: list[bool], offload_at: list[list[int]], dev_out_s: list[float]
    ) -> tuple[list[tuple[int, float, float]], list[float]]:
        """Device steps on the reference timeline (compute only, no recompute), backward held up as
        the runtime holds it: a step is issued when its chunk's last gradient is made, once the step
        issued :data:`DEVICE_STEPS_IN_FLIGHT` before it ended; the steps run one after another on
        their lanes, each ``max(in, out)`` long. Returns ``[(chunk, start, end)]`` in issue order and
        when each step's backward starts (indexed by forward step)."""
        N = self.n_blocks
        t, lane = self._fwd_ref_end, 0.0
        bwd_start = [0.0] * (N + 1)
        steps: list[tuple[int, float, float]] = []
        for j in range(N, -1, -1):
            bwd_start[j] = t
            t += self.cb[j]
            for r in offload_at[j]:
                if dev_trigger[r]:
                    k = len(steps)
                    if k >= DEVICE_STEPS_IN_FLIGHT and steps[k - DEVICE_STEPS_IN_FLIGHT][2] > t:
                        t = steps[k - DEVICE_STEPS_IN_FLIGHT][2]
                    ch = self.run_chunk[r]
                    start = lane if lane > t else t
                    lane = start + max(self.dev_in_s[ch], dev_out_s[ch])
                    steps.append((ch, start, lane))
        return steps, bwd_start

    def _forward(self, p: int, b: int, s: int) -> _Forward:
        """Forward of ``(p, b, s, *)``; it does not depend on ``n_checkpoint``, so recent ones are kept.

        Returns ``done`` (run -> its fetch finished), ``ff_dur`` (run -> fetch duration), ``so_done``
        (block -> its swap offload finished), and when the H2D queue, the D2H queue and the GPU are
        free at the end of forward (read-only: callers copy ``done`` before writing).
        """
        key = (p, b, s)
        got = self._fwd_cache.get(key)
        if got is not None:
            return got
        if len(self._fwd_cache) > 256:
            self._fwd_cache.clear()
        N = self.n_blocks
        P = self._pp(p)
        PB = self._pb(p, b)
        cf, h_d1, h_d2, ff_thr = self.cf, P.h_d1, P.h_d2, P.ff_thr
        done = [0.0] * len(h_d1)
        ff_dur = [0.0] * len(h_d1)
        fe = [0.0] * (N + 1)
        so_done = [0.0] * N
        gpu = h2d = d2h = 0.0
        wait_step = PB.wait_step
        for j in range(N + 1):
            for k, r in P.fetch_at[j]:
                ready = fe[wait_step[k]] if k >= b else 0.0
                dur = ff_dur[r] = h_d2[r] if s > ff_thr[r] else h_d1[r]
                h2d = (h2d if h2d > ready else ready) + dur
                done[r] = h2d
            start = gpu
            for r in P.step_runs[j]:
                if done[r] > start:
                    start = done[r]
            gpu = fe[j] = start + cf[j]
            if j < s:  # swap blocks are the first n_swap
                d2h = (d2h if d2h > gpu else gpu) + (self.so_d2[j] if s > PB.so_thr[j] else self.so_d1[j])
                so_done[j] = d2h
        if s and so_done[s - 1] > gpu:
            gpu = so_done[s - 1]  # the forward's graph waits for its offloads by its output at the latest
        got = self._fwd_cache[key] = (done, ff_dur, so_done, h2d, d2h, gpu)
        return got

    def _simulate(
        self, p: int, b: int, s: int, c: int, g: int = 0, *, optimizer: bool, detail: bool
    ) -> tuple[float, float] | Estimate:
        N = self.n_blocks
        P = self._pp(p, g if optimizer else 0)
        PB = self._pb(p, b)
        dev_refetch = self._dev_refetch(p, b, g) if optimizer and g else None
        pol = self.policies(s, c)
        cb, rc = self.cb, self.recomputes(s, c)
        h_d1, h_d2, g_d1, g_d2 = P.h_d1, P.h_d2, self.g_d1, self.g_d2
        bf_thr, go_thr = P.bf_thr, PB.go_thr
        # ---- forward (shared by every n_checkpoint)
        fdone, ff_dur, so_done, h2d, d2h, gpu = self._forward(p, b, s)
        done = fdone[:]  # fetch finished; in backward: re-fetch, then gradient offload finished
        fwd_end = gpu
        # ---- backward
        adam_done: list[tuple[int, float]] = []
        cpu = recompute = 0.0
        prev_start = gpu
        rl_d1, rl_d2, rl_thr = self.rl_d1, self.rl_d2, P.rl_thr
        adam_s = P.adam_s if optimizer else P.no_adam
        device, dev_trigger = P.device, P.dev_trigger
        dev_done: list[float] = []
        dev_in = dev_out = 0.0  # when the device steps' copies in and out are done
        for j in range(N, -1, -1):
            for r, freed_by in PB.refetch_at[j]:
                ready = done[freed_by]  # its gradient offload (stored in done[] when it finished)
                h2d = (h2d if h2d > ready else ready) + (h_d2[r] if s > bf_thr[r] else h_d1[r])
                done[r] = h2d
            start = gpu
            if j < s:
                ready = so_done[j] if so_done[j] > prev_start else prev_start
                h2d = (h2d if h2d > ready else ready) + (rl_d2[j] if s > rl_thr[j] else rl_d1[j])
                if h2d > start:
                    start = h2d
            for r in PB.step_refetched[j]:
                if done[r] > start:
                    start = done[r]
            prev_start = start
            gpu = start + cb[j]
            if j < N and pol[j] == _CKPT:
                gpu += rc[j]
                recompute += rc[j]
            for r in P.offload_at[j]:
                if device[r]:  # stepped on the GPU: its gradient stays, its buffer is free now
                    done[r] = gpu
                    if dev_trigger[r]:
                        k = len(dev_done)
                        if k >= DEVICE_STEPS_IN_FLIGHT and dev_done[k - DEVICE_STEPS_IN_FLIGHT] > gpu:
                            gpu = dev_done[k - DEVICE_STEPS_IN_FLIGHT]  # the issuing thread waits
                        ch = self.run_chunk[r]
                        h_start = dev_in if dev_in > gpu else gpu  # the step's own copy lanes
                        dev_in = h_start + self.dev_in_s[ch]
                        for i, d in P.dev_swap_in[ch]:  # swap-ins beside it on the reference timeline
                            if i < s:
                                dev_in += d  # take the host-to-device link from its copies in
                        dev_out = (dev_out if dev_out > h_start else h_start) + P.dev_out_s[ch]
                        if dev_refetch is not None and dev_refetch[ch]:  # re-fetches beside it: both ways
                            dev_in += dev_refetch[ch]
                            dev_out += dev_refetch[ch]
                        if dev_in > dev_out:
                            dev_out = dev_in
                        dev_done.append(dev_out)
                        adam_done.append((r, dev_out))
                    continue
                d2h = (d2h if d2h > gpu else gpu) + (g_d2[r] if s > go_thr[r] else g_d1[r])
                done[r] = d2h  # the run's buffer is free again
                if adam_s[r]:
                    cpu = (cpu if cpu > d2h else d2h) + adam_s[r]
                    adam_done.append((r, cpu))
        bwd_end = gpu
        # ---- optimizer, and the next forward overlapping the CPU Adam tail
        gpu_adam = P.gpu_adam_s if optimizer else 0.0
        cpu_adam = P.cpu_adam_s if optimizer else 0.0
        step = bwd_end + gpu_adam
        if cpu_adam > step:
            step = cpu_adam
        ref = self.fwd_ref_start
        for r, a in adam_done:
            x = a + ff_dur[r] - ref[self.run_first[r]]
            if x > step:
                step = x
        if not detail:
            return step, fwd_end
        static = self.static_bytes(p, b, g)
        act = self.activation_peak(s, c)
        refetched = sum(P.fetch_bytes[r] for r in P.runs if PB.refetch[r])
        fetched = sum(P.fetch_bytes[r] for r in P.runs)
        offloaded = sum(self.run_bytes[r] for r in P.runs if not device[r])
        stepped = [ch for ch in range(p, p + g)] if optimizer else []
        swapped = sum(self._swap[:s])
        return Estimate(
            step_s=step,
            peak_bytes=static + act,
            fwd_s=fwd_end,
            bwd_s=bwd_end - fwd_end,
            opt_s=step - bwd_end,
            static_bytes=static,
            activation_peak_bytes=act,
            compute_s=self.compute_s,
            recompute_s=recompute,
            gpu_adam_s=gpu_adam,
            cpu_adam_s=cpu_adam,
            h2d_bytes=fetched + refetched + swapped + sum(self.dev_in_bytes[ch] for ch in stepped),
            d2h_bytes=offloaded + swapped + sum(P.dev_out_bytes[ch] for ch in stepped),
            device_steps=len(stepped),
        )

    # ------------------------------------------------------------------ per-config tables

    def _pp(self, p: int, g: int = 0) -> _PerPersist:
        got = self._per_p.get((p, g))
        if got is None:
            got = self._per_p[(p, g)] = _PerPersist.build(self, p, g)
        return got

    def refetch_beside_steps(self, config: Config) -> list[float]:
        """Chunk -> seconds ``config``'s device step of it is lengthened by the backward re-fetches
        beside it (0 for a chunk not stepped on the device, or timed in training): see
        :meth:`_dev_refetch`."""
        p, b, g = config.n_persist, config.n_buffer, config.n_gpu_optim
        return list(self._dev_refetch(p, b, g)) if g else [0.0] * self.n_chunks

    def _dev_refetch(self, p: int, b: int, g: int) -> list[float]:
        """Chunk -> seconds its device step is lengthened by the backward re-fetches beside it.

        Decided on the device steps' reference timeline (:meth:`_device_chain`, kept by
        :class:`_PerPersist`), as the swap-ins are: a run re-fetched in backward (``n_buffer = b``) is
        issued when the backward of the step after its last use starts and lasts its bytes over the
        one-way rate, and it is over when the backward of its last use starts (that backward waits
        for it); the first step it overlaps there is lengthened by its whole duration, its copies in
        and out alike. A step timed in training (:attr:`Problem.device_step_s`) has them in its seconds
        and is not lengthened. Fixed by the config alone (never by the simulated timing), so the
        step time stays built from ``max`` and ``+`` of durations the config decides, and it is
        non-increasing in ``b`` (the runs re-fetched with ``b + 1`` buffers are among those with ``b``).

        Why both ways: a step moves 12 bytes a parameter in and 14 out, near the link's duplex
        rate, so what else crosses the link while it runs delays the whole step. On the H200 (B24 4.2B
        at 24 GiB, 3/3/0/35/11, twenty-first session) the two steps issued after backward's last
        re-fetch took 67-70 ms where the profile priced 69, and the others 72-85 (medians of calls
        3-8), where one re-fetch alone takes 8.4 ms."""
        key = (p, b, g)
        got = self._per_pbg.get(key)
        if got is not None:
            return got
        if len(self._per_pbg) > 4096:
            self._per_pbg.clear()
        P, PB = self._pp(p, g), self._pb(p, b)
        got = [0.0] * self.n_chunks
        N = self.n_blocks
        for r in P.runs:
            if not PB.refetch[r]:
                continue
            j = self.run_last[r]
            a = P.dev_bwd_start[j + 1] if j < N else P.dev_bwd_start[N]
            # over by the time block j's backward starts (it waits for it): a step issued then is not beside it
            e = min(a + P.h_d1[r], P.dev_bwd_start[j])
            for ch, x, y in P.dev_chain:
                if a < y and x < e:
                    if not self._step_timed[ch]:
                        got[ch] += P.h_d1[r]
                    break
        self._per_pbg[key] = got
        return got

    def _pb(self, p: int, b: int) -> _PerBuffer:
        got = self._per_pb.get((p, b))
        if got is None:
            got = self._per_pb[(p, b)] = _PerBuffer.build(self, self._pp(p), b)
        return got


@dataclass
class _PerPersist:
    """Tables that depend on ``n_persist`` (and ``n_gpu_optim``: which runs are stepped on the GPU):
    the runs of non-persistent chunks, and when each H2D copy shares the link (iff ``n_swap > thr``)."""

    p: int
    runs: list[int]  # forward order (first, chunk)
    by_last: list[int]  # release order in forward: (last, run)
    fetch_at: list[list[tuple[int, int]]]  # step -> [(fetch index k, run)]
    step_runs: list[list[int]]
    offload_at: list[list[int]]  # step -> runs whose gradient is final after its backward (FIFO order)
    adam_trigger: list[bool]
    adam_s: list[float]  # run -> CPU Adam time of its chunk when its gradient offload completes the chunk, else 0
    no_adam: list[float]
    min_buffers: int
    gpu_adam_s: float
    cpu_adam_s: float
    ff_thr: list[float]
    bf_thr: list[float]
    rl_thr: list[float]
    device: list[bool]  # run -> its chunk is stepped on the GPU
    dev_trigger: list[bool]  # run -> its gradient completes a GPU-stepped chunk: issue the step
    fetch_bytes: list[int]  # run -> bytes one fetch moves (a lean chunk's fp32 master)
    h_d1: list[float]  # run -> fetch duration alone
    h_d2: list[float]  # run -> fetch duration sharing the link
    dev_out_bytes: list[int]  # chunk -> bytes its device step copies out (a lean chunk: no working copy)
    dev_out_s: list[float]
    dev_swap_in: list[list[tuple[int, float]]]  # chunk -> [(block, seconds of its swap-in alone)] stalling its step
    dev_chain: list[tuple[int, float, float]]  # the device steps on their reference timeline (chunk, start, end)
    dev_bwd_start: list[float]  # forward step -> when its backward starts on that timeline

    @classmethod
    def build(cls, m: CostModel, p: int, g: int = 0) -> _PerPersist:
        N = m.n_blocks
        R = len(m.run_chunk)
        runs = [r for r in range(R) if m.run_chunk[r] >= p]
        fetch_at: list[list[tuple[int, int]]] = [[] for _ in range(N + 1)]
        for k, r in enumerate(runs):
            fetch_at[m.run_first[r]].append((k, r))
        offload_at: list[list[int]] = [[] for _ in range(N + 1)]
        for r in reversed(runs):  # backward release order: (first desc, run desc)
            offload_at[m.run_first[r]].append(r)
        device = [p <= m.run_chunk[r] < p + g for r in range(R)]
        adam_trigger = [False] * R
        dev_trigger = [False] * R
        for ch, r in m.adam_run.items():
            adam_trigger[r] = ch >= p + g
            dev_trigger[r] = p <= ch < p + g
        step_runs = [[r for r in rs if m.run_chunk[r] >= p] for rs in m.step_runs]

        def thr(key: tuple[float, int]) -> float:  # shared iff a swap block < n_swap or a chunk >= p overlaps
            return -1 if key[1] >= p else key[0]

        lean_from = m.lean_from(p)
        chunks = m.problem.chunks
        if lean_from < m.n_chunks:
            fetch_bytes = [
                chunks[c].lean_fetch_bytes if c >= lean_from else x for c, x in zip(m.run_chunk, m.run_bytes)
            ]
            h_d1, h_d2 = [x / m._h2d for x in fetch_bytes], [x / m._h2d_sh for x in fetch_bytes]
            dev_out_bytes = [
                x if c >= lean_from else y for c, (x, y) in enumerate(zip(m.dev_in_bytes, m.dev_out_bytes))
            ]
            dev_out_s = m.timed_steps([x / m._d2h_dev for x in dev_out_bytes])
        else:
            fetch_bytes, h_d1, h_d2, dev_out_bytes, dev_out_s = m.run_bytes, m.h_d1, m.h_d2, m.dev_out_bytes, m.dev_out_s

        # A swap-in that overlaps a device step on the reference timeline (CostModel._device_chain)
        # stalls that step: it takes the host-to-device link from the step's copies in.
        dev_swap_in: list[list[tuple[int, float]]] = [[] for _ in range(m.n_chunks)]
        steps: list[tuple[int, float, float]] = []
        bwd_start: list[float] = []
        if g:
            steps, bwd_start = m._device_chain(dev_trigger, offload_at, dev_out_s)
            for i in range(N):
                a = bwd_start[i + 1]  # a block's swap-in is issued when the next block's backward starts
                b = a + m.rl_d1[i]
                if b > a:
                    for ch, x, y in steps:
                        if a < y and x < b:
                            dev_swap_in[ch].append((i, m.rl_d1[i]))
                            break

        return cls(
            p=p,
            runs=runs,
            by_last=sorted(runs, key=lambda r: (m.run_last[r], r)),
            fetch_at=fetch_at,
            step_runs=step_runs,
            offload_at=offload_at,
            adam_trigger=adam_trigger,
            adam_s=[m.adam_s[m.run_chunk[r]] if adam_trigger[r] else 0.0 for r in range(R)],
            no_adam=[0.0] * R,
            min_buffers=max((len(rs) for rs in step_runs), default=0),
            gpu_adam_s=sum(m.gpu_adam_s[:p]),
            cpu_adam_s=sum(m.adam_s[p + g :]),
            ff_thr=[thr(k) for k in m.ff_key],
            bf_thr=[thr(k) for k in m.bf_key],
            rl_thr=[thr(k) for k in m.rl_key],
            device=device,
            dev_trigger=dev_trigger,
            fetch_bytes=fetch_bytes,
            h_d1=h_d1,
            h_d2=h_d2,
            dev_out_bytes=dev_out_bytes,
            dev_out_s=dev_out_s,
            dev_swap_in=dev_swap_in,
            dev_chain=steps,
            dev_bwd_start=bwd_start,
        )


@dataclass
class _PerBuffer:
    """Tables that depend on ``(n_persist, n_buffer)``: which buffer each fetch waits for, which runs
    are re-fetched in backward, and when each D2H copy shares the link (iff ``n_swap > thr``)."""

    wait_step: list[int]  # fetch k >= B waits for the end of this forward step
    refetch: list[bool]  # run -> re-fetched in backward
    refetch_at: list[list[tuple[int, int]]]  # step -> [(run, run whose gradient offload frees its buffer)]
    step_refetched: list[list[int]]  # step -> its runs that were re-fetched
    so_thr: list[float]
    go_thr: list[float]

    @classmethod
    def build(cls, m: CostModel, P: _PerPersist, b: int) -> _PerBuffer:
        N = m.n_blocks
        K = len(P.runs)
        p = P.p
        wait_step = [0] * K
        for k in range(b, K):
            wait_step[k] = m.run_last[P.by_last[k - b]]
            assert wait_step[k] < m.run_first[P.runs[k]], "fewer buffers than one step needs"
        acquire = P.by_last[::-1]  # backward acquisition order; the first b are still resident
        release = P.runs[::-1]  # backward release order (gradient offload FIFO order)
        refetch = [False] * len(m.run_chunk)
        refetch_at: list[list[tuple[int, int]]] = [[] for _ in range(N + 1)]
        for pos in range(b, K):
            r = acquire[pos]
            refetch[r] = True
            freed_by = release[pos - b]
            assert m.run_first[freed_by] > m.run_last[r], "fewer buffers than one step needs"
            refetch_at[m.run_last[r]].append((r, freed_by))

        def thr(key: tuple[int, float, list[int]]) -> float:
            # shared iff a fetched chunk >= p, a re-fetched run or a reloaded block < n_swap overlaps
            return -1 if key[0] >= p or any(refetch[r] for r in key[2]) else key[1]

        return cls(
            wait_step=wait_step,
            refetch=refetch,
            refetch_at=refetch_at,
            step_refetched=[[r for r in rs if refetch[r]] for rs in P.step_runs],
            so_thr=[thr(k) for k in m.so_key],
            go_thr=[thr(k) for k in m.go_key],
        )


# ---------------------------------------------------------------------------- helpers


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


__all__ = [
    "PROBLEM_VERSION",
    "BlockProfile",
    "ChunkProfile",
    "Config",
    "CostModel",
    "Estimate",
    "MachineProfile",
    "Problem",
    "RATE_SPREAD",
    "block_plan",
    "estimate",
    "expected_estimate",
    "rate_scenarios",
    "steadiest_gpu_optim",
]
