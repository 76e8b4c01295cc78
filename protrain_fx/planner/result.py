"""What the planner hands back: :class:`AutoPlan` (the plan chosen and why) and :class:`PeakCheck`.

Data and its formatting only: choosing is ``planner/activations.py`` and ``planner/offload.py``,
measuring is ``planner/first_step.py``. An ``AutoPlan`` lives on ``CapturedGraph.auto_plan`` for
the life of the compiled graph and gains its measurements (peak, step period, training rates,
re-plan) as the first training calls run. A first step starts without optimizer state (made at the
first ``step()``) and beside memory that is not the plan's (other tensors, library workspaces), so
:class:`PeakCheck` puts the step's measured rise above its start on the predicted start before
comparing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protrain_fx.analysis.readable import human_bytes
from protrain_fx.plan import Plan
from protrain_fx.planner.budget import ALLOCATOR_HEADROOM
from protrain_fx.planner.rates import Replan, TrainingRates
from protrain_fx.planner.reserve import ReturnedOutput
from protrain_fx.planner.verify import Trial
from protrain_fx.progress import seconds_line
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts, Estimate, Problem
from protrain_fx.search.search import SearchResult

if TYPE_CHECKING:
    from protrain_fx.planner.rates import StepCheck


#: How far (a fraction of the allocated cap) a first step may peak above its cap before it counts
#: as a miss. The budget keeps 8% over the cap for the allocator (``ALLOCATOR_HEADROOM``), and a
#: step that fits its prediction exactly still varies by a few MiB between runs: compiling the graph
#: again for that would trade a kept step for a slower plan over noise. Half a percent stays inside
#: the headroom (``docs/results.md#allocator-headroom``).
MISS_TOLERANCE = 0.005


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
    config: Counts
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
    #: Seconds a step spends in the user's code on ``returned`` (a loss), estimated before any step
    #: ran (``planner.reserve.outside_seconds``): ``estimate.step_s`` prices the graph and the optimizer.
    around_estimate_s: float = 0.0
    peak_check: PeakCheck | None = None
    step_check: StepCheck | None = None
    #: The host rates' spread the predicted step was averaged over (``search.spread.expected_estimate``; ``None``:
    #: the step at the readings).
    rate_spread: dict[str, float] | None = None
    #: The offload runtime's CPU and device optimizer rates over the same training calls
    #: (``planner.rates.TrainingRates``; ``None`` until then, and without offloaded steps).
    training_rates: TrainingRates | None = None
    #: ``n_gpu_optim`` chosen again at those rates and applied to the running step
    #: (``planner.rates.Replan``; ``config`` and ``estimate`` stay the plan first chosen).
    replanned: Replan | None = None
    #: The chunk counts were chosen too (``planner/offload.py``); ``empty_*`` are then the step
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
    #: The plan cache file and entry this plan is kept under (``planner/plan_cache.py``; ``""``: not
    #: kept), and whether it was read from there instead of chosen (no search, no trial lowerings).
    cache_file: str = ""
    cache_key: str = ""
    #: The joint graph's structure (``planner.plan_cache.graph_digest``): what the code around it
    #: measured at a first step is kept under in the plan cache file, for later launches.
    graph_key: str = ""
    from_cache: bool = False
    #: The step compiled with this plan at an earlier launch was loaded whole from AOTAutograd's
    #: cache (``aot_cache.py``): no tracing, partitioning or lowering in this process.
    from_aot_cache: bool = False
    #: Seconds of each phase of the compile that chose this plan, measured (``CapturedGraph.phases``,
    #: the same dict: the backward's codegen joins it at the first ``backward()``); empty outside a compile.
    phases: dict[str, float] = field(default_factory=dict)
    #: Trials this choice ran (each a rewrite and its analysis; with Inductor judging, a lowering of
    #: both graphs), and trials answered from what earlier compiles of the graph judged
    #: (``planner/judged.py``: no rewrite, no lowering).
    trials_run: int = 0
    trials_kept: int = 0

    def trials_line(self) -> str:
        """``"3 trial lowerings (2 judged before)"``: the trials this choice ran and those it reused."""
        what = "trial lowerings" if self.judged_by == "inductor" or self.empty_by_inductor else "trial rewrites"
        kept = f" ({self.trials_kept} judged before)" if self.trials_kept else ""
        return f"{self.trials_run} {what}{kept}"

    def phases_line(self) -> str:
        """``"phases: capture 12.3 s, planning 0.4 s, search 0.05 s, trial lowerings 31.0 s (2 trial
        lowerings)"``; a plan from the plan cache says that the search and the trial lowerings were skipped."""
        skipped = ("; tracing, planning and lowering skipped (AOTAutograd's cache)" if self.from_aot_cache else
                   "; search and trial lowerings skipped (plan cache)" if self.from_cache else "")
        counts = f" ({self.trials_line()})" if not self.from_cache and (self.trials_run or self.trials_kept) else ""
        return f"phases: {seconds_line(self.phases) or '-'}{counts}{skipped}" if self.phases or skipped else ""

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
        if self.from_cache:
            lines.insert(2, f"  from the plan cache ({self.cache_file}): no search, no trial lowerings; the first "
                            "step's peak is checked as for a plan chosen here")
        if self.from_aot_cache:
            lines.insert(3, "  the step compiled with it at an earlier launch, loaded from AOTAutograd's cache: no "
                            "tracing, no partitioning, no lowering; its peak is the analysis kept with it")
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
                f"for it, about {self.around_estimate_s * 1e3:.1f} ms a step estimated: the step with it "
                f"{(self.estimate.step_s + self.around_estimate_s) * 1e3:.1f} ms); computing the loss inside the "
                "compiled module (returned from forward) lowers the step's peak by about that much"
            )
        if self.search is not None:
            s = self.search
            lines.append(f"  search: {s.evaluated} of {s.total} configs simulated in {s.seconds * 1e3:.1f} ms")
        if self.choose_s:
            lines.append(f"  chosen in {self.choose_s:.2f} s: {self.problem_s:.2f} s profiling and describing the step, "
                         f"{self.trials_line()}")
        if phases := self.phases_line():
            lines.append(f"  {phases}")
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
