"""Measured against predicted, over the first training calls of a planned graph.

:func:`watch_first_step` wraps the compiled callable. Its first call with grad enabled reads the
CUDA memory counters at the forward's start and at the end of the backward its outputs join (a
callback queued on the autograd engine) and hands them to :func:`record_first_step`: a
:class:`~protrain_fx.planner.result.PeakCheck`, the measured reserve for the code around the graph,
and, after a miss or when that reserve allows a faster plan, the graph removed from Dynamo's cache
so that its next call compiles it again (a faster plan on CUDA compiles beside training instead:
``beside.py``). Calls 3 to 8 (``STEP_TIMED_CALLS``; with gradient
accumulation, as many from the third as one optimizer step has) are timed against the predicted step, and an offloaded step's optimizer rates over them may re-plan ``n_gpu_optim``.
Peak statistics are reset only when the compile itself raised them, or after a miss; off CUDA
nothing is measured (tests replace :func:`memory_counters`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Protocol

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import CapturedGraph
from protrain_fx.planner.plan_cache import drop_after_miss, keep_outside
from protrain_fx.planner.rates import (
    STEP_TIMED_CALLS,
    Replan,
    RunningOffload,
    StepCheck,
    StepPhases,
    replan_gpu_optim,
    timed_calls,
    training_rates,
)
from protrain_fx.planner.result import AutoPlan, PeakCheck
from protrain_fx.planner.verify import RAISE_MIN_GAIN
from protrain_fx.profile import cache as profile_cache
from protrain_fx.profile.disk import note_disk_rates
from protrain_fx.runtime.parallel import distributed
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts
from protrain_fx.search.spread import expected_estimate
from protrain_fx.state import STATE

log = logging.getLogger("protrain_fx")

#: How the backend opens a window on the offload whose chunks a graph's plan placed, when the rate
#: window starts (``None``: no offload with optimizer steps of its own).
OpenOffload = Callable[[], "RunningOffload | None"]


class CompileAgain(Protocol):
    """How the backend compiles a graph again beside training (``beside.py``), lent to the watch of
    its first steps."""

    @property
    def pending(self) -> bool:
        """Whether that compile runs now (the calls meanwhile share the host with it: not timed)."""

    def start(self) -> bool:
        """Start it; ``False`` where the graph is compiled again at its next call instead."""


#: The clock of those starts (a test drives it).
_clock = time.perf_counter

#: The clock of a step's phases off CUDA (:class:`_Marks`; a test drives it apart from :data:`_clock`).
_phase_clock = time.perf_counter


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
    record: CapturedGraph, compiled: Callable, peaks_before: Mapping[torch.device, int] | None = None,
    open_offload: OpenOffload | None = None, inputs: Sequence[Any] = (), again: CompileAgain | None = None,
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
    peak, and the new plan is measured to check that it fits.

    ``open_offload``: the backend's window on the offload whose chunks the plan placed
    (:func:`_open_rate_window`), opened when the timed calls start. ``inputs``: the compile's example
    inputs, whose trainable parameters :func:`_watch_held_gradients` looks at. ``again``: how a faster
    plan the first step finds is compiled beside training (:func:`record_first_step`)."""
    if record.auto_plan is None or record.memory is None:
        return compiled
    compiled = _watch_held_gradients(record, _timing_calls(record, compiled, open_offload, again), inputs)
    device = torch.device(record.memory.device)
    if STATE.reset_after_miss.pop(record.memory.device, False):
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
                record_first_step(record, start, end, again)

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


#: Training calls of a graph whose parameters :func:`_watch_held_gradients` looks at: by the second,
#: a loop that accumulates or zeroes gradients to 0 instead of None holds them.
HELD_GRADIENT_CALLS = 3


