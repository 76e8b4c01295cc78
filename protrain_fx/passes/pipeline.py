"""The passes, in order, and the runner that runs them: the only place their order lives.

A compile runs three lists, each at its own point of AOTAutograd's work:

* :data:`JOINT_PASSES`, on the joint forward+backward graph, before the min-cut partitioner (which
  acts on their recompute tags);
* :data:`STEP_PASSES`, on the partitioned forward and backward graphs (or the inference graph);
* :data:`LOWERED_PASSES`, once Inductor has lowered both graphs (its allocation plans read).

Every pass is one function ``name(ctx: PassContext) -> str | None`` whose name is its key: it reads
the graphs and what it needs from ``ctx`` (the record being compiled, the plan this compile runs,
handed in as an argument, and the :class:`RewrittenStep` so far), rewrites the graphs in place or
analyses them, adds what it found to the step (:meth:`PassContext.add`), and returns a one-line
summary (``None``: nothing to do here). Each declares what it reads and writes (:func:`contract`),
and the three lists are checked against those declarations when the package loads
(:func:`check_schedule`): the order is data, not a comment. The runner (:func:`run_passes`) times
each pass, logs its line, keeps a :class:`~protrain_fx.capture.PassRecord`, names the pass and the
one before it in any error, dumps the graphs after each pass when ``PROTRAIN_DUMP_DIR`` is set
(``<dir>/graph<N>/<NN>_<pass>_<forward|backward>.txt``), and returns the step as the passes left it:
the backend, which drives the compile, stores it in the record (the pipeline writes no record).

Debugging: ``PROTRAIN_DISABLE_PASSES=swap_activations,recompute_param_casts`` skips those rewrites
(the step runs as if they had nothing to do). Only rewrites can be disabled (:data:`REWRITES`); the
analyses feed the planner. An offloaded model needs ``gather_chunks``: without it, the graphs read
parameters that hold no bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.fx as fx

from protrain_fx import settings
from protrain_fx.analysis import blocks, inductor_memory, memory
from protrain_fx.analysis.blocks import BlockInfo
from protrain_fx.analysis.inductor_memory import GraphPlan
from protrain_fx.analysis.memory import MemoryAnalysis, StepGraphs
from protrain_fx.analysis.readable import format_graph, readable_graphs
from protrain_fx.capture import CapturedGraph, PassRecord
from protrain_fx.machine import machine_for
from protrain_fx.passes import annotate, gather, param_casts, swap
from protrain_fx.passes.gather import GatheredChunk
from protrain_fx.passes.swap import SwappedValue
from protrain_fx.plan import Plan
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.optim import device_adam

log = logging.getLogger("protrain_fx")

#: Environment variable naming a folder where graphs are dumped after every pass.
DUMP_DIR_ENV = settings.DUMP_DIR
#: Environment variable listing rewrites to skip, comma-separated (module docstring).
DISABLE_ENV = settings.DISABLE_PASSES


@dataclasses.dataclass(frozen=True)
class RewrittenStep:
    """One rewrite of a captured step for one plan: the graphs the backend hands the passes (the
    joint graph, then the partitioned ones and their :class:`~protrain_fx.analysis.memory.StepGraphs`,
    or the inference graph), what the passes found (blocks, gathers, swaps, the memory analyses,
    readable graphs, the passes run) and, once Inductor lowered the graphs, its allocation plans.
    Each stage of :func:`run_passes` returns a new one; the record shows the latest the backend
    stored (``capture.CapturedGraph``)."""

    joint: fx.GraphModule | None = None
    #: The activation plan the graphs run (``None``: none).
    plan: Plan | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    inference: fx.GraphModule | None = None
    step: StepGraphs | None = None
    blocks: BlockInfo | None = None
    memory: MemoryAnalysis | None = None
    #: The graph-level analysis, kept once Inductor's plans replace :attr:`memory`.
    memory_unfused: MemoryAnalysis | None = None
    passes: tuple[PassRecord, ...] = ()
    readable: Mapping[str, str] = dataclasses.field(default_factory=dict)
    swapped: tuple[SwappedValue, ...] = ()
    gathered: tuple[GatheredChunk, ...] = ()
    inductor_plans: Mapping[str, GraphPlan] = dataclasses.field(default_factory=dict)
    #: The step was loaded whole from AOTAutograd's cache (``aot_cache.py``): no graph was traced or
    #: rewritten in this process, and :attr:`memory` holds the figures kept with the compiled step
    #: (its peak, what is live at the start, per block), without a per-node timeline.
    from_aot_cache: bool = False


@dataclasses.dataclass
class PassContext:
    """What a pass is given: the record whose graphs it works on, and the plan this compile runs
    (``None``: none; the user's hand plan, or the one the planner is trying). ``parameter_names``
    and ``num_fwd_outputs`` describe the joint graph (AOTAutograd's static inputs and forward
    outputs) for the passes that run on it. ``result``: the step the passes start from (the
    record's latest when not given), replaced as each pass adds to it; :func:`run_passes` returns it."""

    record: CapturedGraph
    plan: Plan | None = None
    parameter_names: frozenset[str] = frozenset()
    num_fwd_outputs: int = 0
    result: RewrittenStep = None  # type: ignore[assignment]  # (set from the record when not given)

    def __post_init__(self) -> None:
        if self.result is None:
            self.result = self.record.rewritten if self.record.rewritten is not None else RewrittenStep()

    def add(self, **found: object) -> None:
        """The step with ``found`` (fields of :class:`RewrittenStep`) in place of what it had."""
        self.result = dataclasses.replace(self.result, **found)  # type: ignore[arg-type]


Pass = Callable[[PassContext], "str | None"]


def contract(*, reads: tuple[str, ...] = (), writes: tuple[str, ...] = ()) -> Callable[[Pass], Pass]:
    """What a pass reads and writes: fields of the :class:`RewrittenStep` (``forward``, ``blocks``,
    ``memory``...) and the states of the graphs a rewrite leaves (``graphs:gathered``).
    :func:`check_schedule` holds each list of passes to it: nothing is read before a pass (or the
    stage) provides it."""

    def mark(fn: Pass) -> Pass:
        fn.reads, fn.writes = frozenset(reads), frozenset(writes)  # type: ignore[attr-defined]
        return fn

    return mark


def check_schedule(passes: Sequence[Pass], given: frozenset[str], name: str) -> frozenset[str]:
    """Raise when a pass of ``passes`` reads what neither ``given`` (what the stage starts from) nor
    an earlier pass provides; what the list provides at its end, with ``given``."""
    have = set(given)
    for fn in passes:
        missing = sorted(fn.reads - have)  # type: ignore[attr-defined]
        if missing:
            raise RuntimeError(f"{name}: {fn.__name__} reads {', '.join(missing)}, which no pass before it provides "
                               f"(the order: {', '.join(f.__name__ for f in passes)})")
        have |= fn.writes  # type: ignore[attr-defined]
    return frozenset(have)


# ---------------------------------------------------------------------------- the passes


@contract(reads=("joint",), writes=("joint:casts recomputed",))
def recompute_param_casts(ctx: PassContext) -> str | None:
    """An offloaded model's parameter casts (and views of them) recomputed in backward, so the
    forward saves no bf16 copy of a weight (``passes/param_casts.py``)."""
    joint = ctx.result.joint
    if joint is None or not param_casts.reads_offload_handle(ctx.record.real_inputs()):
        return None
    n = param_casts.recompute_param_casts(joint, ctx.parameter_names)
    return f"{n} parameter casts and views of them recomputed in backward"


@contract(reads=("joint", "joint:casts recomputed"), writes=("joint:tagged",))
def annotate_plan(ctx: PassContext) -> str | None:
    """The plan's recompute / save tags on the joint graph (``passes/annotate.py``)."""
    plan, joint = ctx.plan, ctx.result.joint
    if plan is None or joint is None:
        return None
    n = annotate.annotate_plan(joint, plan, blocks.find_blocks([joint]),
                               parameter_names=ctx.parameter_names, num_fwd_outputs=ctx.num_fwd_outputs)
    return (f"{n} forward nodes tagged ({len(plan.blocks_with('checkpoint'))} checkpointed block(s), "
            f"{len(plan.tensors)} per-tensor override(s))")


@contract(reads=("forward", "backward"), writes=("blocks",))
def attribute_blocks(ctx: PassContext) -> str:
    """Block and phase of every node (``analysis/blocks.py``): every later pass reads ``meta.BLOCK``."""
    step = ctx.result
    forward = step.forward if step.forward is not None else step.inference
    info = blocks.attribute_blocks(forward, step.backward)
    ctx.add(blocks=info)
    return f"{len(info.labels)} blocks of {info.layer_class or '-'} under {info.container or '-'}"


@contract(reads=("forward", "backward", "blocks"), writes=("gathered", "graphs:gathered"))
def gather_chunks(ctx: PassContext) -> str | None:
    """Offloaded parameters read from chunk buffers, their gradients handed to the chunk store
    (``passes/gather.py``); an inference graph (no_grad, eval) reads offloaded chunks too."""
    step, real = ctx.result, ctx.record.real_inputs()
    forward = step.forward if step.forward is not None else step.inference
    if forward is None or not any(chunk_ops.offloaded(t) for t in real):
        return None
    gathered = tuple(gather.gather_pass(forward, step.backward, real))
    ctx.add(gathered=gathered)
    return f"{len(gathered)} chunk gathers (offloaded parameters read from chunk buffers)"


@contract(reads=("forward", "backward", "step", "blocks", "graphs:gathered"), writes=("swapped", "graphs:swapped"))
def swap_activations(ctx: PassContext) -> str | None:
    """Saved values of swapped blocks to host memory and back (``passes/swap.py``); rewrites both
    graphs, so it runs before the memory analysis."""
    plan, record, step = ctx.plan, ctx.record, ctx.result
    if plan is None or step.backward is None or not (plan.blocks_with("swap") or "swap" in plan.tensors.values()):
        return None
    assert step.forward is not None and step.step is not None
    swapped = tuple(swap.swap_pass(
        step.forward, step.backward, plan, step.step.num_user_outputs,
        machine=machine_for(memory.analysis_device(step.step), record.config.machine),
        slot_prefix=f"g{record.index}.", state_inputs=step.step.state_inputs,
    ))
    ctx.add(swapped=swapped)
    return (f"{len(swapped)} saved values ({sum(s.nbytes for s in swapped) / 2**20:.1f} MiB) "
            "offloaded to host memory and reloaded for backward")


@contract(reads=("step", "blocks", "graphs:gathered", "graphs:swapped"), writes=("memory",))
def analyze_memory(ctx: PassContext) -> str | None:
    """Liveness, timeline and peak of the whole step (``analysis/memory.py``), with what it counts of
    the offload handles the graphs gather from handed over as data."""
    record = ctx.record
    if ctx.result.step is None:
        return None
    step = dataclasses.replace(ctx.result.step, offload=_offload_facts(ctx.result.step),
                               held_gradients=record.config.accumulation_steps > 1)
    m = memory.analyze_memory(
        step, optimizer_states_per_param=record.config.optimizer_states_per_param,
        label=f"graph {record.index}")
    ctx.add(step=step, memory=m)
    return (f"predicted peak {m.peak_bytes / 2**20:.1f} MiB on {m.device} (params {m.parameter_bytes / 2**20:.1f}, "
            f"saved {m.saved_activation_bytes / 2**20:.1f} MiB)")


@contract(reads=("step", "memory", "inductor_plans"), writes=("memory", "memory_unfused"))
def analyze_inductor_memory(ctx: PassContext) -> str | None:
    """The same analysis from Inductor's own allocation plans (``analysis/inductor_memory.py``);
    the graph-level one stays in ``memory_unfused``."""
    record, step = ctx.record, ctx.result
    if step.step is None or step.memory is None:
        return None
    unfused = step.memory_unfused if step.memory_unfused is not None else step.memory
    m = inductor_memory.analyze_inductor_memory(
        step.step, dict(step.inductor_plans), optimizer_states_per_param=record.config.optimizer_states_per_param,
        label=f"graph {record.index} (Inductor)")
    ctx.add(memory=m, memory_unfused=unfused)
    return (f"predicted peak {m.peak_bytes / 2**20:.1f} MiB from Inductor's allocation plan "
            f"(graph-level: {unfused.peak_bytes / 2**20:.1f} MiB)")


def _offload_facts(step: memory.StepGraphs) -> dict[int, memory.OffloadFacts]:
    """What the memory analysis counts of each offload handle ``step``'s graphs gather chunks from."""
    gather_op = torch.ops.protrain.chunk_gather.default
    graphs = [g for g in (step.forward, step.backward) if g is not None]
    out = {}
    for hid in sorted({n.args[0] for g in graphs for n in g.graph.nodes if n.target is gather_op}):
        handle = chunk_ops.handle(hid)
        out[hid] = memory.OffloadFacts(
            compute_itemsize=handle.store.compute_dtype.itemsize, chunk_numel=handle.store.full_numel,
            n_buffer=handle.pool.n_buffer, fetch_staging_bytes=handle.pool.staging_bytes,
            device_step_staging_bytes=handle.device_adam.staging_bytes if handle.device_adam is not None else 0,
            n_gpu_optim=handle.n_gpu_optim, device_steps_in_flight=device_adam.MAX_IN_FLIGHT)
    return out


# ---------------------------------------------------------------------------- the order

#: Before the partitioner, which acts on their tags. recompute_param_casts first: a checkpointed
#: block's tags win over its casts'.
JOINT_PASSES: tuple[Pass, ...] = (recompute_param_casts, annotate_plan)
#: On the partitioned graphs. gather_chunks before the swap: its selection is built and tested on
#: graphs that read chunk buffers; the swap rewrites both graphs, so it comes before the analysis.
STEP_PASSES: tuple[Pass, ...] = (attribute_blocks, gather_chunks, swap_activations, analyze_memory)
#: Once Inductor has lowered both graphs.
LOWERED_PASSES: tuple[Pass, ...] = (analyze_inductor_memory,)

# The schedule, checked against the passes' contracts when the package loads. Each stage starts
# from what the backend hands it: the joint graph; the partitioned graphs (``step``); Inductor's
# allocation plans of them. A rewrite that is switched off (PROTRAIN_DISABLE_PASSES) leaves its
# graphs as they were, which is what "rewritten" means for a plan that has nothing for it to do.
_STEP = check_schedule(STEP_PASSES, frozenset({"forward", "backward", "step"}), "STEP_PASSES")
check_schedule(JOINT_PASSES, frozenset({"joint"}), "JOINT_PASSES")
check_schedule(LOWERED_PASSES, _STEP | {"inductor_plans"}, "LOWERED_PASSES")
#: The passes :data:`DISABLE_ENV` may name.
REWRITES = frozenset({"recompute_param_casts", "annotate_plan", "gather_chunks", "swap_activations"})


# ---------------------------------------------------------------------------- the runner


def disabled_passes() -> frozenset[str]:
    """The rewrites :data:`DISABLE_ENV` names; ``ValueError`` for a name that is not one."""
    names = settings.disabled_passes()
    unknown = sorted(names - REWRITES)
    if unknown:
        raise ValueError(f"{DISABLE_ENV}: {', '.join(unknown)} cannot be disabled; the rewrites that can: "
                         f"{', '.join(sorted(REWRITES))}")
    return names


def run_passes(passes: Sequence[Pass], ctx: PassContext) -> RewrittenStep:
    """Run ``passes`` in order on ``ctx``; the step as they left it (module docstring)."""
    record = ctx.record
    off = disabled_passes()
    dump_dir = settings.dump_dir()
    previous = ctx.result.passes[-1].name if ctx.result.passes else "capture"
    if dump_dir and passes is STEP_PASSES:
        _dump(record, ctx.result, dump_dir, "capture")
    for fn in passes:
        name = fn.__name__
        if name in off:
            log.info("graph %d: %s disabled (%s)", record.index, name, DISABLE_ENV)
            continue
        start = time.perf_counter()
        try:
            line = fn(ctx)
        except ValueError as e:  # the user's settings (a plan naming an unknown block, ...): keep the type
            raise ValueError(f"protrain_fx: {e} (in pass {name!r} on graph {record.index})") from e
        except Exception as e:
            raise RuntimeError(
                f"protrain_fx: pass {name!r} failed on graph {record.index} (after {previous!r}): {e}") from e
        if line is None:
            log.debug("graph %d: %s: nothing to do (%.3f s)", record.index, name, time.perf_counter() - start)
            continue
        seconds = time.perf_counter() - start
        ctx.add(passes=(*ctx.result.passes, PassRecord(name, seconds, line)))
        log.info("graph %d: %s (%.3f s): %s", record.index, name, seconds, line)
        previous = name
        if dump_dir:
            _dump(record, ctx.result, dump_dir, name)
    if passes is STEP_PASSES:
        step = ctx.result
        ctx.add(readable=readable_graphs(step.forward or step.inference, step.backward, record.index))
    return ctx.result


def _dump(record: CapturedGraph, step: RewrittenStep, dump_dir: str, name: str) -> None:
    """The graphs of ``step`` as they are after pass ``name``, numbered in the order of the dumps."""
    folder = Path(dump_dir) / f"graph{record.index}"
    folder.mkdir(parents=True, exist_ok=True)
    count = len({p.name.split("_", 1)[0] for p in folder.glob("*.txt")}) + 1  # this dump's number
    graphs: list[tuple[str, fx.GraphModule | None]] = [
        ("forward", step.forward), ("backward", step.backward), ("inference", step.inference)]
    if name == "capture":
        graphs = [("dynamo", record.dynamo_graph), ("joint", step.joint)] + graphs
    elif step.forward is None:  # a pass on the joint graph, before partitioning
        graphs = [("joint", step.joint)]
    for kind, gm in graphs:
        if gm is not None:
            (folder / f"{count:02d}_{name}_{kind}.txt").write_text(
                format_graph(gm, title=f"graph {record.index} {kind} after {name}"))
