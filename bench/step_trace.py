"""Where a step's device time goes, measured against the cost model's estimate, per kind of work.

    python bench/step_trace.py --size 760M [--batch 8 --seq 1024 --steps 3 --protocols R --json out.json]

Runs B24 ``size`` through ``torch.compile(backend="protrain")`` with the empty plan (what the
automatic plan runs when everything fits: Inductor codegen, parameters kept), traces ``--steps``
steps with ``torch.profiler`` (a device sync after the forward, so kernels split into forward and
backward by their start), and sums the kernels' device time per kind: matrix products (cuBLAS),
attention, Inductor's generated kernels, other. Beside it, the estimate the cost model prices the
same graphs at (``planner.problem.node_times`` with the fused roofline and the measured op times, as
``planner.problem.problem_from_record`` does): the timed ops split into products and attention, the rest
(the fused roofline). The question it answers: do the products run faster inside the step than
measured alone, or is the fused roofline high. Also per phase, where the device sat idle
(:func:`gap_analysis`: before the first kernel, between kernels, and how much of it waited for the
host to launch the next). With ``--protocols R``, the products and attention are timed afresh R
times under the profiler's protocol and with the device kept busy while they are queued
(:func:`protocol_rounds`). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

KINDS = ("products", "attention", "generated", "other")


def kernel_kind(name: str) -> str:
    """The kind of work of a CUDA kernel, from its name."""
    low = name.lower()
    if "flash" in low or "fmha" in low or "attention" in low or "sdpa" in low:
        return "attention"
    if low.startswith("triton") or "triton_" in low:
        return "generated"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_", "splitk")):
        return "products"
    return "other"


def node_kind(target: str) -> str:
    """The kind of work of a timed graph node (one with a measured op time)."""
    return "attention" if "attention" in target or "sdpa" in target else "products"


def estimate(record, machine, op_times) -> dict:
    """The estimate's seconds per phase and kind (nodes with a FLOP formula are products or attention,
    measured when ``op_times`` has them; the rest is the fused roofline), and node counts."""
    from protrain_fx.planner.problem import node_times
    from protrain_fx.profile.ops import op_signature

    out: dict = {}
    for phase, graph in (("forward", record.forward), ("backward", record.backward)):
        nodes = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
        times = node_times(nodes, machine, fused=True, op_times=op_times)
        sums = dict.fromkeys(KINDS, 0.0)
        counts = dict.fromkeys(KINDS, 0)
        timed = 0
        for n, t in times.items():
            sig = op_signature(n)
            kind = node_kind(str(n.target)) if sig is not None else "generated"
            sums[kind] += t
            counts[kind] += 1
            timed += sig is not None and bool(op_times) and sig in op_times
        out[phase] = {"seconds": sums, "nodes": counts, "timed_nodes": timed}
    return out


def trace(step_parts, steps: int) -> dict:
    """Kernel device seconds per phase and kind, the medians over ``steps`` traced steps; and the
    phases' wall times."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    walls = {"forward": [], "backward": [], "optimizer": []}
    marks = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.profiler.record_function("pt_forward"):
                loss = step_parts["forward"]()
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            with torch.profiler.record_function("pt_backward"):
                loss.backward()
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            with torch.profiler.record_function("pt_optimizer"):
                step_parts["optimizer"]()
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            walls["forward"].append(t1 - t0)
            walls["backward"].append(t2 - t1)
            walls["optimizer"].append(t3 - t2)
    events = prof.events()
    for e in events:
        if e.name in ("pt_forward", "pt_backward", "pt_optimizer") and e.device_type == torch.autograd.DeviceType.CPU:
            marks.append((e.time_range.start, e.time_range.end, e.name.removeprefix("pt_")))
    marks.sort()
    per: dict = {p: {k: 0.0 for k in KINDS} for p in walls}
    counts: dict = {p: {k: 0.0 for k in KINDS} for p in walls}
    names: dict = {p: {} for p in walls}
    for e in events:
        # the record_function ranges show on the device too (as annotations): not kernels
        if (e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False)
                or e.name.startswith(("pt_", "Optimizer.step#"))):
            continue
        start = e.time_range.start
        phase = next((p for s, end, p in marks if s <= start <= end), None)
        if phase is None:
            continue
        dur = e.time_range.elapsed_us() * 1e-6
        kind = kernel_kind(e.name)
        per[phase][kind] += dur / steps
        counts[phase][kind] += 1 / steps
        names[phase][e.name] = names[phase].get(e.name, 0.0) + dur / steps
    top = {p: sorted(v.items(), key=lambda kv: -kv[1])[:12] for p, v in names.items()}
    try:
        gaps = gap_analysis(prof, steps)
    except Exception as exc:  # noqa: BLE001 - the raw events' interface moved: the rest still stands
        gaps = {"error": f"{type(exc).__name__}: {exc}"}
    return {"kernels_s": per, "kernels_per_step": counts, "wall_s": {p: statistics.median(v) for p, v in walls.items()},
            "top_kernels": top, "gaps": gaps}