def _watch_held_gradients(record: CapturedGraph, compiled: Callable, inputs: Sequence[Any]) -> Callable:
    """``compiled``, looking at the start of its first :data:`HELD_GRADIENT_CALLS` training calls for
    gradients its trainable device parameters hold from an earlier backward, which a plan counts only
    with ``accumulation_steps`` above 1 (``StepGraphs.held_gradients``): gradient accumulation without
    that option, or ``zero_grad(set_to_none=False)``. Found, one warning names their bytes, the
    predicted peak with them and the cap, and the way out. Weak references: the model's parameters are
    not kept alive by its compiled code."""
    step = record.step
    if step is None or step.held_gradients or record.memory is None:
        return compiled
    device = torch.device(record.memory.device)
    params = [weakref.ref(t) for t in inputs if isinstance(t, torch.nn.Parameter) and t.requires_grad
              and t.device == device]
    if not params:
        return compiled
    calls = 0

    def call(*args: Any) -> Any:
        nonlocal calls
        if calls < HELD_GRADIENT_CALLS and torch.is_grad_enabled():
            calls += 1
            grads = [g for r in params if (p := r()) is not None and (g := p.grad) is not None and g.device == device]
            held = sum(g.untyped_storage().nbytes() for g in grads)  # (an offloaded parameter's: a shell of 0)
            if held:
                calls = HELD_GRADIENT_CALLS
                auto = record.auto_plan
                cap = f" of its cap {human_bytes(auto.allocated_cap_bytes)}" if auto is not None else ""
                log.warning(
                    "protrain_fx: graph %d: its parameters come to a training call holding %s of gradients from an "
                    "earlier backward (gradient accumulation, or zero_grad(set_to_none=False)), which its plan did not "
                    "count: the step's peak is up to %s, not the %s predicted%s. Pass options={'accumulation_steps': "
                    "K} (micro-batches per optimizer step) so that the plan counts them, or zero the gradients to "
                    "None", record.index, human_bytes(held), human_bytes(record.memory.peak_bytes + held),
                    human_bytes(record.memory.peak_bytes), cap)
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _timing_calls(record: CapturedGraph, compiled: Callable, open_offload: OpenOffload | None = None,
                  again: CompileAgain | None = None) -> Callable:
    """``compiled``, noting when its training calls start until :data:`STEP_TIMED_CALLS` have, then
    :func:`record_step_period`. Calls without grad are not training steps and are not counted, nor
    are those made while the graph is compiled again beside training (``again``). When
    the rates measured over those calls re-plan the running step (:func:`_close_rate_window`), as
    many calls after the next one are timed too, against the new prediction (``Replan.step_check``)."""
    starts: list[float] = []
    first, last = timed_calls(record.config.accumulation_steps)
    after: tuple[int, int] | None = None  # the calls timed after a re-plan
    # where each timed call's period went (one optimizer step per call: with accumulation a call's
    # period holds no optimizer step but the last's, and the phases are not split)
    phases = _PhaseTimer(torch.device(record.memory.device)) if (
        record.memory is not None and record.config.accumulation_steps == 1) else None

    window: list[RunningOffload] = []  # the offload runtime's rates over the same calls (planner/rates.py)
    replanned: list[RunningOffload] = []  # the offload whose n_gpu_optim the rates changed

    def intervals(a: int, b: int) -> list[float]:
        return [y - x for x, y in zip(starts[a - 1 : b - 1], starts[a:b])]

    def call(*args: Any) -> Any:
        nonlocal after
        timed = False
        if (len(starts) < (after or (first, last))[1] and torch.is_grad_enabled()
                and (again is None or not again.pending)):
            starts.append(_clock())
            if len(starts) == first:
                window.extend(_open_rate_window(record, open_offload))  # none without offloaded optimizer steps
            if phases is not None and first <= len(starts) <= last and after is None:
                timed = len(starts) < last  # the last call's start only ends the one before it
                phases.start()
            if len(starts) == last:
                replanned.extend(w for w in window if _close_rate_window(record, w) is not None)
                record_step_period(record, intervals(first, last), (first, last),
                                   phases.close() if phases is not None else None)
                if replanned:  # the call starting now waits for the switch; time the ones after it
                    after = (last + 1, 2 * last + 1 - first)
            elif after is not None and len(starts) == after[1]:
                record_replan_period(record, intervals(*after), after, replanned[0])
        out = compiled(*args)
        if timed:
            assert phases is not None
            phases.returned(out)
        return out

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call


