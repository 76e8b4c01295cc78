"""Exhaustive search over ProTrain's four counts, with pruning that never drops the optimum.

:func:`search` returns the :class:`~protrain_fx.search.problem.Counts` with the smallest predicted step time
whose predicted peak fits ``budget_bytes - reserve_bytes``, over every valid config:
``n_persist`` in ``0..n_chunks``; ``n_buffer`` in ``min_buffers(n_persist)..n_chunks - n_persist``
(0 only when every chunk persists; ``min_buffers`` = the most non-persistent chunks one block uses);
``n_swap + n_checkpoint <= n_blocks``, with ``n_swap = 0`` where a swap frees no device memory
(``CostModel.activation_pairs``). Among equally fast configs it returns the first one it finds.

What the pruning relies on (all properties of the cost model, :mod:`protrain_fx.search.cost`, stated
in ``docs/DESIGN.md#the-cost-model`` and tested):

1. ``peak = static(p, b) + activations(s, c)`` exactly, and ``static`` grows with ``b``. So for each
   ``(p, b)`` the fitting ``(s, c)`` are those with ``activations <= budget - static(p, b)``.
2. The step time is non-increasing in ``n_buffer``. So for each ``(p, s, c)`` only the largest fitting
   ``b`` can be optimal: ``b`` is visited downwards and a pair ``(s, c)`` is simulated only at the
   first ``b`` where it fits.
3. Lower bounds: ``T(p, b, s, c) >= T(p, b, 0, 0)`` and ``>= T_act(s, c)`` (all chunks persistent, no
   optimizer), ``>= compute + recompute(s, c) + gpu_adam(p)`` (one GPU stream) and
   ``>= cpu_adam(p)`` (one CPU worker), and ``>= fwd_s(p, b, 0, 0) + backward compute +
   recompute(s, c) + gpu_adam(p)`` (the forward ignores ``n_checkpoint`` and only slows with
   ``n_swap``). A candidate whose bound is not below the best time so far is skipped; so is every
   later one when the candidates are visited in increasing bound order (of recompute).

Before that, a first pass simulates a few configs per ``n_persist`` (keep all, swap all, checkpoint
all, least recompute) to start with a good incumbent; it changes what is simulated, not the result.

``prune=False`` simulates every fitting config instead (for tests and for checking the bounds).

``persist_all=True`` restricts every pass above to ``n_persist = n_chunks`` (so ``n_buffer = 0``):
the activation plan alone (``n_swap``, ``n_checkpoint``), for a model whose parameters all stay on
the device. The bounds hold for any subset of ``n_persist`` values, so the result is the fastest
fitting config of that subset.

``gpu_optim=True`` also searches ``n_gpu_optim`` (the first non-persistent chunks stepped on the GPU,
:mod:`protrain_fx.search.cost`): the same walk per ``(n_persist, n_gpu_optim)`` (rules 1 to 3 hold for each
``n_gpu_optim``; its static bytes add the device staging when it is above 0), first ``n_gpu_optim =
0`` for every ``n_persist`` (a good incumbent), then the others, each pair skipped when its bound
``max(compute + gpu_adam, cpu_adam of the chunks left to the CPU, CostModel.device_step_bound)``
is not below the best time. ``n_gpu_optim`` takes every value in ``0..n_chunks - n_persist`` when
there are at most :data:`GPU_OPTIM_GRID` + 1 of them; otherwise :data:`GPU_OPTIM_GRID` + 1 evenly
spread values, then every value within one grid step of the best found (for its ``n_persist``). So
the result equals brute force on small problems (tested); on large ones the refinement is local,
which keeps the search under a second on 100 chunks (``bench/search_time.py``;
``docs/results.md#search-and-planning-time``).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts, Estimate, Problem
from protrain_fx.state import STATE

#: ``n_gpu_optim`` values searched per ``n_persist`` before the local refinement (see the module docstring).
GPU_OPTIM_GRID = 8


class NoPlanFits(ValueError):
    """No config fits the budget. ``min_budget_bytes`` is the smallest budget (reserve included) with
    which one does: the smallest predicted peak over all configs, plus the reserve."""

    def __init__(self, message: str, *, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


@dataclass(frozen=True)
class SearchResult:
    """The best config and its estimate. ``evaluated``: configs whose step time was simulated;
    ``bound_evaluations``: simulations run only for a lower bound; ``pruned``: valid configs never
    simulated (over budget or bounded out); ``total``: valid configs; ``seconds``: wall time."""

    best: Counts
    estimate: Estimate
    evaluated: int
    bound_evaluations: int
    pruned: int
    total: int
    seconds: float


def search(
    problem: Problem,
    budget_bytes: int,
    *,
    reserve_bytes: int = 0,
    prune: bool = True,
    persist_all: bool = False,
    gpu_optim: bool = False,
    n_persist: int | None = None,
) -> SearchResult:
    """The fastest config whose predicted peak is at most ``budget_bytes - reserve_bytes``.

    ``reserve_bytes`` is memory the model does not see (CUDA context, allocator fragmentation): the
    caller's safety margin. ``persist_all``: only configs where every chunk persists
    (``n_persist = n_chunks``, ``n_buffer = 0``; ``total`` and ``min_budget_bytes`` then count those
    alone). ``n_persist``: only configs with that many persistent chunks (the same restriction for
    one other value). ``gpu_optim``: also choose ``n_gpu_optim`` (see the module docstring). Raises
    :class:`NoPlanFits` (a ``ValueError``) naming the smallest budget that would fit, and
    ``ValueError`` for a negative budget or reserve.
    """
    for name, v in (("budget_bytes", budget_bytes), ("reserve_bytes", reserve_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"search: {name}={v!r} must be an int >= 0")
    t0 = time.perf_counter()
    model, tab = _model_and_tables(problem)
    n = model.n_chunks
    cap_all = budget_bytes - reserve_bytes
    if n_persist is not None and not 0 <= n_persist <= n:
        raise ValueError(f"search: n_persist={n_persist} must be in 0..{n}")
    if persist_all:
        n_persist = n
    # visited downwards
    persists = range(n_persist, n_persist - 1, -1) if n_persist is not None else range(n, problem.min_persist - 1, -1)
    total = sum(len(model.buffer_range(p)) * (n - p + 1 if gpu_optim else 1) for p in persists) * len(tab.pairs)
    _check_one_fits(model, persists, tab, budget_bytes, reserve_bytes)

    inc = _Incumbent()
    if prune:
        _first_incumbent(model, persists, cap_all, tab, inc)
    for p in persists:
        _walk(model, p, 0, cap_all, prune, tab, inc)
    if gpu_optim:
        _walk_device_steps(model, persists, cap_all, prune, tab, inc)

    assert inc.best is not None, "a config fits, so one was evaluated"
    p, b, s_, c, g = inc.best
    config = Counts(p, b, s_, c, g)
    est = model.estimate(config)
    assert est.step_s == inc.best_t and est.peak_bytes <= cap_all
    return SearchResult(
        best=config,
        estimate=est,
        evaluated=len(inc.simulated),
        bound_evaluations=inc.bounds,
        pruned=total - len(inc.simulated),
        total=total,
        seconds=time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class _Tables:
    """The activation pairs ``(n_swap, n_checkpoint)`` with their peak bytes (``act``) and recompute
    seconds (``rec``), in the orders the walk visits them, and the step's compute seconds."""

    pairs: list[tuple[int, int]]
    act: dict[tuple[int, int], int]
    by_act: list[tuple[int, int]]  # by (peak, pair)
    act_sorted: list[int]  # the peaks of by_act
    rec: dict[tuple[int, int], float]
    by_rec: list[tuple[int, int]]  # by (recompute, peak)
    fwd_compute: float
    bwd_compute: float

    @classmethod
    def build(cls, model: CostModel) -> _Tables:
        pairs = model.activation_pairs()
        act = {q: model.activation_peak(*q) for q in pairs}
        by_act = sorted(pairs, key=lambda q: (act[q], q))
        rec = {q: sum(model.recomputes(*q)) for q in pairs}
        return cls(pairs=pairs, act=act, by_act=by_act, act_sorted=[act[q] for q in by_act], rec=rec,
                   by_rec=sorted(pairs, key=lambda q: (rec[q], act[q])),
                   fwd_compute=sum(model.cf), bwd_compute=sum(model.cb))


