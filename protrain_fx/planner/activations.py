"""The automatic activation plan: which blocks to swap and checkpoint under a memory budget.

For a train graph whose parameters stay on the device, with a budget and no plan by hand
(:func:`~protrain_fx.planner.budget.wants_auto_plan`), the partitioner calls :func:`choose_plan`:

1. The step is partitioned and analysed with no plan.
2. If that peak fits the allocated cap (budget less headroom and reserve), nothing is rewritten.
3. Otherwise :func:`activation_problem` describes the step to the cost model (roofline block times
   with measured matrix and attention ops on CUDA, this device's swap threshold, all parameters in
   one unpadded chunk) and the search finds the fastest ``(n_swap, n_checkpoint)`` predicted to fit
   (``n_swap = 0`` on the CPU, where a swap's copy stays in the memory the budget counts:
   ``Machine.host_memory_apart``).
4. The step is partitioned with that plan and analysed again; the analysis judges, the search is
   lowered or raised around it (``planner/verify.py``), and last the least-memory configs are tried.
5. When nothing fits, :class:`~protrain_fx.search.search.NoPlanFits` names the smallest budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch._guards import CompileContext
from torch.fx.experimental.symbolic_shapes import guard_int

from protrain_fx import progress
from protrain_fx.analysis.params import parameter_infos
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import CapturedGraph
from protrain_fx.machine import Machine, machine_for
from protrain_fx.planner.budget import ALLOCATOR_HEADROOM, budget_for_peak
from protrain_fx.planner.judged import Judge, Judgment, trial_key
from protrain_fx.planner.problem import (
    IN_STEP_SCALE,
    device_op_times,
    problem_from_record,
)
from protrain_fx.planner.reserve import outside_seconds, plan_cap, reserve_note, returned_outputs
from protrain_fx.planner.result import AutoPlan
from protrain_fx.planner import verify
from protrain_fx.planner.verify import (
    Trial,
    widened,
)
from protrain_fx.search import problem
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts, Problem, block_plan
from protrain_fx.search.search import NoPlanFits, SearchResult, search
from protrain_fx.search.spread import expected_estimate
from protrain_fx.state import STATE

log = logging.getLogger("protrain_fx")


#: Bytes per parameter a fused AdamW step moves through device memory (fp32: reads parameter,
#: gradient and two moments, writes parameter and two moments); gives the cost model a GPU Adam rate.
ADAM_BYTES_PER_PARAM = 28


def machine_profile(machine: Machine) -> problem.MachineProfile:
    """The cost model's rates from the backend's machine constants (``protrain_fx.machine``, with the
    ``machine`` option applied): copy bandwidths as they are; GPU Adam from the memory bandwidth
    (:data:`ADAM_BYTES_PER_PARAM`). No chunk is stepped on the CPU when every chunk persists, so the
    CPU Adam rate is a stand-in (the GPU one)."""
    adam = machine.hbm_bytes * machine.hbm_efficiency / ADAM_BYTES_PER_PARAM
    return problem.MachineProfile(
        h2d_bytes_per_s=machine.h2d_bytes,
        d2h_bytes_per_s=machine.d2h_bytes,
        duplex_bytes_per_s=machine.duplex_bytes,
        cpu_adam_params_per_s=adam,
        gpu_adam_params_per_s=adam,
        host_memory_apart=machine.host_memory_apart,
    )


def activation_problem(record: CapturedGraph) -> Problem:
    """The cost model's :class:`~protrain_fx.search.problem.Problem` for a step analysed with no plan,
    as the module docstring says: roofline times, this device's swap threshold, one unpadded chunk
    (every chunk persists, so the padding a layout adds would count memory the model does not use)."""
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
    ``budget_bytes - reserve_bytes``: :func:`protrain_fx.search.search.search` with ``persist_all=True``."""
    return search(problem, budget_bytes, reserve_bytes=reserve_bytes, persist_all=True)


def least_memory_config(model: CostModel) -> Counts:
    """The all-persistent config of least predicted peak (the faster one among equals)."""
    return least_memory_configs(model, model.n_chunks, 0)[0]


def least_memory_configs(model: CostModel, n_persist: int, n_buffer: int, n_gpu_optim: int = 0) -> list[Counts]:
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
    pairs = model.activation_pairs()
    act = {q: model.activation_peak(*q) for q in pairs}
    low = min(act.values())
    p, b, g = n_persist, n_buffer, n_gpu_optim
    s, c = min((q for q in pairs if act[q] == low), key=lambda q: (model.step_time(p, b, *q, g), q))
    configs = [Counts(p, b, s, c, g), Counts(p, b, 0, N, g)]
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