class _Marks:
    """Points on a step's device timeline: CUDA events recorded on the device's current stream (read
    without a wait until :meth:`seconds`), or host times off CUDA, where each op runs as it is called."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()

    def now(self) -> Any:
        if not self.cuda:
            return _phase_clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3


#: Marks around ``optimizer.step()`` calls kept per timed call (pre and post: several optimizers).
MAX_OPTIMIZER_MARKS = 16

#: The phase timer whose optimizer hooks are on (:meth:`_PhaseTimer._hook`).
_HOOKED: list[_PhaseTimer] = []
STATE.on_reset(lambda: [timer._unhook() for timer in list(_HOOKED)])


class _PhaseTimer:
    """The :class:`~protrain_fx.planner.rates.StepPhases` of the timed training calls of one graph:
    marks where a call starts, where its forward returns, where the backward reaches its outputs (a
    hook on them), where that backward ends (a callback queued on the autograd engine), around each
    ``optimizer.step()`` made on this thread (torch.optim's global step hooks, held from a timed
    call's backward end to the next call's start), and where the next call starts. :meth:`close`
    reads them: on CUDA one wait for the device to reach the last call's start, once per plan."""

    def __init__(self, device: torch.device) -> None:
        self.marks = _Marks(device)
        self.calls: list[dict[str, Any]] = []
        self.hooks: list[Any] = []
        self.thread = threading.get_ident()

    def start(self) -> None:
        """A timed call starts, or the call after the timed ones, whose start ends the last of them."""
        self._unhook()
        self.calls.append({"start": self.marks.now(), "optimizer": []})

    def _hook(self) -> None:
        """torch.optim's global step hooks, from a timed call's backward end to the next call's start,
        for one timer of the process at a time (a timer whose loop stopped there is unhooked by the
        next, or by ``protrain_fx.reset()``)."""
        if not self.hooks:
            for other in list(_HOOKED):
                other._unhook()
            self.hooks = [register_optimizer_step_pre_hook(self._optimizer_mark),
                          register_optimizer_step_post_hook(self._optimizer_mark)]
            _HOOKED.append(self)

    def _unhook(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self in _HOOKED:
            _HOOKED.remove(self)

    def _optimizer_mark(self, *_: Any) -> None:
        marks = self.calls[-1]["optimizer"] if self.calls else None
        if marks is not None and threading.get_ident() == self.thread and len(marks) < MAX_OPTIMIZER_MARKS:
            marks.append(self.marks.now())

    def returned(self, out: Any) -> None:
        """The timed call's forward returned ``out``; its backward is marked through hooks on it."""
        call = self.calls[-1]
        call["returned"] = self.marks.now()

        def done() -> None:
            call["done"] = self.marks.now()
            self._hook()

        def on_grad(_grad: torch.Tensor) -> None:
            if "grad" not in call:
                call["grad"] = self.marks.now()
                torch.autograd.Variable._execution_engine.queue_callback(done)

        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)

    def close(self) -> StepPhases | None:
        """The median phases of the timed calls (each read against the next call's start), the
        hooks removed; ``None`` when no timed call ran its backward and returned to the next."""
        self._unhook()
        seconds = self.marks.seconds
        done: list[StepPhases] = []
        for call, after in zip(self.calls, self.calls[1:]):
            if "done" not in call:
                continue
            opt = call["optimizer"]
            optimizer_s = sum(seconds(a, b) for a, b in zip(opt[::2], opt[1::2]))
            done.append(StepPhases(
                forward_s=seconds(call["start"], call["returned"]),
                loss_s=seconds(call["returned"], call["grad"]),
                backward_s=seconds(call["grad"], call["done"]),
                optimizer_s=optimizer_s,
                rest_s=max(0.0, seconds(call["done"], after["start"]) - optimizer_s),
            ))
        self.calls = []
        return StepPhases.median(done) if done else None


def _open_rate_window(record: CapturedGraph, open_offload: OpenOffload | None) -> list[RunningOffload]:
    """``[the backend's window]`` on the offload whose chunks ``record``'s automatic plan placed with
    optimizer steps of their own (CPU or device), else ``[]``."""
    auto = record.auto_plan
    if auto is None or not auto.offload or open_offload is None:
        return []
    window = open_offload()
    return [] if window is None else [window]


