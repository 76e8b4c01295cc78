"""The cost model's precomputed tables, so that simulating one config is list lookups and comparisons.

:func:`link_sharing_keys` decides, once per problem, which copies of the other direction each copy
overlaps on the reference timeline; :class:`_PerPersist` (per ``n_persist`` and ``n_gpu_optim``)
and :class:`_PerBuffer` (per ``n_persist`` and ``n_buffer``) turn those keys and the chunk runs into
thresholds and queues for one config. :class:`~protrain_fx.search.cost.CostModel` builds and caches
them; they read its attributes (passed in as ``m``) and never import it, so the model imports them
without a cycle. Seconds and bytes, as the cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


_Interval = tuple[float, float]


def _interval(start: float, nbytes: int, rate: float) -> _Interval:
    """A copy of ``nbytes`` issued at ``start`` at ``rate`` bytes/s, as ``(start, end)``."""
    return (start, start + nbytes / rate)


def _overlaps(a: _Interval, b: _Interval) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def link_sharing_keys(
    m: Any, fs: list[float], fe: list[float], bs: list[float], be: list[float]
) -> tuple[list[tuple[float, int]], list[tuple[float, int]], list[tuple[float, int]],
           list[tuple[int, float, list[int]]], list[tuple[int, float, list[int]]]]:
    """Per copy, what decides whether it shares the link with the other direction: the copies of
    the other direction its interval overlaps on the reference timeline (forward steps' starts
    ``fs`` and ends ``fe``, backward steps' ``bs`` and ``be``, indexed by forward step), each copy
    issued one step before its use and lasting its bytes over the one-way rate. Returns the keys
    of forward fetches, backward re-fetches and swap reloads (H2D), then of swap offloads and
    gradient offloads (D2H); ``thr`` in :class:`_PerPersist` and :class:`_PerBuffer` reads them."""
    N, R = m.n_blocks, len(m.run_chunk)
    h2d, d2h = m.problem.machine.h2d_bytes_per_s, m.problem.machine.d2h_bytes_per_s
    blocks = m.problem.blocks
    ff = [_interval(fs[m.run_first[r] - 1] if m.run_first[r] else 0.0, m.run_bytes[r], h2d) for r in range(R)]
    bf = [_interval(bs[m.run_last[r] + 1] if m.run_last[r] < N else bs[N], m.run_bytes[r], h2d) for r in range(R)]
    rl = [_interval(bs[i + 1], blocks[i].swap_bytes, h2d) for i in range(N)]
    so = [_interval(fe[i], blocks[i].swap_bytes, d2h) for i in range(N)]
    go = [_interval(be[m.run_first[r]], m.run_bytes[r], d2h) for r in range(R)]
    inf = math.inf

    # An H2D copy is shared iff a performed swap offload (block < n_swap) or gradient offload
    # (chunk >= n_persist) overlaps it: keep the smallest such block and the largest such chunk.
    def h2d_keys(x: _Interval) -> tuple[float, int]:
        return (
            min((i for i in range(N) if _overlaps(x, so[i])), default=inf),
            max((m.run_chunk[r] for r in range(R) if _overlaps(x, go[r])), default=-1),
        )

    # A D2H copy is shared iff a performed forward fetch (chunk >= n_persist), swap reload
    # (block < n_swap) or backward re-fetch (config dependent: listed) overlaps it.
    def d2h_keys(x: _Interval) -> tuple[int, float, list[int]]:
        return (
            max((m.run_chunk[r] for r in range(R) if _overlaps(x, ff[r])), default=-1),
            min((i for i in range(N) if _overlaps(x, rl[i])), default=inf),
            [r for r in range(R) if _overlaps(x, bf[r])],
        )

    return ([h2d_keys(x) for x in ff], [h2d_keys(x) for x in bf], [h2d_keys(x) for x in rl],
            [d2h_keys(x) for x in so], [d2h_keys(x) for x in go])


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
    def build(cls, m: Any, p: int, g: int = 0) -> _PerPersist:
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
        adam = m.adam_for(p)
        chunks = m.problem.chunks
        if lean_from < m.n_chunks:
            fetch_bytes = [
                m.problem.shard_bytes(chunks[c].lean_fetch_bytes) if c >= lean_from else x
                for c, x in zip(m.run_chunk, m.run_bytes)
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
            adam_s=[adam[m.run_chunk[r]] if adam_trigger[r] else 0.0 for r in range(R)],
            no_adam=[0.0] * R,
            min_buffers=max((len(rs) for rs in step_runs), default=0),
            gpu_adam_s=sum(m.gpu_adam_s[:p]),
            cpu_adam_s=sum(adam[p + g :]),
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
    def build(cls, m: Any, P: _PerPersist, b: int) -> _PerBuffer:
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
