"""The automatic activation plan: from ``options={"memory_budget": ...}`` to a plan the step runs.

For a train graph whose parameters all stay on the device (no ``protrain_fx.offload``), with a memory
budget and no plan by hand (``pipeline.wants_auto_plan``), the backend's partitioner calls
:func:`choose_plan` instead of partitioning once:

1. The step is partitioned and analysed with no plan, as without a budget.
2. If the analysed peak fits the budget (``pipeline.budget_verdict`` says ``"fits"``), that is the
   plan: nothing is rewritten.
3. Otherwise :func:`activation_problem` describes the step to the cost model and
   :func:`search_activation_plan` (``search.search(..., persist_all=True)``) finds the fastest
   ``(n_swap, n_checkpoint)`` whose predicted peak fits; the step is partitioned again with
   ``cost.block_plan`` of it (checkpoint tags on the joint graph, swap after partitioning), so the
   compiled function executes that plan.
4. The rewritten step is analysed again. If the analysis is above the cap after all (the cost model
   is an approximation), the search runs again with the cap lowered by the difference, a few times, and
   last the configs of least memory are tried (the cost model's least, then checkpointing every
   block: :func:`least_memory_configs`), each judged by the analysis. A searched plan that fits is a measure of the
   cost model's margin: the search runs again with the cap raised by it, and a plan predicted faster
   is kept if its analysis fits too; one analysed above the cap is left out and the search runs
   again under it, where the line through the two trials' peaks meets the cap (:func:`raised_choice`).
5. When nothing fits, :class:`~protrain_fx.search.NoPlanFits` (a ``ValueError``) is raised while
   compiling, before the step runs, naming the smallest budget in bytes and GiB.

Budget and allocator headroom. The budget caps what the caching allocator *reserves*; reserved ran
up to 7% above allocated on the H200 (``pipeline.ALLOCATOR_HEADROOM`` = 8%). Every comparison here is
against ``pipeline.allocated_cap_bytes(budget)`` = the largest allocated peak with 8% headroom under
the budget (``peak * 1.08 <= budget``), the same rule as the report's "fits". The search gets it as
``reserve_bytes = budget - allocated_cap_bytes(budget)``, so its ``min_budget_bytes`` (``minimum
predicted peak + reserve``) is close to, and is then replaced by, ``pipeline.budget_for_peak`` of
the minimum predicted peak: the smallest budget under which that peak fits with the headroom.

Where the budget comes from (``AutoPlan.budget_source``): the user's ``memory_budget`` (``"user"``),
or, with none and the step on a CUDA device, what this process can still reach there when the step is
compiled (``"device"``: ``pipeline.device_budget_bytes``, the per-process cap bounded by the free
memory plus what the caching allocator already holds). ``auto_plan=False`` turns both off.

Measured against predicted, time (every device): the starts of a planned graph's training calls 3 to 8
are timed (:data:`STEP_TIMED_CALLS`), and the median interval, the step period the user's loop runs
at, is logged against the cost model's step time (:class:`StepCheck`, ``AutoPlan.step_check``). The
period itself changes no plan. An offloaded step's CPU and device optimizer rates over the same
calls (``protrain_fx.calibrate``) may: on CUDA, ``n_gpu_optim`` is chosen again at those rates and a
faster count is applied to the running step (``AutoPlan.replanned``), whose next calls are timed
against its new prediction (``Replan.step_check``).

Measured against predicted, memory (CUDA, :func:`watch_first_step`). The first training call of a planned
graph is measured: ``torch.cuda.max_memory_allocated`` from the start of its forward to the end of
the backward pass it joins, against the analysis' peak (:class:`PeakCheck`, logged, kept in
``AutoPlan.peak_check``). The allocator's peak statistics are reset only when the compile itself
raised them (its measurements and trial placements run inside the user's first call, where no reset
of theirs can follow them); otherwise benchmarks and users read them over their own spans, and a
reset inside their step would lower what they see. So the peak is known only when the step raises
the process' peak (the usual first step; call ``torch.cuda.reset_peak_memory_stats()`` before it
after other work peaked higher), and is otherwise logged as not measured. The first step starts
without optimizer state (made at the first ``step()``), and memory outside the step (other
tensors, cuBLAS workspaces) is not the plan's: the step's measured rise above its start is put on
the predicted start (parameters, optimizer state, inputs) before comparing. The first step also
compiles the backward graph, so it can only measure high.

The code around the graph. A training graph's large outputs handed back to the user's code
(:func:`returned_outputs`: logits, when the loss is computed outside the compiled module) are what
that code computes on between the forward and the backward, outside the graphs the analysis sees.
A plan keeps :data:`OUTSIDE_BYTES_PER_ELEMENT` per element of them under its cap until a first step
has measured what the step holds above the graph's analysed peak (``PeakCheck.outside_bytes``);
then every later plan on that device keeps the measured bytes instead (:func:`outside_reserve`,
:func:`plan_cap`; the plan table names the outputs and the reserve). A first step above the
allocated cap is a miss: a warning names it, and the graph is removed from Dynamo's cache
(``remove_from_cache`` of the code object it was compiled for, ``CapturedGraph.dynamo_code``), so
its next call compiles it again with the measured reserve. The step that missed has already run;
the next one runs the new plan. A step under its cap whose reserve was the estimate is compiled
again the same way only when the measured reserve lets the cost model find a plan
:data:`RAISE_MIN_GAIN` faster (:func:`faster_plan_under`). An offloaded model keeps its chunk counts
(its optimizer state lives in the placed store): its activation plan is chosen again for the chunks
as placed.

What the cost model is told (:func:`activation_problem`): ``profiler.problem_from_record`` with
roofline block times (``passes/estimate.py``, with the ``machine`` option's constants; on CUDA the
matrix, convolution and attention nodes measured, ``profiler.device_op_times``), the swap
threshold the swap pass will use on this device (``Machine.min_swap_bytes``), and all parameters in
one chunk of exactly their size (every chunk persists: the padding a chunk layout adds would be
counted as memory the model does not use). The cost model keeps gradients and optimizer state live
for the whole step, where the analysis frees nothing but starts gradients in backward: its peak is
above the analysis' for these models (on the test GPT by 10-30%), so a plan it calls fitting fits the
analysis too, and the named minimum budget is one the backend can keep, not always the lowest one a
hand plan could reach.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import guard_int

from protrain_fx import cost
from protrain_fx.calibrate import RateWindow, Replan, TrainingRates, replan_gpu_optim
from protrain_fx.capture import CapturedGraph
from protrain_fx.cost import Config, CostModel, Estimate, Problem, block_plan, expected_estimate
from protrain_fx.machine import Machine, machine_for
from protrain_fx.passes.params import parameter_infos
from protrain_fx.pipeline import ALLOCATOR_HEADROOM, allocated_cap_bytes, budget_for_peak
from protrain_fx.plan import Plan
from protrain_fx.profiler import IN_STEP_SCALE, device_op_times, problem_from_record
from protrain_fx.readable import human_bytes
from protrain_fx.search import NoPlanFits, SearchResult, search

if TYPE_CHECKING:
    from protrain_fx.param_offload import OffloadHandle

log = logging.getLogger("protrain_fx")

#: Searches after a rewritten step analysed above the cap, before the least-memory config is tried.
MAX_SEARCHES = 3
#: Bytes per parameter a fused AdamW step moves through device memory (fp32: reads parameter,
#: gradient and two moments, writes parameter and two moments); gives the cost model a GPU Adam rate.
ADAM_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Trial:
    """One plan partitioned and analysed: its config, the cost model's peak, the analysis' peak
    (``by_inductor``: Inductor's allocation plan of the step, ``verify="inductor"``)."""

    config: Config
    predicted_peak_bytes: int
    analysed_peak_bytes: int
    by_inductor: bool = False


def judged_peak(record: CapturedGraph) -> tuple[int, bool]:
    """The peak the plan now in ``record`` is judged by, and whether Inductor's allocation plan gave
    it: the graph-level analysis' peak, or with ``verify="inductor"`` the peak of Inductor's plan of
    the same graphs (``record.probe_inductor``: one lowering of both graphs, as the compile lowers
    them). That plan is what runs: it can be below the graph-level peak (values Inductor never
    stores) or above it (a tiny offloaded GPT on the CPU: 2.82 MB against 2.59)."""
    assert record.memory is not None
    peak = record.memory.peak_bytes
    if record.probe_inductor is not None:
        probed = record.probe_inductor()
        if probed is not None:
            log.info("protrain_fx: a plan the graph-level analysis puts at %d bytes peaks at %d in "
                     "Inductor's allocation plan", peak, probed.peak_bytes)
            return probed.peak_bytes, True
    return peak, False


def judged_trial(record: CapturedGraph, config: Config, predicted_peak_bytes: int) -> Trial:
    """The :class:`Trial` of the plan now in ``record`` (:func:`judged_peak`)."""
    peak, by_inductor = judged_peak(record)
    return Trial(config, predicted_peak_bytes, peak, by_inductor)


#: Bytes a first step measured above its graph's analysed peak, per device, in this process (the
#: user's code around the graph, such as a loss on returned logits, and whatever the analysis did not
#: see; :func:`record_first_step`): later plans on that device keep that much under their cap
#: instead of an estimate (:func:`outside_reserve`). Cleared by ``protrain_fx.reset()``.
_MEASURED_OUTSIDE: dict[str, int] = {}
#: Devices whose next planned graph resets the peak statistics before its first step (a miss
#: made the process' peak there; :func:`watch_first_step`).
_RESET_AFTER_MISS: dict[str, bool] = {}


#: How far (a fraction of the allocated cap) a first step may peak above its cap before it counts
#: as a miss. The budget keeps 8% over the cap for the allocator (``ALLOCATOR_HEADROOM``; the
#: reserved peak ran 1.07x the allocated one for B24 760M on the H200), and a step that fits its
#: prediction exactly still varies by a few MiB between runs (a 2 GiB step on the H200 measured
#: 1.5 MiB, 0.07%, above its Inductor-judged prediction, 2026-12-01): compiling the graph again for
#: that would trade a kept step for a slower plan over noise. Half a percent stays inside the headroom.
MISS_TOLERANCE = 0.005


#: A training graph's outputs handed back to the user's code with a gradient to come (a tangent)
#: of at least this many bytes are where that code computes (a loss on logits): named in the plan
#: table, and what it holds at the step's peak is reserved (:data:`OUTSIDE_BYTES_PER_ELEMENT`).
LARGE_OUTPUT_BYTES = 16 * 2**20
#: Bytes per element of such an output kept under the cap for the user's code until a first step
#: measures it: a loss in fp32 on it (``F.cross_entropy(logits.float(), y)``) holds an fp32 copy and
#: its log-softmax at the forward's end, then the log-softmax and its gradient at the backward's
#: start, 8 bytes per element (docs/results.md, "Loss outside the compiled model"); a quarter more
#: for a loss with one more fp32 temporary.
OUTSIDE_BYTES_PER_ELEMENT = 10


@dataclass(frozen=True)
class ReturnedOutput:
    """A large output of a training graph returned to the user's code, which computes on it (a loss)
    outside the plan: its position among the graph's differentiable outputs, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def line(self) -> str:
        return f"output {self.index} ({'x'.join(map(str, self.shape))} {self.dtype}, {human_bytes(self.nbytes)})"


def returned_outputs(record: CapturedGraph) -> list[ReturnedOutput]:
    """The training graph's differentiable outputs of at least :data:`LARGE_OUTPUT_BYTES` (the
    backward graph's tangents: each gradient the user's code hands back), in order; none when one
    of them is a scalar: the loss is computed inside, and the large ones ride along unused (a
    Hugging Face model returns its logits beside the loss)."""
    step = record.step
    if step is None or step.backward is None:
        return []
    out = []
    tangents = [n for n in step.backward.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.numel() == 1 for n in tangents):
        return []
    for i, node in enumerate(tangents):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            nbytes = val.numel() * val.element_size()
            if nbytes >= LARGE_OUTPUT_BYTES:
                out.append(ReturnedOutput(i, tuple(int(d) for d in val.shape), str(val.dtype).replace("torch.", ""),
                                          int(nbytes)))
    return out


def outside_reserve(record: CapturedGraph) -> tuple[int, str]:
    """Bytes a plan of ``record`` keeps under its cap for the user's code around the graph, and
    where the number comes from: ``"measured"`` (a first step on this device, :data:`_MEASURED_OUTSIDE`),
    ``"outputs"`` (:data:`OUTSIDE_BYTES_PER_ELEMENT` per element of the large outputs returned to
    that code: an estimate, measured and corrected at the first step), or ``""`` (nothing to keep)."""
    assert record.memory is not None
    measured = _MEASURED_OUTSIDE.get(record.memory.device)
    if measured is not None:
        return measured, "measured"
    estimate = sum(OUTSIDE_BYTES_PER_ELEMENT * o.numel for o in returned_outputs(record))
    return (estimate, "outputs") if estimate else (0, "")


def plan_cap(record: CapturedGraph, budget: int) -> tuple[int, int, str]:
    """``(cap, reserve, source)``: the allocated peak a plan of ``record`` may reach under ``budget``
    (``pipeline.allocated_cap_bytes`` less :func:`outside_reserve`), the reserve and its source."""
    reserve, source = outside_reserve(record)
    return max(0, allocated_cap_bytes(budget) - reserve), reserve, source


def reserve_note(reserve: int, source: str) -> str:
    """For a refusal's minimum budget: the bytes it keeps for the user's code (``""`` without any)."""
    if not reserve:
        return ""
    why = {"measured": "measured above the plan in an earlier first step on this device",
           "outputs": "for the user's code on the outputs returned to it (a loss)"}.get(source, source)
    return f", and {human_bytes(reserve)} {why}"


@dataclass(frozen=True)
class PeakCheck:
    """The first training step of a planned graph, measured on the GPU, against its prediction.

    ``measured_peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the step (forward start to the
    end of its backward pass), ``measured_start_bytes`` ``torch.cuda.memory_allocated`` when the forward
    began; ``predicted_peak_bytes`` the analysis' peak and ``predicted_start_bytes`` what it has live
    before the step's first node (parameters, optimizer state, inputs). ``step_peak_bytes`` puts the
    measured rise on the predicted start (module docstring: the first step has no optimizer state yet,
    and memory outside the step is not the plan's); ``error_pct`` compares it with the prediction.
    ``over``: it is above ``allocated_cap_bytes``, the most the step was allowed (the plan's
    graph peak plus what it kept for the user's code), by more than :data:`MISS_TOLERANCE` of it.
    """

    predicted_peak_bytes: int
    predicted_start_bytes: int
    measured_peak_bytes: int
    measured_start_bytes: int
    allocated_cap_bytes: int

    @property
    def step_peak_bytes(self) -> int:
        return self.predicted_start_bytes + self.measured_peak_bytes - self.measured_start_bytes

    @property
    def error_pct(self) -> float:
        """Measured step peak against the prediction, in % of the prediction (positive: above)."""
        return 100 * (self.step_peak_bytes - self.predicted_peak_bytes) / max(1, self.predicted_peak_bytes)

    @property
    def over(self) -> bool:
        return self.step_peak_bytes > self.allocated_cap_bytes * (1 + MISS_TOLERANCE)

    @property
    def outside_bytes(self) -> int:
        """What the step held above the graph's analysed peak (the user's code around the graph,
        and what the analysis did not see; 0 when it stayed under the prediction)."""
        return max(0, self.step_peak_bytes - self.predicted_peak_bytes)

    def line(self) -> str:
        above = self.step_peak_bytes - self.allocated_cap_bytes
        noise = (
            f" ({100 * above / max(1, self.allocated_cap_bytes):.2f}% above it, inside the "
            f"{100 * MISS_TOLERANCE:.1f}% tolerance: not a miss)"
            if above > 0 and not self.over
            else ""
        )
        return (
            f"first step measured peak {human_bytes(self.step_peak_bytes)} against {human_bytes(self.predicted_peak_bytes)} "
            f"predicted ({self.error_pct:+.1f}%; max_memory_allocated {human_bytes(self.measured_peak_bytes)}, "
            f"{human_bytes(self.measured_start_bytes)} allocated at the start, "
            f"{human_bytes(self.predicted_start_bytes)} predicted there); allocated cap {human_bytes(self.allocated_cap_bytes)}"
            f"{noise}"
        )


#: Training calls of a planned graph whose starts are timed (:func:`watch_first_step`): the step
#: period is the median of the intervals between the starts of calls ``STEP_TIMED_CALLS[0]`` ..
#: ``STEP_TIMED_CALLS[1]`` (1-based), after the first (compiles) and second (warms the allocator
#: and the optimizer's state) have run.
STEP_TIMED_CALLS = (3, 8)
#: The clock of those starts (a test drives it).
_clock = time.perf_counter


@dataclass(frozen=True)
class StepCheck:
    """The step period of a planned graph measured in training against the cost model's step time.

    ``intervals_s``: wall-clock seconds between the starts of consecutive training calls of the graph
    (:data:`STEP_TIMED_CALLS`); their median is the measured period: the whole training step as the
    user's loop runs it (the optimizer, data loading, and with several graphs per step, the others).
    No synchronisation is added: in a steady state the host runs no further ahead of the device
    between two calls than before them. With several training calls per optimizer step (gradient
    accumulation) the interval is one micro-batch's, which the prediction (one call and one
    optimizer step) does not describe."""

    predicted_step_s: float
    intervals_s: tuple[float, ...]
    #: The training calls whose starts were timed (1-based, first and last).
    calls: tuple[int, int] = STEP_TIMED_CALLS

    @property
    def measured_step_s(self) -> float:
        return statistics.median(self.intervals_s)

    @property
    def error_pct(self) -> float:
        """The prediction against the measured period, in % of the measured (positive: predicted slower)."""
        return 100 * (self.predicted_step_s / self.measured_step_s - 1)

    def line(self) -> str:
        a, b = self.calls
        return (f"step period measured {self.measured_step_s * 1e3:.1f} ms (median between the starts of training "
                f"calls {a} to {b}) against {self.predicted_step_s * 1e3:.1f} ms predicted ({self.error_pct:+.1f}%)")


@dataclass
class AutoPlan:
    """The plan the backend chose for one graph, and why (``CapturedGraph.auto_plan``).

    ``plan`` lists every block (all ``"none"`` when the step fits as it is). ``predicted_peak_bytes``
    and ``estimate`` are the cost model's for ``config``; ``analysed_peak_bytes`` is the peak the plan
    was judged by: the memory analysis of the graphs as rewritten (``record.memory`` before Inductor
    refines it), or with ``judged_by == "inductor"`` (option ``verify``) Inductor's allocation plan
    of them (``empty_peak_bytes`` likewise).
    ``allocated_cap_bytes`` is what that peak had to stay under: the budget less the allocator's
    headroom (``step_cap_bytes``, what the whole step may reach) less ``reserve_bytes`` kept for the
    user's code around the graph (``reserve_source``: ``"outputs"``, estimated from ``returned``, the
    large outputs handed back to it; ``"measured"``, by an earlier first step on this device; ``""``,
    none: :func:`outside_reserve`). ``how``: ``"fits as
    is"``, ``"searched"`` or ``"least memory"``. ``trials``: every rewrite that was analysed, in order;
    ``search``: the last search's result. ``budget_source``: ``"user"`` (``memory_budget``) or
    ``"device"`` (none given: what the process could reach on its CUDA device). ``peak_check``: the
    first step measured on the GPU (:func:`watch_first_step`; ``None`` until then, and on the CPU).
    ``step_check``: the step period measured over the first training calls (:class:`StepCheck`;
    ``None`` until :data:`STEP_TIMED_CALLS` have started).
    """

    plan: Plan
    config: Config
    estimate: Estimate
    problem: Problem
    budget_bytes: int
    allocated_cap_bytes: int
    predicted_peak_bytes: int
    analysed_peak_bytes: int
    empty_peak_bytes: int
    empty_step_s: float
    how: str
    search: SearchResult | None = None
    trials: list[Trial] = field(default_factory=list)
    budget_source: str = "user"
    reserve_bytes: int = 0
    reserve_source: str = ""
    returned: tuple[ReturnedOutput, ...] = ()
    peak_check: PeakCheck | None = None
    step_check: StepCheck | None = None
    #: The host rates' spread the predicted step was averaged over (``cost.expected_estimate``; ``None``:
    #: the step at the readings).
    rate_spread: dict[str, float] | None = None
    #: The offload runtime's CPU and device optimizer rates over the same training calls
    #: (``protrain_fx.calibrate.TrainingRates``; ``None`` until then, and without offloaded steps).
    training_rates: TrainingRates | None = None
    #: ``n_gpu_optim`` chosen again at those rates and applied to the running step
    #: (``protrain_fx.calibrate.Replan``; ``config`` and ``estimate`` stay the plan first chosen).
    replanned: Replan | None = None
    #: The chunk counts were chosen too (``protrain_fx.autooffload``); ``empty_*`` are then the step
    #: with every parameter on the device and no plan.
    offload: bool = False
    #: Seconds spent describing the step to the cost model: the machine's rates and the matrix and
    #: attention ops measured on the device (once per device and signature; read from the cache
    #: after), and the block tables read from the analysis.
    problem_s: float = 0.0
    #: Seconds of the whole choice, from the first partition to the plan applied and verified.
    choose_s: float = 0.0
    #: What judged the plan kept: ``"graph"`` (the graph-level analysis) or ``"inductor"``; and
    #: whether ``empty_peak_bytes`` is Inductor's.
    judged_by: str = "graph"
    empty_by_inductor: bool = False
    #: Set after a measured miss when this graph was removed from Dynamo's cache, so that its next
    #: call compiles it again under the lowered cap (``record_first_step``).
    recompile: bool = False

    @property
    def step_cap_bytes(self) -> int:
        """The allocated peak the whole step may reach: the graph's cap and the reserve."""
        return self.allocated_cap_bytes + self.reserve_bytes

    @property
    def measured_peak_bytes(self) -> int | None:
        """The first step's measured peak on the prediction's terms (``PeakCheck.step_peak_bytes``)."""
        return self.peak_check.step_peak_bytes if self.peak_check is not None else None

    @property
    def replan(self) -> bool:
        """The first step measured above the allocated cap: later plans lower their cap, and the graph
        is compiled again at its next call (:attr:`recompile`)."""
        return self.peak_check is not None and self.peak_check.over

    def table(self, index: int | None = None) -> str:
        """The plan table with predicted step time and peak, for logs and reports."""
        where = f" for graph {index}" if index is not None else ""
        source = {"user": "memory_budget", "device": "reachable on the device"}.get(self.budget_source, self.budget_source)
        lowered = (f", {human_bytes(self.reserve_bytes)} of it kept for your code around the graph "
                   f"({'measured in a first step' if self.reserve_source == 'measured' else 'estimated'})"
                   if self.reserve_bytes else "")
        what = "offload and activation plan" if self.offload else "activation plan"
        judged = "in Inductor's allocation plan" if self.judged_by == "inductor" else "analysed"
        empty_judged = "in Inductor's allocation plan" if self.empty_by_inductor else "analysed"
        lines = [
            f"automatic {what}{where}: budget {human_bytes(self.budget_bytes)} ({source}), allocated peak "
            f"at most {human_bytes(self.allocated_cap_bytes)} ({100 * ALLOCATOR_HEADROOM:.0f}% allocator headroom{lowered})",
            f"  {self.how}: n_swap={self.config.n_swap}, n_checkpoint={self.config.n_checkpoint}; predicted step "
            f"{self.estimate.step_s * 1e3:.3f} ms (no plan: {self.empty_step_s * 1e3:.3f} ms); peak "
            f"{human_bytes(self.analysed_peak_bytes)} {judged}, {human_bytes(self.predicted_peak_bytes)} by the "
            f"cost model (no plan: {human_bytes(self.empty_peak_bytes)} {empty_judged})",
        ]
        if self.offload:
            c, p = self.config, self.problem
            lines.insert(2, (
                f"  chunks: n_persist={c.n_persist}, n_buffer={c.n_buffer}, n_gpu_optim={c.n_gpu_optim} of "
                f"{len(p.chunks)} chunks ({human_bytes(p.buffer_bytes)} buffers); every parameter on the device "
                "would be the 'no plan' above"
            ))
        if self.rate_spread and self.config.n_persist < len(self.problem.chunks):
            at_readings = CostModel(self.problem).estimate(self.config).step_s
            lines.insert(3, (
                "  predicted step: the mean over the host rates within "
                + ", ".join(f"{100 * u:.0f}% ({k})" for k, u in self.rate_spread.items())
                + f" of the profile's readings; {at_readings * 1e3:.3f} ms at the readings"
            ))
        if self.returned:
            lines.append(
                "  returned to your code: " + ", ".join(o.line() for o in self.returned)
                + f"; what it computes on them (a loss) is outside the plan ({human_bytes(self.reserve_bytes)} kept "
                "for it); computing the loss inside the compiled module (returned from forward) lowers the step's "
                "peak by about that much"
            )
        if self.search is not None:
            s = self.search
            lines.append(f"  search: {s.evaluated} of {s.total} configs simulated in {s.seconds * 1e3:.1f} ms")
        if self.choose_s:
            lines.append(f"  chosen in {self.choose_s:.2f} s: {self.problem_s:.2f} s profiling and describing the step, "
                         f"{len(self.trials)} rewrite(s) analysed")
        if self.peak_check is not None:
            lines.append(f"  {self.peak_check.line()}")
        if self.step_check is not None:
            lines.append(f"  {self.step_check.line()}")
        if self.training_rates is not None:
            lines.append(f"  {self.training_rates.line(self.problem, self.config)}")
        if self.replanned is not None:
            lines.append(f"  {self.replanned.line()}")
        lines.append(self.plan.table([b.name for b in self.problem.blocks]))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def machine_profile(machine: Machine) -> cost.MachineProfile:
    """The cost model's rates from the backend's machine constants (``protrain_fx.machine``, with the
    ``machine`` option applied): copy bandwidths as they are; GPU Adam from the memory bandwidth
    (:data:`ADAM_BYTES_PER_PARAM`). No chunk is stepped on the CPU when every chunk persists, so the
    CPU Adam rate is a stand-in (the GPU one)."""
    adam = machine.hbm_bytes * machine.hbm_efficiency / ADAM_BYTES_PER_PARAM
    return cost.MachineProfile(
        h2d_bytes_per_s=machine.h2d_bytes,
        d2h_bytes_per_s=machine.d2h_bytes,
        duplex_bytes_per_s=machine.duplex_bytes,
        cpu_adam_params_per_s=adam,
        gpu_adam_params_per_s=adam,
    )


