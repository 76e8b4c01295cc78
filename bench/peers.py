"""Side-by-side benchmark of protrain_fx against the peers on the B24 protocol (../shared/anchors.md).

Each (size, system) trains in its own process (an OOM in one must not poison the next): the GPT of
``examples/gpt.py`` at batch 8 x 1024, bf16, AdamW, on a GPU capped at ``--cap-gib`` GiB with
``torch.cuda.set_per_process_memory_fraction`` (before anything is allocated), 2 warm-up steps and
``--steps`` timed steps. Per run: tokens/s, step time, peak allocated and reserved GPU memory, host
RAM peak, loss after the timed steps, MFU against the measured 786 TFLOP/s, or the OOM / crash and
its reason.

    python bench/peers.py --sizes 350M 760M --out OUT            # every system at each size
    python bench/peers.py --ladder --sizes 350M 760M 1.3B --out OUT  # per system, up to its first failure

DeepSpeed is benchmark-only and not on the GPU machine: build its wheel and its pure-Python needs
into the git-ignored ``.whl/`` as ``../shared/anchors.md`` says, carry ``.whl`` with the device call,
and start the command with ``python3 -m pip install -q --no-index --no-deps --target /tmp/site
.whl/*.whl && export PYTHONPATH=/tmp/site``; without it the ``deepspeed`` run records the import error.

Systems: protrain (``torch.compile(backend="protrain")``, today with no rewrites), eager, eager_ac
(every block checkpointed), compile, compile_amb0 / compile_amb05 (``activation_memory_budget`` 0 and
0.5), fsdp2 (FSDP2 ``CPUOffloadPolicy`` + AC, world size 1), deepspeed (ZeRO-3, parameters and
optimizer offloaded to CPU + AC; when importable). Writes ``OUT/peers.json``, ``OUT/peers.md`` and,
when matplotlib is there, ``OUT/peers_throughput.png`` and ``OUT/peers_largest.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("protrain", "eager", "eager_ac", "compile", "compile_amb0", "compile_amb05", "fsdp2", "deepspeed")
#: bf16 dense matmul rate measured on the H200 (anchors.md), the denominator of MFU.
PEAK_FLOPS = 786e12


def flops_per_token(cfg) -> float:
    """Model FLOPs per trained token: 6N for the weights plus attention scores (PaLM appendix B)."""
    from examples.gpt import num_params

    n = num_params(cfg) - cfg.block_size * cfg.n_embd  # position embeddings do no matmul
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def _checkpoint_blocks(model) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from examples.gpt import Block

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def build(system: str, cfg, device: str):
    """(step function, model) for one system; the step runs forward, backward and the optimizer."""
    import torch

    from examples.gpt import GPT

    if system == "fsdp2":
        return _build_fsdp2(cfg)
    if system == "deepspeed":
        return _build_deepspeed(cfg)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if system == "eager_ac":
        _checkpoint_blocks(model)
    if system == "eager" or system == "eager_ac":
        run = model
    elif system == "protrain":
        from protrain_fx.backend import register

        register()
        run = torch.compile(model, backend="protrain")
    else:
        budget = {"compile": None, "compile_amb0": 0.0, "compile_amb05": 0.5}[system]
        if budget is not None:
            torch._functorch.config.activation_memory_budget = budget
        run = torch.compile(model)

    return _train_step(run, optimizer, autocast=device if device == "cuda" else None), model


def _train_step(run, optimizer, autocast: str | None):
    """Forward (under bf16 autocast on ``autocast``'s device, if given), backward, optimizer step."""
    import contextlib

    import torch

    def step(idx, targets):
        ctx = torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = run(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _build_fsdp2(cfg):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from examples.gpt import GPT

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    # Materialise on the CPU, where CPUOffloadPolicy keeps parameters; to_empty unties the tied
    # embedding / LM head, so tie again before initialising (else the model is not the one the
    # other systems train: seen on 2026-11-30 as a higher loss).
    model.to_empty(device="cpu")
    model.tie_weights()
    model.reset_parameters()
    _checkpoint_blocks(model)
    policy = dict(
        offload_policy=CPUOffloadPolicy(pin_memory=True),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return _train_step(model, optimizer, autocast=None), model  # FSDP2's policy casts to bf16


def _build_deepspeed(cfg):
    import deepspeed  # benchmark-only peer; see anchors.md for carrying it to the GPU machine
    import torch

    from examples.gpt import GPT

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29518")):
        os.environ.setdefault(key, value)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "activation_checkpointing": {"partition_activations": False},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    _checkpoint_blocks(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(idx, targets):
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine


def run_one(size: str, system: str, *, steps: int, warmup: int, batch: int, seq: int, cap_gib: float,
            device: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from examples.gpt import gpt_config, random_batch

    cuda = device == "cuda"
    if cuda and cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    cfg = gpt_config(size)
    result: dict = {"size": size, "system": system, "cap_gib": cap_gib, "batch": batch, "seq": seq}
    try:
        step, _model = build(system, cfg, device)
        idx, targets = random_batch(cfg, batch, seq, device=device, generator=torch.Generator().manual_seed(0))
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(warmup):
            step(idx, targets)
        sync()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = step(idx, targets)
            sync()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        tokens_per_s = batch * seq / step_s
        result.update(
            status="ok",
            step_s=step_s,
            step_times_s=times,
            tokens_per_s=tokens_per_s,
            mfu=tokens_per_s * flops_per_token(cfg) / PEAK_FLOPS,
            loss=float(loss.item()),
        )
    except torch.OutOfMemoryError as e:
        result.update(status="OOM", reason=str(e).splitlines()[0][:300])
    except Exception as e:  # a crash is a result too: recorded with its reason
        result.update(status="crash", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                      traceback=traceback.format_exc()[-2000:])
    if cuda:
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    result["host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _spawn(size: str, system: str, args) -> dict:
    cmd = [sys.executable, __file__, "--run", size, system, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--seq", str(args.seq), "--cap-gib", str(args.cap_gib), "--device", args.device,
           "--out", str(args.out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"size": size, "system": system, "status": "crash", "reason": f"exit {proc.returncode}: {tail[0][:300]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["350M"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--ladder", action="store_true", help="per system, stop at its first failing size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--run", nargs=2, metavar=("SIZE", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        result = run_one(*args.run, steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq,
                         cap_gib=args.cap_gib, device=args.device)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for system in args.systems:
        for size in args.sizes:
            try:
                r = _spawn(size, system, args)
            except subprocess.TimeoutExpired:
                r = {"size": size, "system": system, "status": "timeout", "reason": f"over {args.timeout} s"}
            results.append(r)
            print(_row(r), flush=True)
            (args.out / "peers.json").write_text(json.dumps(results, indent=1))
            if args.ladder and r["status"] != "ok":
                break
    (args.out / "peers.md").write_text(markdown(results, args))
    print("\n" + markdown(results, args))
    plot(results, args.out)


def _row(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['size']:>5} {r['system']:>14}: {r['status']} ({r.get('reason', '')[:100]})"
    peak = r.get("peak_allocated_bytes")
    peak_text = f", peak {peak / 2**30:.2f} GiB" if peak else ""
    return (f"{r['size']:>5} {r['system']:>14}: {r['tokens_per_s'] / 1e3:7.1f}k tok/s, "
            f"{1000 * r['step_s']:.1f} ms, MFU {100 * r['mfu']:.1f}%{peak_text}, loss {r['loss']:.3f}")


def markdown(results: list[dict], args) -> str:
    """Tokens/s table (sizes x systems) and a detail table."""
    sizes = list(dict.fromkeys(r["size"] for r in results))
    systems = list(dict.fromkeys(r["system"] for r in results))
    cell = {(r["size"], r["system"]): r for r in results}

    def fmt(r: dict | None) -> str:
        if r is None:
            return "–"
        return f"{r['tokens_per_s'] / 1e3:.1f}k" if r["status"] == "ok" else r["status"]

    lines = [f"tokens/s, B24 (batch {args.batch} x {args.seq}, cap {args.cap_gib:g} GiB)", "",
             "| model | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    lines += [f"| {s} | " + " | ".join(fmt(cell.get((s, y))) for y in systems) + " |" for s in sizes]
    lines += ["", "| model | system | status | tok/s | step ms | MFU | peak alloc GiB | peak reserved GiB | host RAM GiB | loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append("| " + " | ".join(_detail(r)) + " |")
    return "\n".join(lines) + "\n"


def _detail(r: dict) -> list[str]:
    ok = r["status"] == "ok"

    def gib(key: str) -> str:
        return f"{r[key] / 2**30:.2f}" if r.get(key) else "–"

    return [
        r["size"],
        r["system"],
        r["status"] if ok else f"{r['status']}: {r.get('reason', '')[:80]}",
        f"{r['tokens_per_s'] / 1e3:.1f}k" if ok else "–",
        f"{1000 * r['step_s']:.1f}" if ok else "–",
        f"{100 * r['mfu']:.1f}%" if ok else "–",
        gib("peak_allocated_bytes"),
        gib("peak_reserved_bytes"),
        gib("host_peak_bytes"),
        f"{r['loss']:.3f}" if ok else "–",
    ]


def plot(results: list[dict], out: Path) -> None:
    """PNG plots (matplotlib, benchmark-only; skipped where it is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: no PNG plots")
        return
    sys.path.insert(0, str(ROOT))
    from examples.gpt import gpt_config, num_params

    systems = list(dict.fromkeys(r["system"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 5))
    for system in systems:
        pts = sorted((num_params(gpt_config(r["size"])) / 1e9, r["tokens_per_s"]) for r in results
                     if r["system"] == system and r["status"] == "ok")
        if pts:
            ax.plot(*zip(*pts), marker="o", label=system)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "peers_throughput.png", dpi=120)
    fig, ax = plt.subplots(figsize=(8, 4))
    largest = {}
    for system in systems:
        ok = [r["size"] for r in results if r["system"] == system and r["status"] == "ok"]
        largest[system] = max((num_params(gpt_config(s)) / 1e9 for s in ok), default=0.0)
    ax.barh(list(largest), list(largest.values()))
    ax.set_xlabel("largest size that trained (billions of parameters)")
    fig.tight_layout()
    fig.savefig(out / "peers_largest.png", dpi=120)


if __name__ == "__main__":
    main()
