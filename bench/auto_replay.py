"""The prediction check: replay the automatic plans of benchmark runs against what was measured (no GPU).

    python bench/auto_replay.py OUT/cap24/peers.json ...          # per run, per phase and per rate
    python bench/auto_replay.py --summary docs/raw/b24_matrix_*.json         # one line per run
    python bench/auto_replay.py --phases docs/raw/b24_{auto,matrix}_*.json   # the compute estimate

For each ``protrain_offload[auto]`` run in the given ``bench/peers.py`` JSON files: the cost model's
step (replayed from the run's dumped ``Problem``) against the measured median step, per phase
(forward, backward from CUDA events; the CPU worker's busy time), and the CPU Adam rate the worker
reached in training (the parameters the config steps on the CPU over its median busy time) against
the rate the profile measured; the device steps' measured time against the cost model's, where the run
timed them. Then the step replayed with the in-training CPU rate, and with both in-training rates
(what is left is the model's own error, not the machine profile's), and at the rates of the backend's
own window (``auto_plan.training_rates``). With ``--search``, also the config the search picks with
the in-training rate (same budget and cap, and with the cap raised by 3 GiB as
``planner.verify.raised_choice`` could). With ``--recompute-factor K``, every block's recompute is replayed
at ``K`` times its forward, and with ``--chained-factor K2`` at ``K2`` times when the next block is
checkpointed too (``search.problem.BlockProfile.recompute_chained_s``).

``--summary``: one line per run instead: the step the run's plan was predicted at when it ran, the step
this code's cost model replays from the same dumped problem, and the measured step (the timed calls
before any re-plan), with the mean errors over the runs with device steps and over the others (how a
change to the cost model would have predicted the recorded first plans).

``--phases``: the compute estimate per phase on the runs whose plan kept every chunk on the device (so
the step is compute, recompute and the GPU optimizer: no copies and no CPU step): forward, backward and
step predicted against the measured medians (the first call, which compiles, left out); per size, over
the runs without checkpointing, the spread of the measured and of the predicted phases. Runs that read
the profile's inputs again after training (``PEERS_REREAD=N`` for ``bench/peers.py``) also get each
phase priced with their matrix and attention nodes at the times read then, with 5 calls between two
events (``events``) and with the device kept busy (``prefilled``), times the scale the compile applied
(``compute_scale``). The last lines: over those runs, each phase's measured time over its unscaled
``prefilled`` price (the fit behind ``planner.problem.IN_STEP_SCALE``), and each run left out in turn, priced
with one scale for both phases and with one per phase.

Every replay is a prediction: nothing here was measured with the replayed config.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protrain_fx.planner.offload import prefer_persistent  # noqa: E402
from protrain_fx.planner.verify import widened  # noqa: E402
from protrain_fx.search.cost import CostModel
from protrain_fx.search.spread import expected_estimate
from protrain_fx.search.problem import Counts, Problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("files", nargs="+", help="bench/peers.py JSON files (peers.json)")
    parser.add_argument("--search", action="store_true", help="search again with the in-training CPU rate")
    parser.add_argument("--recompute-factor", type=float, default=None,
                        help="replay each block's recompute at this factor times its forward")
    parser.add_argument("--chained-factor", type=float, default=None,
                        help="with --recompute-factor: the factor when the next block is checkpointed too "
                             "(default: the same)")
    parser.add_argument("--summary", action="store_true",
                        help="one line per run: as predicted when it ran, as replayed now, measured")
    parser.add_argument("--phases", action="store_true",
                        help="the compute estimate per phase on the runs that kept every chunk on the device")
    args = parser.parse_args()
    if args.chained_factor is not None and args.recompute_factor is None:
        parser.error("--chained-factor needs --recompute-factor")
    if args.summary:
        summary(args.files)
        return
    if args.phases:
        phases(args.files)
        return
    for f in args.files:
        for r in json.loads(Path(f).read_text()):
            ap = r.get("auto_plan")
            if not ap or not r.get("breakdown") or not r.get("step_s"):
                continue
            problem, config = Problem.from_dict(ap["problem"]), Counts.from_dict(ap["config"])
            if args.recompute_factor is not None:
                k = args.recompute_factor
                kc = k if args.chained_factor is None else args.chained_factor
                problem = dataclasses.replace(problem, blocks=[
                    dataclasses.replace(b, recompute_s=k * b.fwd_s, recompute_chained_s=kc * b.fwd_s)
                    for b in problem.blocks])
            # predicted as the mean over the host rates' spread where the run recorded one (search.spread.expected_estimate)
            spread = ap.get("rate_spread")
            est = expected_estimate(problem, config, spread) if spread else CostModel(problem).estimate(config)
            steps = r["breakdown"][1:] or r["breakdown"]  # the first step compiles
            step = r["step_s"]
            replan = ap.get("replan")  # n_gpu_optim changed at the start of call 8 (planner.rates.Replan)
            if replan:  # the first plan ran the timed steps before call 8 (the bench times from call 3)
                first, last = replan["calls"] or (9, 14)
                before = r["step_times_s"][: first - 4]
                after = r["step_times_s"][first - 3 : last - 3]  # calls first .. last - 1 (a revert starts at last)
                step = statistics.median(before)
                steps = steps[: len(before)]
                c0, c1 = Counts.from_dict(replan["before"]), Counts.from_dict(replan["after"])
                measured = f"{replan['measured_after_s'] * 1e3:.0f} ms" if replan["measured_after_s"] else "not timed"
                print(f"{Path(f).name} {r['size']} cap {r['cap_gib']:g} GiB: re-planned at the training rates, n_gpu_optim "
                      f"{c0.n_gpu_optim} -> {c1.n_gpu_optim}: predicted {replan['after_s'] * 1e3:.0f} ms (the first plan "
                      f"{replan['before_s'] * 1e3:.0f} at those rates, {replan['predicted_s'] * 1e3:.0f} first predicted); "
                      f"measured after: backend's period (calls {first}-{last}) {measured}, the bench's steps "
                      + (f"{statistics.median(after) * 1e3:.0f} ms ({100 * (replan['after_s'] / statistics.median(after) - 1):+.1f}%)"
                         if after else "none")
                      + {True: "; kept", False: "; undone (measured slower than before it)"}.get(replan.get("kept"), ""))
            med = {k: statistics.median(s[k] for s in steps) for k in ("forward_s", "backward_s", "cpu_optimizer_busy_s")}
            c = config
            print(f"{Path(f).name} {r['size']} cap {r['cap_gib']:g} GiB, {c.n_persist}/{c.n_buffer}/{c.n_swap}/"
                  f"{c.n_checkpoint}/{c.n_gpu_optim} of {len(problem.chunks)}: step {est.step_s * 1e3:.0f} ms predicted, "
                  f"{step * 1e3:.0f} measured ({100 * (est.step_s / step - 1):+.1f}%); forward {est.fwd_s * 1e3:.0f} / "
                  f"{med['forward_s'] * 1e3:.0f}, backward {est.bwd_s * 1e3:.0f} / {med['backward_s'] * 1e3:.0f} ms")
            if r.get("stream_step_s"):  # steps with no device sync between them (peers.py --stream-steps)
                stream, ran, which = r["stream_step_s"], est.step_s, ""
                first_stream = 3 + len(r["step_times_s"])  # calls 1-2 warm up, then the timed ones
                if replan and (replan.get("kept") or first_stream < (replan["calls"] or (9, 14))[1]):
                    # the stream steps ran the re-planned count (kept, or still on trial before its undo)
                    ran, which = replan["after_s"], " (the re-planned count)"
                print(f"    with no sync between steps{which} ({len(r['stream_starts_s'])} steps from call {first_stream}): "
                      f"{stream * 1e3:.0f} ms per step, predicted {ran * 1e3:.0f} ({100 * (ran / stream - 1):+.1f}%); "
                      + (f"the synced steps' median {100 * (step / stream - 1):+.1f}% above it" if not which else
                         f"the backend's synced period after the re-plan {100 * (replan['measured_after_s'] / stream - 1):+.1f}% "
                         "above it" if replan.get("measured_after_s") else ""))
            machine = problem.machine
            device_steps = [d for s in steps for _, d, _ in s.get("device_steps", [])]
            if device_steps:  # timed by the runtime (DeviceAdamW.timing)
                model = CostModel(problem)
                stepped = range(c.n_persist, c.n_persist + c.n_gpu_optim)
                out_bytes = statistics.median(model.dev_out_bytes[k] for k in stepped)
                dev_rate = out_bytes / statistics.median(device_steps)
                print(f"    device steps: {statistics.median(device_steps) * 1e3:.1f} ms measured (median of "
                      f"{len(device_steps)}; {dev_rate / 1e9:.1f} GB/s out), "
                      f"{statistics.median(model.dev_out_s[k] for k in stepped) * 1e3:.1f} "
                      f"predicted per chunk (priced at {machine.device_step_bytes_per_s / 1e9:.1f} GB/s: the "
                      f"profiler's, or training's kept on that machine; 0: the shared link rate)")
                machine = dataclasses.replace(machine, device_step_bytes_per_s=dev_rate)
                by_chunk: dict[int, list[float]] = {}
                for s in steps:
                    for ch, d, _ in s.get("device_steps", []):
                        by_chunk.setdefault(ch, []).append(d)
                print("    device steps per store chunk, median ms (issue order: the last chunk first): " + ", ".join(
                    f"{ch}: {statistics.median(v) * 1e3:.1f}" for ch, v in sorted(by_chunk.items(), reverse=True)))
            cpu_params = est.cpu_adam_s * problem.machine.cpu_adam_params_per_s
            if cpu_params and med["cpu_optimizer_busy_s"]:
                # the worker's busy time includes its waits for gradients to land: a lower bound of the rate
                rate = cpu_params / med["cpu_optimizer_busy_s"]
                trained = dataclasses.replace(problem, machine=dataclasses.replace(problem.machine,
                                                                                   cpu_adam_params_per_s=rate))
                again = CostModel(trained).estimate(config)
                print(f"    CPU Adam: {cpu_params / 1e9:.2f} G params, profile {problem.machine.cpu_adam_params_per_s / 1e9:.2f} "
                      f"G/s, training {rate / 1e9:.2f} G/s; step replayed at the training rate {again.step_s * 1e3:.0f} ms "
                      f"({100 * (again.step_s / step - 1):+.1f}%)")
                machine = dataclasses.replace(machine, cpu_adam_params_per_s=rate)
            kept = ap.get("training_rates")  # the backend's own window (protrain_fx.planner.rates)
            if kept:
                from protrain_fx.planner.rates import TrainingRates

                rates = TrainingRates(**{**kept, "device_steps": tuple(map(tuple, kept["device_steps"]))})
                again = CostModel(rates.priced(problem)).estimate(config)
                print(f"    backend's window: CPU Adam {rates.cpu_adam_params_per_s / 1e9:.2f} G/s, device steps "
                      f"{rates.device_step_bytes_per_s / 1e9:.1f} GB/s; step replayed at them {again.step_s * 1e3:.0f} ms "
                      f"({100 * (again.step_s / step - 1):+.1f}%)")
            if machine == problem.machine:
                continue
            trained = dataclasses.replace(problem, machine=machine)
            both = CostModel(trained).estimate(config)
            print(f"    replayed at both in-training rates: step {both.step_s * 1e3:.0f} ms "
                  f"({100 * (both.step_s / step - 1):+.1f}%), backward {both.bwd_s * 1e3:.0f} ms")
            if args.search:
                budget, cap = ap["budget_bytes"], ap["allocated_cap_bytes"]
                for raised in (0, 3 * 2**30):
                    found = prefer_persistent(trained, *widened(budget, budget - cap - raised), gpu_optim=True)
                    b = found.best
                    print(f"    search at the training rates, cap +{raised >> 30} GiB: {b.n_persist}/{b.n_buffer}/"
                          f"{b.n_swap}/{b.n_checkpoint}/{b.n_gpu_optim}, {found.estimate.step_s * 1e3:.0f} ms predicted")


def summary(files: list[str]) -> None:
    """``--summary``: each auto run's first plan as predicted when it ran and as replayed by this
    code's cost model from its dumped problem, against its measured step (the timed calls before
    any re-plan)."""
    rows: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for f in files:
        for r in json.loads(Path(f).read_text()):
            ap = r.get("auto_plan")
            if not ap or not r.get("step_s") or not ap.get("problem"):
                continue
            problem, config = Problem.from_dict(ap["problem"]), Counts.from_dict(ap["config"])
            replan = ap.get("replan")
            step = (statistics.median(r["step_times_s"][: (replan["calls"] or (9, 14))[0] - 4])
                    if replan else r["step_s"])
            # a first plan predicted as the mean over the host rates' spread is replayed so (search.spread.expected_estimate)
            spread = ap.get("rate_spread")
            now = (expected_estimate(problem, config, spread) if spread else CostModel(problem).estimate(config)).step_s
            then = ap["predicted_step_s"]
            rows[config.n_gpu_optim > 0].append((then / step - 1, now / step - 1))
            c = config
            print(f"{Path(f).name[:34]:34} {r['size']:>5} {r['cap_gib']:3g} GiB {c.n_persist}/{c.n_buffer}/{c.n_swap}/"
                  f"{c.n_checkpoint}/{c.n_gpu_optim}: measured {step * 1e3:7.1f} ms; predicted then {then * 1e3:7.1f} "
                  f"({100 * (then / step - 1):+5.1f}%), replayed now {now * 1e3:7.1f} ({100 * (now / step - 1):+5.1f}%)")
    for device, errors in rows.items():
        if errors:
            then, now = zip(*errors)
            print(f"{len(errors)} runs {'with' if device else 'without'} device steps: mean error then "
                  f"{100 * statistics.mean(then):+.2f}%, now {100 * statistics.mean(now):+.2f}%; mean |error| then "
                  f"{100 * statistics.mean(map(abs, then)):.2f}%, now {100 * statistics.mean(map(abs, now)):.2f}%; "
                  f"within 5% then {sum(abs(e) <= 0.05 for e in then)}, now {sum(abs(e) <= 0.05 for e in now)}")


def phase_rows(files: list[str]) -> list[dict]:
    """One dict per on-device auto run: size, cap, checkpointed blocks, predicted and measured seconds."""
    out = []
    for f in files:
        for r in json.loads(Path(f).read_text()):
            ap = r.get("auto_plan")
            if not ap or not r.get("breakdown") or not r.get("step_s"):
                continue
            problem, config = Problem.from_dict(ap["problem"]), Counts.from_dict(ap["config"])
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
                k = r["reread"].get("compute_scale", 1.0)  # the compile's planner.problem.IN_STEP_SCALE (1: before it)
                for protocol in ("events", "prefilled"):
                    d_fwd, d_bwd = (k * (sums[protocol][i] - sums["cached"][i]) for i in (0, 1))
                    row[protocol] = (est.fwd_s + d_fwd, est.bwd_s + d_bwd, est.step_s + d_fwd + d_bwd)
                # each phase's compute at the ``prefilled`` times, unscaled: what a scale multiplies
                row["unscaled"] = tuple(est_s / k + sums["prefilled"][i] - sums["cached"][i]
                                        for i, est_s in enumerate((est.fwd_s, est.bwd_s)))
            out.append(row)
    return out


def phases(files: list[str]) -> None:
    """``--phases``: the table of :func:`phase_rows`, the spread per size and :func:`phase_scales`."""
    table = phase_rows(files)
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
    backward ratios, as ``planner.problem.IN_STEP_SCALE``) and with one per phase (the others' mean each)."""
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
