"""The passes run on a captured training step, in order, and the runner that runs them.

Order (one line per pass; a comment where order matters):

On the joint graph, before partitioning:

0. ``annotate_plan`` — recompute / save tags from the plan (only with a plan; must run before the
   partitioner, which acts on the tags).

On the partitioned graphs:

1. ``attribute_blocks`` — block and phase of every forward/backward node (analysis; every later pass
   reads ``meta.BLOCK``).
2. ``swap_activations`` — saved values of swapped blocks go to host memory and come back (only with a
   plan that swaps; rewrites both graphs, so it runs before the memory analysis).
3. ``analyze_memory`` — liveness, timeline and peak of the whole step (analysis; needs blocks for its
   per-block table).

With Inductor, once it has compiled the graphs:

4. ``analyze_inductor_memory`` — the same analysis from Inductor's own allocation plan.

With a memory budget and no plan by hand (:func:`wants_auto_plan`), the backend runs steps 0-3 once per
plan it tries (``protrain_fx.autoplan``) and keeps the graphs of the plan it chose. Without a
``memory_budget``, a step on a CUDA device gets the memory the process can reach there as its budget
(:func:`resolve_budget`, :func:`device_budget_bytes`); ``auto_plan=False`` turns both off.

Parameter chunk rewrites join this list in later releases. The runner times each pass,
logs one line per pass, wraps errors with the pass name and, when ``PROTRAIN_DUMP_DIR`` is set, writes
the graphs after each pass into numbered files: ``<dir>/graph<N>/<NN>_<pass>_<forward|backward>.txt``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from fractions import Fraction
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.capture import CapturedGraph, PassRecord
from protrain_fx.machine import machine_for
from protrain_fx.passes.annotate import annotate_plan
from protrain_fx.passes.blocks import attribute_blocks, find_blocks
from protrain_fx.passes.inductor_memory import analyze_inductor_memory
from protrain_fx.passes.memory import analysis_device, analyze_memory
from protrain_fx.passes.gather import gather_pass
from protrain_fx.passes.param_casts import reads_offload_handle, recompute_param_casts
from protrain_fx.passes.swap import swap_pass
from protrain_fx.runtime import chunk_ops
from protrain_fx.readable import format_graph, readable_graphs

log = logging.getLogger("protrain_fx")

#: Environment variable naming a folder where graphs are dumped after every pass.
DUMP_DIR_ENV = "PROTRAIN_DUMP_DIR"


class PassRunner:
    """Runs passes on one captured graph: timing, logging, error context, dumps."""

    def __init__(self, record: CapturedGraph, dump_dir: str | None = None) -> None:
        self.record = record
        self.dump_dir = Path(dump_dir) / f"graph{record.index}" if dump_dir else None
        self.count = 0
        self.previous = "capture"

    def run(self, name: str, fn: Callable[[], Any], summary: Callable[[Any], str]) -> Any:
        start = time.perf_counter()
        try:
            result = fn()
        except ValueError as e:  # the user's settings (a plan naming an unknown block, ...): keep the type
            raise ValueError(f"protrain_fx: {e} (in pass {name!r} on graph {self.record.index})") from e
        except Exception as e:
            raise RuntimeError(
                f"protrain_fx: pass {name!r} failed on graph {self.record.index} (after {self.previous!r}): {e}"
            ) from e
        seconds = time.perf_counter() - start
        line = summary(result)
        self.record.passes.append(PassRecord(name, seconds, line))
        log.info("graph %d: %s (%.3f s): %s", self.record.index, name, seconds, line)
        self.previous = name
        self.dump(name)
        return result

    def dump(self, name: str) -> None:
        self.count += 1
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        graphs: list[tuple[str, fx.GraphModule | None]] = [
            ("forward", self.record.forward),
            ("backward", self.record.backward),
            ("inference", self.record.inference),
        ]
        if name == "capture":
            graphs = [("dynamo", self.record.dynamo_graph), ("joint", self.record.joint)] + graphs
        elif self.record.forward is None:  # a pass on the joint graph, before partitioning
            graphs = [("joint", self.record.joint)]
        for kind, gm in graphs:
            if gm is not None:
                path = self.dump_dir / f"{self.count:02d}_{name}_{kind}.txt"
                path.write_text(format_graph(gm, title=f"graph {self.record.index} {kind} after {name}"))


def run_joint_passes(record: CapturedGraph, *, parameter_names: set[str], num_fwd_outputs: int) -> None:
    """Passes on the joint graph, before the partitioner: the casts of an offloaded model's parameters
    recomputed in backward (``passes/param_casts.py``), then the plan written onto it."""
    if record.joint is not None and reads_offload_handle(record.real_inputs()):
        PassRunner(record, os.environ.get(DUMP_DIR_ENV) or None).run(
            "recompute_param_casts",
            lambda: recompute_param_casts(record.joint, frozenset(parameter_names)),
            lambda n: f"{n} parameter casts and views of them recomputed in backward",
        )
    plan = record.config.plan
    if plan is None or record.joint is None:
        return
    runner = PassRunner(record, os.environ.get(DUMP_DIR_ENV) or None)
    info = find_blocks([record.joint])
    runner.run(
        "annotate_plan",
        lambda: annotate_plan(
            record.joint,
            plan,
            info,
            parameter_names=frozenset(parameter_names),
            num_fwd_outputs=num_fwd_outputs,
        ),
        lambda n: f"{n} forward nodes tagged ({len(plan.blocks_with('checkpoint'))} checkpointed block(s), "
        f"{len(plan.tensors)} per-tensor override(s))",
    )


def run_step_passes(record: CapturedGraph, *, check: bool = True) -> None:
    """Run the pass list on a captured step (train graphs or an inference graph). ``check=False``
    skips the budget check (a trial run of the automatic plan, ``protrain_fx.autoplan``)."""
    if record.backward is None and any(chunk_ops.deferred(t) for t in record.real_inputs()):
        raise RuntimeError(
            f"protrain_fx: graph {record.index} (no backward: inference or no_grad) reads an offloaded model whose "
            "chunk counts are not chosen yet; they are chosen with the first training graph: run a training "
            "step first, or give n_persist / n_buffer to offload(...) by hand"
        )
    runner = PassRunner(record, os.environ.get(DUMP_DIR_ENV) or None)
    runner.count = len(record.passes)  # after the joint-graph passes' dumps
    runner.dump("capture")
    forward = record.forward if record.forward is not None else record.inference
    record.blocks = runner.run(
        "attribute_blocks",
        lambda: attribute_blocks(forward, record.backward),
        lambda info: f"{len(info.labels)} blocks of {info.layer_class or '-'} under {info.container or '-'}",
    )
    if forward is not None:  # an inference graph (no_grad, eval) reads offloaded chunks too
        record.gathered = runner.run(
            "gather_chunks",
            lambda: gather_pass(forward, record.backward, record.real_inputs()),
            lambda chunks: f"{len(chunks)} chunk gathers (offloaded parameters read from chunk buffers)",
        ) if _has_offloaded(record) else []
    plan = record.config.plan
    swaps = plan is not None and (plan.blocks_with("swap") or "swap" in plan.tensors.values())
    if swaps and record.backward is not None:
        record.swapped = runner.run(
            "swap_activations",
            lambda: swap_pass(
                record.forward,
                record.backward,
                plan,
                record.step.num_user_outputs,
                machine=machine_for(analysis_device(record.step), record.config.machine),
                slot_prefix=f"g{record.index}.",
                state_inputs=record.step.state_inputs,
            ),
            lambda swapped: f"{len(swapped)} saved values ({sum(s.nbytes for s in swapped) / 2**20:.1f} MiB) "
            "offloaded to host memory and reloaded for backward",
        )
    if record.step is not None:
        record.memory = runner.run(
            "analyze_memory",
            lambda: analyze_memory(
                record.step,
                optimizer_states_per_param=record.config.optimizer_states_per_param,
                label=f"graph {record.index}",
            ),
            lambda m: f"predicted peak {m.peak_bytes / 2**20:.1f} MiB on {m.device}"
            f" (params {m.parameter_bytes / 2**20:.1f}, saved {m.saved_activation_bytes / 2**20:.1f} MiB)",
        )
    record.readable = readable_graphs(record)
    if check and (record.config.codegen == "eager" or record.step is None or record.step.backward is None):
        check_budget(record)  # with Inductor: once its plan is known


def _has_offloaded(record: CapturedGraph) -> bool:
    graph = record.forward if record.forward is not None else record.inference
    return graph is not None and _reads_offloaded(record)


def _reads_offloaded(record: CapturedGraph) -> bool:
    """Whether the graph's inputs include parameters offloaded with ``protrain_fx.offload``."""
    return any(chunk_ops.offloaded(t) for t in record.real_inputs())


