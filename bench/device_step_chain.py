"""Why the profiler's device-step rate misses training's: the same measurement
(``profiler.device_step_spans``, beside the CPU step and matrix products) read two ways, over
longer chains of steps, and with backward's re-fetch traffic beside it. GPU only.

    python bench/device_step_chain.py [--layouts 1.3B,4.2B] [--chunks 3,6,10] [--out FILE.json]

For each chunk layout (B24 GPT blocks: 1.3B's chunk is 2 blocks of width 2048, 100.7M parameters;
4.2B's 2 blocks of width 3072, 226.6M; 24 tensors each) and each number of device-stepped chunks per
round, it prints two rates of the bytes a step copies out (14 per parameter):

* ``round``: all the round's steps over the round's span, first copy in to last copy out: what
  ``profiler._device_step_bytes_per_s`` takes (with 3 chunks) and the cost model prices with;
* ``step``: each step's bytes over its own span (the median over the timed steps): what
  ``calibrate.RateWindow`` takes from training's steps.

Variants (``--variants``), each at every ``--chunks`` count:

* ``plain``: the profiler's: matrix products beside the steps once the last one is issued, nothing
  while the issuing thread waits for room for the next step;
* ``refetch``: and one chunk's compute-dtype working copy (2 bytes per parameter) copied in on a
  stream of its own before each step, as backward re-fetches the next chunk while the steps run;
* ``waiting``: products also while the issuing thread waits (backward's kernels run beside every
  step in training);
* ``deep_waiting``: a kernel queue about 48 deep (products and memory-bound kernels), not drained
  when the load returns, also while waiting;
* ``block`` / ``block_waiting``: in place of 8192^3 products, the kernels of one GPT block of the
  layout's width recomputed and differentiated (B24: 8 x 1024 tokens, heads of 128; its four
  products forward and both gradients, causal attention forward and backward, layer norm, GELU),
  over and over: the nineteenth session found 1.3B's device steps ran 36 ms beside its own backward
  and 40-46 ms beside 8192^3 products, so the load's own size matters.

The question (eighteenth session): at 4.2B's layout the profile read 45.7-46.7 GB/s on five hosts of
six where training reached 39.2-41.8; at 1.3B's it read 34.5-35.3 where training reached 36.6-40.5.
Longer chains use more pinned memory (``(chunks + 1) * 18`` bytes per parameter), which also tests
whether a larger DMA working set slows the copies (training pins about 46 GB at 4.2B, the profile 16).

What it found (nineteenth session, ``docs/results.md``): longer chains read higher, not lower (more
of their steps run with nothing beside them); with products beside, none of ``plain``, ``waiting``,
``deep_waiting`` and ``refetch`` read like training at both layouts (at 1.3B's all read 8-12% low on
the host where both layouts trained). Twentieth session, each step's own span against the same
host's training (1.3B / 4.2B, GB/s): on one host ``plain`` 35.7 / 42.2 and ``block`` 40.6 / 42.2
where training reached 40.3 / 41.1; on another ``plain`` 32.9 / 39.9, ``block`` 38.8 / 41.7 and
``ops`` 38.6 / 40.3 where it reached 35.3 / 41.9. The profiler took up ``ops``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: variant -> (what runs beside the steps, also while waiting, re-fetch copies) for ``device_step_spans``;
#: ``"block"``: :func:`block_backward_until` at the layout's width
VARIANTS = {
    "plain": ("matmul", False, False),
    "refetch": ("matmul", False, True),
    "waiting": ("matmul", True, False),
    "deep_waiting": ("deep_kept", True, False),
    "block": ("block", False, False),
    "block_waiting": ("block", True, False),
    "ops": ("ops", False, False),
}

#: B24 chunk layouts: 2 GPT blocks of this width per chunk (the auto plan's chunks at these sizes).
LAYOUTS = {"1.3B": 2048, "4.2B": 3072}


def block_parts(width: int, blocks: int = 2) -> list[int]:
    """Parameter sizes, in order, of ``blocks`` GPT blocks of ``width``
    (``bench/device_step_rate.gpt_parts``'s block: norms, QKV, projection, MLP)."""
    from bench.device_step_rate import gpt_parts

    return gpt_parts(1, width) * blocks  # one block fills at least one parameter


def block_backward_until(
    done, width: int, batch: int = 8, seq: int = 1024, head_dim: int = 128, device: str = "cuda"
) -> None:
    """Until ``done()``: the kernels of one GPT block of ``width`` (bf16, ``batch`` x ``seq`` tokens)
    as a checkpointed block's backward runs them, one block at a time (waiting for each): recompute
    (QKV, causal attention, projection, layer norm, MLP up, GELU, down), then each product's two
    gradient products, attention's backward, and GELU's and the norm's. On ``device`` (the tests
    run it on the CPU at a small width)."""
    import torch
    import torch.nn.functional as F

    d, t = width, batch * seq
    heads = d // head_dim
    kw = {"dtype": torch.bfloat16, "device": device}
    x = torch.randn(t, d, **kw)
    w = {"qkv": torch.randn(d, 3 * d, **kw) * d**-0.5, "proj": torch.randn(d, d, **kw) * d**-0.5,
         "up": torch.randn(d, 4 * d, **kw) * d**-0.5, "down": torch.randn(4 * d, d, **kw) * (4 * d) ** -0.5}
    ln_w = torch.ones(d, **kw)

    def heads_of(a):
        return a.view(batch, seq, heads, head_dim).transpose(1, 2)

    while not done():
        qkv = x @ w["qkv"]
        q, k, v = (heads_of(c).detach().requires_grad_() for c in qkv.split(d, dim=1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att2 = att.detach().transpose(1, 2).reshape(t, d)
        pre = (att2 @ w["proj"] + x).requires_grad_()
        n = F.layer_norm(pre, (d,), ln_w)
        h = (n.detach() @ w["up"]).requires_grad_()
        g = F.gelu(h, approximate="tanh")
        dout = torch.ones(t, d, **kw)
        _ = g.detach() @ w["down"]
        # backward: each product's two gradient products, GELU's, the norm's and attention's
        dg = dout @ w["down"].T
        _ = g.detach().T @ dout
        (dh,) = torch.autograd.grad(g, h, dg)
        dn = dh @ w["up"].T
        _ = n.detach().T @ dh
        (dpre,) = torch.autograd.grad(n, pre, dn)
        datt = dpre @ w["proj"].T
        _ = att2.T @ dpre
        grads = torch.autograd.grad(att, (q, k, v), datt.view(batch, seq, heads, head_dim).transpose(1, 2))
        dqkv = torch.cat([z.transpose(1, 2).reshape(t, d) for z in grads], dim=1)
        _ = dqkv @ w["qkv"].T
        _ = x.T @ dqkv
        if x.is_cuda:
            torch.cuda.current_stream().synchronize()


def block_nodes(width: int, device: str = "cuda", **shape: int) -> list:
    """The nodes of one pass of :func:`block_backward_until` at ``width`` (and its other ``shape``
    arguments), traced (``make_fx``, fake tensors): what ``opprofile.compute_load`` builds the
    profiler's load from, as it does from a captured model's forward and backward graphs."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def once(x):
        flags = iter([False, True])
        block_backward_until(lambda: next(flags), width=width, device=device, **shape)
        return x

    return list(make_fx(once, tracing_mode="fake")(torch.zeros(1, device=device)).graph.nodes)


def rates(n: int, chunks: int, round_spans: list[float], step_spans: list[float]) -> dict:
    """The two rates (bytes out per second) of a measurement: ``round`` the median round's
    ``chunks`` steps over its span, ``step`` the median step's own; and ``step_after_first`` the
    median over steps that are not first in their round (those wait behind no earlier step)."""
    out_bytes = 14 * n
    later = [s for i, s in enumerate(step_spans) if i % chunks]
    return {
        "round": chunks * out_bytes / statistics.median(round_spans),
        "step": out_bytes / statistics.median(step_spans),
        "step_after_first": out_bytes / statistics.median(later) if later else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="1.3B,4.2B", help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--chunks", default="3,6,10", help="device-stepped chunks per round, comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--variants", default="plain,refetch", help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    if unknown := [x for x in layouts if x not in LAYOUTS]:
        sys.exit(f"device_step_chain: unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    variants = [x for x in args.variants.split(",") if x]
    if not variants or (unknown := [x for x in variants if x not in VARIANTS]):
        sys.exit(f"device_step_chain: --variants must name some of: {', '.join(VARIANTS)}; got {args.variants!r}")
    counts = [int(x) for x in args.chunks.split(",") if x]
    if not counts or min(counts) <= 0:
        sys.exit(f"device_step_chain: --chunks must be positive counts, got {args.chunks!r}")

    import torch

    if not torch.cuda.is_available():
        sys.exit("device_step_chain: needs a GPU")
    from protrain_fx.opprofile import compute_load
    from protrain_fx.profiler import device_step_spans

    out: dict = {"device": torch.cuda.get_device_name(), "runs": []}
    for layout in layouts:
        parts = block_parts(LAYOUTS[layout])
        n = sum(parts)
        for k, variant in itertools.product(counts, variants):
            beside, waiting, refetch = VARIANTS[variant]
            if beside == "block":
                beside = functools.partial(block_backward_until, width=LAYOUTS[layout])
            elif beside == "ops":  # the profiler's load: the block's products and attention only
                load = compute_load(block_nodes(LAYOUTS[layout]), "cuda")
                if load is None:
                    sys.exit(f"device_step_chain: no op of the {layout} block could run as a load")
                beside = load[0]
            t = time.perf_counter()
            steps: list[float] = []
            spans = device_step_spans(n, k, args.repeat, cpu=True, beside=beside, parts=parts,
                                      while_waiting=waiting, step_spans=steps, refetch=refetch)
            run = {"layout": layout, "params": n, "chunks": k, "variant": variant, "refetch": refetch,
                   "round_spans_s": spans, "step_spans_s": steps, "wall_s": time.perf_counter() - t,
                   **rates(n, k, spans, steps)}
            out["runs"].append(run)
            print(f"{layout:>5} chunks {k:>2} {variant:>12}: round {run['round'] / 1e9:5.1f} GB/s, "
                  f"step {run['step'] / 1e9:5.1f}, step after the first {run['step_after_first'] / 1e9:5.1f} "
                  f"({run['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            if args.out:  # after each run: a deadline keeps what was measured
                Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
