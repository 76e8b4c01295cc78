"""What the backend captured: one record per Dynamo graph, kept for inspection.

Each Dynamo graph handed to the backend becomes a :class:`CapturedGraph`: what Dynamo handed over
(:class:`Captured`, frozen), and what each phase of the compile returned, stored by the backend as
it comes: the rewrite of the step (the joint forward+backward graph and both partitioned graphs, or
the inference graph when no backward is needed, the blocks found, the memory analysis, and how long
each pass took), the resolved budget and the planner's choice.
``captured_graphs()`` lists them in capture order; several graphs mean graph breaks, whose reasons are
kept too.
"""

from __future__ import annotations

import types
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from protrain_fx.config import ProtrainConfig
from protrain_fx.state import STATE, compiling_beside

# The record is data only: the types of what later phases return are named in comments, not
# imported (capture sits below analysis, planner and passes).


@dataclass(frozen=True)
class PassRecord:
    """One pass run: its name, which graph(s) it ran on, seconds, and a one-line summary."""

    name: str
    seconds: float
    summary: str


@dataclass(frozen=True)
class GraphBreak:
    """One graph break: Dynamo's reason (its first line), where in the user's code it happened
    (``file:line in function``, ``""`` when Dynamo kept no stack), and the repeated layer the graph
    was inside when it broke (``"blocks.3"``; ``""`` outside every block). A break inside a block
    splits the blocks over several graphs, or leaves those after it to run outside the backend:
    they are then not in any plan."""

    reason: str
    where: str = ""
    inside_block: str = ""

    def line(self) -> str:
        where = f" at {self.where}" if self.where else ""
        inside = f", inside block {self.inside_block}" if self.inside_block else ""
        return f"{self.reason}{where}{inside}"


@dataclass(frozen=True)
class Budget:
    """The memory budget a step is planned and checked for, apart from the user's options
    (``planner.budget.resolve_budget``): ``bytes``, and where they came from: ``"user"``
    (``memory_budget``, lowered to what the process can reach on a CUDA device when above it) or
    ``"device"`` (none given: what the process could reach on the step's CUDA device when it was
    compiled)."""

    bytes: int
    source: str = "user"


@dataclass(frozen=True)
class Captured:
    """What Dynamo handed the backend for one graph, as it was handed: nothing later changes it."""

    index: int
    config: ProtrainConfig
    dynamo_graph: fx.GraphModule
    #: Reasons of the graph break that ended this graph (Dynamo counts a break before it compiles
    #: the graph the break ends); empty for a graph that ran to the end of the frame.
    graph_breaks_after: tuple[str, ...] = ()
    #: The same breaks with where they happened (:class:`GraphBreak`).
    breaks: tuple[GraphBreak, ...] = ()
    #: The Dynamo graph's example inputs (parameters first-class with inlined modules), tensors held
    #: weakly; AOTAutograd's flat inputs (``primals_*``) follow this order.
    example_inputs: tuple[Any, ...] = ()
    #: The code object whose Dynamo cache holds this graph (the frame Dynamo was compiling, or the
    #: resume function after a graph break): removing it from the cache makes the next call compile
    #: the graph again (``planner.first_step.record_first_step`` after a measured miss). ``None`` when
    #: the backend was called outside Dynamo.
    dynamo_code: types.CodeType | None = None

    def real_inputs(self) -> list[Any]:
        """The example inputs, or ``None`` for tensors no longer alive."""
        return [x() if isinstance(x, weakref.ref) else x for x in self.example_inputs]


def _captured(name: str) -> property:
    return property(lambda self: getattr(self.captured, name), doc=f"``captured.{name}`` (:class:`Captured`).")


def _rewritten(name: str, empty: Callable[[], Any] | None = None) -> property:
    """A field of the latest rewrite, ``None`` (or a new ``empty()``) before any; a container comes as
    a copy of its own (a list, a dict), so that what a reader does with it stays with the reader."""

    def get(self: CapturedGraph) -> Any:
        if self.rewritten is None:
            return empty() if empty is not None else None
        value = getattr(self.rewritten, name)
        return type(empty())(value) if empty is not None else value

    return property(get, doc=f"``rewritten.{name}`` (``passes.pipeline.RewrittenStep``).")


