"""Train a small GPT through ``torch.compile(backend="protrain")`` and show where its memory goes.

    python examples/train_gpt.py                 # GPU if present (125M GPT), else CPU (small GPT)
    python examples/train_gpt.py --size 350M --steps 20 --out out/train
    python examples/train_gpt.py --offload --budget 1GiB   # parameters in chunks, counts chosen for 1 GiB

Prints the per-block table (parameters, saved activations, transient peak, node counts), the
predicted memory timeline of one step as text, loss and throughput per step, and the measured peak
next to the predicted one (GPU: the CUDA allocator; CPU: the profiler's allocation events). Writes
the predicted and measured timelines as memory snapshot pickles (open at
https://pytorch.org/memory_viz), a Chrome trace JSON and an SVG plot with both overlaid.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import protrain_fx  # noqa: E402  (only for inspection; the backend itself needs no import)
from examples.gpt import GPT, gpt_config, random_batch  # noqa: E402
from protrain_fx.analysis.readable import human_bytes, text_plot  # noqa: E402
from protrain_fx.backend import register  # noqa: E402
from protrain_fx.inspect.export import write_all  # noqa: E402
from protrain_fx.inspect.report import StepReport  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125M" if cuda else "small", help="GPT preset (examples/gpt.py SIZES)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8 if cuda else 4)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's block size")
    parser.add_argument("--codegen", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--budget", default=None, help="memory budget, e.g. 24GiB: the backend chooses the activation plan (with --plan: checked only)")
    parser.add_argument("--plan", default=None,
                        help="activation plan: 'swap=N,checkpoint=M' (ProTrain's interleaved layout), JSON text or a .json path")
    parser.add_argument("--offload", action="store_true",
                        help="parameters in chunks (protrain_fx.offload) with the counts left to the backend: "
                             "it chooses them with the plan for --budget (on a GPU without --budget: its free memory)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--out", type=Path, default=Path("out/train_gpt"))
    args = parser.parse_args(argv)

    register()  # a no-op once the package is installed (pip install -e .)
    if not cuda:  # a CUDA build of torch without a GPU warns that it found no CUDA runtime; the CPU run needs none
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    device = torch.device(args.device)
    config = gpt_config(args.size)
    seq_len = args.seq_len or config.block_size
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    if args.offload:
        if args.plan or (device.type != "cuda" and not args.budget):
            raise SystemExit("--offload: the backend chooses the plan with the counts (no --plan), and needs "
                             "--budget on a device without its own memory size")
        handle = protrain_fx.offload(model, optimizer, device=device,
                                     compute_dtype=torch.bfloat16 if device.type == "cuda" else None)
    options = {"codegen": args.codegen}
    if args.budget:
        options["memory_budget"] = args.budget
    if args.plan:
        options["plan"] = _plan(args.plan, config.n_layer)
    compiled = torch.compile(model, backend="protrain", options=options)
    batch = random_batch(config, args.batch_size, seq_len, device=device, generator=torch.Generator().manual_seed(0))
    print(f"GPT {args.size}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"batch {args.batch_size} x {seq_len}, {device}, codegen {args.codegen}")
    if args.plan:
        print(options["plan"].table([f"blocks.{i}" for i in range(config.n_layer)]))

    def step(mark=None) -> torch.Tensor:
        mark = mark or (lambda _phase: None)
        mark("forward")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = compiled(*batch)
        mark("backward")
        loss.backward()
        mark("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("end")
        return loss

    start = time.perf_counter()
    loss = step()
    print(f"step 1 (compiles): loss {loss.item():.4f}, {time.perf_counter() - start:.1f} s")
    if args.offload:
        print(f"chunks: {handle.n_persist} of {len(handle.layout.chunks)} on the {device.type}, "
              f"{handle.n_buffer} buffers, {handle.n_gpu_optim} offloaded chunks stepped there")
    report = StepReport(graphs=protrain_fx.captured_graphs())
    print()
    print(report.summary())
    predicted = report.timeline()
    print()
    print(text_plot(predicted))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens = args.batch_size * seq_len
    for i in range(2, args.steps + 1):
        start = time.perf_counter()
        loss = step()
        loss_value = loss.item()  # synchronises
        seconds = time.perf_counter() - start
        print(f"step {i}: loss {loss_value:.4f}, {1000 * seconds:.1f} ms, {tokens / seconds:,.0f} tokens/s")

    from protrain_fx.inspect.measure import mark_phase, record_cpu_memory, record_memory

    if device.type == "cuda":
        measured_peak = torch.cuda.max_memory_allocated()
        how = "torch.cuda.max_memory_allocated over the steps above"
        recorder = record_memory()
    else:
        recorder = record_cpu_memory()
        how = "CPU allocations of one step (profiler) over the tensors alive before it"
        if args.offload:  # the "device" is the host: the chunk store's steps allocate there too
            how += "; with --offload on the CPU this counts the chunk store's optimizer steps, not predicted"
    with recorder:  # one more step, with the allocator's history recorded and its phases marked
        step(mark_phase)
        if device.type == "cuda":
            torch.cuda.synchronize()
    measured = recorder.timeline()
    if device.type != "cuda":
        measured_peak = measured.peak_bytes
    error = (predicted.peak_bytes - measured_peak) / measured_peak
    print(f"\npeak: predicted {human_bytes(predicted.peak_bytes)}, measured {human_bytes(measured_peak)} "
          f"({how}), error {100 * error:+.1f}%")
    paths = write_all(predicted, args.out, measured=measured, stem=f"gpt_{args.size}",
                      title=f"GPT {args.size}, batch {args.batch_size} x {seq_len}, {args.codegen}")
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    return 0


def _plan(spec: str, n_layer: int):
    """``swap=N,checkpoint=M`` → ProTrain's interleaved layout over the GPT's blocks
    (``protrain_fx.plan.from_counts``); anything else (JSON text, a path) goes to ``parse_plan``."""
    from protrain_fx.plan import from_counts, parse_plan

    if "=" in spec and not spec.lstrip().startswith("{"):
        try:
            return from_counts(spec, [f"blocks.{i}" for i in range(n_layer)])
        except ValueError as e:
            raise SystemExit(f"--plan: {e}") from None
    return parse_plan(spec)


if __name__ == "__main__":
    raise SystemExit(main())