def activation_problem(record: CapturedGraph) -> Problem:
    """The cost model's :class:`~protrain_fx.cost.Problem` for a step analysed with no plan, as the
    module docstring says: roofline times, this device's swap threshold, one unpadded chunk."""
    device = torch.device(record.memory.device)
    machine = machine_for(device, record.config.machine)
    params = parameter_infos(record.step, record.dynamo_graph)
    return problem_from_record(
        record,
        machine_profile(machine),
        chunk_bytes=max(1, sum(p.nbytes for p in params)),
        estimate_machine=machine,
        min_swap_bytes=machine.min_swap_bytes,
        op_times=(op_times := device_op_times(record)),
        compute_scale=IN_STEP_SCALE if op_times else 1.0,
    )


def search_activation_plan(problem: Problem, budget_bytes: int, *, reserve_bytes: int = 0) -> SearchResult:
    """The fastest ``(n_swap, n_checkpoint)`` with every chunk persistent that fits
    ``budget_bytes - reserve_bytes``: :func:`protrain_fx.search.search` with ``persist_all=True``."""
    return search(problem, budget_bytes, reserve_bytes=reserve_bytes, persist_all=True)


def least_memory_config(model: CostModel) -> Config:
    """The all-persistent config of least predicted peak (the faster one among equals)."""
    return least_memory_configs(model, model.n_chunks, 0)[0]


