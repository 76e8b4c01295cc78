"""How long the plan search takes on a synthetic 48-block, ~100-chunk problem at several budgets.

    python bench/search_time.py [--fractions 0.1 0.3 0.5 0.8 1.2] [--cpu-adam factory 1e9]

Prints two rows per budget (without and with the choice of n_gpu_optim): milliseconds, configurations
simulated, bound-only and total, and the config chosen. A budget is a share of the range from the
least static memory any config needs to the all-kept step's peak (plus 2000 MiB). One table per CPU
Adam rate: the factory's (fast: every chunk stays on the CPU) and one slow enough for device steps to
pay. Uses the synthetic problem factory of tests/search/test_cost_search.py (seeded), so rows are comparable
across runs and machines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.search.test_cost_search import MiB, make_problem  # noqa: E402

from protrain_fx.search.cost import CostModel  # noqa: E402
from protrain_fx.search.search import search  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.8, 1.2],
                        help="budgets, as shares of the memory range (default: 0.1 0.3 0.5 0.8 1.2)")
    parser.add_argument("--cpu-adam", nargs="+", default=["factory", "1e9"], metavar="RATE",
                        help="CPU Adam rates in params/s, 'factory' for the problem factory's (default: factory 1e9)")
    args = parser.parse_args()
    for cpu in args.cpu_adam:
        table(None if cpu == "factory" else float(cpu), args.fractions)


def table(cpu_adam_params_per_s: float | None, fractions: list[float]) -> None:
    extra = {} if cpu_adam_params_per_s is None else {"cpu_adam_params_per_s": cpu_adam_params_per_s}
    problem = make_problem(11, n_blocks=48, chunks_per_block=(2, 2), **extra)
    model = CostModel(problem)
    n = len(problem.chunks)
    lo = min(model.static_bytes(p, model.buffer_range(p).start) for p in range(n + 1))
    hi = model.static_bytes(n, 0) + model.activation_peak(0, 0)
    print(f"\n48 blocks, {n} chunks, CPU Adam {problem.machine.cpu_adam_params_per_s / 1e9:.1f} G params/s")
    print("| budget (share of range) | n_gpu_optim searched | search ms | simulated | bounds only | configs | best | predicted step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for frac in fractions:
        for gpu_optim in (False, True):
            r = search(problem, int(lo + 2000 * MiB + frac * (hi - lo)), gpu_optim=gpu_optim)
            b = r.best
            print(f"| {frac:.0%} | {'yes' if gpu_optim else 'no'} | {r.seconds * 1e3:.0f} | {r.evaluated} | "
                  f"{r.bound_evaluations} | {r.total} | p={b.n_persist} b={b.n_buffer} s={b.n_swap} "
                  f"c={b.n_checkpoint} g={b.n_gpu_optim} | {r.estimate.step_s * 1e3:.0f} |")


if __name__ == "__main__":
    main()
