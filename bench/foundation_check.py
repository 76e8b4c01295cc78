"""GPU check of the backend foundation: predicted vs measured peak, and the cost of the backend.

For each GPT size (B24 shape, batch 8 x 1024, fp32 parameters under bf16 autocast, fused AdamW,
uncapped) and each system, one fresh process trains a few steps and reports:

* ``protrain-inductor`` / ``protrain-eager``: ``torch.compile(backend="protrain")`` with Inductor or
  eager codegen: predicted peak (our analysis) vs ``torch.cuda.max_memory_allocated`` over the timed
  steps, step time, and one step recorded with the allocator history, written as a timeline plot
  with the prediction overlaid;
* ``torch.compile``: plain Inductor, the speed our backend must match when it has nothing to do.

Run: ``python bench/foundation_check.py --out OUT`` (prints a table, writes ``OUT/foundation.json``
and ``OUT/<size>_<system>.svg``). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("torch.compile", "protrain-inductor", "protrain-eager")


def worker(size: str, system: str, steps: int, out: Path, batch: int, seq: int, device: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import protrain_fx
    from examples.gpt import GPT, gpt_config, random_batch
    from protrain_fx.backend import register
    from protrain_fx.export import write_all
    from protrain_fx.measure import mark_phase, record_cpu_memory, record_memory

    register()
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    cfg = gpt_config(size)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if system == "torch.compile":
        compiled = torch.compile(model)
    else:
        codegen = system.split("-", 1)[1]
        compiled = torch.compile(model, backend="protrain", options={"codegen": codegen})
    idx, targets = random_batch(cfg, batch, seq, device=device, generator=torch.Generator().manual_seed(0))

    def step(marks: bool = False) -> torch.Tensor:
        if marks:
            mark_phase("forward")
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = compiled(idx, targets)
        if marks:
            mark_phase("backward")
        loss.backward()
        if marks:
            mark_phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if marks:
            mark_phase("end")
        return loss

    t0 = time.perf_counter()
    for _ in range(2):  # compile + optimizer state
        loss = step()
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    measured_peak = torch.cuda.max_memory_allocated() if cuda else None
    step_s = statistics.median(times)
    result = {
        "size": size,
        "system": system,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": step_s,
        "step_times_s": times,
        "tokens_per_s": batch * seq / step_s,
        "measured_peak_bytes": measured_peak,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "loss": loss.item(),
        "warmup_s": warmup_s,
    }
    if system != "torch.compile":
        train = [g for g in protrain_fx.captured_graphs() if g.memory is not None and g.backward is not None]
        assert len(train) == 1, [g.describe() for g in protrain_fx.captured_graphs()]
        memory = train[0].memory
        result["predicted_peak_bytes"] = memory.peak_bytes
        result["predicted_peak_node"] = f"{memory.peak_entry.phase}:{memory.peak_entry.name}"
        if train[0].memory_unfused is not None:
            result["graph_level_peak_bytes"] = train[0].memory_unfused.peak_bytes
        result["graph_breaks"] = protrain_fx.graph_break_reasons()
        with (record_memory() if cuda else record_cpu_memory()) as rec:
            step(marks=True)
            sync()
        measured = rec.timeline()
        result["recorded_step_peak_bytes"] = measured.peak_bytes
        if measured_peak is None:  # CPU: the recorded step is the measurement
            measured_peak = result["measured_peak_bytes"] = measured.peak_bytes
        result["peak_error"] = (memory.peak_bytes - measured_peak) / measured_peak
        stem = f"{size}_{system}".replace(".", "_")
        paths = write_all(memory.timeline, out / "timelines", measured=measured, stem=stem)
        svg = out / f"{stem}.svg"
        svg.write_bytes(Path(paths["svg"]).read_bytes())
    return result


def speed(size: str, rounds: int, steps: int, batch: int, seq: int) -> dict:
    """Step time of the backend with no rewrites against plain ``torch.compile``, in one process,
    timed in alternating rounds so that drift of the machine falls on both alike."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT))
    from examples.gpt import GPT, gpt_config, random_batch
    from protrain_fx.backend import register

    register()
    torch.manual_seed(0)
    cfg = gpt_config(size)
    base = GPT(cfg).cuda()
    systems = {}
    for name, backend in (("torch.compile", "inductor"), ("protrain-inductor", "protrain")):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        systems[name] = (torch.compile(model, backend=backend), opt)
    idx, targets = random_batch(cfg, batch, seq, device="cuda", generator=torch.Generator().manual_seed(0))

    def step(name: str) -> None:
        compiled, opt = systems[name]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for name in systems:
        for _ in range(3):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in systems}
    order = list(systems)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            for _ in range(steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(name)
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1000)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "size": size,
        "mode": "speed",
        "median_step_s": med,
        "tokens_per_s": {name: batch * seq / m for name, m in med.items()},
        "ratio_protrain_over_compile": med["protrain-inductor"] / med["torch.compile"],
        "steps_per_system": rounds * steps,
        "step_times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["125M", "350M"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--speed", nargs="*", default=[], metavar="SIZE",
                        help="also time protrain vs torch.compile in one process, alternating, for these sizes")
    parser.add_argument("--speed-worker", metavar="SIZE", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("SIZE", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.speed_worker:
        result = speed(args.speed_worker, rounds=6, steps=args.steps, batch=args.batch, seq=args.seq)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.worker:
        result = worker(*args.worker, steps=args.steps, out=args.out, batch=args.batch, seq=args.seq,
                        device=args.device)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    jobs = [(size, system, ["--worker", size, system]) for size in args.sizes for system in args.systems]
    jobs += [(size, "speed", ["--speed-worker", size]) for size in args.speed]
    for size, system, job in jobs:
        cmd = [sys.executable, __file__, *job, "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq", str(args.seq), "--out", str(args.out), "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout)[-3000:]
            results.append({"size": size, "system": system, "error": tail})
            print(f"{size} {system}: FAILED\n{tail}", flush=True)
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
        print(f"{size} {system}: done", flush=True)
    (args.out / "foundation.json").write_text(json.dumps(results, indent=1))
    timelines = args.out / "timelines"
    if timelines.is_dir():  # one archive: the device tool brings back few files
        import shutil
        import tarfile

        with tarfile.open(args.out / "timelines.tar.gz", "w:gz") as tar:
            tar.add(timelines, arcname="timelines")
        shutil.rmtree(timelines)
    print_table(results)


def print_table(results: list[dict]) -> None:
    for r in results:
        if r.get("mode") == "speed":
            t = r["tokens_per_s"]
            print(f"{r['size']}: alternating rounds, {r['steps_per_system']} steps each: torch.compile "
                  f"{t['torch.compile']:.0f} tok/s, protrain {t['protrain-inductor']:.0f} tok/s, "
                  f"protrain/compile step time {r['ratio_protrain_over_compile']:.4f}")
    results = [r for r in results if r.get("mode") != "speed" and r.get("system") != "speed"]
    base = {r["size"]: r["step_s"] for r in results if r.get("system") == "torch.compile" and "step_s" in r}
    print(f"\n{'size':>5} {'system':>18} {'tok/s':>9} {'step ms':>8} {'vs compile':>10} "
          f"{'measured GiB':>12} {'predicted GiB':>13} {'error':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['size']:>5} {r['system']:>18}  FAILED: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        rel = f"{r['step_s'] / base[r['size']]:.3f}x" if r["size"] in base else "-"
        pred = f"{r['predicted_peak_bytes'] / 2**30:.3f}" if "predicted_peak_bytes" in r else "-"
        err = f"{100 * r['peak_error']:+.1f}%" if "peak_error" in r else "-"
        measured = f"{r['measured_peak_bytes'] / 2**30:.3f}" if r.get("measured_peak_bytes") else "-"
        print(f"{r['size']:>5} {r['system']:>18} {r['tokens_per_s']:>9.0f} {1000 * r['step_s']:>8.1f} {rel:>10} "
              f"{measured:>12} {pred:>13} {err:>7}")


if __name__ == "__main__":
    main()