def least_memory_configs(model: CostModel, n_persist: int, n_buffer: int, n_gpu_optim: int = 0) -> list[Config]:
    """The configs tried as the plan of least memory with these chunk counts, in the order tried: the
    activation counts of least predicted peak (the faster among equals), then checkpointing every
    block (no swap), when that is another config.

    Why both: the cost model's peak is an upper bound of the analysis', not its order. Its least
    config can be a swap-heavy one the analysis puts gigabytes above checkpointing every block
    (the swapped blocks' casts of weights, what their copies leave waiting), and a refusal that names
    that config's peak names a minimum the backend does not need; checkpointing every block keeps
    the least activations whatever the link does. Each is judged by the analysis like every trial
    (:func:`verified_choice`)."""
    N = model.n_blocks
    pairs = [(s, c) for s in range(N + 1) for c in range(N + 1 - s)]
    act = {q: model.activation_peak(*q) for q in pairs}
    low = min(act.values())
    p, b, g = n_persist, n_buffer, n_gpu_optim
    s, c = min((q for q in pairs if act[q] == low), key=lambda q: (model.step_time(p, b, *q, g), q))
    configs = [Config(p, b, s, c, g), Config(p, b, 0, N, g)]
    return configs[:1] if configs[0] == configs[1] else configs


