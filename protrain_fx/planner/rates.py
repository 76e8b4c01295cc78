"""The rates an offloaded step reaches in training, measured over its first training calls.

The machine profile (``profile/machine_profile.py``, ``measure_machine``) measures the two rates an
offloaded step pays on every step with stand-ins for training around them: the CPU step of one chunk
under copy traffic and kernel launches, and device steps (``runtime/optim/device_adam.py``) beside matrix
products. Training reaches neither exactly: the device steps run slower beside the model's own
kernels than beside the stand-ins, and the CPU step's rate moves from host to host, enough to put a
predicted step 10-15% off (``docs/results.md#profiled-rates-against-training``).

So the runtime's own work is timed while the user trains. Between the starts of the training calls
:data:`STEP_TIMED_CALLS`, a window on the optimizer steps of the offload whose chunks the plan placed
(the backend's :class:`RunningOffload`; its readings come as data, ``handoffs.StepReadings``, and
:func:`training_rates` makes rates of them):

* the CPU worker's chunk steps: seconds from each step's gradient landed on the host to its new
  working copy written, and the parameters stepped (``ChunkAdamW.computed``);
* each device step on CUDA: from its first copy in to its last copy out (CUDA events,
  ``DeviceAdamW.window``), against the bytes the cost model has it copy out, less what the cost
  model has backward's re-fetches beside it add (:func:`alone_rate`: the rate the cost model takes,
  ``MachineProfile.device_step_bytes_per_s``, before it adds them).

At the window's end the rates are kept in the device's profile file
(``profile/cache.py``, ``note_training_rates``) and later plans on this machine are priced at them
(``training_rates`` there: a restart, another budget or model, a new input shape). The running
plan's step is predicted again at these rates, each timed chunk's device step at its own median
time (``search.problem.Problem.device_step_s``: the one issued last in backward runs longer than the rest),
and logged beside the measured step period (:class:`TrainingRates`).

Then the one count the running step can change is chosen again at these rates:
``n_gpu_optim``, which offloaded chunks the CPU steps and which stream through the device
(:func:`replan_gpu_optim`). A faster count (by :data:`REPLAN_MIN_GAIN`, and only where its device
staging fits under the cap) is applied between two calls (``RunningOffload.set_gpu_optim``) and the
calls after it are timed against its prediction (:class:`Replan`). Measured slower than the
calls before it, the change is undone: the cost model can be wrong about it, when the device
steps hold backward up more than it models (``docs/results.md#the-rate-window-and-the-re-plan``). The chunk counts (where the optimizer state
lives) and the activation plan (compiled in) stay.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from protrain_fx.handoffs import StepReadings
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts, Problem


#: Training calls of a planned graph whose starts are timed (:func:`watch_first_step`): the step
#: period is the median of the intervals between the starts of calls ``STEP_TIMED_CALLS[0]`` ..
#: ``STEP_TIMED_CALLS[1]`` (1-based), after the first (compiles) and second (warms the allocator
#: and the optimizer's state) have run.
STEP_TIMED_CALLS = (3, 8)


def timed_calls(calls_per_step: int) -> tuple[int, int]:
    """The training calls whose starts time the step period: :data:`STEP_TIMED_CALLS`, or with
    several calls per optimizer step, from its first as many calls as one step has (their intervals
    add up to one step's period, whichever micro-batch the window starts at)."""
    first, last = STEP_TIMED_CALLS
    return (first, first + calls_per_step) if calls_per_step > 1 else (first, last)


@dataclass(frozen=True)
class StepCheck:
    """The step period of a planned graph measured in training against the cost model's step time.

    ``intervals_s``: wall-clock seconds between the starts of consecutive training calls of the graph
    (:data:`STEP_TIMED_CALLS`); their median is the measured period: the whole training step as the
    user's loop runs it (the optimizer, data loading, and with several graphs per step, the others).
    No synchronisation is added: in a steady state the host runs no further ahead of the device
    between two calls than before them. With ``calls_per_step`` training calls per optimizer step
    (the option ``accumulation_steps``) an interval is one micro-batch's and the prediction the
    whole accumulated step's: the period is then the mean interval times ``calls_per_step`` (the
    window times whole steps: :func:`timed_calls`)."""

    predicted_step_s: float
    intervals_s: tuple[float, ...]
    #: The training calls whose starts were timed (1-based, first and last).
    calls: tuple[int, int] = STEP_TIMED_CALLS
    calls_per_step: int = 1
    #: Where the period went (:class:`StepPhases`, medians over the timed calls), with the cost
    #: model's share of it; ``None`` where it was not measured (several calls per optimizer step).
    phases: StepPhases | None = None
    #: The cost model's seconds for the graph and the optimizer (:attr:`StepPhases.priced_s`): the
    #: prediction without the accumulated micro-batches (``Estimate.fwd_s + bwd_s + opt_s``).
    predicted_priced_s: float | None = None
    #: The user's code around the graph estimated before any step ran (``AutoPlan.around_estimate_s``:
    #: a loss on the outputs returned to it); 0: nothing estimated.
    predicted_around_s: float = 0.0

    @property
    def measured_step_s(self) -> float:
        if self.calls_per_step == 1:
            return statistics.median(self.intervals_s)
        return statistics.fmean(self.intervals_s) * self.calls_per_step

    @property
    def error_pct(self) -> float:
        """The prediction against the measured period, in % of the measured (positive: predicted slower)."""
        return 100 * (self.predicted_step_s / self.measured_step_s - 1)

    @property
    def priced_error_pct(self) -> float | None:
        """The cost model's graph-and-optimizer seconds against the same part of the period measured
        (:attr:`StepPhases.priced_s`), in %; ``None`` where the phases were not measured."""
        if self.phases is None or self.predicted_priced_s is None or self.phases.priced_s <= 0:
            return None
        return 100 * (self.predicted_priced_s / self.phases.priced_s - 1)

    @property
    def with_around_s(self) -> float | None:
        """The predicted step with the user's code around the graph as measured (:attr:`StepPhases.around_s`,
        which no plan changes): what the next plans of this step are compared with."""
        return None if self.phases is None else self.predicted_step_s + self.phases.around_s

    def line(self) -> str:
        a, b = self.calls
        line = (f"step period measured {self.measured_step_s * 1e3:.1f} ms (median between the starts of training "
                f"calls {a} to {b}) against {self.predicted_step_s * 1e3:.1f} ms predicted ({self.error_pct:+.1f}%)")
        if self.phases is not None and (err := self.priced_error_pct) is not None:
            assert self.predicted_priced_s is not None and (around := self.with_around_s) is not None
            line += (f"; of it {self.phases.line()}: the graph and the optimizer "
                     f"{self.phases.priced_s * 1e3:.1f} ms against {self.predicted_priced_s * 1e3:.1f} ms "
                     f"predicted ({err:+.1f}%); the step predicted with the code around the graph as measured: "
                     f"{around * 1e3:.1f} ms ({100 * (around / self.measured_step_s - 1):+.1f}%)")
        if self.predicted_around_s:
            line += (f"; with it estimated before the first step ({self.predicted_around_s * 1e3:.1f} ms): "
                     f"{self.first_estimate_s * 1e3:.1f} ms ({self.first_estimate_error_pct:+.1f}%)")
        return line

    @property
    def first_estimate_s(self) -> float:
        """The step as the plan predicted it before any step ran: the graph and the optimizer, and the
        user's code around the graph estimated (:attr:`predicted_around_s`)."""
        return self.predicted_step_s + self.predicted_around_s

    @property
    def first_estimate_error_pct(self) -> float:
        """:attr:`first_estimate_s` against the measured period, in % of the measured."""
        return 100 * (self.first_estimate_s / self.measured_step_s - 1)


@dataclass(frozen=True)
class StepPhases:
    """Where a training call's period went, on the step's device (CUDA events on its stream; host
    time on the CPU, which runs each op as it is called): the graph's forward (``forward_s``), the
    user's code on its outputs until the backward reaches the graph (``loss_s``: a loss computed
    outside the model, and its backward), the graph's backward (``backward_s``), the
    ``optimizer.step()`` calls before the next training call (``optimizer_s``, timed by torch.optim's
    global step hooks), and the rest (``rest_s``: clipping, ``zero_grad``, data, a device left idle
    while the host prepares the next call). The cost model prices the first, the third and the
    fourth (:attr:`priced_s`); the others are the user's code around the graph (:attr:`around_s`)."""

    forward_s: float
    loss_s: float
    backward_s: float
    optimizer_s: float
    rest_s: float

    @property
    def priced_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def around_s(self) -> float:
        return self.loss_s + self.rest_s

    @classmethod
    def median(cls, calls: list[StepPhases]) -> StepPhases:
        """Each phase's median over ``calls`` (one odd call moves none)."""
        return cls(*(statistics.median(getattr(c, f.name) for c in calls) for f in dataclasses.fields(cls)))

    def line(self) -> str:
        return (f"forward {self.forward_s * 1e3:.1f} ms, loss {self.loss_s * 1e3:.1f}, backward "
                f"{self.backward_s * 1e3:.1f}, optimizer {self.optimizer_s * 1e3:.1f}, rest {self.rest_s * 1e3:.1f}")


@dataclass(frozen=True)
class TrainingRates:
    """What an offloaded step's runtime reached over a window of training calls.

    ``cpu_params`` parameters were stepped on the CPU in ``cpu_s`` seconds of the worker's compute
    (0 and 0: none); ``device_steps``: (chunk in the host store's numbering, from 0 at the first
    offloaded chunk; seconds) of each device step timed (empty: none, or
    not on CUDA) and ``device_step_bytes_per_s`` their rate without the re-fetches beside them
    (:func:`alone_rate`; 0: none timed), the rate the cost model prices an untimed step at.
    ``device_step_s``: per chunk timed (in the cost model's numbering, all
    chunks from 0), the median of its steps' seconds: the running plan is priced with them
    (:meth:`priced`, ``search.problem.Problem.device_step_s``), the chunks not timed at the median rate.
    ``disk_read_bytes_per_s`` / ``disk_write_bytes_per_s``: the spill file's reads and writes (bytes
    over the I/O thread's seconds in them; 0: none)."""

    cpu_params: int
    cpu_s: float
    device_steps: tuple[tuple[int, float], ...] = ()
    device_step_bytes_per_s: float = 0.0
    device_step_s: tuple[tuple[int, float], ...] = ()
    disk_read_bytes_per_s: float = 0.0
    disk_write_bytes_per_s: float = 0.0

    @property
    def cpu_adam_params_per_s(self) -> float:
        """The CPU step's rate in training (0: nothing stepped on the CPU)."""
        return self.cpu_params / self.cpu_s if self.cpu_params and self.cpu_s > 0 else 0.0

    def priced(self, problem: Problem) -> Problem:
        """``problem`` with its machine's rates replaced by those measured here (where measured)."""
        changes = {}
        if self.cpu_adam_params_per_s:
            changes["cpu_adam_params_per_s"] = self.cpu_adam_params_per_s
        if self.device_step_bytes_per_s:
            changes["device_step_bytes_per_s"] = self.device_step_bytes_per_s
        timed = self.device_step_s or problem.device_step_s
        machine = dataclasses.replace(problem.machine, **changes)
        disk = {k: v for k, v in (("disk_read_bytes_per_s", self.disk_read_bytes_per_s),
                                  ("disk_write_bytes_per_s", self.disk_write_bytes_per_s)) if v > 0}
        return dataclasses.replace(problem, machine=machine, device_step_s=timed, **disk)

    def line(self, problem: Problem, config: Counts) -> str:
        """One log line: the rates against the profile's, and ``config``'s step predicted at them."""
        m, parts = problem.machine, []
        if self.cpu_adam_params_per_s:
            parts.append(f"CPU Adam {self.cpu_adam_params_per_s / 1e9:.2f} G params/s (profiled "
                         f"{m.cpu_adam_params_per_s / 1e9:.2f})")
        if self.device_step_bytes_per_s:
            parts.append(f"device steps {self.device_step_bytes_per_s / 1e9:.1f} GB/s each way without the "
                         f"re-fetches beside them, over {len(self.device_steps)} steps (profiled "
                         f"{m.device_step_bytes_per_s / 1e9:.1f})")
            if not self.cpu_adam_params_per_s:  # a profiled CPU rate read too low is never corrected then
                parts.append(f"no CPU step timed (the profiled CPU rate, {m.cpu_adam_params_per_s / 1e9:.2f} G "
                             "params/s, stands untested)")
        if self.disk_read_bytes_per_s or self.disk_write_bytes_per_s:
            parts.append(f"spill file read {self.disk_read_bytes_per_s / 2**30:.2f} GiB/s, written "
                         f"{self.disk_write_bytes_per_s / 2**30:.2f} GiB/s (profiled {problem.disk_read_bytes_per_s / 2**30:.2f}, "
                         f"{problem.disk_write_bytes_per_s / 2**30:.2f})")
        if not parts:
            return "no offloaded optimizer step was timed in training"
        step = CostModel(self.priced(problem)).estimate(config).step_s
        return f"in training: {', '.join(parts)}; step predicted at these rates {step * 1e3:.1f} ms"


class RunningOffload(Protocol):
    """An offloaded model in training, as the rate window reads it and the re-plan changes it (the
    backend adapts the offload handle whose chunks the plan placed: ``backend.py``). A window on its
    optimizer steps opens when it is made (``runtime/offload/step_window.py``); the rest is read
    when asked, and ``n_gpu_optim`` is the one count a running step can change."""

    @property
    def chunk_params(self) -> int:
        """Parameters one chunk holds."""

    @property
    def spill_dir(self) -> Path:
        """The folder its store spills optimizer state to."""

    @property
    def grad_clipping(self) -> bool | None:
        """Whether the loop clips (learned at its first optimizer step)."""

    @property
    def n_gpu_optim(self) -> int:
        """Offloaded chunks stepped on the device now."""

    def close(self) -> StepReadings:
        """What its optimizer steps did since the window opened."""

    def set_gpu_optim(self, n_gpu_optim: int) -> None:
        """The first ``n_gpu_optim`` offloaded chunks stepped on the device from the next gradient that
        lands (``OffloadHandle.set_gpu_optim``: nothing moves)."""


def training_rates(readings: StepReadings, problem: Problem, config: Counts) -> TrainingRates:
    """The rates of ``readings`` (a window's, device steps still running left out). The cost model
    of ``problem`` gives each device-stepped chunk's bytes out (``config``: which chunks are lean,
    with no working copy to write back)."""
    timed = readings.device_steps
    by_chunk: dict[int, list[float]] = {}
    rate = 0.0
    if timed:
        model = CostModel(dataclasses.replace(problem, device_step_s=()))
        for c, s in timed:  # the store numbers the offloaded chunks from 0; the cost model all chunks
            k = c + config.n_persist
            if 0 <= k < len(model.dev_out_bytes) and s > 0:
                by_chunk.setdefault(k, []).append(s)
        rate = alone_rate(model, config, {k: statistics.median(s) for k, s in by_chunk.items()})
    r = readings
    return TrainingRates(cpu_params=r.cpu_params, cpu_s=r.cpu_s, device_steps=timed,
                         device_step_bytes_per_s=rate,
                         device_step_s=tuple((k, statistics.median(s)) for k, s in sorted(by_chunk.items())),
                         disk_read_bytes_per_s=r.disk_read_bytes / r.disk_read_s if r.disk_read_s > 0 else 0.0,
                         disk_write_bytes_per_s=r.disk_written_bytes / r.disk_write_s if r.disk_write_s > 0 else 0.0)


def alone_rate(model: CostModel, config: Counts, seconds: dict[int, float]) -> float:
    """The device steps' rate each way without the re-fetches beside them, from ``seconds`` (chunk
    -> the median of its device steps timed in training under ``config``): the bytes they copy out
    over their seconds, each less what the cost model has the backward re-fetches beside it add
    (``CostModel.refetch_beside_steps``), summed over the chunks. The rate the model prices an
    untimed step at (``MachineProfile.device_step_bytes_per_s``) before it adds those, so a later
    plan priced at it does not count the re-fetches twice. 0: nothing timed.

    Summed, not per chunk: the model places the re-fetches on a reference timeline without
    recompute, so it gives the first step issued more of them than it ran beside, while the total
    over all steps comes close to what was measured
    (``docs/results.md#device-steps-beside-re-fetches-and-swap-ins``)."""
    if not seconds:
        return 0.0
    lean_from = model.lean_from(config.n_persist)
    added = model.refetch_beside_steps(config)
    out = sum(model.dev_in_bytes[k] if k >= lean_from else model.dev_out_bytes[k] for k in seconds)
    alone = sum(seconds.values()) - sum(added[k] for k in seconds)
    if alone <= 0.0:  # the model's re-fetches exceed what was measured: the measured rate stands
        alone = sum(seconds.values())
    return out / alone


#: How much faster (a fraction of its own step at the measured rates) another ``n_gpu_optim`` must be
#: predicted before a running plan is changed to it: the rates are a few calls' medians, and a switch
#: waits once for every optimizer step in flight.
REPLAN_MIN_GAIN = 0.03


@dataclass
class Replan:
    """``n_gpu_optim`` changed from ``before``'s to ``after``'s once training measured its rates
    (:func:`replan_gpu_optim`); the other counts and the activation plan stayed. ``predicted_s``:
    ``before``'s step as first predicted (the profiled rates); ``before_s`` and ``after_s``: both
    steps predicted at the measured rates. ``step_check``: the step period measured over the calls
    after the change (:class:`StepCheck`; ``None`` until they ran)."""

    before: Counts
    after: Counts
    predicted_s: float
    before_s: float
    after_s: float
    step_check: StepCheck | None = None
    #: The step period measured before the change (calls 3-8); ``kept``: whether the change stayed
    #: once measured (``None`` until then). A change measured slower than that period is undone.
    measured_before_s: float | None = None
    kept: bool | None = None

    def line(self) -> str:
        line = (f"re-planned at the rates training reached: n_gpu_optim {self.before.n_gpu_optim} -> "
                f"{self.after.n_gpu_optim} (nothing else changes); step predicted at these rates "
                f"{self.after_s * 1e3:.1f} ms against {self.before_s * 1e3:.1f} ms for the plan that ran "
                f"(first predicted {self.predicted_s * 1e3:.1f} ms)")
        if self.step_check is not None:
            line += f"; after it: {self.step_check.line()}"
        if self.kept is not None and self.measured_before_s is not None:
            line += (f"; kept (measured before it: {self.measured_before_s * 1e3:.1f} ms)" if self.kept else
                     f"; slower than the {self.measured_before_s * 1e3:.1f} ms measured before it, so undone: "
                     f"n_gpu_optim back to {self.before.n_gpu_optim}")
        return line


def replan_gpu_optim(
    problem: Problem,
    config: Counts,
    rates: TrainingRates,
    *,
    predicted_s: float,
    room_bytes: int,
    min_gain: float = REPLAN_MIN_GAIN,
) -> Replan | None:
    """The ``n_gpu_optim`` whose step ``problem``'s cost model predicts fastest at ``rates`` (the
    rates training reached), everything else of ``config`` kept, when it beats ``config``'s own by
    more than ``min_gain``; else ``None``.

    Why only this count: moving a chunk between the CPU's and the device's optimizer step moves no
    state (both read and write the host store; ``OffloadHandle.set_gpu_optim``) and changes no graph,
    so the running step can take it between two calls. The chunk counts place the optimizer state
    and the activation counts are compiled in. A CPU step slower in training than profiled (the rate
    differs from host to host: ``docs/results.md#cpu-step-rate-within-and-across-hosts``) makes a plan that
    steps many chunks there slow by the same factor, and stepping more on the device is then the one remedy
    the running step can take.

    Memory: a count above 0 holds the device steps' staging and gradients in flight
    (``CostModel.static_bytes``); a count is only taken when what it adds to ``config``'s static bytes
    fits in ``room_bytes`` (the allocated cap less the plan's judged peak). ``predicted_s``:
    ``config``'s step as predicted when it was chosen (kept in the :class:`Replan`)."""
    model = CostModel(rates.priced(problem))
    p, b, s, c = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint
    here = model.static_bytes(p, b, config.n_gpu_optim)
    now = model.step_time(p, b, s, c, config.n_gpu_optim)
    best_g, best = config.n_gpu_optim, now
    for g in range(model.max_gpu_optim(p) + 1):
        if model.static_bytes(p, b, g) - here > room_bytes:
            continue
        t = model.step_time(p, b, s, c, g)
        if t < best:
            best_g, best = g, t
    if best_g == config.n_gpu_optim or best >= now * (1 - min_gain):
        return None
    after = dataclasses.replace(config, n_gpu_optim=best_g)
    return Replan(before=config, after=after, predicted_s=predicted_s, before_s=now, after_s=best)
