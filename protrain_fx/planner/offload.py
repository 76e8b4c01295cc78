"""The automatic offload: ProTrain's chunk counts and the activation plan from one memory budget.

    handle = protrain_fx.offload(model, optimizer, device="cuda", compute_dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": "24GiB"})

``offload`` without ``n_persist`` / ``n_buffer`` packs the parameters into chunks but places none:
every parameter is a device tensor without bytes (what Dynamo traces) and its values wait in host
memory (``OffloadHandle.automatic``). When the backend's partitioner gets the model's first training
graph, :func:`choose_offload` runs instead of partitioning once. It holds no handle: it prices
the model from what the backend read of it (``handoffs.ChunkFacts``: the layout, dtypes, clipping,
the store's tiers) and places chunks to judge a config through the backend's ``planner.verify.Placer``:

1. The step is partitioned and analysed with no plan, as if every parameter stayed on the device:
   the memory analysis gives each block's saved and transient bytes (``trial(None)``).
2. :func:`offload_problem` describes the step to the cost model with the model's own chunks (the
   ones the runtime will move): chunk buffers in the compute dtype, persistent chunks as the runtime
   keeps them (fp32 parameter and gradient, two fp32 Adam moments: ``persistent_param_bytes``),
   block times from the roofline (``analysis/estimate.py``) with the matrix and attention nodes
   measured on CUDA (``planner.problem.device_op_times``), the machine's copy and Adam rates
   measured once and cached (``profile.machine_profile.measure_machine``, the CPU step at the
   model's chunk size: ``chunk_adam_rate`` there; on a device that is not CUDA the
   backend's ``machine`` constants stand in, see :func:`offload_machine`).
3. :func:`protrain_fx.search.search.search` finds the fastest ``(n_persist, n_buffer, n_swap,
   n_checkpoint, n_gpu_optim)`` whose predicted peak fits the budget less the allocator's headroom
   (``planner.budget.allocated_cap_bytes``); ``n_gpu_optim`` only on CUDA (on the CPU there is no second
   device to step on). A config with more persistent chunks predicted within 5% of it is taken
   instead (:func:`prefer_persistent`).
4. The chunks are placed with those counts (``Placer.place``, the backend's ``OffloadHandle.configure``:
   the host store laid out but not filled, the chunk buffers, persistent parameters on the device), the step is partitioned again with the
   activation plan (``search.problem.block_plan``) and rewritten to read the chunks (``passes/gather.py``),
   and the memory analysis checks the rewritten step, chunk buffers and staging included. Above the
   cap, the search runs again with the cap lowered by the miss (the chunks are placed again; nothing
   has run yet), a few times; last the configs of least memory (no persistent chunk, the fewest
   buffers, and the cost model's least activation counts, then checkpointing every block:
   :func:`least_memory_candidates`), each judged by the analysis. Under the cap, the search
   runs again with the cap raised by the cost model's margin over the analysis, and a faster config
   it finds is placed and kept if it analyses under the cap (``planner.verify.raised_choice``).
5. Nothing fits: :class:`~protrain_fx.search.search.NoPlanFits` names the smallest budget with a plan.
   A host too small for the chunk store is refused by the store, naming its bytes.

The chosen config is handed back (``AutoPlan.config``) with its chunks placed; the backend makes it
final: the handle fills the placement's store and forgets the values it kept
(``OffloadHandle.finalize``), and the counts stay for the life of the model. Another input shape
compiles again (the plan guards on the shapes) and gets its own activation plan for the chunks as
placed (:func:`choose_for_placed`, from ``ChunkFacts.placed``).

Lean chunks (a host short of memory for every chunk's compute-dtype copy): the cost model gets
how many the store would make for each ``n_persist`` (``ChunkFacts.lean_counts``), their fp32
fetch bytes and the fp32 fetch staging (``search/cost.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import time
from collections.abc import Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from protrain_fx import progress
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import CapturedGraph
from protrain_fx.errors import UnsupportedError, too_few_buffers
from protrain_fx.handoffs import ChunkFacts, Placement
from protrain_fx.machine import machine_for
from protrain_fx.planner.activations import (
    chosen,
    least_after_miss,
    least_memory_configs,
    machine_profile,
)
from protrain_fx.planner.budget import ALLOCATOR_HEADROOM, budget_for_peak
from protrain_fx.planner.judged import Judge, Judgment, trial_key
from protrain_fx.planner.problem import (
    IN_STEP_SCALE,
    device_op_times,
    problem_from_record,
)
from protrain_fx.planner.reserve import plan_cap, reserve_note
from protrain_fx.planner.result import AutoPlan
from protrain_fx.planner import verify
from protrain_fx.planner.verify import (
    Trial,
    judged_trial,
    widened,
)
from protrain_fx.profile.cache import pinned_profile, training_rates
from protrain_fx.profile.disk import disk_rates
from protrain_fx.profile.collectives import collective_times
from protrain_fx.profile.machine_profile import (
    chunk_adam_rate,
    device_step_rate,
    measure_machine,
)
from protrain_fx.runtime.parallel import distributed
from protrain_fx.runtime.store.buffer_pool import FETCH_SLICE_ELEMS
from protrain_fx.runtime.store.host_memory import spill_bytes
from protrain_fx.search.cost import CostModel
from protrain_fx.search.spread import RATE_SPREAD, expected_estimate, steadiest_gpu_optim
from protrain_fx.search.problem import Counts, MachineProfile, Problem, block_plan
from protrain_fx.search.search import NoPlanFits, SearchResult, search

log = logging.getLogger("protrain_fx")


def choose_for_placed(
    record: CapturedGraph, facts: ChunkFacts, trial: verify.TrialFn,
    kept: dict[str, Judgment] | None = None,
) -> AutoPlan | None:
    """The activation plan of a later graph (another input shape) of a model whose chunk counts the
    backend chose at its first compile (``facts.placed``): the counts stay, the fastest ``(n_swap,
    n_checkpoint)`` whose predicted peak fits with them is searched (every pair simulated), applied and verified as in
    :func:`choose_offload`. ``"fits as is"`` when the step analyses under the cap without a plan.
    ``None`` for a graph without transformer blocks (the part of a step after a graph break, say):
    nothing to plan, and the backend checks its peak against the budget as it is. ``kept``: the
    judgments of this graph kept from earlier compiles (``planner/judged.py``), added to."""
    started = time.perf_counter()
    budget = record.budget_bytes
    assert budget is not None
    trial(None)
    if record.blocks is None or not record.blocks.labels:
        return None
    t0 = time.perf_counter()
    model = offload_cost_model(record, facts, "its activations cannot be planned for the placed chunks")
    problem_s = time.perf_counter() - t0
    cap, outside, source = plan_cap(record, budget)
    assert facts.placed is not None
    p, b, g = facts.placed.n_persist, facts.placed.n_buffer, facts.placed.n_gpu_optim
    configs = [Counts(p, b, s, c, g) for s, c in model.activation_pairs()]
    empty = configs[0]
    short: list[int] = []  # chunks held at once by plans the placed buffers cannot hold

    def rewrite(config: Counts) -> Counts:
        plan = block_plan(model.problem, config)
        trial(plan)
        return config

    def judge_now(lower: bool) -> tuple[int, bool]:
        return verify.judged_peak(record, lower)

    lean = facts.lean_counts[p]
    judge = Judge({} if kept is None else kept, lambda c: trial_key(block_plan(model.problem, c), (p, b, g, lean)),
                  rewrite, judge_now, lambda c: model.estimate(c).peak_bytes, holding=empty,
                  lowers=verify.lowers(record))
    judged_empty = verify.judged_as_is(judge, empty, cap)
    empty_peak = judged_empty.analysed_peak_bytes
    trials: list[Trial] = []

    def result(config: Counts, how: str, found: SearchResult | None) -> AutoPlan:
        judge.hold(config)  # the record holds the chosen plan's graphs
        plain = verify.tried(trials, empty) or judged_empty  # lowered after all, when confirmed_choice did
        return chosen(record, model, config, how, found, trials, cap=cap, reserve=(outside, source),
                      empty_peak_bytes=plain.analysed_peak_bytes,
                      empty_step_s=model.estimate(empty).step_s, offload=True, problem_s=problem_s, started=started,
                      empty_by_inductor=plain.by_inductor,
                      rate_spread=RATE_SPREAD if torch.device(record.memory.device).type == "cuda" else None,
                      judge=judge)

    @progress.timed("search")
    def search_at(lowered: int) -> SearchResult:
        t0 = time.perf_counter()
        estimates = [(model.estimate(c), c) for c in configs]
        fitting = [(e.step_s, c, e) for e, c in estimates if e.peak_bytes <= cap - lowered]
        if not fitting:
            raise NoPlanFits("no activation plan fits with these chunks",
                             min_budget_bytes=min(e.peak_bytes for e, _ in estimates) + budget - cap)
        _, best, est = min(fitting, key=lambda x: (x[0], x[1]))
        return SearchResult(best, est, len(configs), 0, 0, len(configs), time.perf_counter() - t0)

    def run(config: Counts) -> Trial:
        try:
            t = judge(config)
        except ValueError as e:
            if (too := too_few_buffers(e)) is None:
                raise
            short.append(too.needed)  # the buffers are placed: this plan cannot run with them
            judge.holding = None  # the record holds no finished rewrite
            t = Trial(config, model.estimate(config).peak_bytes, UNRUNNABLE)
        trials.append(t)
        return t

    if (promised := verify.faster_after_first_step(record, run, judge, cap, judged_empty)) is not None:
        return result(*promised, None)
    if empty_peak <= cap:
        return result(empty, "fits as is", None)
    config, how, found, need, least = verify.confirmed_choice(
        search_at, run, least_memory_configs(model, p, b, g), trials, cap, judge, as_is=judged_empty)
    if config is not None:
        # a lowering can put the step as it is under the cap where its analysis did not (confirmed_choice)
        return result(config, "fits as is" if config == empty else how, None if config == empty else found)
    minimum = budget_for_peak(need + outside)
    if need != UNRUNNABLE and least_after_miss(record, least, need, cap, outside, minimum,
                                               f" for the chunks as placed (n_persist={p}, n_buffer={b}, n_gpu_optim={g})"):
        return result(least, "least memory", None)
    if need == UNRUNNABLE:
        raise UnsupportedError(
            f"protrain_fx: graph {record.index} (another input shape) needs an activation plan whose rewritten step "
            f"holds {min(short)} parameter chunks at once, but the model's first compile placed n_buffer={b}: "
            "compile the largest shape first (the counts are chosen for the first), or give the counts to "
            f"offload(...) by hand with n_buffer >= {min(short)}"
        )
    raise NoPlanFits(
        f"protrain_fx: no activation plan fits the memory budget of {budget} bytes ({human_bytes(budget)}) for "
        f"graph {record.index} with the chunks placed at the model's first compile (n_persist={p}, n_buffer={b}, "
        f"n_gpu_optim={g}): the plan of least memory needs an allocated peak of {need} bytes, so the budget must "
        f"be at least {minimum} bytes ({human_bytes(minimum)}{reserve_note(outside, source)}); "
        + ("raise memory_budget (the chunk counts stay as placed)" if source == "measured" else
           "use the first shape's batch, or compile the largest shape first (the counts are chosen for the first)"),
        min_budget_bytes=minimum,
    )


def placement(config: Counts) -> Placement:
    """The chunk counts of ``config`` (its activation counts are the rewrite's, not the placement's)."""
    return Placement(config.n_persist, config.n_buffer, config.n_gpu_optim)


#: The analysed peak of a trial whose plan the placed chunk buffers cannot run (``choose_for_placed``).
UNRUNNABLE = 2**63 - 1


def offload_cost_model(record: CapturedGraph, facts: ChunkFacts, what: str) -> CostModel:
    """After ``trial(None)`` left ``record`` analysed: the cost model of its step with the offloaded
    model's chunks (``facts``; the machine measured on the first call, cached after). ``what`` ends
    the refusal of a step without transformer blocks ("... cannot be chosen")."""
    assert record.memory is not None
    if record.blocks is None or not record.blocks.labels:
        split = (f": it ends at a graph break before them ({record.breaks[0].line()}); remove the break so "
                 "that the blocks are in this graph, or") if record.breaks else ";"
        raise ValueError(
            f"protrain_fx: graph {record.index} has no transformer blocks, so {what}{split} give n_persist / "
            "n_buffer to offload(...) by hand"
        )
    # the partitioner runs under the compile's fake mode: real tensors here
    device = torch.device(record.memory.device)
    with unset_fake_temporarily(), progress.phase("machine", "measuring the machine"):
        machine = offload_machine(device, record, facts.chunk_params, chunk_parts(facts))
        # data-parallel: a sharded chunk's all-gather and reduce-scatter (0 with one rank)
        collectives = collective_times(device, facts.chunk_params, facts.compute_dtype)
    return CostModel(offload_problem(record, facts, machine, collectives))


def chunk_parts(facts: ChunkFacts) -> list[int]:
    """The sizes, in order, of the parameters of the layout's most typical chunk (of those with the
    most common number of parameters, the fullest): what a device step of the model streams."""
    param_size = facts.param_dtype.itemsize
    chunks = [c for c in facts.layout.chunks if c.slots]
    if not chunks:
        return []
    counts = collections.Counter(len(c.slots) for c in chunks)
    common = max(counts, key=lambda k: (counts[k], k))
    chunk = max((c for c in chunks if len(c.slots) == common), key=lambda c: (c.used_bytes, -c.index))
    return [s.param.nbytes // param_size for s in chunk.slots]


def offload_machine(
    device: torch.device, record: CapturedGraph, chunk_params: int | None = None, parts: Sequence[int] = ()
) -> MachineProfile:
    """The machine's rates: measured on CUDA (``profile.machine_profile.measure_machine``, once per
    device and torch version, cached; the rates training reached on this machine in their place where
    known: ``profile.cache.training_rates``); elsewhere the backend's ``machine`` constants
    (``planner.activations.machine_profile``) with the CPU Adam rate measured the same way (the one
    rate a CPU step depends on). With ``chunk_params``, the CPU Adam rate is that of chunks of this
    size (``profile.machine_profile.chunk_adam_rate``, cached per size): the rate fell with the chunk's size; on CUDA, the faster of two readings, one
    before and one after the device steps' measurement (a host's CPU can be slow for a while). With
    ``parts`` (:func:`chunk_parts`), on CUDA, the device-step rate is that of chunks laid out so,
    stepped beside the model's own matrix and attention kernels
    (``profile.machine_profile.device_step_rate``, cached per layout and load): one large tensor
    reads well above what training reaches (``docs/results.md#device-step-rate-measured-against-training``).
    A pinned profile (``profile.cache.pin_machine_profile``) is every rate, on any device."""
    if (pinned := pinned_profile(device)) is not None:
        return pinned
    measured = measure_machine(device)
    if chunk_params:
        measured = dataclasses.replace(measured, cpu_adam_params_per_s=chunk_adam_rate(device, chunk_params))
    graphs = [g for g in (record.forward, record.backward) if g is not None]
    load_nodes = [node for g in graphs for node in g.graph.nodes]  # beside the steps: the model's own kernels
    if device.type == "cuda" and parts and (rate := device_step_rate(device, parts, load_nodes=load_nodes)):
        log.info("protrain_fx: graph %d: device_step_bytes_per_s %.4g, measured on this model's chunk layout "
                 "(%.4g on one tensor)", record.index, rate, measured.device_step_bytes_per_s)
        measured = dataclasses.replace(measured, device_step_bytes_per_s=rate)
    if device.type == "cuda" and chunk_params:  # a second reading of the CPU step, apart in time: the faster
        measured = dataclasses.replace(measured, cpu_adam_params_per_s=chunk_adam_rate(device, chunk_params, readings=2))
    profiled = measured
    measured, trained = training_rates(device, measured, chunk_params)  # what training reached here before
    for name in trained:
        log.info(
            "protrain_fx: graph %d: %s %.4g, the rate training reached on this machine (profiled %.4g; "
            "planner/rates.py)", record.index, name, getattr(measured, name), getattr(profiled, name),
        )
    if device.type == "cuda":
        return measured
    base = machine_profile(machine_for(device, record.config.machine))
    return MachineProfile(
        h2d_bytes_per_s=base.h2d_bytes_per_s,
        d2h_bytes_per_s=base.d2h_bytes_per_s,
        duplex_bytes_per_s=base.duplex_bytes_per_s,
        cpu_adam_params_per_s=measured.cpu_adam_params_per_s,
        gpu_adam_params_per_s=base.gpu_adam_params_per_s,
        gpu_bytes=base.gpu_bytes,
        host_memory_apart=base.host_memory_apart,
    )


def offload_problem(record: CapturedGraph, facts: ChunkFacts, machine: MachineProfile,
                    collective_s: tuple[float, float] = (0.0, 0.0)) -> Problem:
    """The cost model's Problem of a step analysed with every parameter on the device, with the
    offloaded model's chunks (``facts``; module docstring, step 2); ``collective_s``: a chunk's
    all-gather and reduce-scatter seconds where the chunks are sharded over ranks."""
    device = torch.device(record.memory.device)
    estimate_machine = machine_for(device, record.config.machine)
    param_size = torch.empty(0, dtype=facts.param_dtype).element_size()
    compute_size = torch.empty(0, dtype=facts.compute_dtype).element_size()
    problem = problem_from_record(
        record,
        machine,
        layout=facts.layout,
        buffer_bytes_per_byte=compute_size / param_size,
        persistent_param_bytes=param_size if compute_size != param_size else 0,
        estimate_machine=estimate_machine,
        min_swap_bytes=estimate_machine.min_swap_bytes,
        op_times=(op_times := device_op_times(record)),
        compute_scale=IN_STEP_SCALE if op_times else 1.0,
        collective_s=collective_s,
    )
    if facts.grad_clipping is True:  # every chunk's step waits for the clip's norm
        problem = dataclasses.replace(problem, held_steps=True)
    lean = facts.lean_counts
    spill = tuple(k for _, k in facts.tiers)
    if any(spill):  # optimizer state on disk: its reads and writes priced at the spill folder's rates
        folder = facts.spill_dir
        read, write = disk_rates(folder)
        # and no n_persist whose store would spill more than the folder has free (refused at its build;
        # a folder that cannot be read is refused there too, naming why)
        try:
            floor = min_persist_for_disk(facts, shutil.disk_usage(folder).free)
        except OSError:
            floor = 0
        problem = dataclasses.replace(problem, spill_chunks=spill, disk_read_bytes_per_s=read,
                                      disk_write_bytes_per_s=write, min_persist=floor)
    if any(lean):
        # a lean chunk is fetched from its fp32 master (through an fp32 staging slice on CUDA when the
        # compute dtype is narrower: runtime/store/buffer_pool.py)
        numel = facts.layout.chunk_bytes // param_size
        staged = device.type == "cuda" and facts.compute_dtype != torch.float32
        problem = dataclasses.replace(
            problem,
            chunks=tuple(dataclasses.replace(c, lean_fetch_bytes=4 * numel) for c in problem.chunks),
            lean_chunks=lean,
            lean_staging_bytes=4 * min(numel, FETCH_SLICE_ELEMS) if staged else 0,
        )
    return distributed.from_rank0(problem)  # data-parallel: rank 0's host memory decides for every rank


def min_persist_for_disk(facts: ChunkFacts, free_bytes: int) -> int:
    """The fewest persistent chunks whose store spills at most ``free_bytes`` to disk (the store's
    tiers at each ``n_persist``, ``ChunkFacts.tiers``; with every chunk persistent nothing spills)."""
    for p, (lean, spill) in enumerate(facts.tiers):
        if spill_bytes(facts.chunk_params, facts.trainable[p:], lean, spill) <= free_bytes:
            return p
    return len(facts.layout.chunks)


#: A config that keeps more chunks on the device is chosen when its predicted step is at most this
#: fraction slower than the fastest (see :func:`prefer_persistent`).
PREFER_PERSISTENT = 0.05


def prefer_persistent(problem: Problem, budget: int, reserve: int, *, gpu_optim: bool) -> SearchResult:
    """The fastest config (:func:`protrain_fx.search.search.search`), unless one with more persistent chunks
    is predicted within :data:`PREFER_PERSISTENT` of it: then the one with the most. An offloaded
    chunk's speed rests on host rates measured once, in isolation, and on the cost model's overlap of
    CPU steps with compute; where the model sees a few percent to gain by offloading, the device is
    the safer bet: a gain of a few percent is inside the host rates' error, and an offload that
    loses it runs far slower than keeping every chunk (``docs/results.md#profiled-rates-against-training``)."""
    best = search(problem, budget, reserve_bytes=reserve, gpu_optim=gpu_optim)
    seconds = best.seconds
    for p in range(len(problem.chunks), best.best.n_persist, -1):
        try:
            r = search(problem, budget, reserve_bytes=reserve, gpu_optim=gpu_optim, n_persist=p)
        except NoPlanFits:
            continue
        seconds += r.seconds
        if r.estimate.step_s <= best.estimate.step_s * (1 + PREFER_PERSISTENT):
            return dataclasses.replace(r, seconds=seconds, total=best.total)
    return dataclasses.replace(best, seconds=seconds)


def steadier_gpu_optim(
    model: CostModel, kept: Trial, cap: int, trials: list[Trial], spread: Mapping[str, float] = RATE_SPREAD,
) -> Counts:
    """The chosen config ``kept.config`` with the ``n_gpu_optim`` of the least expected step over the
    host rates' spread (``search.spread.steadiest_gpu_optim``), within the memory its judged peak leaves under
    ``cap``; appended to ``trials`` (the judged peak raised by the static bytes the change adds), with a
    log line, when it differs. The caller applies it (``Placer.set_gpu_optim``): the count changes no
    graph, the two optimizer paths read and write the same host state (``OffloadHandle.set_gpu_optim``)."""
    config = kept.config
    steadier = steadiest_gpu_optim(model.problem, config, room_bytes=cap - kept.analysed_peak_bytes, spread=spread)
    if steadier == config:
        return config
    p, b = config.n_persist, config.n_buffer
    added = model.static_bytes(p, b, steadier.n_gpu_optim) - model.static_bytes(p, b, config.n_gpu_optim)
    trials.append(Trial(steadier, model.estimate(steadier).peak_bytes, kept.analysed_peak_bytes + added,
                        kept.by_inductor))
    log.info("protrain_fx: n_gpu_optim %d -> %d: the least step expected with the host rates within %s of "
             "their readings (%.4g s against %.4g at n_gpu_optim %d)", config.n_gpu_optim, steadier.n_gpu_optim,
             ", ".join(f"{k} {100 * u:.0f}%" for k, u in spread.items()),
             expected_estimate(model.problem, steadier, spread).step_s,
             expected_estimate(model.problem, config, spread).step_s, config.n_gpu_optim)
    return steadier


def least_memory_config(model: CostModel) -> Counts:
    """The config of least predicted peak: no persistent chunk, the fewest buffers, no device step,
    the activation counts of least memory (the faster among equals)."""
    return least_memory_candidates(model)[0]


def least_memory_candidates(model: CostModel) -> list[Counts]:
    """The configs tried as the plan of least memory: the fewest persistent chunks (none, or as many as
    the spill folder's free space needs: ``Problem.min_persist``), the fewest buffers, no device step,
    and the activation counts of ``planner.activations.least_memory_configs`` (the cost model's least,
    then checkpointing every block)."""
    p = model.problem.min_persist
    b = model.min_buffers(p) if model.n_chunks > p else 0
    return least_memory_configs(model, p, b)


def place_and_rewrite(
    record: CapturedGraph,
    placer: verify.Placer,
    model: CostModel,
    config: Counts,
    trial: verify.TrialFn,
) -> Counts:
    """Place the chunks (``placer``) with ``config``'s counts and rewrite and analyse the step with its
    activation plan (``trial``), leaving ``record`` as of it; returns the config applied. A rewrite
    that holds more chunks at once than ``config`` has buffers
    (:class:`~protrain_fx.errors.TooFewBuffers`) is placed again with as many as it holds: the config
    applied is then that one."""
    applied = config
    while True:
        with unset_fake_temporarily():  # the partitioner runs under the compile's fake mode: real tensors here
            # laid out, not filled: the trial needs the placement's sizes; the backend fills the chosen one
            placer.place(placement(applied))
        plan = block_plan(model.problem, applied)
        try:
            trial(plan)
        except ValueError as e:
            short = too_few_buffers(e)
            if short is None or short.needed <= applied.n_buffer or short.needed > model.n_chunks - applied.n_persist:
                raise
            log.info("protrain_fx: %s needs %d chunk buffers in its rewritten step; placed again with them",
                     applied, short.needed)
            applied = dataclasses.replace(applied, n_buffer=short.needed)
            continue
        return applied


def offload_judge(
    record: CapturedGraph,
    facts: ChunkFacts,
    placer: verify.Placer,
    model: CostModel,
    trial: verify.TrialFn,
    kept: dict[str, Judgment] | None,
) -> Judge:
    """The :class:`~protrain_fx.planner.judged.Judge` of the offloaded model's placements: each config
    placed and rewritten (:func:`place_and_rewrite`) and judged (``planner.verify.judged_peak``), or
    answered from ``kept``; a placement's trial is told apart by its counts and lean chunks (``facts``)."""
    lean = facts.lean_counts
    return Judge(
        {} if kept is None else kept,
        lambda c: trial_key(block_plan(model.problem, c), (c.n_persist, c.n_buffer, c.n_gpu_optim, lean[c.n_persist])),
        lambda c: place_and_rewrite(record, placer, model, c, trial),
        lambda lower: verify.judged_peak(record, lower),
        lambda c: model.estimate(c).peak_bytes,
        lowers=verify.lowers(record),
    )


def place_and_analyse(
    record: CapturedGraph,
    placer: verify.Placer,
    model: CostModel,
    config: Counts,
    trial: verify.TrialFn,
) -> Trial:
    """Place, rewrite and analyse ``config`` (:func:`place_and_rewrite`) and return the :class:`Trial`:
    the cost model's peak and the analysis' (``planner.verify.judged_peak``: or Inductor's plan's,
    with ``verify="inductor"``); ``requested`` is ``config`` when more buffers were applied."""
    applied = place_and_rewrite(record, placer, model, config, trial)
    t = judged_trial(record, applied, model.estimate(applied).peak_bytes)
    return t if applied == config else dataclasses.replace(t, requested=config)


def choose_offload(
    record: CapturedGraph,
    facts: ChunkFacts,
    placer: verify.Placer,
    trial: verify.TrialFn,
    *,
    model: CostModel | None = None,
    kept: dict[str, Judgment] | None = None,
) -> AutoPlan:
    """Choose the counts and the activation plan of the offloaded model (``facts``), placing its
    chunks for each config judged (``placer``), and verify (module docstring). ``trial`` is
    :func:`protrain_fx.planner.activations.choose_plan`'s: it partitions and analyses the step with a
    plan, leaving ``record`` as of that plan. The chosen config is left placed, not final: the
    backend makes it final (``OffloadHandle.finalize``), or ``what_fits`` undoes it
    (``placer.undo()``); a refusal undoes it here. ``model``: the cost model of the step, when the
    caller made it after ``trial(None)``. ``kept``: the judgments of this graph kept from earlier
    compiles (``planner/judged.py``), added to."""
    started = time.perf_counter()
    budget = record.budget_bytes
    assert budget is not None  # the backend refuses the compile before (backend._check_automatic_offload)
    t0 = time.perf_counter()
    if model is None:
        trial(None)
        model = offload_cost_model(record, facts, "the offload counts cannot be chosen")
    problem_s = time.perf_counter() - t0
    problem = model.problem
    device = torch.device(record.memory.device)
    cap, outside, source = plan_cap(record, budget)
    reserve = budget - cap
    all_on_device_peak = record.memory.peak_bytes
    everything = Counts(model.n_chunks, 0, 0, 0)
    trials: list[Trial] = []  # every placement analysed, in order
    judge = offload_judge(record, facts, placer, model, trial, kept)

    def run(config: Counts) -> Trial:
        t = judge(config)
        trials.append(t)
        return t

    def result(config: Counts, how: str, found: SearchResult | None) -> AutoPlan:
        judge.hold(config)  # the chunks placed and the record rewritten for the chosen config
        spread = RATE_SPREAD if device.type == "cuda" else None  # the CPU device plans with fixed rates
        done = next((t for t in trials if t.config == config), None)
        if spread and done is not None:
            steadier = steadier_gpu_optim(model, done, cap, trials, spread)
            if steadier != config:
                placer.set_gpu_optim(steadier.n_gpu_optim)
            config = steadier
        return chosen(record, model, config, how, found, trials, cap=cap, reserve=(outside, source),
                      empty_peak_bytes=all_on_device_peak, empty_step_s=model.estimate(everything).step_s,
                      offload=True, problem_s=problem_s, started=started, rate_spread=spread, judge=judge)

    try:
        gpu_optim = device.type == "cuda"
        config, how, found, need, least = verify.confirmed_choice(
            progress.timed("offload counts", "choosing the offload counts")(
                lambda lowered: prefer_persistent(problem, *widened(budget, reserve + lowered), gpu_optim=gpu_optim)),
            run, least_memory_candidates(model), trials, cap, judge,
        )
        if config is not None:
            return result(config, how, found)
        minimum = budget_for_peak(need + outside)
        refusal = NoPlanFits(
            f"protrain_fx: no offload plan fits the memory budget of {budget} bytes ({human_bytes(budget)}) "
            f"for graph {record.index}: the plan of least memory (n_persist=0, n_buffer={least.n_buffer} of "
            f"{model.n_chunks} chunks of {human_bytes(problem.buffer_bytes)}, n_swap={least.n_swap}, "
            f"n_checkpoint={least.n_checkpoint} of {model.n_blocks} blocks) needs an allocated peak of {need} "
            f"bytes, so the budget must be at least {minimum} bytes ({human_bytes(minimum)}, "
            f"{100 * ALLOCATOR_HEADROOM:.0f}% allocator headroom included{reserve_note(outside, source)}); raise memory_budget, "
            "use a smaller batch, or smaller chunks (offload(..., chunk_bytes=...))",
            min_budget_bytes=minimum,
        )
        refusal.least_config = least  # the config the minimum is named from (fit.answer_offload reports it)
        raise refusal
    except BaseException:
        with unset_fake_temporarily():
            placer.undo()  # nothing stays placed: a later compile (another budget) chooses again
        raise