def specialize_shapes(gm: fx.GraphModule) -> int:
    """Guard on the value of every symbolic size of ``gm``'s inputs, so that a plan sized for these
    shapes is never reused for others: Dynamo compiles again for a new shape (and the backend plans
    again). Returns how many sizes were symbolic. (Dynamo's own recompile limit then bounds how many
    shapes one function compiles for.)"""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        sizes = (*val.shape, *val.stride()) if isinstance(val, torch.Tensor) else (val,)
        for size in sizes:
            if isinstance(size, torch.SymInt):
                guard_int(size)
                count += 1
    return count


def choose_plan(record: CapturedGraph, trial: Callable[[Plan | None], None]) -> AutoPlan | None:
    """Choose, apply and verify the activation plan of ``record`` (module docstring, steps 1-5).

    ``trial(plan)`` partitions the step with ``plan`` (``None``: no plan) and runs the passes on it,
    leaving ``record``'s graphs and ``record.memory`` as of that plan; on return the record holds the
    chosen plan's graphs. Returns ``None`` for a step without transformer blocks (nothing to plan;
    the record holds it as it is). Raises :class:`~protrain_fx.search.NoPlanFits` when nothing fits.
    """
    started = time.perf_counter()
    budget = record.config.memory_budget_bytes
    assert budget is not None
    trial(None)
    assert record.memory is not None
    cap, outside, source = plan_cap(record, budget)
    reserve = budget - cap
    if record.blocks is None or not record.blocks.labels:
        return None  # no block to checkpoint or swap: the budget is only checked, as with a plan by hand
    empty_peak, empty_by_inductor = judged_peak(record)
    t0 = time.perf_counter()
    problem = activation_problem(record)
    problem_s = time.perf_counter() - t0
    model = CostModel(problem)
    n = model.n_chunks
    empty = Config(n, 0, 0, 0)
    empty_est = model.estimate(empty)

    def result(config: Config, how: str, found: SearchResult | None, trials: list[Trial]) -> AutoPlan:
        return chosen(record, model, config, how, found, trials, cap=cap, reserve=(outside, source),
                      empty_peak_bytes=empty_peak, empty_step_s=empty_est.step_s, problem_s=problem_s,
                      started=started, empty_by_inductor=empty_by_inductor)

    if empty_peak <= cap:
        return result(empty, "fits as is", None, [])

    trials: list[Trial] = []

    def run(config: Config) -> Trial:
        plan = block_plan(problem, config)
        trial(plan if plan.blocks_with("swap") or plan.blocks_with("checkpoint") else None)
        t = judged_trial(record, config, model.estimate(config).peak_bytes)
        trials.append(t)
        return t

    candidates = least_memory_configs(model, n, 0)

    def search_at(lowered: int) -> SearchResult:
        b, r = widened(budget, reserve + lowered)
        return search_activation_plan(problem, b, reserve_bytes=r)

    config, how, found, need, least = verified_choice(search_at, run, candidates, trials, cap)
    if config is not None:
        return result(config, how, found, trials)
    minimum = budget_for_peak(need + outside)
    raise NoPlanFits(
        f"protrain_fx: no activation plan fits the memory budget of {budget} bytes ({budget / 2**30:.4g} GiB) "
        f"for graph {record.index}: the plan of least memory (n_swap={least.n_swap}, n_checkpoint="
        f"{least.n_checkpoint} of {model.n_blocks} blocks) needs an allocated peak of {need} bytes, so the budget "
        f"must be at least {minimum} bytes ({minimum / 2**30:.4g} GiB, {100 * ALLOCATOR_HEADROOM:.0f}% allocator "
        f"headroom included{reserve_note(outside, source)}); raise memory_budget, use a smaller batch, or offload "
        "parameters with protrain_fx.offload(...)",
        min_budget_bytes=minimum,
    )