def _close_rate_window(record: CapturedGraph, window: RunningOffload) -> Replan | None:
    """Stores, logs and keeps for later plans (``profile.cache.note_training_rates``) the rates
    ``window`` measured (``AutoPlan.training_rates``). Where the device may step chunks
    (:func:`replans_device_steps`; the counts are the backend's: the window opens on those only),
    ``n_gpu_optim`` is chosen again at those rates (``planner.rates.replan_gpu_optim``) and a faster
    count is applied to the offload at once (``AutoPlan.replanned``, logged); that :class:`Replan`
    is returned."""
    auto = record.auto_plan
    assert auto is not None and record.memory is not None
    if window.grad_clipping is True and not auto.problem.held_steps:  # learned at the first step
        # The plan's prediction becomes the held step's, priced as the plan was (over the rate spread or at the
        # readings): the step period measured over these calls is a held step's, and so is the re-plan's baseline.
        planned = auto.estimate
        auto.problem = dataclasses.replace(auto.problem, held_steps=True)
        auto.estimate = (expected_estimate(auto.problem, auto.config, auto.rate_spread) if auto.rate_spread
                         else CostModel(auto.problem).estimate(auto.config))
        log.info("protrain_fx: graph %d: the loop clips: every offloaded chunk's step waits for the norm; step "
                 "predicted with that %.1f ms (%.1f ms as planned)", record.index,
                 1e3 * auto.estimate.step_s, 1e3 * planned.step_s)
    # every rank re-plans alike
    rates = distributed.from_rank0(training_rates(window.close(), auto.problem, auto.config))
    auto.training_rates = rates
    kept = profile_cache.note_training_rates(
        record.memory.device,
        chunk_params=window.chunk_params,
        cpu_adam_params_per_s=rates.cpu_adam_params_per_s,
        device_step_bytes_per_s=rates.device_step_bytes_per_s,
    )
    if rates.disk_read_bytes_per_s or rates.disk_write_bytes_per_s:
        kept_disk = note_disk_rates(window.spill_dir, rates.disk_read_bytes_per_s,
                                    rates.disk_write_bytes_per_s)
        kept = kept if kept_disk is None else f"{kept} and {kept_disk}" if kept is not None else kept_disk
    where = f"; kept for later plans on this machine in {kept}" if kept is not None else ""
    log.info("protrain_fx: graph %d: %s%s", record.index, rates.line(auto.problem, auto.config), where)
    if (not replans_device_steps(torch.device(record.memory.device)) or auto.replanned is not None
            or window.n_gpu_optim != auto.config.n_gpu_optim):
        return None
    judged = max(auto.analysed_peak_bytes, auto.measured_peak_bytes or 0)
    replan = replan_gpu_optim(auto.problem, auto.config, rates, predicted_s=auto.estimate.step_s,
                              room_bytes=max(0, auto.allocated_cap_bytes - judged))
    distributed.agree({"the re-planned n_gpu_optim": None if replan is None else replan.after.n_gpu_optim},
                      f"the re-plan of graph {record.index}")
    if replan is None:
        return None
    window.set_gpu_optim(replan.after.n_gpu_optim)
    auto.replanned = replan
    log.info("protrain_fx: graph %d: %s", record.index, replan.line())
    return replan


def replans_device_steps(device: torch.device) -> bool:
    """Whether a running plan's ``n_gpu_optim`` is chosen again from the measured rates: where the
    search chooses it (CUDA; on the CPU there is no second device to step on)."""
    return device.type == "cuda"


def record_replan_period(
    record: CapturedGraph, intervals_s: Sequence[float], calls: tuple[int, int], offload: RunningOffload
) -> StepCheck | None:
    """Stores and logs the step period measured after a re-plan (``Replan.step_check``) against the
    re-planned step's prediction, and undoes the re-plan on ``offload`` when that period is longer
    than the one measured before it (``AutoPlan.step_check``): the measurement decides, not the
    cost model that proposed the change."""
    auto = record.auto_plan
    if auto is None or auto.replanned is None or not intervals_s:
        return None
    replan = auto.replanned
    check = StepCheck(predicted_step_s=replan.after_s, intervals_s=tuple(intervals_s), calls=calls,
                      calls_per_step=record.config.accumulation_steps)
    replan.step_check = check
    if auto.step_check is not None:
        replan.measured_before_s = auto.step_check.measured_step_s
        replan.kept = check.measured_step_s <= replan.measured_before_s
        if not replan.kept and offload.n_gpu_optim == replan.after.n_gpu_optim:
            offload.set_gpu_optim(replan.before.n_gpu_optim)
    log.info("protrain_fx: graph %d: %s", record.index, replan.line())
    return check