class CapturedGraph:
    """Everything known about one Dynamo graph that went through the backend: a read-only view of
    what was captured (:attr:`captured`) and of what the phases of its compile returned. Each phase
    returns its result to the backend, which alone stores them here (one compile drives one record):

    * :attr:`rewritten`: the graphs and analyses of the plan the step runs (the pass pipeline's
      ``passes.pipeline.RewrittenStep``: ``joint``, ``plan``, ``forward``, ``backward``,
      ``inference``, ``step``, ``blocks``, ``memory``, ``memory_unfused``, ``passes``,
      ``readable``, ``swapped``, ``gathered``, ``inductor_plans``, read here under their own names);
    * :attr:`budget`: the budget the step is planned and checked for (``planner.budget.resolve_budget``);
    * :attr:`auto_plan`: the planner's choice (``planner.result.AutoPlan``);
    * :attr:`probe_inductor`, :attr:`phases`: what the backend lends the planner while it chooses,
      and the seconds of the compile's phases.
    """

    def __init__(self, captured: Captured, rewritten: Any = None) -> None:
        self._captured = captured
        #: The latest rewrite of the step (``passes.pipeline.RewrittenStep``; ``None``: not compiled yet).
        self.rewritten = rewritten
        #: The budget the step is planned and checked for (:class:`Budget`); ``None``: none. The
        #: user's option stays in ``config.memory_budget_bytes``.
        self.budget: Budget | None = None
        #: The activation plan the backend chose from the memory budget, with its prediction
        #: (``planner.result.AutoPlan``); ``None`` without a budget, with a plan by hand or
        #: offloaded parameters.
        self.auto_plan: Any = None
        #: With ``verify="inductor"``, lent by the backend while it chooses a plan: lowers the graphs
        #: of the plan now in ``step`` with Inductor and returns the analysis of its allocation plans
        #: (``analysis.memory.MemoryAnalysis``), or ``None`` when that could not be done
        #: (``lowering.probe_inductor``).
        self.probe_inductor: Callable[[], Any] | None = None
        #: Seconds of each phase of this graph's compile, in the order they first ran
        #: (``progress.py``: ``capture``, ``planning``, ``ops``, ``machine``, ``search``, ``offload
        #: counts``, ``trial lowerings``, ``codegen``, ``aot cache``); a phase inside another counts
        #: only for itself, so they never overlap.
        self.phases: dict[str, float] = {}

    @property
    def captured(self) -> Captured:
        """What Dynamo handed the backend (frozen)."""
        return self._captured

    index = _captured("index")
    config = _captured("config")
    dynamo_graph = _captured("dynamo_graph")
    graph_breaks_after = _captured("graph_breaks_after")
    breaks = _captured("breaks")
    example_inputs = _captured("example_inputs")
    dynamo_code = _captured("dynamo_code")

    #: The joint forward+backward graph the plan was applied to.
    joint = _rewritten("joint")
    #: The activation plan the graphs run: the user's ``plan`` option, or the one the planner chose
    #: (``planner/``); ``None``: none.
    plan = _rewritten("plan")
    forward = _rewritten("forward")
    backward = _rewritten("backward")
    inference = _rewritten("inference")
    step = _rewritten("step")  # analysis.memory.StepGraphs
    blocks = _rewritten("blocks")  # analysis.blocks.BlockInfo
    #: The memory analysis of the step (``analysis.memory.MemoryAnalysis``). With Inductor, that of
    #: Inductor's plans once both graphs are compiled (the backward graph at the first
    #: ``backward()``), and :attr:`memory_unfused` keeps the graph-level one.
    memory = _rewritten("memory")
    memory_unfused = _rewritten("memory_unfused")
    #: The passes run on the graphs, in order (:class:`PassRecord`).
    passes = _rewritten("passes", list)
    #: Readable forward/backward graphs as they were after our passes (Inductor later rewrites the
    #: graph objects in place during its own lowering).
    readable = _rewritten("readable", dict)
    #: Saved values the plan swaps, with where their copies were placed (``passes.swap.SwappedValue``).
    swapped = _rewritten("swapped", list)
    #: Chunks of offloaded parameters gathered per graph (``passes.gather.GatheredChunk``).
    gathered = _rewritten("gathered", list)
    #: Inductor codegen: per phase, the allocation plan of its generated code
    #: (``analysis.inductor_memory.GraphPlan``).
    inductor_plans = _rewritten("inductor_plans", dict)
    #: The training step was loaded whole from AOTAutograd's cache: :attr:`plan` and :attr:`memory`
    #: are those kept with it, and no graph of it is here (``aot_cache.py``).
    from_aot_cache = _rewritten("from_aot_cache", bool)

    @property
    def budget_bytes(self) -> int | None:
        """:attr:`budget`'s bytes, ``None`` without a budget."""
        return self.budget.bytes if self.budget is not None else None

    @property
    def has_backward(self) -> bool:
        return self.backward is not None or self.from_aot_cache

    def real_inputs(self) -> list[Any]:
        """The example inputs, or ``None`` for tensors no longer alive."""
        return self.captured.real_inputs()

    def describe(self) -> str:
        kind = "train (forward+backward)" if self.has_backward else "inference / no backward"
        if self.from_aot_cache:
            kind += ", loaded from AOTAutograd's cache"
        elif self.forward is None and self.inference is None:
            kind = "not compiled yet"
        return f"graph {self.index}: {kind}, {len(self.dynamo_graph.graph.nodes)} Dynamo nodes"

    def __repr__(self) -> str:
        return f"CapturedGraph({self.describe()})"


