"""Two ways to choose ``n_gpu_optim`` for an offloaded first plan, replayed on the recorded runs (no GPU needed).

    python bench/gpu_optim_rules.py [files...]   (default: docs/raw/session1[3-9]_call*_peers.json, session2*)

For each recorded ``protrain_offload[auto]`` run that offloaded chunks and whose rate window measured
the CPU step, the run's chunk and activation counts are kept and ``n_gpu_optim`` is chosen two ways
from its dumped ``Problem`` (the profile's rates):

* ``readings``: the count of least step at the rates as read (what the search did until 2026-12-02);
* ``expected``: the count of least mean step over the CPU step's rate within 25% and the device
  steps' within 10% of their readings (``cost.steadiest_gpu_optim``), predicted as that mean
  (``cost.expected_estimate``).

Each choice is then priced at the rates the run's training reached (its rate window:
``calibrate.TrainingRates.priced``, every device step at the window's rate). Printed per run and per
size: the first plan's predicted step against that price (its error), and how much slower the chosen
count is than the count fastest at training's rates (its loss). Both are judged by the cost model
at the measured rates, not by measured steps: only one count of each run was measured. Memory is
not checked here (every count is tried); the backend only takes a count whose device staging fits.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protrain_fx.calibrate import TrainingRates  # noqa: E402
from protrain_fx.cost import (  # noqa: E402
    RATE_SPREAD,
    Config,
    CostModel,
    Problem,
    expected_estimate,
    steadiest_gpu_optim,
)


def replay(run: dict) -> dict | None:
    """One run's two choices: per rule, the count, the first plan's error and the loss (fractions)."""
    ap = run.get("auto_plan")
    if not ap or not ap.get("training_rates") or not run.get("step_s"):
        return None
    config, problem = Config.from_dict(ap["config"]), Problem.from_dict(ap["problem"])
    window = ap["training_rates"]
    if not window["cpu_s"] or config.n_persist >= len(problem.chunks):
        return None
    problem = dataclasses.replace(problem, device_step_s=())  # a first plan has no timed device steps
    rates = TrainingRates(cpu_params=window["cpu_params"], cpu_s=window["cpu_s"],
                          device_step_bytes_per_s=window["device_step_bytes_per_s"])
    trained = CostModel(rates.priced(problem))
    at_readings = CostModel(problem)
    p, b, s, c = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint
    counts = range(at_readings.n_chunks - p + 1)
    truth = {g: trained.step_time(p, b, s, c, g) for g in counts}
    best = min(truth.values())
    readings = min(counts, key=lambda g: (at_readings.step_time(p, b, s, c, g), g))
    steady = steadiest_gpu_optim(problem, dataclasses.replace(config, n_gpu_optim=readings), room_bytes=2**62)
    out = {"size": run["size"], "cap_gib": run["cap_gib"]}
    for rule, g, predicted in (
        ("readings", readings, at_readings.step_time(p, b, s, c, readings)),
        ("expected", steady.n_gpu_optim, expected_estimate(problem, steady, RATE_SPREAD).step_s),
    ):
        out[rule] = {"g": g, "error": predicted / truth[g] - 1, "loss": truth[g] / best - 1}
    return out


def main() -> None:
    files = sys.argv[1:] or sorted([*glob.glob(str(ROOT / "docs/raw/session1[3-9]_call*_peers.json")),
                                    *glob.glob(str(ROOT / "docs/raw/session2[0-9]_call*_peers.json"))])
    rows = []
    for f in files:
        for run in json.loads(Path(f).read_text()):
            row = replay(run)
            if row is None:
                continue
            rows.append(row)
            cells = "  ".join(f"{rule}: g={row[rule]['g']:2d} error {100 * row[rule]['error']:+6.1f}% loss "
                              f"{100 * row[rule]['loss']:5.1f}%" for rule in ("readings", "expected"))
            print(f"{Path(f).name[:34]:34} {row['size']:>5} {row['cap_gib']:3g} GiB  {cells}")
    print("first plan's error and loss, judged at the rates training reached:")
    for size in [None, *sorted({r["size"] for r in rows})]:
        some = [r for r in rows if size is None or r["size"] == size]
        for rule in ("readings", "expected"):
            err = [abs(r[rule]["error"]) for r in some]
            loss = [r[rule]["loss"] for r in some]
            print(f"  {size or 'all':>5} {rule:8}: {len(some)} runs, mean |error| {100 * statistics.mean(err):.1f}%, "
                  f"within 5% {sum(e <= 0.05 for e in err)}, largest {100 * max(err):.1f}%; mean loss "
                  f"{100 * statistics.mean(loss):.2f}%, largest {100 * max(loss):.1f}%")


if __name__ == "__main__":
    main()
