"""Replays every recorded run with device steps (``docs/raw/session{1[3-9],2[0-9]}_call*_peers.json``) at the
rates its own steps measured, with the device-step rate defined two ways:

* ``span``: each step's bytes out over its own span, first copy in to last copy out (what
  ``calibrate.RateWindow`` takes);
* ``lane``: over the time the out-lane spent on it alone, from the later of its start and the
  previous step's end (the cost model runs one step's copies out after another's);
* ``per chunk``: the span rate, and each chunk timed at the median of its own steps' seconds
  (``cost.Problem.device_step_s``, as ``calibrate.TrainingRates.priced`` prices the running plan);
* ``alone``: the chunks' median seconds less the backward re-fetches the cost model puts beside
  them (``calibrate.alone_rate``, what the window keeps since the twenty-first session), every
  chunk priced at it with those re-fetches added back: how a later plan on that machine is priced.

The CPU rate is the backend's own window's (``auto_plan.training_rates``). Prints each run's
predicted step error against its measured synced median (the calls before any re-plan) both ways,
and the means. Then, per size with three runs or more, how the profile's readings (the device
steps' and the CPU step's rates the plan was priced at) track what training reached on the same
host (the ``alone`` rate; the window's CPU rate): their correlation, and the mean error of the
reading against that of training's mean over the hosts (twenty-second session: at 4.2B the
device-step reading did no better than a constant).

    python bench/device_rate_definitions.py
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protrain_fx.calibrate import alone_rate  # noqa: E402
from protrain_fx.cost import Config, CostModel, Problem  # noqa: E402


def device_rates(
    record: dict, model: CostModel, config: Config
) -> tuple[float, float, tuple[tuple[int, float], ...]] | None:
    """(span rate, lane rate, per chunk seconds): medians over the timed steps before any re-plan;
    None without device steps."""
    replan = record["auto_plan"].get("replan")
    before = replan["calls"][0] - 4 if replan and replan.get("calls") else len(record["step_times_s"])
    span, lane, by_chunk = [], [], {}
    for step in record["breakdown"][1:][:before]:  # the first step compiles
        previous_end = None
        for chunk, seconds, start in sorted(step["device_steps"], key=lambda d: d[2]):
            by_chunk.setdefault(chunk + config.n_persist, []).append(seconds)
            if start <= 0:  # the last step's, finished after it: no previous end to compare with
                continue
            out_bytes = model.dev_out_bytes[chunk + config.n_persist]
            span.append(out_bytes / seconds)
            alone = seconds if previous_end is None else start + seconds - max(start, previous_end)
            lane.append(out_bytes / alone)
            previous_end = start + seconds
    if not span:
        return None
    return (statistics.median(span), statistics.median(lane),
            tuple((k, statistics.median(v)) for k, v in sorted(by_chunk.items())))


def main() -> None:
    errors: list[tuple[float, float]] = []
    readings: dict[str, list[tuple[float, float, float, float]]] = {}  # size -> (profile, alone, CPU profile, CPU window)
    for path in sorted([*(ROOT / "docs" / "raw").glob("session1[3-9]_call*_peers.json"),
                       *(ROOT / "docs" / "raw").glob("session2[0-9]_call*_peers.json")]):
        for record in json.loads(path.read_text()):
            auto = record.get("auto_plan")
            if not auto or not record.get("breakdown") or not record.get("step_s") or not auto.get("training_rates"):
                continue
            config, problem = Config.from_dict(auto["config"]), Problem.from_dict(auto["problem"])
            rates = device_rates(record, CostModel(problem), config) if config.n_gpu_optim else None
            if rates is None:
                continue
            window = auto["training_rates"]
            cpu = window["cpu_params"] / window["cpu_s"] if window["cpu_s"] else problem.machine.cpu_adam_params_per_s
            replan = auto.get("replan")
            before = replan["calls"][0] - 4 if replan and replan.get("calls") else len(record["step_times_s"])
            measured = statistics.median(record["step_times_s"][:before])
            row = []
            alone = alone_rate(CostModel(dataclasses.replace(problem, device_step_s=())), config, dict(rates[2]))
            for rate, timed in ((rates[0], ()), (rates[1], ()), (rates[0], rates[2]), (alone, ())):
                machine = dataclasses.replace(problem.machine, cpu_adam_params_per_s=cpu, device_step_bytes_per_s=rate)
                priced = dataclasses.replace(problem, machine=machine, device_step_s=timed)
                row.append(100 * (CostModel(priced).estimate(config).step_s / measured - 1))
            errors.append(tuple(row))
            profiled = problem.machine.device_step_bytes_per_s
            if profiled:
                readings.setdefault(record["size"], []).append(
                    (profiled, alone, problem.machine.cpu_adam_params_per_s, cpu))
            print(f"{path.name[:24]:24} {record['size']:>5} {record['cap_gib']:3g} GiB g={config.n_gpu_optim:2d}  "
                  f"profile {profiled / 1e9:.1f}, span {rates[0] / 1e9:.1f} GB/s, lane {rates[1] / 1e9:.1f}  step error: span {row[0]:+5.1f}%, "
                  f"lane {row[1]:+5.1f}%, per chunk {row[2]:+5.1f}%, alone ({alone / 1e9:.1f} GB/s) {row[3]:+5.1f}%")
    print(f"{len(errors)} runs:")
    for name, column in zip(("span", "lane", "per chunk", "alone"), zip(*errors)):
        print(f"  {name:9}: mean |error| {statistics.mean(map(abs, column)):.2f}%, mean error "
              f"{statistics.mean(column):+.2f}%, within 5%: {sum(abs(e) <= 5 for e in column)}")
    print("The profile's readings against training's on the same host (the window's CPU rate; the device steps' alone):")
    for size, rows in sorted(readings.items()):
        if len(rows) < 3:
            continue
        for what, a, b in (("device steps", 0, 1), ("CPU step", 2, 3)):
            prof, train = [r[a] for r in rows], [r[b] for r in rows]
            mean = statistics.mean(train)
            print(f"  {size:>5} {what:12}: {len(rows)} runs, training {mean / 1e9:.2f} (sd {statistics.stdev(train) / mean:.1%}), "
                  f"correlation {statistics.correlation(prof, train):+.2f}; mean |profile / training - 1| "
                  f"{statistics.mean(abs(x / y - 1) for x, y in zip(prof, train)):.1%}, mean |training's mean / training - 1| "
                  f"{statistics.mean(abs(mean / y - 1) for y in train):.1%}")


if __name__ == "__main__":
    main()