def chosen(
    record: CapturedGraph,
    model: CostModel,
    config: Config,
    how: str,
    found: SearchResult | None,
    trials: list[Trial],
    *,
    cap: int,
    reserve: tuple[int, str] = (0, ""),
    empty_peak_bytes: int,
    empty_step_s: float,
    offload: bool = False,
    problem_s: float = 0.0,
    started: float | None = None,
    empty_by_inductor: bool = False,
    rate_spread: Mapping[str, float] | None = None,
) -> AutoPlan:
    """The :class:`AutoPlan` of ``config`` for ``record`` (as rewritten for it) under its budget;
    ``started``: ``time.perf_counter()`` when the choice began (for ``choose_s``);
    ``empty_by_inductor``: ``empty_peak_bytes`` is Inductor's (:func:`judged_peak`). With
    ``rate_spread``, the predicted step is the mean over the host rates within that spread of their
    readings (``cost.expected_estimate``)."""
    est = expected_estimate(model.problem, config, rate_spread) if rate_spread else model.estimate(config)
    kept = next((t for t in trials if t.config == config), None)
    if kept is not None:
        analysed, by_inductor = kept.analysed_peak_bytes, kept.by_inductor
    elif how == "fits as is":
        analysed, by_inductor = empty_peak_bytes, empty_by_inductor
    else:
        analysed, by_inductor = record.memory.peak_bytes, False
    return AutoPlan(
        plan=block_plan(model.problem, config),
        config=config,
        estimate=est,
        problem=model.problem,
        budget_bytes=record.config.memory_budget_bytes,
        allocated_cap_bytes=cap,
        predicted_peak_bytes=est.peak_bytes,
        analysed_peak_bytes=analysed,
        empty_peak_bytes=empty_peak_bytes,
        empty_step_s=empty_step_s,
        how=how,
        search=found,
        trials=trials,
        budget_source=record.budget_source or "user",
        reserve_bytes=reserve[0],
        reserve_source=reserve[1],
        returned=tuple(returned_outputs(record)),
        offload=offload,
        problem_s=problem_s,
        choose_s=time.perf_counter() - started if started is not None else 0.0,
        judged_by="inductor" if by_inductor else "graph",
        empty_by_inductor=empty_by_inductor,
        rate_spread=dict(rate_spread) if rate_spread else None,
    )


def verified_choice(
    search_at: Callable[[int], SearchResult],
    run: Callable[[Config], Trial],
    least: Config | Sequence[Config],
    trials: list[Trial],
    cap: int,
) -> tuple[Config | None, str, SearchResult | None, int, Config]:
    """Steps 3 and 4 of the module docstring, shared with ``autooffload``: ``search_at(lowered)``
    searches with the cap lowered by ``lowered`` bytes (raised when negative), ``run(config)``
    applies a config and returns its analysed :class:`Trial` (appending it to ``trials``). ``least``:
    the configs of least memory (:func:`least_memory_configs`), in the order to try them. Returns
    ``(config, how, last search, peak needed, least config)``: a searched config analysed under
    ``cap`` (``"searched"``), else the first of ``least`` the analysis puts under ``cap`` (``"least
    memory"``; tried even when the cost model says it does not fit, and judged by the analysis
    alone, as every trial is: the cost model's peak is an upper bound of it, and with
    ``verify="inductor"`` it can be gigabytes above the plan that runs), else ``None`` with the
    least peak any of ``least`` analyses to and that config, so that the minimum a caller names is
    one this procedure keeps. On return the last ``run`` is of the returned config.

    A searched config that fits is then used as a measure of the cost model's margin
    (:func:`raised_choice`): the search runs again with the cap raised by what the cost model
    predicted above the analysis, and the faster config it finds is kept if it analyses under the
    cap too."""
    found: SearchResult | None = None
    lowered = 0
    for _ in range(MAX_SEARCHES):
        try:
            found = search_at(lowered)
        except NoPlanFits:
            break
        if any(t.config == found.best for t in trials):
            break
        t = run(found.best)
        if t.analysed_peak_bytes <= cap:
            found = raised_choice(search_at, run, found, t, trials, cap)
            need = next(x for x in trials if x.config == found.best).analysed_peak_bytes
            return found.best, "searched", found, need, found.best
        lowered += max(1, t.analysed_peak_bytes - t.predicted_peak_bytes)
    judged: list[Trial] = []
    for config in [least] if isinstance(least, Config) else least:
        done = next((t for t in trials if t.config == config), None) or run(config)
        judged.append(done)
        if done.analysed_peak_bytes <= cap:  # the analysis judges (the cost model's peak is an upper bound of it)
            if trials[-1] is not done:
                run(config)  # the record holds the graphs of the last trial
            return config, "least memory", found, done.analysed_peak_bytes, config
    lowest = min(judged, key=lambda t: t.analysed_peak_bytes)
    return None, "", found, lowest.analysed_peak_bytes, lowest.config


