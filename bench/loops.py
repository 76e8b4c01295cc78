"""The training loops users write, through the backend, measured step by step on a capped GPU.

Each run trains in its own process (an OOM in one must not poison the next) on a GPU capped at
``--cap-gib`` with ``torch.cuda.set_per_process_memory_fraction``, bf16 autocast, fused AdamW, and
``memory_budget`` = the cap. Per step: wall time (the step's stream synced, as ``loss.item()`` syncs
it: work the step left on side streams, an offloaded chunk's optimizer step, overlaps the next one as
in a loop that logs its loss), the step's peak allocated bytes
(``max_memory_allocated`` from a reset before the forward to the end of ``optimizer.step()``: the
loss, backward and optimizer included), the loss, and the prediction in force for it (the newest
training graph's analysed peak plus what the code around the graph holds: measured by the backend
at that graph's first step, or before that what its plan keeps for it). Per run:
OOMs, recompiles (training graphs compiled beyond the first), tokens/s over the steps from the
third on, and the plan table.

A run is ``MODEL:SIZE:LOSS[:FLAGS]``: MODEL ``gpt`` (examples/gpt.py at a B24 size: 350M, 760M,
4.2B ...), ``llama`` or ``mistral`` (Hugging Face, 7B shapes: ``--hf-layers`` to cut them), LOSS
``inside`` (the model returns the loss) or ``outside`` (the model returns logits and the loop
computes ``F.cross_entropy(logits.float(), targets)``), FLAGS ``+``-joined: ``offload``
(``protrain_fx.offload`` without counts, built on ``meta``), ``clip`` (``clip_grad_norm_(..., 1.0)``
every step), ``said`` (with ``offload`` and ``clip``: ``offload(..., grad_clipping=True)``, the loop says
up front that it clips), ``inductor`` (plain ``torch.compile``, the reference: how much the loop itself costs),
``uncapped`` (no memory fraction and no budget given: the reference for a model that does not fit the cap),
``keys`` (Inductor's FX graph cache keys and what differs from the nearest earlier one, in the run's
``fx_cache_keys`` and its log as they come), ``graph`` (``verify="graph"``: plans judged by the graph-level
memory analysis, no trial lowering; a shorter start for a large model), ``counts=P/B/G`` (with ``offload``:
``n_persist``, ``n_buffer`` and ``n_gpu_optim`` by hand, the activation plan chosen for them), ``trace`` (after the timed steps, two more under ``torch.profiler``: the kernels and CPU ops by time and the
device's busy fraction, in the run's ``trace``).

Time to each step: every step's entry holds ``since_launch_s``, seconds from the run's process start
(before ``import torch``) to the step's end, and the run its compiles' phases (``phases``: one dict
per graph, ``CapturedGraph.phases``) and Inductor's own timers summed over the process
(``inductor_s``: ``torch._dynamo.utils.compilation_time_metrics``, the kernels' source written and
defined apart, and how many graphs Inductor lowered). A step's ``beside`` says whether a faster plan
compiled beside training (``protrain_fx/beside.py``) as it started or ended; the summary line gives
those steps' median time against the steps after the switch. With ``--cache-dir DIR`` each run has its own
Inductor, Triton and protrain_fx caches under ``DIR/<run>``, empty at its first run: a spec named
twice runs the second time on the caches the first left (a second launch).

    python bench/loops.py --runs gpt:350M:inside gpt:350M:outside --out OUT
    python bench/loops.py --runs gpt:4.2B:outside:offload llama:7B:inside:offload --batch 4 --seq 2048 --out OUT
    python bench/loops.py --device cpu --runs gpt:tiny:outside:offload+clip --seq 32 --out OUT   # dry run
    python bench/loops.py --device cpu --runs gpt:small:outside:inductor+uncapped gpt:small:outside --layers 24 \
        --seq 128 --steps 5 --cpu-budget 200MiB --cache-dir /tmp/caches --out OUT      # CPU time to step 5
    python bench/loops.py --runs gpt:760M:outside:inductor+clip+uncapped gpt:760M:outside:clip \
        gpt:760M:outside:clip --steps 5 --cache-dir /tmp/caches --out OUT    # first and second launch

Writes ``OUT/loops.json`` (every run, rewritten after each) and prints one line per run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Hugging Face configurations of the 7B shapes (``transformers`` keyword arguments).
HF_SHAPES = {
    "llama": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096),
    "mistral": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768),
    "llama13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                     intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096),
}


def parse_run(spec: str) -> dict:
    """``"gpt:760M:outside:offload+clip"`` → its fields (``ValueError`` naming what is wrong)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"run {spec!r}: expected MODEL:SIZE:LOSS[:FLAGS]")
    model, size, loss = parts[:3]
    flags = set(parts[3].split("+")) if len(parts) == 4 and parts[3] else set()
    counts = None
    for flag in [f for f in flags if f.startswith("counts=")]:
        flags.discard(flag)
        try:
            counts = tuple(int(k) for k in flag.removeprefix("counts=").split("/"))
        except ValueError:
            counts = ()
        if len(counts) != 3 or min(counts) < 0:
            raise ValueError(f"run {spec!r}: {flag!r}; expected counts=N_PERSIST/N_BUFFER/N_GPU_OPTIM, e.g. counts=4/3/6")
    if model not in ("gpt", *HF_SHAPES):
        raise ValueError(f"run {spec!r}: model {model!r}; accepted: gpt, {', '.join(HF_SHAPES)}")
    if loss not in ("inside", "outside"):
        raise ValueError(f"run {spec!r}: loss {loss!r}; accepted: inside, outside")
    unknown = flags - {"offload", "clip", "said", "inductor", "uncapped", "trace", "keys", "graph"}
    if unknown:
        raise ValueError(f"run {spec!r}: flags {sorted(unknown)}; accepted: offload, clip, said, inductor, uncapped, "
                         "trace, keys, graph")
    if "said" in flags and not {"offload", "clip"} <= flags:
        raise ValueError(f"run {spec!r}: 'said' tells offload(...) that the loop clips: it needs 'offload' and 'clip'")
    if "graph" in flags and "inductor" in flags:
        raise ValueError(f"run {spec!r}: 'graph' chooses how the protrain backend judges plans (no 'inductor')")
    if counts is not None and "offload" not in flags:
        raise ValueError(f"run {spec!r}: 'counts=' are offload(...)'s counts: it needs 'offload'")
    if {"offload", "inductor"} <= flags:
        raise ValueError(f"run {spec!r}: an offloaded model runs only through the protrain backend (no 'inductor')")
    return {"spec": spec, "model": model, "size": size, "loss": loss, "offload": "offload" in flags,
            "clip": "clip" in flags, "inductor": "inductor" in flags, "uncapped": "uncapped" in flags,
            "trace": "trace" in flags, "keys": "keys" in flags, "said": "said" in flags,
            "graph": "graph" in flags, "counts": counts}


