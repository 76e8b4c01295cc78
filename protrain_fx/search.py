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
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

from protrain_fx.cost import Config, CostModel, Estimate, Problem


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
) -> SearchResult:
    """The fastest config whose predicted peak is at most ``budget_bytes - reserve_bytes``.

    ``reserve_bytes`` is memory the model does not see (CUDA context, allocator fragmentation): the
    caller's safety margin. ``persist_all``: only configs where every chunk persists
    (``n_persist = n_chunks``, ``n_buffer = 0``; ``total`` and ``min_budget_bytes`` then count those
    alone). Raises :class:`NoPlanFits` (a ``ValueError``) naming the smallest budget that would fit,
    and ``ValueError`` for a negative budget or reserve.
    """
    for name, v in (("budget_bytes", budget_bytes), ("reserve_bytes", reserve_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"search: {name}={v!r} must be an int >= 0")
    t0 = time.perf_counter()
    model = CostModel(problem)
    n, N = model.n_chunks, model.n_blocks
    cap_all = budget_bytes - reserve_bytes
    persists = range(n, n - 1, -1) if persist_all else range(n, -1, -1)  # visited downwards

    pairs = [(s, c) for s in range(N + 1) for c in range(N + 1 - s)]
    act = {q: model.activation_peak(*q) for q in pairs}
    by_act = sorted(pairs, key=lambda q: (act[q], q))
    act_sorted = [act[q] for q in by_act]
    rc = model.rc
    rec = {q: sum(rc[i] for i, x in enumerate(model.policies(*q)) if x == 1) for q in pairs}
    bwd_compute = sum(model.cb)
    fwd_compute = sum(model.cf)
    total = sum(len(model.buffer_range(p)) for p in persists) * len(pairs)

    min_peak = min(model.static_bytes(p, model.buffer_range(p).start) for p in persists) + act_sorted[0]
    if min_peak > cap_all:
        raise NoPlanFits(
            f"no plan fits a budget of {budget_bytes} bytes ({_mib(budget_bytes)}) with {reserve_bytes} reserved: "
            f"the smallest predicted peak is {min_peak} bytes ({_mib(min_peak)}), so the budget must be at "
            f"least {min_peak + reserve_bytes} bytes ({_mib(min_peak + reserve_bytes)})",
            min_budget_bytes=min_peak + reserve_bytes,
        )

    best_t = math.inf
    best: tuple[int, int, int, int] | None = None
    simulated: set[tuple[int, int, int, int]] = set()  # candidates whose step time was simulated
    bounds = 0
    act_lb: dict[tuple[int, int], float] = {}
    by_rec = sorted(pairs, key=lambda q: (rec[q], act[q]))

    if prune:
        # A first incumbent, so that the bounds bite early: per n_persist, a few pairs (keep all,
        # swap all, checkpoint all, least recompute that fits the most buffers), each with the most
        # buffers it fits with.
        probes = [(0, 0), (N, 0), (0, N)]
        for p in persists:
            buffers = model.buffer_range(p)
            room = cap_all - model.static_bytes(p, 0)
            fits = [b for b in buffers if model.static_bytes(p, b) - model.static_bytes(p, 0) <= room - act_sorted[0]]
            if not fits:
                continue
            least = next(q for q in by_rec if act[q] <= cap_all - model.static_bytes(p, fits[-1]))
            for q in [*probes, least]:
                b = next((b for b in reversed(fits) if model.static_bytes(p, b) + act[q] <= cap_all), None)
                if b is None or (p, b, *q) in simulated:
                    continue
                t = model.step_time(p, b, *q)
                simulated.add((p, b, *q))
                if t < best_t:
                    best_t, best = t, (p, b, *q)

    for p in persists:
        P = model._pp(p)
        p_lb = max(fwd_compute + bwd_compute + P.gpu_adam_s, P.cpu_adam_s)
        if prune and p_lb >= best_t:
            continue
        prev_hi = 0  # pairs by_act[:prev_hi] already fitted with a larger n_buffer
        for b in reversed(model.buffer_range(p)):
            cap = cap_all - model.static_bytes(p, b)
            hi = bisect.bisect_right(act_sorted, cap)
            if not prune:
                for q in by_act[:hi]:
                    t = model.step_time(p, b, *q)
                    simulated.add((p, b, *q))
                    if t < best_t:
                        best_t, best = t, (p, b, *q)
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
                    base, fwd0 = model.step_and_forward_time(p, b, 0, 0)
                    if act[(0, 0)] <= cap:  # a candidate too
                        simulated.add((p, b, 0, 0))
                        if base < best_t:
                            best_t, best = base, (p, b, 0, 0)
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
                if (p, b, *q) in simulated:
                    continue  # by the first pass
                t = model.step_time(p, b, *q)
                simulated.add((p, b, *q))
                if t < best_t:
                    best_t, best = t, (p, b, *q)
            if stop_p:
                break

    assert best is not None, "a config fits, so one was evaluated"
    config = Config(*best)
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


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


__all__ = ["NoPlanFits", "SearchResult", "search"]