def idle_time(kernels, launches, start: float, end: float) -> dict:
    """Where the device sat idle in one phase of one step: ``kernels`` are ``(start, end, name,
    correlation)`` of the phase's kernels (seconds, any order), ``launches`` maps a correlation to its
    launch call's ``(start, end)`` on the host, ``start``/``end`` the phase's host range.

    ``preamble_s``: from the phase's start to its first kernel; ``idle_s``: the time between kernels
    with none running; ``host_bound_s``: the part of it before kernels whose launch call began after
    the device had gone idle (the device waited for the host); ``by_kernel``: that part per name of
    the kernel that ended the wait; ``tail_s``: from the last kernel's end to the phase's end."""
    ks = sorted(kernels)
    out = {"preamble_s": 0.0, "idle_s": 0.0, "host_bound_s": 0.0, "gaps": 0, "tail_s": 0.0, "by_kernel": {}}
    if not ks:
        return out
    out["preamble_s"] = max(0.0, ks[0][0] - start)
    busy_until = ks[0][1]
    for k_start, k_end, name, corr in ks[1:]:
        if k_start > busy_until:
            gap = k_start - busy_until
            out["idle_s"] += gap
            out["gaps"] += 1
            launch = launches.get(corr)
            if launch is not None and launch[0] > busy_until:
                out["host_bound_s"] += gap
                out["by_kernel"][name] = out["by_kernel"].get(name, 0.0) + gap
        busy_until = max(busy_until, k_end)
    out["tail_s"] = max(0.0, end - busy_until)
    return out


def gap_analysis(prof, steps: int) -> dict:
    """:func:`idle_time` per phase of the traced steps (from the profiler's raw events: kernels matched
    to their launch calls by correlation), the means over the steps; ``by_kernel`` the 8 largest."""
    import torch

    events = prof.profiler.kineto_results.events()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    phases = sorted((e.start_ns() * 1e-9, e.end_ns() * 1e-9, e.name().removeprefix("pt_")) for e in events
                    if e.device_type() == cpu and e.name() in ("pt_forward", "pt_backward", "pt_optimizer"))
    launches = {e.correlation_id(): (e.start_ns() * 1e-9, e.end_ns() * 1e-9) for e in events
                if e.device_type() == cpu and e.name().startswith("cu") and e.correlation_id()}
    kernels = [(e.start_ns() * 1e-9, e.end_ns() * 1e-9, e.name(), e.correlation_id()) for e in events
               if e.device_type() == cuda and not e.is_user_annotation() and not e.name().startswith("pt_")]
    out: dict = {}
    for start, end, phase in phases:
        mine = [k for k in kernels if start <= k[0] <= end]
        got = idle_time(mine, launches, start, end)
        got["matched"] = sum(k[3] in launches for k in mine) / max(1, len(mine))
        acc = out.setdefault(phase, {"preamble_s": 0.0, "idle_s": 0.0, "host_bound_s": 0.0, "gaps": 0.0,
                                     "tail_s": 0.0, "matched": 0.0, "by_kernel": {}})
        for key in ("preamble_s", "idle_s", "host_bound_s", "gaps", "tail_s", "matched"):
            acc[key] += got[key] / steps
        for name, t in got["by_kernel"].items():
            acc["by_kernel"][name] = acc["by_kernel"].get(name, 0.0) + t / steps
    for acc in out.values():
        acc["by_kernel"] = dict(sorted(acc["by_kernel"].items(), key=lambda kv: -kv[1])[:8])
    return out