#: How many problems :func:`_model_and_tables` keeps the cost model and tables of.
RECENT_PROBLEMS = 4

_RECENT: list[tuple[Problem, CostModel, _Tables]] = []
STATE.on_reset(_RECENT.clear)


def _model_and_tables(problem: Problem) -> tuple[CostModel, _Tables]:
    """The cost model of ``problem`` and its activation tables, kept for the last
    :data:`RECENT_PROBLEMS` problems (by identity): one choice searches the same problem many times
    (a search per ``n_persist`` in ``planner.offload.prefer_persistent``, raised and lowered caps),
    and the tables (every ``(n_swap, n_checkpoint)`` pair's peak) depend on the problem alone."""
    for i, (kept, model, tables) in enumerate(_RECENT):
        if kept is problem:
            _RECENT.insert(0, _RECENT.pop(i))
            return model, tables
    model = CostModel(problem)
    tables = _Tables.build(model)
    _RECENT.insert(0, (problem, model, tables))
    del _RECENT[RECENT_PROBLEMS:]
    return model, tables


@dataclass
class _Incumbent:
    """The fastest config simulated so far and the search's bookkeeping: ``simulated`` (candidates
    whose step time was simulated), ``bounds`` (simulations run only for a bound) and ``act_lb``
    (per activation pair, its step time with every chunk persistent and no optimizer)."""

    best_t: float = math.inf
    best: tuple[int, int, int, int, int] | None = None
    simulated: set[tuple[int, int, int, int, int]] = field(default_factory=set)
    bounds: int = 0
    act_lb: dict[tuple[int, int], float] = field(default_factory=dict)

    def offer(self, t: float, key: tuple[int, int, int, int, int]) -> None:
        """Record the simulated candidate ``key`` of step time ``t``; it becomes the best if faster."""
        self.simulated.add(key)
        if t < self.best_t:
            self.best_t, self.best = t, key