def build(run: dict, args, device: str):
    """(model, loss_fn(model_or_compiled, idx, targets), vocab, init) for one run."""
    import torch

    if run["model"] == "gpt":
        from examples.gpt import GPT, gpt_config

        config = gpt_config(run["size"], **({"n_layer": args.layers} if args.layers else {}))
        where = "meta" if run["offload"] and device == "cuda" else device
        torch.manual_seed(0)
        with torch.device(where):
            model = GPT(config)
        init = model.init_parameter if where == "meta" else None

        def loss_fn(m, idx, targets):
            if run["loss"] == "inside":
                return m(idx, targets)
            logits = m(idx)
            return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

        return model, loss_fn, config.vocab_size, init
    import transformers

    shape = dict(HF_SHAPES[run["model"]])
    if args.hf_layers:
        shape["num_hidden_layers"] = args.hf_layers
    cls = transformers.MistralForCausalLM if run["model"] == "mistral" else transformers.LlamaForCausalLM
    config_cls = transformers.MistralConfig if run["model"] == "mistral" else transformers.LlamaConfig
    config = config_cls(**shape, use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("meta" if run["offload"] else device):
        model = cls(config)
    model.loss_type = "ForCausalLM"  # no graph break in the loss-type lookup

    def loss_fn(m, idx, targets):
        if run["loss"] == "inside":
            return m(input_ids=idx, labels=targets).loss
        logits = m(input_ids=idx).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                 targets[:, 1:].reshape(-1))

    return model, loss_fn, shape["vocab_size"], "model"