#: Searches with a raised (or, after one analysed above the cap, lowered again) cap after a searched
#: config fitted (:func:`raised_choice`).
MAX_RAISES = 3
#: A raised search's config is tried only when the cost model predicts it at least this fraction
#: faster than the config that fitted (each try is a rewrite and an analysis of the whole step).
RAISE_MIN_GAIN = 0.02


def raised_choice(
    search_at: Callable[[int], SearchResult],
    run: Callable[[Config], Trial],
    found: SearchResult,
    fitted: Trial,
    trials: list[Trial],
    cap: int,
) -> SearchResult:
    """The search result to keep after ``found.best`` (trial ``fitted``) analysed under ``cap``.

    The cost model's peak is an upper bound of the analysis' (it keeps gradients and optimizer
    state live for the whole step; 25-49% above the measured peak on the H200 at B24, 2026-11-30), so
    a plan it calls fitting may leave gigabytes unused that a faster plan could take. Up to
    :data:`MAX_RAISES` times: the search runs again with the cap raised by the fitted config's ratio
    of predicted to analysed peak (a config the model predicts at most ``cap * predicted / analysed``
    analyses under the cap if the ratio carries over; the ratio held within 1.22-1.26 over the
    configs analysed for B24 1.3B at 16 GiB and 4.2B at 24 GiB on the H200, 2026-12-01, where the
    difference ranged over 3.0-3.8 and 4.4-5.4 GB: raised by the fitted config's difference, B24
    1.3B's search stopped 0.1 GB short of the plan that ran fastest), and a config it finds that is predicted
    :data:`RAISE_MIN_GAIN` faster and was not tried is applied and analysed. Under the cap it is kept
    and the next raise starts from it. Above it, the search runs again with the raised cap lowered to
    just under that config's predicted peak (it, and every config the model puts at or above it,
    left out) and at the point where the line through the fitted config's and the overshooting
    config's (predicted, analysed) peaks reaches the cap (:func:`lowered_raise`), and so on,
    :data:`MAX_RAISES` searches in all; at the end the last config that fitted is applied again if
    another was tried after it (the record must hold its graphs). The analysis stays the judge:
    nothing is kept that it puts above the cap.

    Why lower rather than stop: the predicted-to-analysed ratio is not one number. B24 4.2B at 24
    GiB on the H200 (twenty-first session): the config that fitted, 3/3/0/35/11, was predicted at
    23.5 GB and analysed at 19.1 (a measured peak of 16.7 under a cap of 23.9), so the cap was raised
    to 29.3; the search's pick there, 5/3/5/31/9, predicted 29.24 GB, analysed at 24.3, over the cap,
    and the raising stopped on two hosts. 5/2/1/35/9, predicted 29.18, analysed at 23.2 on a third
    host and ran there (8.6k tok/s against 7.4-7.5k for 3/3/0/35/11 on the other two)."""
    applied = fitted.config  # the config whose graphs the record holds
    raise_by: int | None = None  # None: from the fitted config's ratio
    for _ in range(MAX_RAISES):
        if raise_by is None:
            margin = fitted.predicted_peak_bytes - fitted.analysed_peak_bytes
            if margin <= 0:
                break
            raise_by = math.ceil(margin * cap / max(fitted.analysed_peak_bytes, 1))
        try:
            raised = search_at(-raise_by)
        except NoPlanFits:
            break
        if raised.estimate.step_s > found.estimate.step_s * (1 - RAISE_MIN_GAIN) or any(
            t.config == raised.best for t in trials
        ):
            break
        t = run(raised.best)
        applied = raised.best
        if t.analysed_peak_bytes > cap:
            raise_by = lowered_raise(fitted, t, cap)
            if raise_by <= 0:
                break
            continue
        found, fitted, raise_by = raised, t, None
    if applied != found.best:
        run(found.best)
    return found