def protocol_rounds(record, machine, rounds: int, device: str = "cuda") -> dict:
    """The graphs' products and attention timed afresh ``rounds`` times under each of two protocols of
    ``profile.ops.time_node``: ``events`` (the profiler's: 5 calls back to back between two events) and
    ``prefilled`` (the same with the device kept busy while they are queued); per round and protocol,
    the estimate's seconds per phase and kind at those times (nothing cached is read or written)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from protrain_fx.profile.ops import distinct_calls, time_node, warm_clocks

    nodes = [*record.forward.graph.nodes, *record.backward.graph.nodes]
    calls = distinct_calls(nodes)
    device = torch.device(device)
    out: dict = {"events": [], "prefilled": []}
    with unset_fake_temporarily(), torch.no_grad(), torch.autocast(device.type, enabled=False):
        if device.type == "cuda":
            warm_clocks(device)
        for _ in range(rounds):
            for protocol in ("events", "prefilled"):
                times = {sig: time_node(node, device, 5, prefill=protocol == "prefilled")
                         for sig, node in calls.items()}
                est = estimate(record, machine, times)
                out[protocol].append({ph: est[ph]["seconds"] for ph in ("forward", "backward")})
    return out


def main() -> None:
    import peers
    import torch

    from protrain_fx import capture
    from protrain_fx import machine as machines
    from protrain_fx.backend import register
    from protrain_fx.planner.problem import device_op_times

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="760M")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--protocols", type=int, default=0, metavar="R",
                        help="also time the ops afresh R times under each timing protocol (protocol_rounds)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_trace.py needs CUDA")
    register()
    capture.reset()
    with torch.device("cuda"):
        model = peers.build_model(args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = torch.compile(model, backend="protrain", options={"auto_plan": False})
    idx, targets = peers.make_batch(args.size, args.batch, args.seq, "cuda")
    loss_fn = peers._loss_fn(run, args.size)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_fn(idx, targets)

    def opt():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compile, then warm
        forward().backward()
        opt()
    torch.cuda.synchronize()
    measured = trace({"forward": forward, "optimizer": opt}, args.steps)
    record = next(g for g in capture.captured_graphs() if g.backward is not None)
    machine = machines.machine_for(torch.device("cuda"))
    op_times = device_op_times(record)
    est = estimate(record, machine, op_times)
    result = {"size": args.size, "batch": args.batch, "seq": args.seq, "device": torch.cuda.get_device_name(),
              "measured": measured, "estimate": est}
    if args.protocols:
        result["protocols"] = protocol_rounds(record, machine, args.protocols)
    print(f"{args.size} B{args.batch}x{args.seq} on {result['device']}: ms per step (median of {args.steps})")
    print(f"{'phase':10} {'kind':10} {'kernels':>9} {'estimate':>9}")
    for phase in ("forward", "backward"):
        for kind in KINDS:
            m = measured["kernels_s"][phase][kind] * 1e3
            e = est[phase]["seconds"][kind] * 1e3
            print(f"{phase:10} {kind:10} {m:9.2f} {e:9.2f}")
        m = sum(measured["kernels_s"][phase].values()) * 1e3
        e = sum(est[phase]["seconds"].values()) * 1e3
        n = sum(measured["kernels_per_step"][phase].values())
        print(f"{phase:10} {'sum':10} {m:9.2f} {e:9.2f}   wall {measured['wall_s'][phase] * 1e3:.2f}, "
              f"{n:.0f} kernels")
    for phase, g in measured["gaps"].items():
        if phase == "error":
            print(f"gaps: {g}")
            continue
        print(f"{phase:10} device idle: {g['preamble_s'] * 1e3:.2f} ms before its first kernel, {g['idle_s'] * 1e3:.2f} "
              f"between kernels ({g['gaps']:.0f} gaps), {g['host_bound_s'] * 1e3:.2f} of it waiting for a launch, "
              f"{g['tail_s'] * 1e3:.2f} after the last (launches matched {g['matched']:.0%})")
        for name, t in g["by_kernel"].items():
            print(f"    {t * 1e3:7.3f} ms before {name[:100]}")
    for protocol, rounds in result.get("protocols", {}).items():
        for phase in ("forward", "backward"):
            cells = "  ".join(f"{r[phase]['products'] * 1e3:6.2f}/{r[phase]['attention'] * 1e3:5.2f}" for r in rounds)
            print(f"{protocol:10} {phase:9} products/attention ms per round: {cells}")
    print(f"optimizer kernels {sum(measured['kernels_s']['optimizer'].values()) * 1e3:.2f} ms, "
          f"wall {measured['wall_s']['optimizer'] * 1e3:.2f}")
    for phase, top in measured["top_kernels"].items():
        print(f"\n{phase}: largest kernels")
        for name, s in top:
            print(f"  {s * 1e3:8.3f} ms  {kernel_kind(name):9}  {name[:110]}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