def prediction() -> dict:
    """The newest training graph's prediction in force: analysed peak and the plan's reserve."""
    import protrain_fx

    from protrain_fx.beside import waiting_graphs

    waiting = waiting_graphs()  # compiled beside training, not running yet
    records = [g for g in protrain_fx.captured_graphs()
               if g.backward is not None and g.memory is not None and g.index not in waiting]
    if not records:
        return {}
    record = records[-1]
    out = {"graphs": len(records), "predicted_graph_peak_bytes": record.memory.peak_bytes}
    auto = record.auto_plan
    if auto is not None:
        # what the code around the graph holds: measured by the backend at the graph's first step,
        # else what the plan kept for it
        outside = auto.peak_check.outside_bytes if auto.peak_check is not None else auto.reserve_bytes
        out.update(reserve_bytes=auto.reserve_bytes, reserve_source=auto.reserve_source, outside_bytes=outside,
                   predicted_step_peak_bytes=record.memory.peak_bytes + outside,
                   step_cap_bytes=auto.step_cap_bytes, config=auto.config.to_dict(), how=auto.how,
                   predicted_step_s=auto.estimate.step_s)
    return out


def step_check(auto) -> dict:
    """The backend's own step check of a plan: the period measured between training calls against
    the prediction, and where the period went (``planner.rates.StepPhases``); with the plan's
    config, the rates training reached and the cost model's ``Problem`` as it stands after the
    first steps (held steps learned), so that ``CostModel(Problem.from_dict(...))`` replays the
    prediction off the GPU."""
    check = auto.step_check
    rates = auto.training_rates
    out = {"predicted_step_s": auto.estimate.step_s, "fwd_s": auto.estimate.fwd_s, "bwd_s": auto.estimate.bwd_s,
           "opt_s": auto.estimate.opt_s, "config": auto.config.to_dict(),
           "training_rates": dataclasses.asdict(rates) if rates is not None else None,
           "problem": auto.problem.to_dict()}
    if check is not None:
        out.update(measured_step_s=check.measured_step_s, error_pct=check.error_pct,
                   predicted_priced_s=check.predicted_priced_s, priced_error_pct=check.priced_error_pct,
                   with_around_s=check.with_around_s, around_estimate_s=check.predicted_around_s,
                   first_estimate_s=check.first_estimate_s, first_estimate_error_pct=check.first_estimate_error_pct,
                   phases=None if check.phases is None else dataclasses.asdict(check.phases))
    return out


#: Inductor methods timed apart by ``inductor_timers`` (``module:Class.method``): a kernel's source
#: written, and defined (its file written, its compile started). Missing ones are skipped.
KERNEL_TIMERS = ("torch._inductor.codegen.triton:TritonKernel.codegen_kernel",
                 "torch._inductor.codegen.triton:TritonScheduling.define_kernel",
                 "torch._inductor.codegen.cpp:CppScheduling.define_kernel",
                 "torch._inductor.codegen.simd:SIMDScheduling.codegen_node_schedule_with_kernel")