def reads_hand_offloaded(record: CapturedGraph) -> bool:
    """Whether the graph reads parameters offloaded with counts given by hand (the backend plans
    the activations of a model whose counts it chose itself: ``autooffload.choose_for_placed``)."""
    return any(
        found is not None and not chunk_ops.handle(found[0]).counts_chosen
        for found in map(chunk_ops.offloaded, record.real_inputs())
    )


def wants_auto_plan(record: CapturedGraph, *, budget_needed: bool = True) -> bool:
    """A memory budget (the user's or, after :func:`resolve_budget`, the device's), ``auto_plan`` on,
    no plan by hand and no parameter offloaded with counts by hand (those models keep the path they
    had; an offload whose counts the backend chose gets an activation plan for its chunks,
    ``autooffload.choose_for_placed``): the backend chooses the activation plan
    (``protrain_fx.autoplan``). Asked before partitioning a train graph. ``budget_needed=False``: the
    same without the budget (``protrain_fx.what_fits`` also answers without one)."""
    config = record.config
    return (
        (config.memory_budget_bytes is not None or not budget_needed)
        and config.auto_plan
        and config.plan is None
        and not reads_hand_offloaded(record)
    )


def reachable_bytes(total_bytes: int, fraction: float, free_bytes: int, reserved_bytes: int) -> int:
    """What a process can still hold on a GPU: its per-process cap (``fraction`` of ``total_bytes``,
    which bounds what its caching allocator reserves), but no more than is physically there: the
    device's free bytes plus what this allocator already reserves (its cached blocks are free to it,
    not to ``cudaMemGetInfo``)."""
    return min(int(total_bytes * fraction), free_bytes + reserved_bytes)


