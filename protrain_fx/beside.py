"""A faster plan compiled beside training, taken at the start of a later call.

When a graph's first step finds a plan predicted faster with the reserve it measured
(``planner.first_step.record_first_step``), the graph is compiled again. Removing it from Dynamo's
cache makes the next call capture, plan and lower it before it runs: training stops for the whole
compile (a large model's minute and more, ``docs/results.md#time-to-the-first-steps``). On CUDA the
backend instead compiles the Dynamo graph it was handed once more, on a thread of its own, while
the plan in force keeps training; the call that starts after the compile has ended runs the new
plan. Nothing else changes between the two: the same graph, the same inputs, the same chunks
placed (a re-plan for speed keeps the counts), so losses and gradients are those of either plan.

The compile holds Dynamo's compile lock for its whole length (a frame the training loop compiles
meanwhile waits for it, as it would for the compile now), traces under the autocast and grad mode
the graph was first compiled under (a thread's own), lowers the backward too (the backend lowers it
with the forward, never at the first backward on the training thread), measures nothing (readings
taken beside training are not the machine's: ``state.refuse_measuring``), and resets no peak
statistics while training raises them: the switch resets them, so that the new plan's first step is
measured. While it runs, Python's thread switch interval is short (:data:`SWITCH_INTERVAL_S`): the
training thread gives the GIL up at every torch op and would otherwise wait for the compile's Python
to give it back each time.

A compile that fails leaves the plan in force (logged). The re-plan stays where it was, a compile
before the next call, on the CPU (the compile would take the cores the step runs on), in a process
group (every rank must run the same plan at each step) and with deterministic algorithms on (the
step at which the plan changes depends on how long the compile takes).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch._dynamo import config as dynamo_config
from torch._dynamo import convert_frame

from protrain_fx import settings, state
from protrain_fx.capture import captured_graphs
from protrain_fx.planner import first_step
from protrain_fx.runtime.parallel import distributed

log = logging.getLogger("protrain_fx")

#: Inputs of the graph no longer alive when it is compiled again (the first step's batch) are made
#: again, empty, on their device, up to this many bytes in all; above it the re-plan waits for the
#: next call, whose Dynamo capture sees the inputs of that call.
REMADE_INPUT_BYTES = 256 * 2**20

#: Python's thread switch interval (seconds) while a compile runs beside training, against the
#: interpreter's 5 ms: each torch op of the training thread gives the GIL up and waits up to this long
#: to get it back from the compile's Python (``docs/results.md#time-to-the-first-steps``).
SWITCH_INTERVAL_S = 1e-5

_switching_lock = threading.Lock()
_switching = [0, 0.0]  # compiles beside training running, the interval before the first began


@contextlib.contextmanager
def fine_switching() -> Iterator[None]:
    """Python's switch interval at :data:`SWITCH_INTERVAL_S` while any compile beside training runs;
    the interval set before the first is back when the last ends."""
    with _switching_lock:
        if _switching[0] == 0:
            _switching[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_INTERVAL_S, _switching[1]))
        _switching[0] += 1
    try:
        yield
    finally:
        with _switching_lock:
            _switching[0] -= 1
            if _switching[0] == 0:
                sys.setswitchinterval(_switching[1])


def compiling_beside() -> bool:
    """Whether this thread compiles a graph again beside training (the backend resets no peak
    statistics then: the switch does)."""
    return state.compiling_beside() is not None


#: Whether a faster plan compiles beside training where ``PROTRAIN_COMPILE_BESIDE`` is unset.
BY_DEFAULT = True


def compiles_beside(device: torch.device) -> bool:
    """Whether a faster plan for a step on ``device`` is compiled beside training (module docstring;
    ``PROTRAIN_COMPILE_BESIDE=0`` keeps it at the next call everywhere)."""
    wanted = settings.compile_beside()
    return (BY_DEFAULT if wanted is None else wanted) and (
        device.type == "cuda" and distributed.active() is None and not torch.are_deterministic_algorithms_enabled())


_SWITCHES: "weakref.WeakSet[Switch]" = weakref.WeakSet()


def compiling_now() -> bool:
    """Whether a compile beside training runs now, for any graph of this process."""
    return any(switch.pending for switch in list(_SWITCHES))


def waiting_graphs() -> set[int]:
    """Indexes of the graphs compiled beside training that no call has run yet (their plan is not in
    force: the graph they replace still trains)."""
    return {i for switch in list(_SWITCHES) for i in switch.waiting}


def wait_all() -> None:
    """Wait for every compile beside training of this process to end (the next call of each graph
    then runs the plan compiled): a run that must be reproducible step by step, and the tests."""
    for switch in list(_SWITCHES):
        switch.wait()


class Switch:
    """The callable the backend hands Dynamo for a graph: the compiled step in force, and the step
    compiled beside training that takes its place at the start of the first call after its compile
    ended. Dynamo's calling convention (``_boxed_call``) is the compiled step's."""

    def __init__(self, compiled: Callable, device: torch.device | None) -> None:
        self._compiled = compiled
        self._device = device
        self._pending: Future | None = None
        self._index = -1
        #: Indexes of the graphs the compile beside training made, until the switch to them.
        self.waiting: tuple[int, ...] = ()
        if getattr(compiled, "_boxed_call", False):
            self._boxed_call = True

    @property
    def pending(self) -> bool:
        """Whether a compile beside training runs for this graph."""
        return self._pending is not None

    def __call__(self, *args: Any) -> Any:
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            self._take(pending)
        return self._compiled(*args)

    def _take(self, done: Future) -> None:
        try:
            compiled = done.result()
        except Exception as e:  # noqa: BLE001 -- the plan in force goes on; the error is the user's to see
            log.warning("protrain_fx: graph %d: the faster plan compiled beside training failed (%s: %s); the plan "
                        "in force goes on", self._index, type(e).__name__, e)
            self.waiting = ()
            return
        if self._device is not None:
            first_step.reset_peak(self._device)  # the new plan's first step is measured
        self._compiled = compiled
        self.waiting = ()
        log.info("protrain_fx: graph %d: the plan compiled beside training runs from this call on", self._index)

    def start(self, index: int, compile_again: Callable[[], Callable]) -> None:
        """Run ``compile_again`` (the backend compiling graph ``index`` again) on a thread of its own."""
        assert self._pending is None, "one compile beside training at a time"
        self._index = index
        future: Future = Future()

        def run() -> None:
            try:
                with fine_switching():
                    result = compile_again()
                future.set_result(result)
            except BaseException as e:  # noqa: BLE001 -- handed to the training thread at the switch
                future.set_exception(e)

        self._pending = future
        _SWITCHES.add(self)
        # a daemon: a process that ends its training while the compile runs does not wait for it
        threading.Thread(target=run, name="protrain_fx compile beside training", daemon=True).start()

    def wait(self) -> None:
        """Wait for a compile beside training to end (the next call then runs its plan)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.result()