def lowered_raise(fitted: Trial, over: Trial, cap: int) -> int:
    """The raise of the next search after ``over`` (a raised config) analysed above ``cap``, where
    ``fitted`` analysed under it: to just under ``over``'s predicted peak (it, and every config the
    cost model puts at or above it, left out), and no higher than where the line through the two
    trials' (predicted, analysed) peaks puts an analysed peak of ``cap``.

    Why the line: one step under the overshooting config can take one raise per buffer. B24 4.2B at
    40 GiB on the H200 (twenty-second session): 7/9/0/36/9 fitted, predicted 39.75 GB and analysed
    32.22 under a cap of 39.77; raised by its ratio, the search found 10/5/0/36/6 (48.79, analysed
    41.26), then, one step under each, 10/4 and 10/3 (48.33 and 47.87, analysed 40.80 and 40.34), and
    the raises ran out with 7.5 GB unused. All four differed from their analysis by 7.53 GB, so the
    line puts the cap at a predicted 47.30, where the search finds 10/2/2/34/6 (47.21, predicted
    721 ms against 7/9/0/36/9's 816). On the next call, with this rule, the raise found 10/6/3/33/5
    (48.95, analysed 42.87: this difference was 6.08), the line put the cap at 46.27, and 9/7/0/36/6
    (46.08) analysed at 38.55 GB and peaked at 36.32 in training; after the window's re-plan it ran
    798 ms a step (10.3k tok/s) where 7/9/0/36/9 had run 881 ms (9.3k) on the call before."""
    top = over.predicted_peak_bytes - 1
    predicted_rise = over.predicted_peak_bytes - fitted.predicted_peak_bytes
    analysed_rise = over.analysed_peak_bytes - fitted.analysed_peak_bytes
    if predicted_rise > 0 and analysed_rise > 0:
        top = min(top, fitted.predicted_peak_bytes + (cap - fitted.analysed_peak_bytes) * predicted_rise // analysed_rise)
    return top - cap


def widened(budget: int, reserve: int) -> tuple[int, int]:
    """``(budget, reserve)`` for :func:`protrain_fx.search.search` with a reserve that may be negative
    (a cap raised above the budget by :func:`raised_choice`): the search takes no negative reserve, so
    the budget grows instead."""
    return (budget - reserve, 0) if reserve < 0 else (budget, reserve)


def memory_counters(device: torch.device) -> tuple[int, int] | None:
    """``(memory_allocated, max_memory_allocated)`` of a CUDA ``device``; ``None`` for any other
    device (nothing to measure). Tests replace it to drive :func:`watch_first_step` on the CPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def peaks_at_compile_start() -> dict[torch.device, int]:
    """``max_memory_allocated`` of each CUDA device this process has initialized, taken when the
    backend starts compiling a graph (for :func:`watch_first_step`); empty before CUDA is
    initialized (nothing allocated yet)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {torch.device("cuda", i): torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}


def reset_peak(device: torch.device) -> None:
    """``torch.cuda.reset_peak_memory_stats(device)`` (nothing off CUDA); tests replace it on the CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def watch_first_step(
    record: CapturedGraph, compiled: Callable, peaks_before: Mapping[torch.device, int] | None = None
) -> Callable:
    """``compiled`` (the backend's callable for ``record``), measuring the first call made with grad
    enabled when ``record`` has an automatic plan: the memory counters when its forward starts, and
    again when the backward pass that its outputs join ends (a callback queued on the autograd
    engine from a hook on those outputs), handed to :func:`record_first_step`. Later calls go
    straight through. Dynamo's calling convention (``_boxed_call``) is kept.

    ``peaks_before`` (:func:`peaks_at_compile_start`): when the compile itself raised the device's
    peak above it (the machine's rates and ops measured, chunks placed for trial plans: gigabytes on
    a cold cache), the peak statistics are reset here, once, before the first step. The compile runs
    inside the user's first call, so no reset of theirs can come between it and the step, and
    without this the step's peak would stay under the compile's and go unmeasured.

    After a measured miss (:func:`record_first_step`), the next graph planned on that device (the
    one compiled again) has the statistics reset likewise: the step that missed made the process'
    peak, and the new plan is measured to check that it fits."""
    if record.auto_plan is None or record.memory is None:
        return compiled
    compiled = _timing_calls(record, compiled)
    device = torch.device(record.memory.device)
    if _RESET_AFTER_MISS.pop(record.memory.device, False):
        reset_peak(device)
        log.info(
            "protrain_fx: graph %d: the peak statistics of %s were reset so that the first step of the plan "
            "chosen after a measured miss is measured",
            record.index,
            device,
        )
    elif peaks_before is not None and (device.type == "cuda" or device in peaks_before):
        now = memory_counters(device)
        if now is not None and now[1] > peaks_before.get(device, 0):
            reset_peak(device)
            log.info(
                "protrain_fx: graph %d: compiling (measuring the machine, trial plans) raised the peak of %s to "
                "%s; its statistics were reset so that the first step's peak is measured",
                record.index,
                device,
                human_bytes(now[1]),
            )
    armed = True

    def call(*args: Any) -> Any:
        nonlocal armed
        if not armed or not torch.is_grad_enabled():
            return compiled(*args)
        armed = False
        start = memory_counters(device)
        out = compiled(*args)
        if start is None:
            return out
        queued = False

        def finish() -> None:
            end = memory_counters(device)
            if end is not None:
                record_first_step(record, start, end)

        def on_grad(_grad: torch.Tensor) -> None:
            nonlocal queued
            if not queued:
                queued = True
                torch.autograd.Variable._execution_engine.queue_callback(finish)

        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)
        return out

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _timing_calls(record: CapturedGraph, compiled: Callable) -> Callable:
    """``compiled``, noting when its training calls start until :data:`STEP_TIMED_CALLS` have, then
    :func:`record_step_period`. Calls without grad are not training steps and are not counted. When
    the rates measured over those calls re-plan the running step (:func:`_close_rate_window`), as
    many calls after the next one are timed too, against the new prediction (``Replan.step_check``)."""
    starts: list[float] = []
    first, last = STEP_TIMED_CALLS
    after: tuple[int, int] | None = None  # the calls timed after a re-plan

    window: list[RateWindow] = []  # the offload runtime's rates over the same calls (protrain_fx.calibrate)
    replanned: list[OffloadHandle] = []  # the handle whose n_gpu_optim the rates changed

    def intervals(a: int, b: int) -> list[float]:
        return [y - x for x, y in zip(starts[a - 1 : b - 1], starts[a:b])]

    def call(*args: Any) -> Any:
        nonlocal after
        if len(starts) < (after or (first, last))[1] and torch.is_grad_enabled():
            starts.append(_clock())
            if len(starts) == first:
                window.extend(_open_rate_window(record))  # none without offloaded optimizer steps
            if len(starts) == last:
                replanned.extend(w.handle for w in window if _close_rate_window(record, w) is not None)
                record_step_period(record, intervals(first, last))
                if replanned:  # the call starting now waits for the switch; time the ones after it
                    after = (last + 1, 2 * last + 1 - first)
            elif after is not None and len(starts) == after[1]:
                record_replan_period(record, intervals(*after), after, replanned[0])
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _open_rate_window(record: CapturedGraph) -> list[RateWindow]:
    """``[RateWindow]`` on the offload handle whose chunks ``record``'s automatic plan placed with
    optimizer steps of their own (CPU or device), else ``[]``."""
    from protrain_fx.autooffload import placed_handle  # (autooffload imports this module)

    auto = record.auto_plan
    if auto is None or not auto.offload:
        return []
    handle = placed_handle(record)
    if handle is None or handle.adam is None:
        return []
    return [RateWindow(handle)]


def _close_rate_window(record: CapturedGraph, window: RateWindow) -> Replan | None:
    """Stores, logs and keeps for later plans (``profiler.note_training_rates``) the rates
    ``window`` measured (``AutoPlan.training_rates``). Where the counts were chosen by the backend
    and it may step chunks on the device (:func:`replans_device_steps`), ``n_gpu_optim`` is chosen
    again at those rates (``calibrate.replan_gpu_optim``) and a faster count is applied to the
    handle at once (``AutoPlan.replanned``, logged); that :class:`Replan` is returned."""
    from protrain_fx.profiler import note_training_rates  # read at the call (tests replace it)

    auto = record.auto_plan
    assert auto is not None and record.memory is not None
    rates = window.close(auto.problem, auto.config)
    auto.training_rates = rates
    kept = note_training_rates(
        record.memory.device,
        chunk_params=window.handle.chunk_params,
        cpu_adam_params_per_s=rates.cpu_adam_params_per_s,
        device_step_bytes_per_s=rates.device_step_bytes_per_s,
    )
    where = f"; kept for later plans on this machine in {kept}" if kept is not None else ""
    log.info("protrain_fx: graph %d: %s%s", record.index, rates.line(auto.problem, auto.config), where)
    handle = window.handle
    if (not replans_device_steps(torch.device(record.memory.device)) or not handle.counts_chosen
            or auto.replanned is not None or handle.n_gpu_optim != auto.config.n_gpu_optim):
        return None
    judged = max(auto.analysed_peak_bytes, auto.measured_peak_bytes or 0)
    replan = replan_gpu_optim(auto.problem, auto.config, rates, predicted_s=auto.estimate.step_s,
                              room_bytes=max(0, auto.allocated_cap_bytes - judged))
    if replan is None:
        return None
    handle.set_gpu_optim(replan.after.n_gpu_optim)
    auto.replanned = replan
    log.info("protrain_fx: graph %d: %s", record.index, replan.line())
    return replan


def replans_device_steps(device: torch.device) -> bool:
    """Whether a running plan's ``n_gpu_optim`` is chosen again from the measured rates: where the
    search chooses it (CUDA; on the CPU there is no second device to step on)."""
    return device.type == "cuda"


def record_replan_period(
    record: CapturedGraph, intervals_s: Sequence[float], calls: tuple[int, int], handle: OffloadHandle
) -> StepCheck | None:
    """Stores and logs the step period measured after a re-plan (``Replan.step_check``) against the
    re-planned step's prediction, and undoes the re-plan on ``handle`` when that period is longer
    than the one measured before it (``AutoPlan.step_check``): the measurement decides, not the
    cost model that proposed the change."""
    auto = record.auto_plan
    if auto is None or auto.replanned is None or not intervals_s:
        return None
    replan = auto.replanned
    check = StepCheck(predicted_step_s=replan.after_s, intervals_s=tuple(intervals_s), calls=calls)
    replan.step_check = check
    if auto.step_check is not None:
        replan.measured_before_s = auto.step_check.measured_step_s
        replan.kept = check.measured_step_s <= replan.measured_before_s
        if not replan.kept and handle.n_gpu_optim == replan.after.n_gpu_optim:
            handle.set_gpu_optim(replan.before.n_gpu_optim)
    log.info("protrain_fx: graph %d: %s", record.index, replan.line())
    return check


def record_step_period(record: CapturedGraph, intervals_s: Sequence[float]) -> StepCheck | None:
    """Stores and logs a :class:`StepCheck` of ``record``'s automatic plan from the measured
    intervals (seconds between the starts of consecutive training calls). ``None`` without intervals."""
    auto = record.auto_plan
    if auto is None or not intervals_s:
        return None
    check = StepCheck(predicted_step_s=auto.estimate.step_s, intervals_s=tuple(intervals_s))
    auto.step_check = check
    log.info("protrain_fx: graph %d: %s", record.index, check.line())
    return check


def record_first_step(record: CapturedGraph, start: tuple[int, int], end: tuple[int, int]) -> PeakCheck | None:
    """The bookkeeping of :func:`watch_first_step`, from plain numbers: ``start`` and ``end`` are
    ``(memory_allocated, max_memory_allocated)`` at the forward's start and the backward's end.
    Stores a :class:`PeakCheck` on ``record.auto_plan`` and logs it, and keeps what the step held
    above the graph's analysed peak (``PeakCheck.outside_bytes``: the user's code around the graph)
    as the reserve of later plans on this device (:func:`outside_reserve`). The graph is removed
    from Dynamo's cache, so that its next call compiles it again with that reserve, when the step
    went over its allocated cap (a warning names the numbers) or when the reserve it was planned
    with was an estimate and, with the measured one, the cost model finds a plan
    :data:`RAISE_MIN_GAIN` faster (:func:`faster_plan_under`). Returns ``None`` (logged) when the
    step did not raise the process' peak, whose value is then unknown."""
    auto, memory = record.auto_plan, record.memory
    assert auto is not None and memory is not None
    (start_allocated, start_max), (_end_allocated, end_max) = start, end
    if end_max <= start_max:
        log.info(
            "protrain_fx: graph %d: first step's peak not measured: it stayed under this process' earlier peak "
            "of %s (call torch.cuda.reset_peak_memory_stats() before the first step to measure it)",
            record.index,
            human_bytes(start_max),
        )
        return None
    check = PeakCheck(
        predicted_peak_bytes=memory.peak_bytes,
        predicted_start_bytes=sum(memory.timeline.baseline_bytes.values()),
        measured_peak_bytes=end_max,
        measured_start_bytes=start_allocated,
        allocated_cap_bytes=auto.step_cap_bytes,
    )
    auto.peak_check = check
    log.info("protrain_fx: graph %d: %s", record.index, check.line())
    device = memory.device
    outside = check.outside_bytes
    _MEASURED_OUTSIDE[device] = max(_MEASURED_OUTSIDE.get(device, 0), outside)
    if check.over:
        why = (f"the first step peaked at {check.step_peak_bytes} bytes ({human_bytes(check.step_peak_bytes)}), "
               f"{human_bytes(outside)} above the graph's analysed peak of {check.predicted_peak_bytes} bytes "
               f"({human_bytes(check.predicted_peak_bytes)})"
               f" and over the allocated cap of {check.allocated_cap_bytes} bytes "
               f"({human_bytes(check.allocated_cap_bytes)}) that the plan (n_swap={auto.config.n_swap}, "
               f"n_checkpoint={auto.config.n_checkpoint}) was chosen for under a budget of {auto.budget_bytes} bytes "
               f"({human_bytes(auto.reserve_bytes)} of it kept for the code around the graph)")
        level = logging.WARNING
    elif auto.reserve_source == "outputs" and (better := faster_plan_under(auto, auto.step_cap_bytes - outside)):
        why = (f"the code around the graph held {human_bytes(outside)} at the step's peak, where "
               f"{human_bytes(auto.reserve_bytes)} was kept for it: with that measured, n_swap={better.n_swap}, "
               f"n_checkpoint={better.n_checkpoint} is predicted at least {100 * RAISE_MIN_GAIN:.0f}% faster")
        level = logging.INFO
    else:
        return check
    code = record.dynamo_code
    if code is not None:  # the next call compiles this graph again, with the measured reserve
        from torch._dynamo.eval_frame import remove_from_cache

        remove_from_cache(code)
        auto.recompile = True
    _RESET_AFTER_MISS[device] = True
    what = (f"this graph is compiled again at its next call ({code.co_name}), and it and"
            if code is not None else "this graph keeps its plan (it was compiled outside Dynamo), and")
    log.log(level, "protrain_fx: graph %d: %s; %s every later plan on %s keeps %s under its cap for the code "
            "around the graph, as measured", record.index, why, what, device, human_bytes(_MEASURED_OUTSIDE[device]))
    return check


def faster_plan_under(auto: AutoPlan, cap: int) -> Config | None:
    """An activation plan for ``auto``'s chunks as placed (its ``n_persist``, ``n_buffer``,
    ``n_gpu_optim``) that the cost model predicts :data:`RAISE_MIN_GAIN` faster than ``auto.config``
    and under ``cap`` (the cost model's peak scaled by its margin over the judged peak of the plan
    chosen, as :func:`raised_choice` does), else ``None``. No plan at all when the step as it is
    was judged under ``cap`` (parameters on the device: ``empty_peak_bytes``)."""
    model = CostModel(auto.problem)
    c, N = auto.config, model.n_blocks
    empty = Config(c.n_persist, c.n_buffer, 0, 0, c.n_gpu_optim)
    if not auto.offload and c != empty and auto.empty_peak_bytes <= cap:  # judged, not estimated
        return empty
    margin = max(1.0, auto.predicted_peak_bytes / max(1, auto.analysed_peak_bytes))
    best: tuple[float, Config] | None = None
    for s in range(N + 1):
        for k in range(N + 1 - s):
            config = Config(c.n_persist, c.n_buffer, s, k, c.n_gpu_optim)
            estimate = model.estimate(config)
            if estimate.peak_bytes <= cap * margin and (best is None or estimate.step_s < best[0]):
                best = (estimate.step_s, config)
    if best is None or best[0] > auto.estimate.step_s * (1 - RAISE_MIN_GAIN) or best[1] == c:
        return None
    return best[1]


def clear_peak_misses() -> None:
    """Forget what first steps measured (``protrain_fx.reset()``): later plans estimate again."""
    _MEASURED_OUTSIDE.clear()
    _RESET_AFTER_MISS.clear()


__all__ = [
    "AutoPlan",
    "PeakCheck",
    "STEP_TIMED_CALLS",
    "StepCheck",
    "record_replan_period",
    "replans_device_steps",
    "record_step_period",
    "clear_peak_misses",
    "memory_counters",
    "peaks_at_compile_start",
    "record_first_step",
    "reset_peak",
    "watch_first_step",
    "specialize_shapes",
    "Trial",
    "activation_problem",
    "choose_plan",
    "least_memory_config",
    "least_memory_configs",
    "machine_profile",
    "search_activation_plan",
]
