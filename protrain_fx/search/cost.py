"""ProTrain's cost model: a config in, its predicted step time and peak memory out.

:class:`CostModel` turns a :class:`~protrain_fx.search.problem.Problem` into per-problem and
per-config tables once (``tables.py``), then prices each config by an event simulation over the
GPU stream, the two copy queues and the CPU optimizer's worker; peak memory is exact arithmetic,
``static(n_persist, n_buffer) + activations(n_swap, n_checkpoint)``. ``docs/DESIGN.md#the-cost-model``
derives both and lists the monotonicity properties the search prunes with (tests check them on
random problems). Seconds and bytes throughout. No torch, no FX: a dumped Problem replays exactly.
The hot loops write ``x if x > y else y`` rather than ``max``: about twice as fast in CPython."""

from __future__ import annotations

import dataclasses

from protrain_fx.search.memory import _CKPT, MemoryModel
from protrain_fx.search.problem import DEVICE_STEPS_IN_FLIGHT, Counts, Estimate, Problem
from protrain_fx.search.tables import _PerBuffer, _PerPersist, link_sharing_keys
_Forward = tuple[list[float], list[float], list[float], float, float, float, float]


def estimate(problem: Problem, config: Counts) -> Estimate:
    """Predicted step time and peak memory of ``config``. Raises ``ValueError`` for an invalid config."""
    return CostModel(problem).estimate(config)