class CompileAgain:
    """What the backend lends the watch of a graph's first steps (``planner.first_step.CompileAgain``):
    :meth:`start` compiles the Dynamo graph ``gm`` of ``record`` again with ``compile_fn`` on a thread
    of its own, and :meth:`switch` is the callable that takes its result at a later call."""

    def __init__(self, record: Any, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 compile_fn: Callable[[torch.fx.GraphModule, list[Any]], Callable]) -> None:
        self._record = record
        self._gm = gm
        self._specs = input_specs(example_inputs)
        self._compile_fn = compile_fn
        self._switch: Switch | None = None
        self._ambient = ambient_state()  # the user's autocast and grad mode, which the compile traces under

    def switch(self, compiled: Callable) -> Callable:
        """``compiled`` (the backend's callable for the graph) behind the :class:`Switch` that later
        runs the graph compiled again; as it is for a graph without an automatic plan (no first step
        is measured, nothing is compiled again)."""
        memory = self._record.memory
        if self._record.auto_plan is None or memory is None:
            return compiled
        self._switch = Switch(compiled, torch.device(memory.device))
        return self._switch

    @property
    def pending(self) -> bool:
        return self._switch is not None and self._switch.pending

    def start(self) -> bool:
        record, switch = self._record, self._switch
        memory = record.memory
        if switch is None or switch.pending or record.dynamo_code is None or memory is None:
            return False
        if not compiles_beside(torch.device(memory.device)):
            return False
        inputs = remade_inputs(record.real_inputs(), self._specs)
        if inputs is None:
            return False
        gm, compile_fn, code, ambient = self._gm, self._compile_fn, record.dynamo_code, self._ambient
        device = torch.device(memory.device)

        def compile_again() -> Callable:
            # (under Dynamo's compile lock: no other thread makes a record meanwhile)
            with (compiling(code), ambient_as(ambient),
                  torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
                made = len(captured_graphs())
                compiled = compile_fn(gm, inputs)
                switch.waiting = tuple(g.index for g in captured_graphs()[made:])
                return compiled

        switch.start(record.index, compile_again)
        return True


def ambient_state() -> dict[str, Any]:
    """This thread's state that AOTAutograd traces a graph under, beyond the graph itself: grad mode and
    autocast (Dynamo compiles under the user's, which a thread of its own does not have)."""
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in ("cuda", "cpu")},
        "autocast_cache": torch.is_autocast_cache_enabled(),
    }