def warn_at_recompile_limit(record: CapturedGraph) -> None:
    """Warn when the graph being planned is its frame's last compile under Dynamo's recompile limit.

    A plan is sized for exact shapes (:func:`specialize_shapes`), so every new input shape (a batch
    padded to its longest sequence, say) is a recompile; past ``torch._dynamo.config.recompile_limit``
    Dynamo runs the frame eagerly and compiles only the functions it calls, each planned apart (the
    budget no longer holds for the step). The warning comes at the last compile Dynamo allows."""
    compile_id = CompileContext.current_compile_id()
    limit = torch._dynamo.config.recompile_limit
    if compile_id is None or compile_id.frame_compile_id is None or compile_id.frame_compile_id + 1 != limit:
        return
    log.warning(
        "protrain_fx: graph %d is its frame's compile %d of the %d Dynamo allows (torch._dynamo.config."
        "recompile_limit); a plan holds for one input shape, and a further shape runs the frame eagerly, "
        "planned at best as the smaller graphs it calls, not as one step: the memory budget may not hold. Pad "
        "the inputs to a few fixed lengths, or raise recompile_limit (each new shape is planned again)", record.index, limit, limit,
    )


def least_after_miss(record: CapturedGraph, least: Counts, need: int, cap: int, outside: int, minimum: int,
                     placed: str = "") -> bool:
    """Whether ``least`` (the plan of least memory, judged at ``need`` bytes, over ``cap``) is applied
    instead of refusing the budget: when this graph is compiled again after a first step on its
    device peaked over its cap (``STATE.reset_after_miss``) and ``least`` with the room measured for
    the code around the graph (``outside``) stays within the budget itself, in the allocator's
    headroom. That step ran, with a plan of no less memory; training goes on rather than stopping at
    its second step on a near miss, with a warning naming the budget (``minimum``) that plans within
    the cap. Further over, the budget is refused as for any plan. ``placed``: the chunk counts the
    plans were limited to, for the warning."""
    assert record.memory is not None and record.budget_bytes is not None
    if not STATE.reset_after_miss.get(record.memory.device) or need + outside > record.budget_bytes:
        return False
    log.warning(
        "protrain_fx: graph %d: after its first step measured %s for the code around the graph, no activation plan%s "
        "fits the allocated cap of %s: the plan of least memory (n_swap=%d, n_checkpoint=%d) is applied, %s over it "
        "and within the budget of %s, as the first step ran with no less; a memory_budget of at least %d bytes (%s) "
        "plans within the cap", record.index, human_bytes(outside), placed, human_bytes(cap), least.n_swap,
        least.n_checkpoint, human_bytes(need - cap), human_bytes(record.budget_bytes), minimum, human_bytes(minimum))
    return True