def record_step_period(
    record: CapturedGraph, intervals_s: Sequence[float], calls: tuple[int, int] = STEP_TIMED_CALLS,
    phases: StepPhases | None = None,
) -> StepCheck | None:
    """Stores and logs a :class:`StepCheck` of ``record``'s automatic plan from the measured
    intervals (seconds between the starts of consecutive training calls ``calls``) and where they
    went (``phases``). ``None`` without intervals."""
    auto = record.auto_plan
    if auto is None or not intervals_s:
        return None
    e = auto.estimate
    check = StepCheck(predicted_step_s=e.step_s, intervals_s=tuple(intervals_s), calls=calls,
                      calls_per_step=record.config.accumulation_steps, phases=phases,
                      predicted_priced_s=e.fwd_s + e.bwd_s + e.opt_s, predicted_around_s=auto.around_estimate_s)
    auto.step_check = check
    log.info("protrain_fx: graph %d: %s", record.index, check.line())
    return check


def record_first_step(record: CapturedGraph, start: tuple[int, int], end: tuple[int, int],
                      again: CompileAgain | None = None) -> PeakCheck | None:
    """The bookkeeping of :func:`watch_first_step`, from plain numbers: ``start`` and ``end`` are
    ``(memory_allocated, max_memory_allocated)`` at the forward's start and the backward's end.
    Stores a :class:`PeakCheck` on ``record.auto_plan`` and logs it, and keeps what the step held
    above the graph's analysed peak (``PeakCheck.outside_bytes``: the user's code around the graph)
    as the reserve of later plans on this device (:func:`outside_reserve`). The graph is removed
    from Dynamo's cache, so that its next call compiles it again with that reserve, when the step
    went over its allocated cap (a warning names the numbers) or when the reserve it was planned
    with was an estimate and, with the measured one, the cost model finds a plan
    :data:`RAISE_MIN_GAIN` faster (:func:`faster_plan_under`); that plan is judged first by the
    compile again (``planner.verify.faster_after_first_step``), which keeps the plan that ran when
    it does not fit. A faster plan (not a miss) is compiled beside training where ``again`` starts
    that compile (``beside.py``): the plan in force trains until it ends. Returns ``None`` (logged)
    when the step did not raise the process' peak, whose value is then unknown."""
    auto, memory = record.auto_plan, record.memory
    assert auto is not None and memory is not None
    # Data-parallel: every rank judges the largest of the ranks' numbers (the plan must fit each).
    start, end = (tuple(map(max, zip(*ranks))) for ranks in zip(*distributed.gather((start, end))))
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
    STATE.measured_outside[device] = max(STATE.measured_outside.get(device, 0), outside)
    keep_outside(auto, outside)  # for later launches of this graph (plan_cache.seed_outside)
    if check.over:
        why = (f"the first step peaked at {check.step_peak_bytes} bytes ({human_bytes(check.step_peak_bytes)}), "
               f"{human_bytes(outside)} above the graph's analysed peak of {check.predicted_peak_bytes} bytes "
               f"({human_bytes(check.predicted_peak_bytes)})"
               f" and over the allocated cap of {check.allocated_cap_bytes} bytes "
               f"({human_bytes(check.allocated_cap_bytes)}) that the plan (n_swap={auto.config.n_swap}, "
               f"n_checkpoint={auto.config.n_checkpoint}) was chosen for under a budget of {auto.budget_bytes} bytes "
               f"({human_bytes(auto.reserve_bytes)} of it kept for the code around the graph)")
        level = logging.WARNING
    elif auto.reserve_source == "outputs" and (better := faster_plan_under(
            auto, auto.step_cap_bytes - outside, compile_s=sum(record.phases.values()), index=record.index)):
        why = (f"the code around the graph held {human_bytes(outside)} at the step's peak, where "
               f"{human_bytes(auto.reserve_bytes)} was kept for it: with that measured, n_swap={better.n_swap}, "
               f"n_checkpoint={better.n_checkpoint} is predicted at least {100 * RAISE_MIN_GAIN:.0f}% faster")
        level = logging.INFO
    else:
        return check
    drop_after_miss(auto, record.index, "the first step " + ("missed" if check.over else "found a faster plan"))
    code = record.dynamo_code
    if code is not None and not check.over:  # the compile again judges the faster plan first
        STATE.faster_plan[(device, code)] = (auto.config, auto.how, better)
        if again is not None and again.start():
            auto.recompile = True
            log.info("protrain_fx: graph %d: %s; this graph is compiled again beside training, and the plan in force "
                     "trains until that compile ends; it and every later plan on %s keep %s under their cap for the "
                     "code around the graph, as measured", record.index, why, device,
                     human_bytes(STATE.measured_outside[device]))
            return check
    if code is not None:  # the next call compiles this graph again, with the measured reserve
        from torch._dynamo.eval_frame import remove_from_cache

        remove_from_cache(code)
        auto.recompile = True
    STATE.reset_after_miss[device] = True
    what = (f"this graph is compiled again at its next call ({code.co_name}), and it and"
            if code is not None else "this graph keeps its plan (it was compiled outside Dynamo), and")
    log.log(level, "protrain_fx: graph %d: %s; %s every later plan on %s keeps %s under its cap for the code "
            "around the graph, as measured", record.index, why, what, device, human_bytes(STATE.measured_outside[device]))
    return check