def inductor_timers() -> dict:
    """Start timing :data:`KERNEL_TIMERS`; the returned dict collects ``{name: [seconds, calls]}``."""
    import functools
    import importlib

    seen: dict = {}
    for spec in KERNEL_TIMERS:
        module_name, qual = spec.split(":")
        cls_name, method = qual.split(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
            original = getattr(cls, method)
        except (ImportError, AttributeError):
            continue

        def timed(*a, __original=original, __name=qual, **k):
            start = time.perf_counter()
            try:
                return __original(*a, **k)
            finally:
                entry = seen.setdefault(__name, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        setattr(cls, method, functools.wraps(original)(timed))
    return seen


def inductor_seconds(kernel_timers: dict) -> dict:
    """Inductor's own timers summed over this process (``compilation_time_metrics``) and
    :func:`inductor_timers`'s, as ``{name: {"s": seconds, "calls": n}}``."""
    from torch._dynamo.utils import compilation_time_metrics

    out = {name: {"s": round(sum(times), 3), "calls": len(times)} for name, times in compilation_time_metrics.items()}
    out.update({name: {"s": round(s, 3), "calls": n} for name, (s, n) in kernel_timers.items()})
    return out


def traced(train_step, cuda: bool, steps: int = 2) -> dict:
    """``steps`` training steps under ``torch.profiler``: the top kernels and CPU ops by their own
    time, and the device's busy time over the steps' wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    train_step()  # outside the trace: a warm step
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            train_step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    device_s = sum(e.self_device_time_total for e in events) / 1e6 / steps if cuda else 0.0
    top = sorted(events, key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total, reverse=True)
    return {"wall_s_per_step": wall, "device_busy_s_per_step": device_s,
            "top": [{"name": e.key[:120], "calls": e.count // steps, "device_ms": e.self_device_time_total / 1e3 / steps,
                     "cpu_ms": e.self_cpu_time_total / 1e3 / steps} for e in top[:40]],
            "top_cpu": [{"name": e.key[:120], "calls": e.count // steps, "cpu_ms": e.self_cpu_time_total / 1e3 / steps}
                        for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]]}


class CacheKeys:
    """Inductor's FX graph cache keys as a run computes them (the ``keys`` flag): for each key, the
    lines of its hash details (``torch._inductor.codecache.compiled_fx_graph_hash``'s debug log) that
    differ from those of the nearest key before it, printed as they come (a run stopped at its
    timeout keeps them in its log): why a lowering missed the cache that an earlier one filled."""

    PREFIX = "FX graph cache hash details for key "

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[str]]] = []
        self.entries: list[dict] = []

    @classmethod
    def install(cls) -> "CacheKeys":
        import logging

        keys = cls()
        handler = logging.Handler(logging.DEBUG)
        handler.emit = keys.emit  # type: ignore[method-assign]
        logger = logging.getLogger("torch._inductor.codecache")
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the details go here only, not to torch's own log handlers
        logger.addHandler(handler)
        return keys

    def emit(self, record) -> None:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return
        key, _, body = message[len(self.PREFIX):].partition(":\n")
        lines = body.splitlines()
        entry: dict = {"key": key, "lines": len(lines)}
        if self.seen:
            near_key, near = min(self.seen, key=lambda kl: len(set(lines) ^ set(kl[1])))
            theirs = set(near)
            differs = [line[:400] for line in lines if line not in theirs]
            # the fields' own lines first ("[hash] name: value"), then the graph code's
            differs.sort(key=lambda line: not line.startswith("["))
            entry.update(nearest=near_key, differs=differs[:40])
        self.seen.append((key, lines))
        self.entries.append(entry)
        print("fx cache key", json.dumps(entry), flush=True)


def run_one(run: dict, args) -> dict:
    """Train one run in this process; the result dict (never raises for a failed run)."""
    import logging

    import torch

    import protrain_fx
    from protrain_fx.backend import register
    from protrain_fx.beside import compiling_now

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("protrain_fx").setLevel(logging.INFO)  # the plan tables and first-step checks, in the log
    register()
    device = args.device
    cuda = device == "cuda"
    if cuda and not run["uncapped"]:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    kernel_timers = inductor_timers()
    keys = CacheKeys.install() if run["keys"] else None
    launched = args.launched_at or time.time()
    result: dict = {**run, "status": "ok", "steps": [], "device_name": torch.cuda.get_device_name() if cuda else "cpu"}
    try:
        model, loss_fn, vocab, init = build(run, args, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
        handle = None
        if run["offload"]:
            handle = protrain_fx.offload(model, optimizer, device=device, init=init,
                                         compute_dtype=torch.bfloat16 if cuda else None,
                                         available_host_bytes=int(args.host_gib * 2**30) if args.host_gib else None,
                                         spill_dir=args.spill_dir, grad_clipping=True if run["said"] else None,
                                         **({} if run["counts"] is None else dict(zip(
                                             ("n_persist", "n_buffer", "n_gpu_optim"), run["counts"]))))
        elif not cuda:
            pass
        options = {"memory_budget": f"{args.cap_gib}GiB"} if cuda else {"memory_budget": args.cpu_budget}
        if run["uncapped"]:
            options = {}
        if run["graph"]:
            options["verify"] = "graph"
        compiled = (torch.compile(model) if run["inductor"]  # the reference: plain torch.compile, no plan
                    else torch.compile(model, backend="protrain", options=options))
        generator = torch.Generator().manual_seed(0)

        def train_step():
            idx = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
            targets = idx if run["model"] != "gpt" else torch.roll(idx, -1, 1)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(compiled, idx, targets)
            loss.backward()
            if run["clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        for step in range(args.steps):
            if cuda:
                torch.cuda.current_stream().synchronize()
                torch.cuda.reset_peak_memory_stats()
            beside_before = compiling_now()
            start = time.perf_counter()
            loss = train_step()
            if cuda:  # as the loop's loss.item() does: the step's own stream, not the side streams'
                torch.cuda.current_stream().synchronize()  # optimizer work that overlaps the next forward
            entry = {"step": step, "s": time.perf_counter() - start, "since_launch_s": time.time() - launched,
                     "loss": float(loss.item()), "beside": beside_before or compiling_now(), **prediction()}
            if cuda:
                entry["peak_bytes"] = torch.cuda.max_memory_allocated()
                entry["reserved_bytes"] = torch.cuda.max_memory_reserved()
                if "predicted_step_peak_bytes" in entry:
                    entry["peak_error_pct"] = 100 * (entry["peak_bytes"] / entry["predicted_step_peak_bytes"] - 1)
            result["steps"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "config"}), flush=True)
        times = [e["s"] for e in result["steps"][2:]]
        if times:
            result["step_s"] = statistics.median(times)
            result["tokens_per_s"] = args.batch * args.seq / result["step_s"]
        graphs = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
        result["recompiles"] = max(0, len(graphs) - 1)
        result["plans"] = [g.auto_plan.table(g.index) for g in graphs if g.auto_plan is not None]
        result["step_checks"] = [step_check(g.auto_plan) for g in graphs if g.auto_plan is not None]
        result["phases"] = [dict(g.phases) for g in protrain_fx.captured_graphs()]
        if handle is not None:
            result["counts"] = {"n_persist": handle.n_persist, "n_buffer": handle.n_buffer,
                                "n_gpu_optim": handle.n_gpu_optim, "chunks": len(handle.layout.chunks),
                                "host_bytes": handle.store.host_bytes() if handle.store else 0,
                                "n_lean": handle.n_lean, "n_spill": handle.n_spill,
                                "disk_bytes": handle.store.spill_bytes if handle.store else 0,
                                "fill_s": handle.store.fill_s if handle.store else None}
            if handle.store is not None and handle.store.residency is not None:
                result["spill_io"] = handle.store.residency.stats()
        result["inductor_s"] = inductor_seconds(kernel_timers)
        counters = torch._dynamo.utils.counters["inductor"]
        result["fx_graph_cache"] = {"hit": counters["fxgraph_cache_hit"], "miss": counters["fxgraph_cache_miss"]}
        if keys is not None:
            result["fx_cache_keys"] = keys.entries
        if run["trace"]:
            result["trace"] = traced(train_step, cuda)
    except torch.OutOfMemoryError as e:
        result.update(status="OOM", reason=str(e).splitlines()[0][:600], traceback=traceback.format_exc()[-3000:])
    except Exception as e:  # noqa: BLE001 -- a failed run is a result
        result.update(status="error", reason=f"{type(e).__name__}: {str(e)[:1500]}",
                      traceback=traceback.format_exc()[-3000:])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--runs", nargs="+", required=True, help="MODEL:SIZE:LOSS[:FLAGS] (module docstring)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU cap and memory budget (GiB)")
    parser.add_argument("--cpu-budget", default="64MiB", help="memory budget of a --device cpu dry run")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--hf-layers", type=int, default=0, help="Hugging Face models: this many layers (0: all)")
    parser.add_argument("--layers", type=int, default=0, help="GPT: this many blocks instead of the size's (0: the size's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--host-gib", type=float, default=0.0, help="offload runs: host memory the chunk store may "
                        "use (GiB; 0: what the host has free); below the store's need, optimizer state spills to disk")
    parser.add_argument("--spill-dir", help="offload runs: the folder optimizer state spills to (default: "
                        "$PROTRAIN_SPILL_DIR, else the system's temporary folder)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--cache-dir", type=Path, help="each run's own Inductor, Triton and protrain_fx caches under "
                        "DIR/<run> (empty at a spec's first run, kept for its second)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this spec in this process
    parser.add_argument("--launched-at", type=float, default=0.0, help=argparse.SUPPRESS)  # internal: time.time()
    args = parser.parse_args(argv)
    if args.one:
        result = run_one(parse_run(args.one), args)
        (args.out / f"run_{os.getpid()}.json").write_text(json.dumps(result, indent=1))
        return 0
    runs = [parse_run(spec) for spec in args.runs]  # refuse a bad spec before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for run in runs:
        before = set(args.out.glob("run_*.json"))
        slug = re.sub(r"[^A-Za-z0-9.-]", "_", run["spec"])  # a file name: no "/" of counts=P/B/G
        env = dict(os.environ)
        if args.cache_dir is not None:
            caches = args.cache_dir / slug
            run["launch"] = "second" if caches.exists() else "first"
            env.update(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"),
                       PROTRAIN_CACHE_DIR=str(caches / "protrain"))
            caches.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        command = [sys.executable, __file__, "--one", run["spec"], "--runs", run["spec"], *_passed(args),
                   "--launched-at", repr(time.time())]
        with open(args.out / f"{slug}{'_' + run['launch'] if 'launch' in run else ''}.log", "w") as log:
            try:  # the log is written as it runs: a timeout keeps it
                proc = subprocess.run(command, timeout=args.timeout, stdout=log, stderr=subprocess.STDOUT, env=env)
            except subprocess.TimeoutExpired:
                proc = None
        made = sorted(set(args.out.glob("run_*.json")) - before)
        result = json.loads(made[0].read_text()) if made else {**run, "status": "crash" if proc else "timeout"}
        result.update({k: run[k] for k in ("launch",) if k in run})
        for path in made:
            path.unlink()
        result["wall_s"] = time.perf_counter() - started
        results.append(result)
        (args.out / "loops.json").write_text(json.dumps(results, indent=1))
        print(_line(result), flush=True)
    return 0


def _passed(args) -> list[str]:
    return ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--cap-gib",
            str(args.cap_gib), "--cpu-budget", args.cpu_budget, "--lr", str(args.lr), "--hf-layers",
            str(args.hf_layers), "--layers", str(args.layers), "--device", args.device, "--out", str(args.out),
            "--host-gib", str(args.host_gib), *(["--spill-dir", args.spill_dir] if args.spill_dir else [])]


def _line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['spec']}: {r.get('status')} {r.get('reason', '')[:200]}"
    errors = [e["peak_error_pct"] for e in r["steps"][1:] if "peak_error_pct" in e]
    worst = f", later steps' peak vs prediction {min(errors):+.1f}%..{max(errors):+.1f}%" if errors else ""
    tps = f"{r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else "-"
    if (r.get("counts") or {}).get("n_spill"):  # None for a run that offloads nothing
        c = r["counts"]
        tps += f", {c['n_spill']} chunk(s)' state on disk ({c['disk_bytes'] / 2**30:.2f} GiB)"
    steps = r["steps"]
    beside = [e["s"] for e in steps[1:] if e.get("beside")]
    if beside:  # steps that ran while a faster plan compiled beside them, against the later steps
        last = max(i for i, e in enumerate(steps) if i and e.get("beside"))
        later = [e["s"] for e in steps[last + 1:]]
        tps += (f", {len(beside)} step(s) beside a compile (median {statistics.median(beside):.2f} s"
                + (f" against {statistics.median(later):.2f} s after it)" if later else ")"))
    to = f", step 1 at {steps[0]['since_launch_s']:.0f} s, step {len(steps)} at {steps[-1]['since_launch_s']:.0f} s" if steps else ""
    launch = f" ({r['launch']} launch)" if "launch" in r else ""
    return f"{r['spec']}{launch}: ok, {tps}, {r.get('recompiles')} recompile(s){worst}{to}, wall {r['wall_s']:.0f} s"


if __name__ == "__main__":
    raise SystemExit(main())
