"""Exhaustive search over ProTrain's four counts, with pruning that never drops the optimum.

:func:`search` returns the :class:`~protrain_fx.cost.Config` with the smallest predicted step time
whose predicted peak fits ``budget_bytes - reserve_bytes``, over every valid config:
``n_persist`` in ``0..n_chunks``; ``n_buffer`` in ``min_buffers(n_persist)..n_chunks - n_persist``
(0 only when every chunk persists; ``min_buffers`` = the most non-persistent chunks one block uses);
``n_swap + n_checkpoint <= n_blocks``. Among equally fast configs it returns the first one it finds.

What the pruning relies on (all properties of :mod:`protrain_fx.cost`, stated and tested there):

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
:mod:`protrain_fx.cost`): the same walk per ``(n_persist, n_gpu_optim)`` (rules 1 to 3 hold for each
``n_gpu_optim``; its static bytes add the device staging when it is above 0), first ``n_gpu_optim =
0`` for every ``n_persist`` (a good incumbent), then the others, each pair skipped when its bound
``max(compute + gpu_adam, cpu_adam of the chunks left to the CPU, CostModel.device_step_bound)``
is not below the best time. ``n_gpu_optim`` takes every value in ``0..n_chunks - n_persist`` when
there are at most :data:`GPU_OPTIM_GRID` + 1 of them; otherwise :data:`GPU_OPTIM_GRID` + 1 evenly
spread values, then every value within one grid step of the best found (for its ``n_persist``). So
the result equals brute force on small problems (tested); on large ones the refinement is local,
which keeps the search near a second on 100 chunks (``bench/search_time.py``).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Config, Estimate, Problem

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

    best: Config
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
    model = CostModel(problem)
    n, N = model.n_chunks, model.n_blocks
    cap_all = budget_bytes - reserve_bytes
    if n_persist is not None and not 0 <= n_persist <= n:
        raise ValueError(f"search: n_persist={n_persist} must be in 0..{n}")
    if persist_all:
        n_persist = n
    # visited downwards
    persists = range(n_persist, n_persist - 1, -1) if n_persist is not None else range(n, -1, -1)

    pairs = [(s, c) for s in range(N + 1) for c in range(N + 1 - s)]
    act = {q: model.activation_peak(*q) for q in pairs}
    by_act = sorted(pairs, key=lambda q: (act[q], q))
    act_sorted = [act[q] for q in by_act]
    rec = {q: sum(model.recomputes(*q)) for q in pairs}
    bwd_compute = sum(model.cb)
    fwd_compute = sum(model.cf)

    def device_counts(p: int) -> list[int]:
        if not gpu_optim:
            return [0]
        k = n - p
        if k <= GPU_OPTIM_GRID:
            return list(range(k + 1))
        return sorted({round(i * k / GPU_OPTIM_GRID) for i in range(GPU_OPTIM_GRID + 1)})

    total = sum(len(model.buffer_range(p)) * (n - p + 1 if gpu_optim else 1) for p in persists) * len(pairs)

    min_peak = min(model.static_bytes(p, model.buffer_range(p).start) for p in persists) + act_sorted[0]
    if min_peak > cap_all:
        raise NoPlanFits(
            f"no plan fits a budget of {budget_bytes} bytes ({_mib(budget_bytes)}) with {reserve_bytes} reserved: "
            f"the smallest predicted peak is {min_peak} bytes ({_mib(min_peak)}), so the budget must be at "
            f"least {min_peak + reserve_bytes} bytes ({_mib(min_peak + reserve_bytes)})",
            min_budget_bytes=min_peak + reserve_bytes,
        )

    best_t = math.inf
    best: tuple[int, int, int, int, int] | None = None
    simulated: set[tuple[int, int, int, int, int]] = set()  # candidates whose step time was simulated
    bounds = 0
    act_lb: dict[tuple[int, int], float] = {}
    by_rec = sorted(pairs, key=lambda q: (rec[q], act[q]))

    if prune:
        # A first incumbent, so that the bounds bite early: per n_persist, a few pairs (keep all,
        # swap all, checkpoint all, least recompute that fits the most buffers), each with the most
        # buffers it fits with.
        # With gpu_optim, the same for no, half and all of the non-persistent chunks on the GPU.
        probes = [(0, 0), (N, 0), (0, N)]
        for p in persists:
            for g in (0,):
                buffers = model.buffer_range(p)
                room = cap_all - model.static_bytes(p, 0, g)
                fits = [b for b in buffers
                        if model.static_bytes(p, b, g) - model.static_bytes(p, 0, g) <= room - act_sorted[0]]
                if not fits:
                    continue
                least = next(q for q in by_rec if act[q] <= cap_all - model.static_bytes(p, fits[-1], g))
                for q in [*probes, least]:
                    b = next((b for b in reversed(fits) if model.static_bytes(p, b, g) + act[q] <= cap_all), None)
                    if b is None or (p, b, *q, g) in simulated:
                        continue
                    t = model.step_time(p, b, *q, g)
                    simulated.add((p, b, *q, g))
                    if t < best_t:
                        best_t, best = t, (p, b, *q, g)

    def walk(p: int, g: int) -> None:
        nonlocal best_t, best, bounds
        best_t, best, got = _walk(model, p, g, cap_all, prune, best_t, best, simulated, by_act, act_sorted, by_rec,
                                  act, rec, act_lb, fwd_compute, bwd_compute)
        bounds += got

    for p in persists:
        walk(p, 0)
    if gpu_optim:
        for p in persists:
            for g in device_counts(p)[1:]:
                walk(p, g)
        if best is not None and best[0] < n:  # every value within one grid step of the best one
            p, g = best[0], best[4]
            grid = device_counts(p)
            i = grid.index(g) if g in grid else None
            if i is not None:
                lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
                for g2 in range(lo + 1, hi):
                    if g2 not in grid:
                        walk(p, g2)

    assert best is not None, "a config fits, so one was evaluated"
    p, b, s_, c, g = best
    config = Config(p, b, s_, c, g)
    est = model.estimate(config)
    assert est.step_s == best_t and est.peak_bytes <= cap_all
    return SearchResult(
        best=config,
        estimate=est,
        evaluated=len(simulated),
        bound_evaluations=bounds,
        pruned=total - len(simulated),
        total=total,
        seconds=time.perf_counter() - t0,
    )


def _walk(model: CostModel, p: int, g: int, cap_all: int, prune: bool, best_t: float,
          best: tuple[int, int, int, int, int] | None, simulated: set, by_act: list, act_sorted: list,
          by_rec: list, act: dict, rec: dict, act_lb: dict, fwd_compute: float, bwd_compute: float,
          ) -> tuple[float, tuple[int, int, int, int, int] | None, int]:
    """The walk over ``n_buffer`` (downwards) and the activation pairs of one ``(n_persist,
    n_gpu_optim)`` (see the module docstring); returns the new incumbent and the bound-only
    simulations it ran."""
    n = model.n_chunks
    bounds = 0
    p_lb = max(fwd_compute + bwd_compute + model.gpu_adam_time(p), model.cpu_adam_time(p, g),
               model.device_step_bound(p, g))
    if prune and p_lb >= best_t:
        return best_t, best, bounds
    P = model._pp(p, g)
    prev_hi = 0  # pairs by_act[:prev_hi] already fitted with a larger n_buffer
    for b in reversed(model.buffer_range(p)):
        cap = cap_all - model.static_bytes(p, b, g)
        hi = bisect.bisect_right(act_sorted, cap)
        if not prune:
            for q in by_act[:hi]:
                t = model.step_time(p, b, *q, g)
                simulated.add((p, b, *q, g))
                if t < best_t:
                    best_t, best = t, (p, b, *q, g)
            continue
        if prev_hi == 0 and hi == len(by_act):
            fresh = by_rec
        else:
            fresh = sorted(by_act[prev_hi:hi], key=lambda q: (rec[q], act[q]))
        prev_hi = max(prev_hi, hi)
        fwd0: float | None = None  # forward time of (p, b, 0, 0), computed on first need
        stop_p = False
        for q in fresh:
            if max(fwd_compute + bwd_compute + rec[q] + P.gpu_adam_s, P.cpu_adam_s) >= best_t:
                break  # visited in increasing bound order
            if fwd0 is None:
                base, fwd0 = model.step_and_forward_time(p, b, 0, 0, g)
                if act[(0, 0)] <= cap:  # a candidate too
                    simulated.add((p, b, 0, 0, g))
                    if base < best_t:
                        best_t, best = base, (p, b, 0, 0, g)
                else:
                    bounds += 1
                if base >= best_t:
                    # T(p, b', s, c) >= T(p, b', 0, 0) >= T(p, b, 0, 0) for every b' <= b
                    stop_p = True
                    break
            if q == (0, 0):
                continue
            if fwd0 + bwd_compute + rec[q] + P.gpu_adam_s >= best_t:
                break  # the same bound with fwd0 >= forward compute, still in increasing order
            lb = act_lb.get(q)
            if lb is None:
                lb = act_lb[q] = model.step_time(n, 0, *q, optimizer=False)
                bounds += 1
            if lb >= best_t:
                continue
            if (p, b, *q, g) in simulated:
                continue  # by the first pass
            t = model.step_time(p, b, *q, g)
            simulated.add((p, b, *q, g))
            if t < best_t:
                best_t, best = t, (p, b, *q, g)
        if stop_p:
            break
    return best_t, best, bounds


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


__all__ = ["NoPlanFits", "SearchResult", "search"]
