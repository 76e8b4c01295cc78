"""The compute estimate per phase on the recorded runs that kept every chunk on the device (no GPU needed).

    python bench/phase_errors.py [files...]   (default: docs/raw/session1[2-9]_call*_peers.json, session2*)

For each ``protrain_offload[auto]`` run whose plan kept every chunk on the device (so its step is
compute, recompute and the GPU optimizer: no copies and no CPU step), the cost model's forward,
backward and step, replayed from the run's dumped ``Problem``, against the medians measured (CUDA
events; the first call, which compiles, left out). Then per model size, over those runs without
checkpointing (each call ran on its own host; two runs of one call at two caps share one): the spread
of the measured phases and of the predicted ones. Where the predictions spread
more than the measurements, the estimate's inputs (the op times the profile measured on each host)
vary more than the step they price.

Runs that read the profile's inputs again after training (``bench/peers.py``, ``PEERS_REREAD``) also
get each phase priced with their matrix and attention nodes at the times read then, with 5 calls
between two events (``events``) and with the device kept busy (``prefilled``): the cached times' sum
in that phase is replaced by the new one, times the scale the compile applied (``compute_scale``).
Those rows end with each phase's measured time less the ``prefilled`` price, in ms: what the
estimate would still have to model. The last two lines: over those runs, each phase's measured time
over its unscaled ``prefilled`` price (and each run's surplus in ms), and each run left out in turn,
priced with one scale for both phases (as ``profiler.IN_STEP_SCALE``) and with one per phase.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protrain_fx.cost import Config, CostModel, Problem  # noqa: E402


def rows(files: list[str]) -> list[dict]:
    """One dict per on-device auto run: size, cap, checkpointed blocks, predicted and measured seconds."""
    out = []
    for f in files:
        for r in json.loads(Path(f).read_text()):
            ap = r.get("auto_plan")
            if not ap or not r.get("breakdown") or not r.get("step_s"):
                continue
            problem, config = Problem.from_dict(ap["problem"]), Config.from_dict(ap["config"])
            if config.n_persist < len(problem.chunks):
                continue
            est = CostModel(problem).estimate(config)
            steps = r["breakdown"][1:] or r["breakdown"]
            row = {
                "file": Path(f).name, "size": r["size"], "cap_gib": r["cap_gib"], "checkpoint": config.n_checkpoint,
                "fwd": (est.fwd_s, statistics.median(s["forward_s"] for s in steps)),
                "bwd": (est.bwd_s, statistics.median(s["backward_s"] for s in steps)),
                "step": (est.step_s, r["step_s"]),
            }
            sums = (r.get("reread") or {}).get("op_sums_s")
            if sums and config.n_checkpoint == 0:  # a recomputed block's products would count twice
                k = r["reread"].get("compute_scale", 1.0)  # the compile's profiler.IN_STEP_SCALE (1: before it)
                for protocol in ("events", "prefilled"):
                    d_fwd, d_bwd = (k * (sums[protocol][i] - sums["cached"][i]) for i in (0, 1))
                    row[protocol] = (est.fwd_s + d_fwd, est.bwd_s + d_bwd, est.step_s + d_fwd + d_bwd)
                # each phase's compute at the ``prefilled`` times, unscaled: what a scale multiplies
                row["unscaled"] = tuple(est_s / k + sums["prefilled"][i] - sums["cached"][i]
                                        for i, est_s in enumerate((est.fwd_s, est.bwd_s)))
            out.append(row)
    return out


def main() -> None:
    files = sys.argv[1:] or sorted([*glob.glob(str(ROOT / "docs/raw/session1[2-9]_call*_peers.json")),
                                    *glob.glob(str(ROOT / "docs/raw/session2[0-9]_call*_peers.json"))])
    table = rows(files)
    print("ms, predicted / measured (error)")
    for t in table:
        cells = "  ".join(f"{k} {p * 1e3:6.1f} / {m * 1e3:6.1f} ({100 * (p / m - 1):+5.1f}%)"
                          for k, (p, m) in ((k, t[k]) for k in ("fwd", "bwd", "step")))
        print(f"{t['file'][:32]:32} {t['size']:>5} {t['cap_gib']:3g} GiB ck {t['checkpoint']:2d}  {cells}")
        for protocol in ("events", "prefilled"):
            if protocol in t:
                priced = list(zip(("fwd", "bwd", "step"), t[protocol]))
                errors = "  ".join(f"{k} {100 * (p / t[k][1] - 1):+5.1f}%" for k, p in priced)
                rest = ", ".join(f"{k} {1e3 * (t[k][1] - p):+.1f}" for k, p in priced)
                print(f"{'':>32} {'':>5} {'':>7} {'':>5}  reread {protocol:9}: {errors}; "
                      f"measured less priced (ms): {rest}")
    print("Per size, the plans without checkpointing: mean and spread (sd / mean) of the phases")
    for size in sorted({t["size"] for t in table}):
        plain = [t for t in table if t["size"] == size and t["checkpoint"] == 0]
        if len(plain) < 3:
            continue
        parts = []
        for k in ("fwd", "bwd", "step"):
            pred, meas = [t[k][0] for t in plain], [t[k][1] for t in plain]
            parts.append(f"{k}: measured {statistics.mean(meas) * 1e3:.1f} (sd {statistics.stdev(meas) / statistics.mean(meas):.1%}), "
                         f"predicted {statistics.mean(pred) * 1e3:.1f} (sd {statistics.stdev(pred) / statistics.mean(pred):.1%})")
        print(f"  {size:>5} over {len(plain)} runs: " + "; ".join(parts))
    phase_scales(table)


def phase_scales(table: list[dict]) -> None:
    """Measured over the unscaled ``prefilled`` price per phase, on the reread runs; then each run left
    out in turn, its step priced with one scale for both phases (the mean of the others' forward plus
    backward ratios, as ``profiler.IN_STEP_SCALE``) and with one per phase (the others' mean each)."""
    runs = [t for t in table if "unscaled" in t]
    if len(runs) < 3:
        return
    ratio = {k: [t[k][1] / t["unscaled"][i] for t in runs] for i, k in enumerate(("fwd", "bwd"))}
    both = [(t["fwd"][1] + t["bwd"][1]) / sum(t["unscaled"]) for t in runs]
    print(f"Measured / unscaled prefilled price over {len(runs)} reread runs: "
          + "; ".join(f"{k} {statistics.mean(v):.3f} (sd {statistics.stdev(v):.3f})"
                      for k, v in (*ratio.items(), ("fwd+bwd", both)))
          + "; surplus (ms): " + ", ".join(
              f"{t['size']} fwd {1e3 * (t['fwd'][1] - t['unscaled'][0]):.1f} bwd {1e3 * (t['bwd'][1] - t['unscaled'][1]):.1f}"
              for t in runs))
    err: dict[str, list[float]] = {"one scale": [], "per phase": []}
    phase_err: dict[str, list[float]] = {"one scale": [], "per phase": []}
    for i, t in enumerate(runs):
        def others(v: list[float]) -> float:
            return statistics.mean(v[:i] + v[i + 1:])
        rest = t["step"][0] - t["fwd"][0] - t["bwd"][0]  # the optimizer and what follows backward
        for name, (kf, kb) in (("one scale", (others(both),) * 2),
                               ("per phase", (others(ratio["fwd"]), others(ratio["bwd"])))):
            f, b = kf * t["unscaled"][0], kb * t["unscaled"][1]
            err[name].append(abs((f + b + rest) / t["step"][1] - 1))
            phase_err[name] += [abs(f / t["fwd"][1] - 1), abs(b / t["bwd"][1] - 1)]
    print("  each run left out: mean |error| " + "; ".join(
        f"{name}: step {100 * statistics.mean(err[name]):.2f}%, phases {100 * statistics.mean(phase_err[name]):.2f}%"
        for name in err))


if __name__ == "__main__":
    main()