def choose_plan(record: CapturedGraph, trial: verify.TrialFn,
                kept: dict[str, Judgment] | None = None) -> AutoPlan | None:
    """Choose, apply and verify the activation plan of ``record`` (module docstring, steps 1-5).

    ``trial(plan)`` partitions the step with ``plan`` (``None``: no plan) and runs the passes on it,
    leaving ``record``'s graphs and ``record.memory`` as of that plan, and returns that rewrite
    (:class:`~protrain_fx.planner.verify.Rewrite`: the plan applied, its analysis); on return the record holds the
    chosen plan's graphs. ``kept``: the judgments of this graph kept from earlier compiles
    (``planner/judged.py``), added to. Returns ``None`` for a step without transformer blocks
    (nothing to plan; the record holds it as it is). Raises
    :class:`~protrain_fx.search.search.NoPlanFits` when nothing fits.
    """
    started = time.perf_counter()
    budget = record.budget_bytes
    assert budget is not None
    trial(None)
    assert record.memory is not None
    cap, outside, source = plan_cap(record, budget)
    reserve = budget - cap
    if record.blocks is None or not record.blocks.labels:
        return None  # no block to checkpoint or swap: the budget is only checked, as with a plan by hand
    t0 = time.perf_counter()
    problem = activation_problem(record)
    problem_s = time.perf_counter() - t0
    model = CostModel(problem)
    n = model.n_chunks
    empty = Counts(n, 0, 0, 0)
    empty_est = model.estimate(empty)

    def rewrite(config: Counts) -> Counts:
        plan = block_plan(problem, config)
        trial(plan)
        return config

    judge = Judge({} if kept is None else kept, lambda c: trial_key(block_plan(problem, c)), rewrite,
                  lambda lower: verify.judged_peak(record, lower), lambda c: model.estimate(c).peak_bytes,
                  holding=empty, lowers=verify.lowers(record))
    judged_empty = verify.judged_as_is(judge, empty, cap)
    empty_peak = judged_empty.analysed_peak_bytes
    trials: list[Trial] = []

    def result(config: Counts, how: str, found: SearchResult | None) -> AutoPlan:
        judge.hold(config)  # the record holds the chosen plan's graphs
        plain = verify.tried(trials, empty) or judged_empty  # lowered after all, when confirmed_choice did
        return chosen(record, model, config, how, found, trials, cap=cap, reserve=(outside, source),
                      empty_peak_bytes=plain.analysed_peak_bytes, empty_step_s=empty_est.step_s, problem_s=problem_s,
                      started=started, empty_by_inductor=plain.by_inductor, judge=judge)

    def run(config: Counts) -> Trial:
        t = judge(config)
        trials.append(t)
        return t

    if (promised := verify.faster_after_first_step(record, run, judge, cap, judged_empty)) is not None:
        return result(*promised, None)
    if empty_peak <= cap:
        return result(empty, "fits as is", None)

    candidates = least_memory_configs(model, n, 0)

    @progress.timed("search")
    def search_at(lowered: int) -> SearchResult:
        b, r = widened(budget, reserve + lowered)
        return search_activation_plan(problem, b, reserve_bytes=r)

    config, how, found, need, least = verify.confirmed_choice(search_at, run, candidates, trials, cap, judge,
                                                              as_is=judged_empty)
    if config is not None:
        # a lowering can put the step as it is under the cap where its analysis did not (confirmed_choice)
        return result(config, "fits as is" if config == empty else how, None if config == empty else found)
    minimum = budget_for_peak(need + outside)
    if least_after_miss(record, least, need, cap, outside, minimum):
        return result(least, "least memory", None)
    raise NoPlanFits(
        f"protrain_fx: no activation plan fits the memory budget of {budget} bytes ({human_bytes(budget)}) "
        f"for graph {record.index}: the plan of least memory (n_swap={least.n_swap}, n_checkpoint="
        f"{least.n_checkpoint} of {model.n_blocks} blocks) needs an allocated peak of {need} bytes, so the budget "
        f"must be at least {minimum} bytes ({human_bytes(minimum)}, {100 * ALLOCATOR_HEADROOM:.0f}% allocator "
        f"headroom included{reserve_note(outside, source)}); raise memory_budget, use a smaller batch, or offload "
        f"parameters with protrain_fx.offload(...){_graph_judged_note(record, judge)}",
        min_budget_bytes=minimum,
    )


def _graph_judged_note(record: CapturedGraph, judge: Judge) -> str:
    """For a refusal of a step Inductor compiles whose plans the graph-level analysis judged (the
    CPU's default): Inductor's own allocation plan can put the step lower."""
    if record.config.codegen != "inductor" or judge.lowers:
        return ""
    return ("; these peaks are the graph-level analysis', and options={'verify': 'inductor'} judges by "
            "Inductor's own allocation plan, which can fit a smaller budget")


def chosen(
    record: CapturedGraph,
    model: CostModel,
    config: Counts,
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
    judge: Judge | None = None,
) -> AutoPlan:
    """The :class:`AutoPlan` of ``config`` for ``record`` (as rewritten for it) under its budget;
    ``started``: ``time.perf_counter()`` when the choice began (for ``choose_s``);
    ``empty_by_inductor``: ``empty_peak_bytes`` is Inductor's (:func:`judged_peak`). With
    ``rate_spread``, the predicted step is the mean over the host rates within that spread of their
    readings (``search.spread.expected_estimate``). ``judge``: the trials' judge, whose counts of
    trials run and answered from earlier compiles the plan reports."""
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
        budget_bytes=record.budget_bytes,
        allocated_cap_bytes=cap,
        predicted_peak_bytes=est.peak_bytes,
        analysed_peak_bytes=analysed,
        empty_peak_bytes=empty_peak_bytes,
        empty_step_s=empty_step_s,
        how=how,
        search=found,
        trials=trials,
        budget_source=record.budget.source if record.budget is not None else "user",
        reserve_bytes=reserve[0],
        reserve_source=reserve[1],
        returned=tuple(returned_outputs(record)),
        around_estimate_s=outside_seconds(record),
        offload=offload,
        problem_s=problem_s,
        choose_s=time.perf_counter() - started if started is not None else 0.0,
        judged_by="inductor" if by_inductor else "graph",
        empty_by_inductor=empty_by_inductor,
        rate_spread=dict(rate_spread) if rate_spread else None,
        trials_run=judge.lowered if judge is not None else len(trials),
        trials_kept=judge.reused if judge is not None else 0,
    )