def _check_one_fits(model: CostModel, persists: range, tab: _Tables, budget_bytes: int, reserve_bytes: int) -> None:
    """Raise :class:`NoPlanFits` when even the smallest predicted peak is over the budget."""
    min_peak = min(model.static_bytes(p, model.buffer_range(p).start) for p in persists) + tab.act_sorted[0]
    if min_peak > budget_bytes - reserve_bytes:
        floor = model.problem.min_persist
        disk = (f" (with at least {floor} chunks persistent: fewer would spill more optimizer state than the spill "
                "folder has free)") if floor else ""
        raise NoPlanFits(
            f"no plan fits a budget of {budget_bytes} bytes ({_mib(budget_bytes)}) with {reserve_bytes} reserved: "
            f"the smallest predicted peak is {min_peak} bytes ({_mib(min_peak)}){disk}, so the budget must be at "
            f"least {min_peak + reserve_bytes} bytes ({_mib(min_peak + reserve_bytes)})",
            min_budget_bytes=min_peak + reserve_bytes,
        )


def _first_incumbent(model: CostModel, persists: range, cap_all: int, tab: _Tables, inc: _Incumbent) -> None:
    """A first incumbent, so that the bounds bite early: per n_persist, a few pairs (keep all, swap
    all, checkpoint all, least recompute that fits the most buffers), each with the most buffers it
    fits with; without device steps (``n_gpu_optim = 0``), which the later walks start from."""
    N = model.n_blocks
    probes = [(0, 0), (model.max_swap, 0), (0, N)]
    g = 0
    for p in persists:
        buffers = model.buffer_range(p)
        room = cap_all - model.static_bytes(p, 0, g)
        fits = [b for b in buffers
                if model.static_bytes(p, b, g) - model.static_bytes(p, 0, g) <= room - tab.act_sorted[0]]
        if not fits:
            continue
        least = next(q for q in tab.by_rec if tab.act[q] <= cap_all - model.static_bytes(p, fits[-1], g))
        for q in [*probes, least]:
            b = next((b for b in reversed(fits) if model.static_bytes(p, b, g) + tab.act[q] <= cap_all), None)
            if b is None or (p, b, *q, g) in inc.simulated:
                continue
            inc.offer(model.step_time(p, b, *q, g), (p, b, *q, g))


def _device_counts(model: CostModel, p: int) -> list[int]:
    """The ``n_gpu_optim`` values walked for ``n_persist = p`` before the refinement (module docstring)."""
    k = model.max_gpu_optim(p)
    if k <= GPU_OPTIM_GRID:
        return list(range(k + 1))
    return sorted({round(i * k / GPU_OPTIM_GRID) for i in range(GPU_OPTIM_GRID + 1)})