#: A faster plan found after the first step is compiled only when the time it saves per step repays
#: the compile within this many steps (a short run): a plan 2% faster on a 100 ms step saves 20 s over
#: them, less than the minute a large model's compile takes (``docs/results.md#time-to-the-first-steps``).
REPLAN_PAYBACK_STEPS = 10_000


def faster_plan_under(auto: AutoPlan, cap: int, compile_s: float = 0.0, index: int = 0) -> Counts | None:
    """An activation plan for ``auto``'s chunks as placed (its ``n_persist``, ``n_buffer``,
    ``n_gpu_optim``) that the cost model predicts :data:`RAISE_MIN_GAIN` faster than ``auto.config``
    and under ``cap`` (the cost model's peak scaled by its least margin over the judged peaks:
    :func:`_least_margin`), else ``None``. No plan at all when the step as it is
    was judged under ``cap`` (parameters on the device: ``empty_peak_bytes``). ``None`` too (logged)
    when what it saves per step repays ``compile_s`` (the compile of graph ``index`` as it took)
    only after more than :data:`REPLAN_PAYBACK_STEPS` steps (infinitely many: any plan found repays)."""
    better = _faster_plan_under(auto, cap)
    if better is None or compile_s <= 0 or math.isinf(REPLAN_PAYBACK_STEPS):
        return better
    saved = auto.estimate.step_s - CostModel(auto.problem).estimate(better).step_s
    if saved * REPLAN_PAYBACK_STEPS >= compile_s:
        return better
    log.info("protrain_fx: graph %d: n_swap=%d, n_checkpoint=%d fits the measured room and is predicted %.3g ms "
             "faster per step; not compiled: it would repay the %.0f s this graph's compile took only after %s "
             "steps (more than %s)", index, better.n_swap, better.n_checkpoint, 1e3 * saved, compile_s,
             f"{compile_s / saved:.0f}" if saved > 0 else "infinitely many", REPLAN_PAYBACK_STEPS)
    return None


def _least_margin(auto: AutoPlan) -> float:
    """The least ratio of the cost model's peak to the judged peak over the plan chosen and every
    trial judged as it was (lowered, or analysed): how far above the cap the cost model's peak of a
    plan not judged yet may lie. The cost model's margin differs from plan to plan, so the chosen
    plan's own can let through a plan whose lowering comes out over the cap, and each such plan costs
    a compile that keeps nothing (``docs/results.md#time-to-the-first-steps``)."""
    by_inductor = auto.judged_by == "inductor"
    ratios = [auto.predicted_peak_bytes / max(1, auto.analysed_peak_bytes)]
    ratios += [t.predicted_peak_bytes / max(1, t.analysed_peak_bytes) for t in auto.trials
               if t.by_inductor == by_inductor and t.analysed_peak_bytes > 0 and t.predicted_peak_bytes > 0]
    return min(ratios)


def _faster_plan_under(auto: AutoPlan, cap: int) -> Counts | None:
    """:func:`faster_plan_under` before the payback check."""
    model = CostModel(auto.problem)
    c = auto.config
    empty = Counts(c.n_persist, c.n_buffer, 0, 0, c.n_gpu_optim)
    if not auto.offload and c != empty and auto.empty_peak_bytes <= cap:  # judged, not estimated
        return empty
    margin = _least_margin(auto)
    best: tuple[float, Counts] | None = None
    for s, k in model.activation_pairs():
        config = Counts(c.n_persist, c.n_buffer, s, k, c.n_gpu_optim)
        estimate = model.estimate(config)
        if estimate.peak_bytes <= cap * margin and (best is None or estimate.step_s < best[0]):
            best = (estimate.step_s, config)
    if best is None or best[0] > auto.estimate.step_s * (1 - RAISE_MIN_GAIN) or best[1] == c:
        return None
    return best[1]
