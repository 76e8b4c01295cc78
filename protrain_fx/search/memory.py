"""The cost model's memory part: peak device bytes of a config, exact arithmetic.

``peak = static(n_persist, n_buffer) + activations(n_swap, n_checkpoint)``
(``docs/DESIGN.md#the-cost-model``, "Memory" and "Swap memory"). :class:`MemoryModel` is the base
of :class:`~protrain_fx.search.cost.CostModel`: it reads the per-block tables the cost model builds
(``_saved``, ``_ck``, ``_swap``, ``_transient``, ``_lean``, ``_static_persist``, ``_buffer_bytes``)
and adds where ``passes/swap.py`` frees and reloads swapped bytes, the per-block activation
policies and their recompute. Seconds and bytes; no torch, no FX."""

from __future__ import annotations

import bisect
import math

from protrain_fx.plan import _segment_starts
from protrain_fx.search.problem import DEVICE_STEPS_IN_FLIGHT, Problem

_NONE, _CKPT, _SWAP = 0, 1, 2


class MemoryModel:
    """Peak memory of a config, and the activation policies both memory and time read (see the module docstring)."""

    # Set by CostModel's per-problem tables before any method here runs.
    problem: Problem
    n_blocks: int
    n_chunks: int
    rc: list[float]
    rc_chained: list[float]
    _saved: list[int]
    _ck: list[int]
    _swap: list[int]
    _transient: list[int]
    _lean: tuple[int, ...]
    _static_persist: list[int]
    _buffer_bytes: int
    _policies: dict[tuple[int, int], tuple[int, ...]]
    _recomputes: dict[tuple[int, int], tuple[float, ...]]

    def _swap_placement(self, p: Problem) -> None:
        """Where ``passes/swap.py`` frees and reloads swapped bytes: its own timeline, each copy
        lasting ``copy_margin`` times its bytes over the placement rate."""
        N, blocks = self.n_blocks, p.blocks
        place_fwd_start = [0.0] * (N + 1)  # block j's forward starts; [N]: the outside work after the blocks
        for j in range(N):
            place_fwd_start[j + 1] = place_fwd_start[j] + blocks[j].place_fwd_s
        self._place_fwd_start = place_fwd_start
        self._place_bwd = [b.place_bwd_s for b in blocks]
        self._place_rc_scale = [b.place_fwd_s / b.fwd_s if b.fwd_s > 0 else 0.0 for b in blocks]
        margin = p.copy_margin
        out_rate = p.place_d2h_bytes_per_s or p.machine.d2h_bytes_per_s
        in_rate = p.place_h2d_bytes_per_s or p.machine.h2d_bytes_per_s
        # the parts of swapped blocks in the rewrite's queue order: (issued at, block, copy s, bytes)
        self._swap_out = sorted((place_fwd_start[i] + t, i, x * margin / out_rate, x)
                                for i, b in enumerate(blocks) for t, _, x in b.swap_parts if x)
        self._swap_in = [[(u, x * margin / in_rate, x) for _, u, x in b.swap_parts if x] for b in blocks]
        self._freed_at: dict[int, tuple[tuple[int, int, int], ...]] = {}
        self._reloaded_at: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}

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

    @property
    def max_swap(self) -> int:
        """The most blocks a plan swaps: every block, or none where a swap frees no device memory
        (``MachineProfile.host_memory_apart`` false: the CPU device, whose copies stay in its memory)."""
        return self.n_blocks if self.problem.machine.host_memory_apart else 0

    def activation_pairs(self) -> list[tuple[int, int]]:
        """Every activation pair ``(n_swap, n_checkpoint)`` a plan may take, ``n_swap <= max_swap`` and
        ``n_swap + n_checkpoint <= n_blocks``, by ``n_swap`` then ``n_checkpoint`` (``(0, 0)`` first)."""
        N = self.n_blocks
        return [(s, c) for s in range(self.max_swap + 1) for c in range(N + 1 - s)]

    def activation_peak(self, n_swap: int, n_checkpoint: int) -> int:
        """Peak activation bytes of the per-block walk of ``docs/DESIGN.md#the-cost-model`` ("Swap
        memory": a swapped block's bytes stay on the device until the rewrite's wait for their copy
        out, and are back from where it issues their reload)."""
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
            # starts never rise with j: the steps starting by a time are a suffix, found by bisection
            falling = [-t for t in starts]
            issued = []
            latest = math.inf
            for use, i, seconds, x in parts:  # the last used first
                latest = (use if use < latest else latest) - seconds
                m = bisect.bisect_left(falling, -latest)  # the first step starting at or before it
                issued.append((i, m if m > i else i, x))
            got = self._reloaded_at[key] = tuple(issued)
        return got

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