def _walk_device_steps(model: CostModel, persists: range, cap_all: int, prune: bool, tab: _Tables,
                       inc: _Incumbent) -> None:
    """The walks with device steps: every grid value of ``n_gpu_optim`` above 0 per ``n_persist``,
    then every value within one grid step of the best one found."""
    n = model.n_chunks
    for p in persists:
        for g in _device_counts(model, p)[1:]:
            _walk(model, p, g, cap_all, prune, tab, inc)
    if inc.best is not None and inc.best[0] < n:
        p, g = inc.best[0], inc.best[4]
        grid = _device_counts(model, p)
        i = grid.index(g) if g in grid else None
        if i is not None:
            lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
            for g2 in range(lo + 1, hi):
                if g2 not in grid:
                    _walk(model, p, g2, cap_all, prune, tab, inc)


def _walk(model: CostModel, p: int, g: int, cap_all: int, prune: bool, tab: _Tables, inc: _Incumbent) -> None:
    """The walk over ``n_buffer`` (downwards) and the activation pairs of one ``(n_persist,
    n_gpu_optim)`` (see the module docstring), updating the incumbent."""
    p_lb = max(tab.fwd_compute + tab.bwd_compute + model.gpu_adam_time(p), model.cpu_adam_time(p, g),
               model.device_step_bound(p, g))
    if prune and p_lb >= inc.best_t:
        return
    prev_hi = 0  # pairs by_act[:prev_hi] already fitted with a larger n_buffer
    for b in reversed(model.buffer_range(p)):
        cap = cap_all - model.static_bytes(p, b, g)
        hi = bisect.bisect_right(tab.act_sorted, cap)
        if not prune:
            for q in tab.by_act[:hi]:
                inc.offer(model.step_time(p, b, *q, g), (p, b, *q, g))
            continue
        if prev_hi == 0 and hi == len(tab.by_act):
            fresh = tab.by_rec
        else:
            fresh = sorted(tab.by_act[prev_hi:hi], key=lambda q: (tab.rec[q], tab.act[q]))
        prev_hi = max(prev_hi, hi)
        if _walk_pairs(model, p, b, g, cap, fresh, tab, inc):
            break


def _walk_pairs(model: CostModel, p: int, b: int, g: int, cap: int, fresh: list[tuple[int, int]], tab: _Tables,
                inc: _Incumbent) -> bool:
    """Simulate the pairs ``fresh`` (fitting first at this ``n_buffer``, in increasing bound order)
    that their bounds leave; returns True when no smaller ``n_buffer`` can hold a faster config."""
    P = model._pp(p, g)
    fwd_compute, bwd_compute, rec = tab.fwd_compute, tab.bwd_compute, tab.rec
    fwd0: float | None = None  # forward time of (p, b, 0, 0), computed on first need
    for q in fresh:
        if max(fwd_compute + bwd_compute + rec[q] + P.gpu_adam_s, P.cpu_adam_s) >= inc.best_t:
            break  # visited in increasing bound order
        if fwd0 is None:
            base, fwd0 = model.step_and_forward_time(p, b, 0, 0, g)
            if tab.act[(0, 0)] <= cap:  # a candidate too
                inc.offer(base, (p, b, 0, 0, g))
            else:
                inc.bounds += 1
            if base >= inc.best_t:
                # T(p, b', s, c) >= T(p, b', 0, 0) >= T(p, b, 0, 0) for every b' <= b
                return True
        if q == (0, 0):
            continue
        if fwd0 + bwd_compute + rec[q] + P.gpu_adam_s >= inc.best_t:
            break  # the same bound with fwd0 >= forward compute, still in increasing order
        lb = inc.act_lb.get(q)
        if lb is None:
            lb = inc.act_lb[q] = model.step_time(model.n_chunks, 0, *q, optimizer=False)
            inc.bounds += 1
        if lb >= inc.best_t:
            continue
        if (p, b, *q, g) in inc.simulated:
            continue  # by the first pass
        inc.offer(model.step_time(p, b, *q, g), (p, b, *q, g))
    return False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


__all__ = ["NoPlanFits", "SearchResult", "search"]
