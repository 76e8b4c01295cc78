"""The predicted step over the spread of the host rates a plan depends on.

The CPU optimizer's and the device steps' rates move between readings on one host
(``docs/results.md#profiled-rates-against-training``); a plan that is fastest at one reading can be slow at another.
:func:`expected_estimate` averages the step over :func:`rate_scenarios` (each rate at its reading and
at the ends of :data:`RATE_SPREAD`), and :func:`steadiest_gpu_optim` picks the ``n_gpu_optim`` of
least expected step. Plain data in, numbers out, as the cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from protrain_fx.search.problem import Counts, Estimate, Problem
from protrain_fx.search.cost import CostModel
from protrain_fx.search.cost import estimate


#: How far each host rate an offloaded step rests on may be from the profile's reading, as a fraction:
#: the rate the CPU chunk step reaches in training lies tens of percent from its profiled rate, the
#: device steps' about a tenth, and the profile cannot do better, as a host's CPU step moves that much
#: within a minute with nothing else running (``docs/results.md#profiled-rates-against-training``).
#: :func:`expected_estimate` and :func:`steadiest_gpu_optim` price a config at the reading and at each
#: rate this fraction either side of it.
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


def expected_estimate(problem: Problem, config: Counts, spread: Mapping[str, float] = RATE_SPREAD) -> Estimate:
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
    problem: Problem, config: Counts, *, room_bytes: int, spread: Mapping[str, float] = RATE_SPREAD
) -> Counts:
    """``config`` with the ``n_gpu_optim`` of the least expected step (:func:`expected_estimate`'s mean
    over :func:`rate_scenarios`), its other counts kept; only counts whose static bytes add at most
    ``room_bytes`` to ``config``'s are tried (the memory the plan was judged to leave). Ties keep
    ``config``'s own count.

    Why: the search takes the count fastest at the rates read, and a rate read a little high makes it
    step too much on that side, where the step then slows by more than a rate read low would cost.
    Replayed on recorded offloaded runs, each priced at the rates its training reached, this count
    loses less against the best count, on average and at worst, than the count fastest at the
    readings, and the first plan's prediction (:func:`expected_estimate`) lands nearer the step
    (``docs/results.md#n_gpu_optim-over-the-rate-spread``)."""
    if config.n_persist >= len(problem.chunks):
        return config
    models = [CostModel(q) for q in rate_scenarios(problem, spread)]
    plain = models[len(models) // 2]  # the middle case: every rate at its reading
    p, b, s, c, g0 = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint, config.n_gpu_optim
    here = plain.static_bytes(p, b, g0)

    def expected(g: int) -> float:
        return sum(m.step_time(p, b, s, c, g) for m in models) / len(models)

    best_g, best = g0, expected(g0)
    for g in range(plain.max_gpu_optim(p) + 1):
        if g == g0 or plain.static_bytes(p, b, g) - here > room_bytes:
            continue
        t = expected(g)
        if t < best:
            best_g, best = g, t
    return config if best_g == g0 else dataclasses.replace(config, n_gpu_optim=best_g)