class CostModel(MemoryModel):
    """:func:`estimate` with the per-problem precomputation kept (the search calls it many times)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        step_chunks = self._steps(problem)
        self._runs(step_chunks)
        self._optimizer_steps(problem)
        self._reference_timeline()
        self._copy_durations(problem)
        self._swap_placement(problem)
        self._caches(problem, step_chunks)

    def _steps(self, p: Problem) -> list[list[int]]:
        """Per step its compute seconds; returns the chunks each step uses. Forward steps are
        ``0..N`` (``N``: the outside work after the blocks); backward visits ``N, N-1, ..., 0``."""
        self.n_blocks = len(p.blocks)
        self.n_chunks = len(p.chunks)
        self._labels = [b.name for b in p.blocks]
        self.cf = [b.fwd_s for b in p.blocks] + [p.outside_fwd_s]
        self.cb = [b.bwd_s for b in p.blocks] + [p.outside_bwd_s]
        self.rc = [b.recompute_s for b in p.blocks] + [0.0]
        self.rc_chained = [b.recompute_chained_s for b in p.blocks] + [0.0]
        self._recomputes: dict[tuple[int, int], tuple[float, ...]] = {}
        self.compute_s = sum(self.cf) + sum(self.cb)
        return [sorted(set(b.chunk_ids)) for b in p.blocks] + [sorted(set(p.outside_chunk_ids))]

    def _runs(self, step_chunks: list[list[int]]) -> None:
        """Runs: maximal ranges of consecutive forward steps using one chunk, sorted by (first,
        chunk); the runs each step uses; and per chunk the run whose gradient lands last in backward
        (its earliest run), which triggers the chunk's optimizer step."""
        N = self.n_blocks
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
        self.run_bytes = [self.problem.shard_bytes(self.problem.chunks[c].bytes) for c in self.run_chunk]  # a rank's part
        R = len(runs)
        self.step_runs = [[r for r in range(R) if self.run_first[r] <= j <= self.run_last[r]] for j in range(N + 1)]
        self.adam_run = {}
        for r in range(R):
            self.adam_run.setdefault(self.run_chunk[r], r)
        # backward step at which each chunk's gradient is whole (its earliest run's): where a persistent
        # chunk's all-reduce starts, data-parallel
        self.reduce_at: list[list[int]] = [[] for _ in range(N + 1)]
        for ch, r in self.adam_run.items():
            self.reduce_at[self.run_first[r]].append(ch)

    def _optimizer_steps(self, p: Problem) -> None:
        """Per chunk the seconds of its CPU and GPU Adam step and of its device step's copies in and
        out; a chunk timed in training (:attr:`Problem.device_step_s`) takes its own seconds, its
        copies in scaled alike."""
        m = p.machine
        n = p.world_size  # data-parallel: a rank steps its 1/N of each offloaded chunk
        self.adam_s = [c.n_params / n / m.cpu_adam_params_per_s for c in p.chunks]
        self.gpu_adam_s = [c.n_params / m.gpu_adam_params_per_s for c in p.chunks]
        # device steps: fp32 master and moments in; the same and the working copy out (shared rates)
        self.dev_in_bytes = [p.shard_bytes(c.n_params * (4 + p.adam_state_bytes_per_param)) for c in p.chunks]
        self.dev_out_bytes = [x + p.shard_bytes(c.bytes) for x, c in zip(self.dev_in_bytes, p.chunks)]
        self.ag_s, self.rs_s = p.chunk_all_gather_s, p.chunk_reduce_scatter_s  # the collective lane
        # a persistent chunk's gradient all-reduce (runtime/parallel/grad_sync.py): a reduce-scatter and an
        # all-gather of its bytes, as the ring algorithm runs it, the measured whole chunk's scaled
        whole = p.buffer_bytes or 1
        self.ar_s = [(self.ag_s + self.rs_s) * c.bytes / whole if c.n_params else 0.0 for c in p.chunks]
        self._lean = p.lean_chunks or (0,) * (len(p.chunks) + 1)
        self._spill = p.spill_chunks or (0,) * (len(p.chunks) + 1)
        # a spilled chunk's state read and written back (read ahead: overlapping the step before)
        state = [c.n_params * (4 + p.adam_state_bytes_per_param) for c in p.chunks]
        self._disk_s = [x / p.disk_read_bytes_per_s + x / p.disk_write_bytes_per_s if any(self._spill) else 0.0
                        for x in state]
        self._adam_by_p: dict[int, list[float]] = {}
        self._cpu_after_by_p: dict[int, list[float]] = {}
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

    def _reference_timeline(self) -> None:
        """The static reference timeline (compute only, no recompute) the link-sharing decision is
        made on (:func:`~protrain_fx.search.tables.link_sharing_keys`)."""
        N = self.n_blocks
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
        self.ff_key, self.bf_key, self.rl_key, self.so_key, self.go_key = link_sharing_keys(self, fs, fe, bs, be)

    def _copy_durations(self, p: Problem) -> None:
        """Copy seconds alone on the link (``d1``) and sharing it with the other direction (``d2``),
        and the blocks' activation bytes."""
        m = p.machine
        h2d, d2h = m.h2d_bytes_per_s, m.d2h_bytes_per_s
        h2d_sh = min(h2d, m.duplex_bytes_per_s / 2)
        d2h_sh = min(d2h, m.duplex_bytes_per_s / 2)
        self._h2d, self._h2d_sh = h2d, h2d_sh
        self.h_d1 = [x / h2d for x in self.run_bytes]  # fetch durations; lean chunks': _PerPersist.h_d1
        self.h_d2 = [x / h2d_sh for x in self.run_bytes]
        self.g_d1 = [x / d2h for x in self.run_bytes]
        self.g_d2 = [x / d2h_sh for x in self.run_bytes]
        swap = [b.swap_bytes for b in p.blocks]
        self.rl_d1 = [x / h2d for x in swap]
        self.rl_d2 = [x / h2d_sh for x in swap]
        self.so_d1 = [x / d2h for x in swap]
        self.so_d2 = [x / d2h_sh for x in swap]
        self._saved = [b.saved_bytes for b in p.blocks]
        self._ck = [b.checkpoint_saved_bytes for b in p.blocks]
        self._swap = swap
        self._transient = [b.transient_bytes for b in p.blocks]

    def _caches(self, p: Problem, step_chunks: list[list[int]]) -> None:
        """The per-config tables' caches, the persistent chunks' bytes by count, and the fewest
        buffers per ``n_persist``."""
        self._per_p: dict[tuple[int, int], _PerPersist] = {}
        self._per_pb: dict[tuple[int, int], _PerBuffer] = {}
        self._per_pbg: dict[tuple[int, int, int], list[float]] = {}
        self._policies: dict[tuple[int, int], tuple[int, ...]] = {}
        self._fwd_cache: dict[tuple[int, int, int], _Forward] = {}
        self._micro: dict[tuple[int, int, int, int], float] = {}  # micro_batch_time
        static_persist = [0]
        for c in range(self.n_chunks):
            static_persist.append(static_persist[-1] + p.persistent_bytes(c))
        self._static_persist = static_persist
        self._buffer_bytes = p.buffer_bytes
        self._min_buffers = [max(sum(1 for x in cs if x >= q) for cs in step_chunks) for q in range(self.n_chunks + 1)]

    # ------------------------------------------------------------------ time

    def min_buffers(self, n_persist: int) -> int:
        """Fewest buffers with ``n_persist`` persistent chunks: the most non-persistent chunks one step uses."""
        return self._min_buffers[n_persist]

    def buffer_range(self, n_persist: int) -> range:
        """Valid ``n_buffer`` values: ``[0]`` when all chunks persist, else ``min_buffers .. n_chunks - n_persist``."""
        if n_persist == self.n_chunks:
            return range(1)
        return range(self.min_buffers(n_persist), self.n_chunks - n_persist + 1)

    def validate(self, config: Counts) -> Counts:
        p, b, s, c, g = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint, config.n_gpu_optim
        for name, v in config.to_dict().items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Counts: {name}={v!r} must be an int >= 0")
        if p > self.n_chunks:
            raise ValueError(f"Counts: n_persist={p} exceeds the {self.n_chunks} chunks")
        if b not in self.buffer_range(p):
            r = self.buffer_range(p)
            raise ValueError(f"Counts: n_buffer={b} with n_persist={p}; accepted: {r.start}..{r.stop - 1}")
        if s + c > self.n_blocks:
            raise ValueError(f"Counts: n_swap + n_checkpoint = {s + c} exceeds the {self.n_blocks} blocks")
        if p + g > self.n_chunks:
            raise ValueError(f"Counts: n_gpu_optim={g} with n_persist={p}; accepted: 0..{self.n_chunks - p}")
        return config

    def estimate(self, config: Counts) -> Estimate:
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
        after = self._cpu_after_by_p.get(n_persist)
        if after is None:
            adam = self.adam_for(n_persist)
            after = self._cpu_after_by_p[n_persist] = [sum(adam[k:]) for k in range(len(adam) + 1)]
        return after[n_persist + n_gpu_optim]

    def adam_for(self, n_persist: int) -> list[float]:
        """Per chunk, the seconds of its CPU step with ``n_persist`` persistent chunks: its Adam, or
        for a spilled chunk the longer of that and its state's disk read and write."""
        got = self._adam_by_p.get(n_persist)
        if got is None:
            spill = self._spill[n_persist]
            lo = self.n_chunks - self._lean[n_persist] - spill
            got = self._adam_by_p[n_persist] = [
                max(a, self._disk_s[ch]) if lo <= ch < lo + spill else a for ch, a in enumerate(self.adam_s)]
        return got

    def max_gpu_optim(self, n_persist: int) -> int:
        """The most chunks stepped on the device with ``n_persist`` persistent: every offloaded one,
        or those before the spilled ones (never stepped there)."""
        spill = self._spill[n_persist]
        return self.n_chunks - n_persist - (self._lean[n_persist] + spill if spill else 0)

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
        (at most the latest reference start of these chunks' first use). 0 with accumulation:
        no device step runs then (:meth:`_simulate`)."""
        if not n_gpu_optim or self.problem.accumulation > 1:
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
        gpu = h2d = d2h = coll = 0.0
        ag = self.ag_s
        wait_step = PB.wait_step
        for j in range(N + 1):
            for k, r in P.fetch_at[j]:
                ready = fe[wait_step[k]] if k >= b else 0.0
                dur = ff_dur[r] = h_d2[r] if s > ff_thr[r] else h_d1[r]
                h2d = (h2d if h2d > ready else ready) + dur
                done[r] = h2d
                if ag:  # data-parallel: the local part copied, then the whole chunk all-gathered
                    coll = (coll if coll > h2d else h2d) + ag
                    done[r] = coll
                    ff_dur[r] = dur + ag
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
        got = self._fwd_cache[key] = (done, ff_dur, so_done, h2d, d2h, gpu, coll)
        return got

    def _simulate(
        self, p: int, b: int, s: int, c: int, g: int = 0, *, optimizer: bool, detail: bool
    ) -> tuple[float, float] | Estimate:
        """``(step_s, fwd_s)`` of ``(p, b, s, c, g)``, or with ``detail`` its whole :class:`Estimate`;
        ``optimizer=False`` leaves every optimizer step out (the activation plan's bound). With
        :attr:`Problem.accumulation` ``k > 1``: ``k - 1`` micro-batches (:meth:`micro_batch_time`), then
        the last as a step with every offloaded chunk stepped on the CPU (``OffloadHandle.land_grads``
        steps on the device only a gradient fresh in its step): ``n_gpu_optim`` keeps its memory only."""
        k = self.problem.accumulation
        g_run = g if k == 1 else 0
        P = self._pp(p, g_run if optimizer else 0)
        fdone, ff_dur, so_done, h2d, d2h, fwd_end, coll = self._forward(p, b, s)  # shared by every n_checkpoint
        if optimizer and self.problem.held_steps and k == 1:
            bwd_end, adam_done, recompute, gpu_adam, cpu_adam, gpu_end = self._held_backward(
                p, b, s, c, g_run, fdone, so_done, h2d, d2h, fwd_end, coll)
            step = self._step_end(gpu_end, 0.0, adam_done, ff_dur)
        else:
            bwd_end, adam_done, recompute, _ = self._backward(P, p, b, s, c, g_run, optimizer, fdone, so_done, h2d,
                                                              d2h, fwd_end, coll)
            gpu_adam, cpu_adam = (P.gpu_adam_s, P.cpu_adam_s) if optimizer else (0.0, 0.0)
            step = self._step_end(bwd_end + gpu_adam, cpu_adam, adam_done, ff_dur)
        before = (k - 1) * self.micro_batch_time(p, b, s, c) if k > 1 else 0.0
        if not detail:
            return before + step, fwd_end
        e = self._estimate(P, p, b, s, c, g_run, optimizer, step=step, fwd_end=fwd_end, bwd_end=bwd_end,
                           recompute=recompute, gpu_adam=gpu_adam, cpu_adam=cpu_adam)
        static = self.static_bytes(p, b, g)  # with accumulation: the device steps' memory, held though unused
        return e if k == 1 else dataclasses.replace(
            e, step_s=before + step, accumulated_s=before, static_bytes=static, peak_bytes=static + e.activation_peak_bytes,
            compute_s=k * e.compute_s, recompute_s=k * e.recompute_s, h2d_bytes=k * e.h2d_bytes, d2h_bytes=k * e.d2h_bytes)

    def _held_backward(
        self, p: int, b: int, s: int, c: int, g: int, fdone: list[float], so_done: list[float], h2d: float,
        d2h: float, fwd_end: float, coll: float,
    ) -> tuple[float, list[tuple[int, float]], float, float, float, float]:
        """Backward with every offloaded chunk's step held for the clip (:attr:`Problem.held_steps`):
        each gradient lands on the host, and once the last has (the norm is known) the persistent
        chunks step on the GPU, the first ``g`` offloaded chunks stream through the device one after
        another (master, moments and the held gradient in; master, moments and working copy out:
        the slower direction bounds each) and the CPU steps the rest, both in chunk order. Returns
        the backward's end, ``(run, when its chunk is updated)``, the recompute seconds, the GPU and
        CPU optimizer seconds and when the GPU's own optimizer work ends."""
        P0 = self._pp(p, 0)  # no chunk stepped while backward runs: every gradient lands on the host
        bwd_end, _, recompute, landed = self._backward(P0, p, b, s, c, 0, False, fdone, so_done, h2d, d2h,
                                                       fwd_end, coll)
        norm = bwd_end if bwd_end > landed else landed
        P = self._pp(p, g)
        lean_from = self.lean_from(p)
        adam_s = self.adam_for(p)
        dev = cpu = norm
        adam_done: list[tuple[int, float]] = []
        for ch in range(p, self.n_chunks):
            r = self.adam_run.get(ch)
            if r is None:
                continue
            if ch < p + g and ch < lean_from:  # (a lean chunk's held gradient is stepped on the CPU)
                grad_in = self.problem.chunks[ch].bytes
                seconds = max(self.dev_in_s[ch] * (self.dev_in_bytes[ch] + grad_in) / max(1, self.dev_in_bytes[ch]),
                              P.dev_out_s[ch])
                dev += seconds
                adam_done.append((r, dev))
            else:
                cpu += adam_s[ch]
                adam_done.append((r, cpu))
        gpu_adam = P.gpu_adam_s
        return bwd_end, adam_done, recompute, gpu_adam, cpu - norm, norm + gpu_adam

    def micro_batch_time(self, p: int, b: int, s: int, c: int) -> float:
        """Seconds of an accumulating micro-batch: no optimizer step, until its GPU work ends and its last gradient
        landed (the next one's first fetch). Not modelled: chunks resident from the backward before are not re-fetched."""
        got = self._micro.get((p, b, s, c))
        if got is None:
            if len(self._micro) > 65536:
                self._micro.clear()
            fdone, _, so_done, h2d, d2h, gpu, coll = self._forward(p, b, s)
            end, _, _, landed = self._backward(self._pp(p), p, b, s, c, 0, False, fdone, so_done, h2d, d2h, gpu, coll)
            got = self._micro[(p, b, s, c)] = end if end > landed else landed
        return got

    def _backward(
        self, P: _PerPersist, p: int, b: int, s: int, c: int, g: int, optimizer: bool,
        fdone: list[float], so_done: list[float], h2d: float, d2h: float, gpu: float, coll: float,
    ) -> tuple[float, list[tuple[int, float]], float, float]:
        """Backward from the forward's end state (its fetches done, swap offloads done, and when the
        two copy queues, the GPU and the collective lane are free). Returns when backward's GPU work ends, ``(run, when
        its chunk is updated)`` per optimizer step, the recompute seconds and when the last gradient landed."""
        N = self.n_blocks
        PB = self._pb(p, b)
        dev_refetch = self._dev_refetch(p, b, g) if optimizer and g else None
        pol = self.policies(s, c)
        cb, rc = self.cb, self.recomputes(s, c)
        h_d1, h_d2, g_d1, g_d2 = P.h_d1, P.h_d2, self.g_d1, self.g_d2
        bf_thr, go_thr = P.bf_thr, PB.go_thr
        ag, rs = self.ag_s, self.rs_s
        done = fdone[:]  # fetch finished; in backward: re-fetch, then gradient offload finished
        adam_done: list[tuple[int, float]] = []
        cpu = recompute = 0.0
        prev_start = gpu
        rl_d1, rl_d2, rl_thr = self.rl_d1, self.rl_d2, P.rl_thr
        adam_s = P.adam_s if optimizer else P.no_adam
        device, dev_trigger = P.device, P.dev_trigger
        dev_done: list[float] = []
        dev_in = dev_out = 0.0  # when the device steps' copies in and out are done
        all_reduce = optimizer and p and (self.ag_s or self.rs_s)  # not while accumulating (handle.accumulate())
        reduced_all = 0.0  # when the persistent chunks' all-reduces end: backward's end waits for them
        for j in range(N, -1, -1):
            for r, freed_by in PB.refetch_at[j]:
                ready = done[freed_by]  # its gradient offload (stored in done[] when it finished)
                h2d = (h2d if h2d > ready else ready) + (h_d2[r] if s > bf_thr[r] else h_d1[r])
                done[r] = h2d
                if ag:
                    coll = (coll if coll > h2d else h2d) + ag
                    done[r] = coll
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
                reduced = gpu
                if rs:  # data-parallel: the whole gradient reduce-scattered first, on the collective lane
                    coll = reduced = (coll if coll > gpu else gpu) + rs
                if device[r]:  # stepped on the GPU: its gradient stays, its buffer is free now
                    done[r] = gpu
                    if dev_trigger[r]:
                        gpu, dev_in, dev_out = self._device_step(P, r, s, gpu, reduced, dev_in, dev_out, dev_done,
                                                                 dev_refetch)
                        adam_done.append((r, dev_out))
                    continue
                d2h = (d2h if d2h > reduced else reduced) + (g_d2[r] if s > go_thr[r] else g_d1[r])
                done[r] = d2h  # the run's buffer is free again
                if adam_s[r]:
                    cpu = (cpu if cpu > d2h else d2h) + adam_s[r]
                    adam_done.append((r, cpu))
            if all_reduce:
                for ch in self.reduce_at[j]:
                    if ch < p:
                        coll = reduced_all = (coll if coll > gpu else gpu) + self.ar_s[ch]
        if reduced_all > gpu:
            gpu = reduced_all
        return gpu, adam_done, recompute, d2h

    def _device_step(
        self, P: _PerPersist, r: int, s: int, gpu: float, reduced: float, dev_in: float, dev_out: float,
        dev_done: list[float], dev_refetch: list[float] | None,
    ) -> tuple[float, float, float]:
        """Issue the device step of run ``r``'s chunk when its last gradient is made (at ``gpu``):
        the issuing thread, and the GPU stream with it, first waits for the step issued
        :data:`DEVICE_STEPS_IN_FLIGHT` before; the copies in and out run on the steps' own lanes, from
        when the gradient is reduced over the ranks (``reduced``; ``gpu`` at world size 1),
        lengthened by the swap-ins and re-fetches beside them. Appends when it ends to ``dev_done``;
        returns the new ``gpu``, ``dev_in`` and ``dev_out``."""
        k = len(dev_done)
        if k >= DEVICE_STEPS_IN_FLIGHT and dev_done[k - DEVICE_STEPS_IN_FLIGHT] > gpu:
            gpu = dev_done[k - DEVICE_STEPS_IN_FLIGHT]  # the issuing thread waits
        ch = self.run_chunk[r]
        ready = reduced if reduced > gpu else gpu
        h_start = dev_in if dev_in > ready else ready  # the step's own copy lanes
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
        return gpu, dev_in, dev_out

    def _step_end(self, gpu_end: float, cpu_adam: float, adam_done: list[tuple[int, float]],
                  ff_dur: list[float]) -> float:
        """The step time: the end of the GPU work, of the CPU Adam work, and, for each chunk updated
        after backward, when the next forward can use it (updated, then fetched, against the
        compute-only time at which the next forward reaches it)."""
        step = gpu_end
        if cpu_adam > step:
            step = cpu_adam
        ref = self.fwd_ref_start
        for r, a in adam_done:
            x = a + ff_dur[r] - ref[self.run_first[r]]
            if x > step:
                step = x
        return step

    def _estimate(
        self, P: _PerPersist, p: int, b: int, s: int, c: int, g: int, optimizer: bool, *, step: float,
        fwd_end: float, bwd_end: float, recompute: float, gpu_adam: float, cpu_adam: float,
    ) -> Estimate:
        """The :class:`Estimate` of a simulated config: its times, memory and link traffic."""
        PB = self._pb(p, b)
        static = self.static_bytes(p, b, g)
        act = self.activation_peak(s, c)
        refetched = sum(P.fetch_bytes[r] for r in P.runs if PB.refetch[r])
        fetched = sum(P.fetch_bytes[r] for r in P.runs)
        offloaded = sum(self.run_bytes[r] for r in P.runs if not P.device[r])
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

    def refetch_beside_steps(self, config: Counts) -> list[float]:
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
        rate, so what else crosses the link while it runs delays the whole step: steps with a
        re-fetch beside them run longer than those without by about the re-fetch's own time
        (``docs/results.md#device-steps-beside-re-fetches-and-swap-ins``)."""
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