def device_budget_bytes(device: str | torch.device) -> int | None:
    """The budget a step on ``device`` gets when the user gives none: :func:`reachable_bytes` from the
    CUDA runtime, read when the step is compiled; ``None`` for a device that is not CUDA (no budget:
    nothing is planned). Tests replace this function to plan a CPU step for a budget of their own."""
    limit = device_limit_bytes(device)
    if limit is None:
        return None
    index = _cuda_index(device)
    free, _total = torch.cuda.mem_get_info(index)
    return reachable_bytes(limit, 1.0, free, torch.cuda.memory_reserved(index))


def graph_device(gm: fx.GraphModule) -> torch.device:
    """The device holding most of the bytes of ``gm``'s inputs (parameters, batch); CPU if none."""
    weight: dict[torch.device, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            for t in meta.tensor_values(node):
                weight[t.device] = weight.get(t.device, 0) + meta.tensor_nbytes(t)
    return max(weight, key=weight.get) if weight else torch.device("cpu")


def resolve_budget(record: CapturedGraph, joint: fx.GraphModule) -> None:
    """Say where the step's budget comes from (``record.budget_source``), before partitioning: the
    user's ``memory_budget`` (``"user"``), else, when the backend would choose the plan (``auto_plan``
    on, no plan by hand, nothing offloaded), :func:`device_budget_bytes` of the device the step runs
    on (``"device"``; ``record.config`` then carries it as ``memory_budget_bytes``), else none. A
    ``memory_budget`` above what the process can reach on a CUDA device is lowered to that, with a
    warning: a plan that fits the larger number would run out of memory there."""
    config = record.config
    if config.memory_budget_bytes is not None:
        record.budget_source = "user"
        if not config.auto_plan or config.plan is not None:  # a budget only checked: as given
            return
        device = graph_device(joint)
        reachable = device_budget_bytes(device)
        if reachable is not None and config.memory_budget_bytes > reachable:
            log.warning(
                "protrain_fx: memory_budget %d bytes (%.4g GiB) is more than this process can reach on %s (%d bytes, "
                "%.2f GiB: its per-process cap, free memory and what it already holds); graph %d is planned for that",
                config.memory_budget_bytes, config.memory_budget_bytes / 2**30, device, reachable, reachable / 2**30,
                record.index,
            )
            record.config = dataclasses.replace(config, memory_budget_bytes=reachable)
        return
    if not config.auto_plan or config.plan is not None or reads_hand_offloaded(record):
        return
    budget = device_budget_bytes(graph_device(joint))
    if budget is not None:
        record.config = dataclasses.replace(config, memory_budget_bytes=budget)
        record.budget_source = "device"


#: The caching allocator reserves more than the tensors it holds (block rounding, fragmentation);
#: a budget (a memory cap) limits what it reserves. Measured on the H200 (docs/results.md,
#: 2026-11-30): reserved/allocated peaks of 1.015 (350M) to 1.07 (760M); two plans whose allocated
#: peak was predicted 4-5% under a 20 GiB cap ran out of memory.
ALLOCATOR_HEADROOM = 0.08


def _with_headroom(peak_bytes: int) -> Fraction:
    """``peak_bytes`` with :data:`ALLOCATOR_HEADROOM` on top, exactly (no float rounding at any size)."""
    return Fraction(peak_bytes) * (1 + Fraction(ALLOCATOR_HEADROOM).limit_denominator(10**6))


def budget_verdict(peak_bytes: int, budget_bytes: int) -> str:
    """``"fits"``, ``"tight"`` (the allocated peak fits, the allocator's usual headroom does not)
    or ``"over"``."""
    if _with_headroom(peak_bytes) <= budget_bytes:
        return "fits"
    return "tight" if peak_bytes <= budget_bytes else "over"


def allocated_cap_bytes(budget_bytes: int) -> int:
    """The largest allocated peak that :func:`budget_verdict` calls ``"fits"`` under ``budget_bytes``:
    the budget caps what the allocator reserves, and reserved runs up to ``ALLOCATOR_HEADROOM`` above
    allocated."""
    return math.floor(Fraction(budget_bytes) / _with_headroom(1))


def budget_for_peak(peak_bytes: int) -> int:
    """The smallest budget under which an allocated peak of ``peak_bytes`` ``"fits"`` (the inverse of
    :func:`allocated_cap_bytes`)."""
    return max(1, math.ceil(_with_headroom(peak_bytes)))


def device_limit_bytes(device: str | torch.device) -> int | None:
    """Bytes this process may allocate on a CUDA ``device``: its memory times the per-process
    fraction (``torch.cuda.set_per_process_memory_fraction``); None for other devices."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    index = _cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(index))


def _cuda_index(device: str | torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def check_budget(record: CapturedGraph) -> None:
    """Warn when the predicted peak, with the allocator's headroom, exceeds the memory budget, or,
    without one, the memory this process may use on the GPU (a run that will run out of memory)."""
    budget, memory = record.config.memory_budget_bytes, record.memory
    if memory is None:
        return
    what = "its memory budget"
    if getattr(record, "budget_source", None) == "device":
        what = f"the memory this process can reach on {memory.device}"
    if budget is None:
        budget = device_limit_bytes(memory.device)
        what = f"the memory this process may use on {memory.device}"
        if budget is None:
            return
    verdict = budget_verdict(memory.peak_bytes, budget)
    if verdict == "fits":
        return
    if getattr(record, "auto_plan", None) is not None:
        advice = "the automatic plan was chosen from the graph-level prediction, which said it fits"
    else:
        advice = "choose a plan by hand with options={'plan': ...}"
    log.warning(
        "protrain_fx: graph %d is predicted to need %.2f GiB (%.2f GiB with %.0f%% allocator headroom), "
        "%s %s of %.2f GiB (%s)",
        record.index,
        memory.peak_bytes / 2**30,
        memory.peak_bytes * (1 + ALLOCATOR_HEADROOM) / 2**30,
        100 * ALLOCATOR_HEADROOM,
        "over" if verdict == "over" else "at the edge of",
        what,
        budget / 2**30,
        advice,
    )


def refine_memory_for_inductor(record: CapturedGraph) -> None:
    """Replace the graph-level prediction by one read from Inductor's allocation plans.

    Called once Inductor has compiled the step's last graph (the backward graph is compiled at the
    first ``backward()``); the graph-level analysis stays in ``record.memory_unfused``.
    """
    if record.step is None or record.memory is None:
        return
    runner = PassRunner(record, os.environ.get(DUMP_DIR_ENV) or None)
    runner.count = len(record.passes) + 1
    if record.memory_unfused is None:
        record.memory_unfused = record.memory
    record.memory = runner.run(
        "analyze_inductor_memory",
        lambda: analyze_inductor_memory(
            record.step,
            record.inductor_plans,
            optimizer_states_per_param=record.config.optimizer_states_per_param,
            label=f"graph {record.index} (Inductor)",
        ),
        lambda m: f"predicted peak {m.peak_bytes / 2**20:.1f} MiB from Inductor's allocation plan "
        f"(graph-level: {record.memory_unfused.peak_bytes / 2**20:.1f} MiB)",
    )
    check_budget(record)
