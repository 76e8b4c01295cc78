"""How long the plan search takes on a synthetic 48-block, ~100-chunk problem at several budgets.

    python bench/search_time.py

Prints one row per budget: seconds, configurations simulated, bound-only and total. Uses the
synthetic problem factory of tests/test_cost_search.py (seeded), so rows are comparable across runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_cost_search import MiB, make_problem  # noqa: E402

from protrain_fx.cost import CostModel  # noqa: E402
from protrain_fx.search import search  # noqa: E402


def main() -> None:
    problem = make_problem(11, n_blocks=48, chunks_per_block=(2, 2))
    model = CostModel(problem)
    n = len(problem.chunks)
    lo = min(model.static_bytes(p, model.buffer_range(p).start) for p in range(n + 1))
    hi = model.static_bytes(n, 0) + model.activation_peak(0, 0)
    print(f"48 blocks, {n} chunks")
    print("| budget (share of range) | search ms | simulated | bounds only | configs |")
    print("|---|---|---|---|---|")
    for frac in (0.1, 0.3, 0.5, 0.8, 1.2):
        r = search(problem, int(lo + 2000 * MiB + frac * (hi - lo)))
        print(f"| {frac:.0%} | {r.seconds * 1e3:.0f} | {r.evaluated} | {r.bound_evaluations} | {r.total} |")


if __name__ == "__main__":
    main()
