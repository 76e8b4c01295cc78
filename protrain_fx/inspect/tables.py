"""The per-block table of a captured graph: what the step report, the plan's trace artifact and the
CLI print (``inspect/report.py``, ``inspect/structured.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import CapturedGraph
from protrain_fx.planner.budget import ALLOCATOR_HEADROOM, budget_verdict


def block_table(graph: CapturedGraph, seconds: Mapping[str, float] | None = None) -> str:
    """The per-block table of ``graph``: parameter, saved-activation and transient bytes and node counts per
    block, each block's share of ``seconds`` (measured, per block) where given, the budget's verdict and the
    automatic plan."""
    memory = graph.memory
    assert memory is not None
    seconds = dict(seconds or {})
    total_seconds = sum(seconds.values())
    header = ("block", "params", "saved act", "transient peak", "fw nodes", "bw nodes", "time")
    rows = []
    for b in memory.blocks:
        share = f"{100 * seconds[b.block] / total_seconds:.1f}%" if b.block in seconds else "-"
        rows.append(
            (
                b.block,
                human_bytes(b.parameter_bytes),
                human_bytes(b.saved_activation_bytes),
                human_bytes(b.transient_peak_bytes),
                str(b.forward_nodes),
                str(b.backward_nodes),
                share,
            )
        )
    rows.append(
        (
            "total",
            human_bytes(sum(b.parameter_bytes for b in memory.blocks)),
            human_bytes(sum(b.saved_activation_bytes for b in memory.blocks)),
            "",
            str(sum(b.forward_nodes for b in memory.blocks)),
            str(sum(b.backward_nodes for b in memory.blocks)),
            f"{1000 * total_seconds:.1f} ms" if seconds else "-",
        )
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    peak = memory.peak_entry
    lines = [
        f"graph {graph.index} ({memory.device}): predicted peak {human_bytes(memory.peak_bytes)}"
        + (f" at {peak.phase} node {peak.name} [{peak.block}]" if peak else ""),
        f"  parameters {human_bytes(memory.parameter_bytes)}, gradients {human_bytes(memory.gradient_bytes)}, "
        f"optimizer state {human_bytes(memory.optimizer_state_bytes)} ({graph.config.optimizer}), "
        f"inputs {human_bytes(memory.input_bytes)}, saved activations {human_bytes(memory.saved_activation_bytes)}",
        fmt(header),
        fmt(tuple("-" * w for w in widths)),
        *[fmt(r) for r in rows],
    ]
    budget = graph.budget_bytes
    if budget is not None:
        verdict = {
            "fits": "fits",
            "tight": f"TIGHT: the peak fits, the allocator's usual {100 * ALLOCATOR_HEADROOM:.0f}% headroom does not",
            "over": "DOES NOT FIT (" + ("choose a plan with options={'plan': ...})" if graph.blocks and graph.blocks.labels
                                       else "no repeated layers to checkpoint or swap: offload the parameters)"),
        }[budget_verdict(memory.peak_bytes, budget)]
        source = " (what this process can reach on the device)" if graph.budget and graph.budget.source == "device" else ""
        lines.insert(1, f"  budget {human_bytes(budget)}{source}: {verdict}")
        auto = getattr(graph, "auto_plan", None)
        if auto is not None:
            c = auto.config
            chunks = (f"n_persist={c.n_persist}, n_buffer={c.n_buffer}, n_gpu_optim={c.n_gpu_optim} of "
                      f"{len(auto.problem.chunks)} chunks; ") if auto.offload else ""
            cached = f", from the plan cache ({auto.cache_file})" if auto.from_cache else ""
            lines.insert(2, f"  automatic {'offload and ' if auto.offload else ''}activation plan ({auto.how}{cached}): "
                            f"{chunks}swap {', '.join(auto.plan.blocks_with('swap')) or '-'}; "
                            f"checkpoint {', '.join(auto.plan.blocks_with('checkpoint')) or '-'}; "
                            f"predicted step {auto.estimate.step_s * 1e3:.3f} ms")
            if phases := auto.phases_line():
                lines.insert(3, f"  {phases}")
    return "\n".join(lines)