def new_record(
    config: ProtrainConfig, dynamo_graph: fx.GraphModule, example_inputs: Sequence[Any] = (), *,
    inside_block: str = "",
) -> CapturedGraph:
    """Register a graph handed to the backend, with the graph break(s) Dynamo logged since the last
    one: the break that ends this graph. ``inside_block``: the block the graph's last operation ran
    in (``passes.blocks.block_at_end``), where such a break happened."""
    from torch._dynamo.utils import counters, graph_break_reasons

    state = STATE
    with state.lock:
        now = Counter(counters["graph_break"])
        new_breaks = tuple(reason for reason in now if now[reason] > state.breaks_seen[reason])
        state.breaks_seen.clear()
        state.breaks_seen.update(now)
        if len(graph_break_reasons) < state.break_stacks_seen:  # torch._dynamo.reset() cleared them
            state.break_stacks_seen = 0
        stacks = [r.user_stack for r in graph_break_reasons[state.break_stacks_seen:]]
        state.break_stacks_seen = len(graph_break_reasons)
        inside = inside_block if new_breaks else ""
        breaks = tuple(
            GraphBreak(reason.splitlines()[0] if reason else reason, _where(stacks[i] if i < len(stacks) else None),
                       inside)
            for i, reason in enumerate(new_breaks)
        )
        record = CapturedGraph(Captured(
            index=len(state.records),
            config=config,
            dynamo_graph=dynamo_graph,
            graph_breaks_after=new_breaks,
            breaks=breaks,
            example_inputs=tuple(weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in example_inputs),
            dynamo_code=_compiling_code(),
        ))
        state.records.append(record)
        return record


def _where(stack: Any) -> str:
    """``file:line in function`` of the innermost user frame of a Dynamo break stack."""
    if not stack:
        return ""
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


_PACKAGE_DIR = str(Path(__file__).parent)


def watch_break_lines() -> None:
    """Keep the user's line of each graph break Dynamo logs in ``STATE.break_lines`` under its reason's
    first line (installed once per process). A break that makes Dynamo skip a whole frame (one inside
    a loop over the blocks) leaves no graph and no entry in ``graph_break_reasons``, only its reason
    in Dynamo's counters: this line is what an error about it can name (``api._last_graph_break``).
    Frames of this package are passed over: Dynamo also traces our hooks around eager modules."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    original = InstructionTranslatorBase.log_graph_break
    if getattr(original, "protrain_watched", False):
        return

    def log_graph_break(self: Any, *args: Any, **kwargs: Any) -> Any:
        reason = kwargs.get("reason", args[1] if len(args) > 1 else "")
        exc = kwargs.get("exc", args[2] if len(args) > 2 else None)
        try:
            stack = getattr(exc, "real_stack", None) or torch._guards.TracingContext.extract_stack()
            if stack and not stack[-1].filename.startswith(_PACKAGE_DIR):
                for text in (str(exc), str(reason)):  # Dynamo's reason may wrap the break's own message
                    if text.strip():
                        STATE.break_lines[text.strip().splitlines()[0]] = _where(stack)
        except Exception:  # noqa: BLE001 -- a line not found must not change Dynamo's handling of the break
            pass
        return original(self, *args, **kwargs)

    log_graph_break.protrain_watched = True  # type: ignore[attr-defined]
    InstructionTranslatorBase.log_graph_break = log_graph_break


def _compiling_code() -> types.CodeType | None:
    """The code object Dynamo is compiling now (its root frame's), or ``None`` outside Dynamo; on
    the thread that compiles a graph again beside training, that graph's (``beside.py``)."""
    again = compiling_beside()
    if again is not None:
        return again
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # noqa: BLE001 -- no translator: called outside Dynamo
        return None


def captured_graphs() -> list[CapturedGraph]:
    """Records of all graphs the backend captured since the last :func:`reset`, in capture order."""
    with STATE.lock:
        return list(STATE.records)


def forget_records_after(count: int) -> None:
    """Forget the records captured after the first ``count`` (``what_fits``'s trial compile); later
    graphs are numbered from there again."""
    with STATE.lock:
        del STATE.records[count:]


def graph_break_reasons() -> list[str]:
    """Distinct graph-break reasons Dynamo logged while our graphs were captured."""
    with STATE.lock:
        return [r for rec in STATE.records for r in rec.graph_breaks_after]


def _seen_breaks_now() -> None:
    """After a reset: Dynamo's breaks so far belong to no graph of ours."""
    from torch._dynamo.utils import counters, graph_break_reasons

    STATE.breaks_seen.update(counters["graph_break"])
    STATE.break_stacks_seen = len(graph_break_reasons)


STATE.on_reset(_seen_breaks_now)


def reset() -> None:
    """Forget captured graphs and everything else the process keeps (``state.ProcessState.reset``);
    ``torch._dynamo.reset()`` is still needed to force recompilation."""
    STATE.reset()