@contextlib.contextmanager
def ambient_as(ambient: dict[str, Any]) -> Iterator[None]:
    """This thread under ``ambient`` (:func:`ambient_state`) for the block."""
    cache = torch.is_autocast_cache_enabled()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(ambient["grad"]))
        for device_type, (enabled, dtype) in ambient["autocast"].items():
            if enabled:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
        torch.set_autocast_cache_enabled(ambient["autocast_cache"])
        try:
            yield
        finally:
            torch.set_autocast_cache_enabled(cache)


def remade_inputs(examples: Sequence[Any], specs: Sequence[tuple | None]) -> list[Any] | None:
    """The graph's example inputs for a compile again: those alive as they are, the others made
    again, empty, from ``specs`` (``(shape, stride, dtype, device, requires_grad)`` per tensor);
    ``None`` when they would take more than :data:`REMADE_INPUT_BYTES`."""
    total = sum(torch.empty(0, dtype=spec[2]).element_size() * _extent(spec[0], spec[1])
                for x, spec in zip(examples, specs) if spec is not None and x is None)
    if total > REMADE_INPUT_BYTES:
        return None
    out = []
    for x, spec in zip(examples, specs):
        if x is None and spec is not None:
            shape, stride, dtype, device, requires_grad = spec
            x = torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(requires_grad)
        out.append(x)
    return out


def input_specs(example_inputs: Sequence[Any]) -> list[tuple | None]:
    """Per example input, what :func:`remade_inputs` makes it again from (``None``: not a tensor)."""
    return [(tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)
            if isinstance(x, torch.Tensor) else None for x in example_inputs]


def _extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


@contextlib.contextmanager
def compiling(code: types.CodeType | None) -> Iterator[None]:
    """This thread compiles the graph of Dynamo's ``code`` again, beside training, under Dynamo's
    compile lock (module docstring). FX marks its tracing in one flag for the whole process, and a
    compiled module called while it is up refuses to run ("using FX to symbolically trace a
    dynamo-optimized function"): the training thread's calls would meet the compile's tracing;
    Dynamo's ``force_compile_during_fx_trace`` lets them run as compiled."""
    state.set_compiling_beside(code)
    try:
        with convert_frame.compile_lock, dynamo_config.patch(force_compile_during_fx_trace=True):
            yield
    finally:
        state.set_compiling_beside(None)
