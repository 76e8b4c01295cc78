"""Hugging Face 7B models trained through protrain_fx under a GPU memory budget.

Each model is built on the ``meta`` device with no pretrained weights, offloaded without counts
(``protrain_fx.offload(model, optimizer, compute_dtype=torch.bfloat16, init="model")``: the chunk
counts and the activation plan are the backend's to choose), compiled with ``memory_budget`` and
trained at batch ``--batch`` x ``--seq`` under bf16 autocast with AdamW, the way a user fine-tunes:
``compiled(input_ids=idx, labels=idx).loss``. The process is capped at the budget with
``torch.cuda.set_per_process_memory_fraction(budget / total)`` before anything is allocated, as
``bench/peers.py`` caps its runs.

Models (``--models``):

* ``llama7b``: ``LlamaForCausalLM`` with Llama-2-7B shapes (hidden 4096, 32 layers, 32 heads,
  intermediate 11008, vocab 32000);
* ``mistral7b``: ``MistralForCausalLM`` with Mistral-7B shapes (hidden 4096, 32 layers, 32 query
  heads and 8 key/value heads, intermediate 14336, vocab 32000; full attention, no sliding window);
* ``gpt6.7b``: the GPT of ``examples/gpt.py`` at the same width and depth (6.7B preset), its loss
  computed inside the model, for tokens/s beside the Hugging Face models.

``--layers N`` builds the same shapes with N layers (smaller, faster runs). Every model trains in
its own process (an out-of-memory error or a crash must not poison the next run). Initial weights
and batches depend on ``--seed`` only (``init="model"`` draws each parameter from its name and the
seed, wherever the backend places it), so two runs of one model under different budgets start
from the same weights and see the same batches: their losses can be compared (``--budget 24GiB``
against ``--budget 60GiB``, say).

Per run (JSON, ``--out``): the loss of every step, step times, tokens/s over steps 3 to N (each
step followed by a device sync), the peak allocated and reserved memory of the first step and of
the later ones, the chunk counts and the plan the backend chose (its table and trials), the host
store's size, compile time, and the error if the run failed (``NoPlanFits`` with its minimum
budget, out of memory, ...).

``--what-fits`` instead asks ``protrain_fx.what_fits`` for each model (no training): the plan and
chunk counts under the budget, the smallest budget and the host store they need (``llama13b``:
Llama-2-13B shapes, for that question).

    python bench/hf_models.py --out OUT/hf.json                       # llama7b, mistral7b, gpt6.7b at 24 GiB
    python bench/hf_models.py --models llama7b --budget 60GiB --out OUT/hf60.json   # the looser budget
    python bench/hf_models.py --models llama7b --layers 4 --steps 5 --out OUT/quick.json
    python bench/hf_models.py --what-fits --models llama13b --out OUT/fit13b.json
    python bench/hf_models.py --device cpu --models llama_tiny --batch 2 --seq 32 --steps 3 --out OUT/dry.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: ``transformers`` config keywords of the Hugging Face models.
HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama7b": ("LlamaForCausalLM", {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    }),
    "mistral7b": ("MistralForCausalLM", {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "sliding_window": None,
    }),
    "llama13b": ("LlamaForCausalLM", {
        "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
        "intermediate_size": 13824, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    }),
    "llama_tiny": ("LlamaForCausalLM", {  # CPU dry runs
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64,
    }),
}
#: GPT presets (``examples/gpt.py``) run beside them.
GPT_MODELS = {"gpt6.7b": "6.7B", "gpt_tiny": "tiny"}
DEFAULT_MODELS = ["llama7b", "mistral7b", "gpt6.7b"]


# ------------------------------------------------------------------------------------------- models


def build(name: str, layers: int | None, seq: int):
    """``(model, vocab_size, kind)`` on the meta device; ``kind`` is ``"hf"`` or ``"gpt"``."""
    import torch

    if name in GPT_MODELS:
        from examples.gpt import GPT, gpt_config

        overrides: dict[str, Any] = {"block_size": max(seq, 1024) if name != "gpt_tiny" else max(seq, 64)}
        if layers:
            overrides["n_layer"] = layers
        config = gpt_config(GPT_MODELS[name], **overrides)
        with torch.device("meta"):
            model = GPT(config)
        return model, config.vocab_size, "gpt"
    import transformers

    cls_name, kwargs = HF_MODELS[name]
    kwargs = dict(kwargs)
    if layers:
        kwargs["num_hidden_layers"] = layers
    config_cls = transformers.MistralConfig if cls_name.startswith("Mistral") else transformers.LlamaConfig
    config = config_cls(**kwargs, use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config)
    model.loss_type = "ForCausalLM"  # no graph break in the loss-type lookup (bench/peers.py)
    return model, config.vocab_size, "hf"


def batch(step: int, batch_size: int, seq: int, vocab: int, device: str):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


def num_params(model) -> int:
    return sum(p.numel() for p in dict.fromkeys(model.parameters()))


# ---------------------------------------------------------------------------------------- one run


def plan_info() -> dict[str, Any]:
    """What the backend chose for the training graph: the plan table, counts, predictions, trials."""
    import protrain_fx

    records = [g for g in protrain_fx.captured_graphs() if g.backward is not None and g.memory is not None]
    out: dict[str, Any] = {"graphs": len(protrain_fx.captured_graphs()), "train_graphs": len(records)}
    if not records:
        return out
    record = records[-1]
    out["analysed_peak_bytes"] = record.memory.peak_bytes
    a = record.auto_plan
    if a is None:
        return out
    with contextlib.suppress(Exception):
        out["table"] = a.table(record.index)
    out["auto_plan"] = {
        "config": a.config.to_dict(), "how": a.how, "budget_bytes": a.budget_bytes,
        "allocated_cap_bytes": a.allocated_cap_bytes, "predicted_step_s": a.estimate.step_s,
        "cost_model_peak_bytes": a.predicted_peak_bytes, "analysed_peak_bytes": a.analysed_peak_bytes,
        "judged_by": getattr(a, "judged_by", None), "choose_s": getattr(a, "choose_s", None),
        "swap_blocks": list(a.plan.blocks_with("swap")), "checkpoint_blocks": list(a.plan.blocks_with("checkpoint")),
        "trials": [(t.config.to_dict(), t.predicted_peak_bytes, t.analysed_peak_bytes) for t in a.trials],
    }
    for name in ("peak_check", "step_check", "replanned"):
        value = getattr(a, name, None)
        if value is not None:
            out["auto_plan"][name] = str(value.line()) if hasattr(value, "line") else repr(value)
    return out


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.models[0]`` in this process; returns its result (an error is a result too)."""
    import torch

    name = args.models[0]
    cuda = args.device == "cuda"
    result: dict[str, Any] = {"model": name, "budget": args.budget, "batch": args.batch, "seq": args.seq,
                              "layers": args.layers, "steps": args.steps, "device": args.device, "ok": False}
    started = time.perf_counter()
    import protrain_fx
    from protrain_fx.backend import register
    from protrain_fx.config import parse_bytes

    register()  # backend="protrain" from a source tree that is not installed

    budget = parse_bytes(args.budget)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        result["gpu"] = torch.cuda.get_device_name(0)
        result["gpu_total_bytes"] = total
    torch.manual_seed(args.seed)
    model, vocab, kind = build(name, args.layers, args.seq)
    result["params"] = num_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=cuda)
    init = model.init_parameter if kind == "gpt" else "model"
    handle = protrain_fx.offload(model, optimizer, device=args.device, compute_dtype=torch.bfloat16 if cuda else None,
                                 init=init)
    options: dict[str, Any] = {"memory_budget": budget}
    if not cuda:
        options["codegen"] = "eager"
    compiled = torch.compile(model, backend="protrain", options=options)
    result["build_s"] = time.perf_counter() - started
    losses, step_s, peaks, reserved = [], [], [], []
    autocast = torch.autocast(args.device, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    try:
        for step in range(args.steps):
            idx, targets = batch(step, args.batch, args.seq, vocab, args.device)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with autocast:
                loss = compiled(input_ids=idx, labels=idx).loss if kind == "hf" else compiled(idx, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()  # syncs with the device
            if cuda:
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
            losses.append(value)
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated())
                reserved.append(torch.cuda.max_memory_reserved())
            print(f"[{name}] step {step}: loss {value:.4f}, {step_s[-1]:.3f} s"
                  + (f", peak {peaks[-1] / 2**30:.2f} GiB" if peaks else ""), flush=True)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 -- the failure is the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_type"] = type(e).__name__
        cause = e
        while cause is not None:
            if hasattr(cause, "min_budget_bytes"):
                result["min_budget_bytes"] = cause.min_budget_bytes
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        result["traceback"] = traceback.format_exc()[-4000:]
    timed = step_s[2:] if len(step_s) > 2 else step_s
    tokens = args.batch * args.seq
    result.update(
        losses=losses, step_s=step_s, first_step_s=step_s[0] if step_s else None,
        median_step_s=statistics.median(timed) if timed else None,
        tokens_per_s=tokens / statistics.median(timed) if timed else None,
        first_step_peak_bytes=peaks[0] if peaks else None, later_peak_bytes=max(peaks[1:]) if len(peaks) > 1 else None,
        first_step_reserved_bytes=reserved[0] if reserved else None,
        later_reserved_bytes=max(reserved[1:]) if len(reserved) > 1 else None,
        counts={"n_persist": handle.n_persist, "n_buffer": handle.n_buffer, "n_gpu_optim": handle.n_gpu_optim,
                "n_lean": getattr(handle, "n_lean", None), "n_chunks": len(handle.layout.chunks),
                "chunk_bytes": handle.layout.chunk_bytes},
        host_store_bytes=handle.store.host_bytes() if handle.store is not None else 0,
        plan=plan_info(), wall_s=time.perf_counter() - started,
    )
    return result


def what_fits_one(args: argparse.Namespace) -> dict[str, Any]:
    """``protrain_fx.what_fits`` for ``args.models[0]`` offloaded without counts (no training)."""
    import torch

    import protrain_fx
    from protrain_fx.backend import register
    from protrain_fx.config import parse_bytes

    register()  # backend="protrain" from a source tree that is not installed
    name = args.models[0]
    cuda = args.device == "cuda"
    budget = parse_bytes(args.budget)
    result: dict[str, Any] = {"model": name, "budget": args.budget, "what_fits": True, "ok": False}
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    torch.manual_seed(args.seed)
    model, vocab, kind = build(name, args.layers, args.seq)
    result["params"] = num_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    t0 = time.perf_counter()
    try:
        protrain_fx.offload(model, optimizer, device=args.device, compute_dtype=torch.bfloat16 if cuda else None,
                            init=model.init_parameter if kind == "gpt" else "model")
        idx, targets = batch(0, args.batch, args.seq, vocab, args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            if kind == "hf":
                report = protrain_fx.what_fits(model, input_ids=idx, labels=idx, memory_budget=budget)
            else:
                report = protrain_fx.what_fits(model, idx, targets, memory_budget=budget)
        result.update(ok=True, report=str(report), fits=report.fits, min_budget_bytes=report.min_budget_bytes,
                      counts=report.counts, host_chunk_bytes=report.host_chunk_bytes,
                      host_swap_bytes=report.host_swap_bytes, predicted_peak_bytes=report.predicted_peak_bytes,
                      predicted_step_s=report.predicted_step_s)
        print(report, flush=True)
    except BaseException as e:  # noqa: BLE001 -- the failure is the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["wall_s"] = time.perf_counter() - t0
    return result


# ------------------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="JSON file to write (one entry per model)")
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=[*HF_MODELS, *GPT_MODELS],
                   help=f"models to run (default: {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--budget", default="24GiB", help="memory_budget, also the process' cap on the GPU (default 24GiB)")
    p.add_argument("--layers", type=int, default=None, help="layers of every model (default: its own)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20); tokens/s over steps 3 on")
    p.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batches (default 0)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda, or cpu for a dry run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per model's process (default 1800)")
    p.add_argument("--what-fits", action="store_true", help="ask protrain_fx.what_fits instead of training")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # this process runs one model
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.single:
        result = what_fits_one(args) if args.what_fits else run_one(args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0 if result.get("ok") else 1
    results = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        part = out.with_name(f"{out.stem}.{name}.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--single", "--models", name, "--out", str(part),
               "--budget", args.budget, "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
               "--lr", str(args.lr), "--seed", str(args.seed), "--device", args.device]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        if args.what_fits:
            cmd.append("--what-fits")
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout, env=os.environ.copy())
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if part.exists():
            result = json.loads(part.read_text())
        else:
            result = {"model": name, "ok": False, "error": f"the run's process ended ({code}) without a result"}
        result["exit"] = code
        result["process_s"] = time.perf_counter() - t0
        results.append(result)
        out.write_text(json.dumps(results, indent=1, default=str) + "\n")  # after every model: a cut call keeps them
    for r in results:
        if r.get("what_fits"):
            print(f"{r['model']}: {r.get('report') or r.get('error')}")
        else:
            tps = r.get("tokens_per_s")
            peak = r.get("later_peak_bytes") or r.get("first_step_peak_bytes")
            print(f"{r['model']}: {'ok' if r.get('ok') else 'FAILED ' + str(r.get('error', ''))[:300]}; "
                  f"tokens/s {tps:.0f}" if tps else "", f"peak {peak / 2**30:.2f} GiB" if peak else "",
                  f"losses {[round(x, 4) for x in r.get('losses', [])]}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
