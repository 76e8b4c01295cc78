"""A faster plan found at the first step, compiled beside training (``protrain_fx/beside.py``).

On the CPU the re-plan compiles before the next call; here ``compiles_beside`` is made to say yes,
as on CUDA, so that the thread, the switch and what the watch of the first steps does around them
run in CI. The memory counters are driven as in ``test_auto_plan``'s loss-outside test.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import threading

import pytest
import torch

import protrain_fx
from examples.gpt import GPT
from protrain_fx import backend, beside, settings
from protrain_fx.planner import first_step, reserve
from tests.planner.test_auto_plan import CONFIG, _batch, _device_budget, _loss_outside, _train_graphs, logged  # noqa: F401
from tests.planner.test_auto_plan import budget_for_peak


def _empty_peak(options: dict, autocast: bool, monkeypatch) -> int:
    """The step's analysed peak without a plan, as the planner judges it with ``options``."""
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})(_batch()[0]).sum().backward()
    (bare,) = _train_graphs()
    torch._dynamo.reset()
    protrain_fx.reset()
    _device_budget(monkeypatch, budget_for_peak(bare.memory.peak_bytes))  # a plan is chosen: it says
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.compile(GPT(CONFIG), backend="protrain", options=options)(_batch()[0]).sum().backward()
    (planned,) = _train_graphs()
    torch._dynamo.reset()
    protrain_fx.reset()
    return planned.auto_plan.empty_peak_bytes


@pytest.fixture
def gated(monkeypatch):
    """Compiles beside training start only when the returned event is set."""
    gate = threading.Event()
    original = beside.compiling

    @contextlib.contextmanager
    def held(code):
        assert gate.wait(60), "the test never opened the gate"
        with original(code):
            yield

    monkeypatch.setattr(beside, "compiling", held)
    monkeypatch.setattr(beside, "compiles_beside", lambda device: True)
    yield gate
    gate.set()
    beside.wait_all()


@pytest.mark.parametrize("codegen, autocast", [("eager", False), ("inductor", False), ("eager", True)],
                         ids=["eager", "inductor", "eager-autocast"])
def test_a_faster_plan_compiles_beside_training_and_takes_over_at_a_later_call(codegen, autocast, monkeypatch, logged,
                                                                               gated):
    """The first step measures less held around the graph than its plan kept; the faster plan it
    finds compiles on a thread while the plan in force trains on (a call made meanwhile does not
    wait for the compile and is not timed); the call after the compile ended runs the new plan, whose
    first step is measured. Every step matches eager's, whichever plan ran it. With Inductor, the
    backward is lowered on the thread too: the first backward of the new plan lowers nothing. Under the
    loop's autocast, the thread traces the graph under it too (it is the calling thread's state)."""
    monkeypatch.setattr(reserve, "LARGE_OUTPUT_BYTES", 1024)  # the tiny GPT's logits count as large
    monkeypatch.setattr(first_step, "REPLAN_PAYBACK_STEPS", math.inf)
    numel = 4 * 32 * CONFIG.vocab_size
    # plans judged by the graph analysis (the budget is made from its peak): fits as is beside 4 bytes a logit
    options = {"codegen": codegen, "verify": "graph"}
    _device_budget(monkeypatch, budget_for_peak(_empty_peak(options, autocast, monkeypatch) + 4 * numel))
    state = {"reads": 0, "graph": None}

    def counters(device):  # the step held 4 bytes a logit above its graph's analysed peak, as lowered by now
        state["reads"] += 1
        if state["reads"] % 2:
            return 1000, 2000
        memory = state["graph"].memory
        return 1000, 1000 + memory.peak_bytes + 4 * numel - sum(memory.timeline.baseline_bytes.values())

    monkeypatch.setattr(first_step, "memory_counters", counters)
    resets = []
    monkeypatch.setattr(first_step, "reset_peak", resets.append)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    lowered = []  # (graph, phase, thread) of each Inductor lowering of the compile
    lower = backend.lower

    def watched_lower(record, graph, inputs, phase, *args, **kwargs):
        lowered.append((record.index, phase, threading.current_thread().name))
        return lower(record, graph, inputs, phase, *args, **kwargs)

    monkeypatch.setattr(backend, "lower", watched_lower)
    compiled = torch.compile(model, backend="protrain", options=options)
    ran = []

    def same(a, b):  # eager's kernels exactly; Inductor's fused ones to fp32 rounding
        if codegen == "eager":
            assert torch.equal(a, b), step
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for step in range(4):
        if step == 2:  # the compile beside training may start now; the next call takes its plan
            gated.set()
            beside.wait_all()
            assert beside.waiting_graphs() == {1}  # compiled, not running yet
        batch = _batch(seed=step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss_outside(compiled, batch)
        ran.append(len(_train_graphs()))
        state["graph"] = _train_graphs()[-1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref_loss = _loss_outside(reference, batch)
        same(loss, ref_loss)
        loss.backward(), ref_loss.backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            same(p.grad, r.grad)
        for m in (model, reference):
            m.zero_grad()
    first, second = _train_graphs()
    assert beside.waiting_graphs() == set()
    logits = torch.bfloat16 if autocast else torch.float32  # what the loop's autocast makes of them
    assert [o.dtype for o in first.auto_plan.returned] == [o.dtype for o in second.auto_plan.returned] == [str(logits).removeprefix("torch.")]
    assert ran == [1, 1, 2, 2]  # step 1 ran the first plan while the compile waited at the gate
    assert first.auto_plan.recompile and first.auto_plan.peak_check.outside_bytes == 4 * numel
    assert first.dynamo_code is not None and second.dynamo_code is first.dynamo_code
    assert second.auto_plan.reserve_source == "measured" and second.auto_plan.how == "fits as is"
    assert second.auto_plan.peak_check is not None and not second.auto_plan.recompile  # its first step measured
    assert resets == [torch.device("cpu")]  # by the switch, so that the new plan's first step is measured
    if codegen == "inductor":  # the new plan's forward and backward lowered on the thread, not in training
        again = [(phase, thread) for index, phase, thread in lowered if index == second.index]
        assert [phase for phase, _ in again] == ["forward", "backward"]
        assert all("compile beside training" in thread for _, thread in again)
    lines = [r.getMessage() for r in logged]
    assert any("compiled again beside training" in line for line in lines)
    assert any("runs from this call on" in line for line in lines)
    assert not [r for r in logged if r.levelno >= logging.WARNING]
    torch._dynamo.reset()
    protrain_fx.reset()


def test_a_compile_beside_training_that_fails_leaves_the_plan_in_force(monkeypatch, logged):
    """The compile again raises on its thread: a warning names the error, and training goes on with
    the plan that ran, exact."""
    switch = beside.Switch(lambda x: x + 1, None)

    def fails():
        raise RuntimeError("lowering failed")

    switch.start(7, fails)
    switch.wait()
    assert switch(torch.ones(1)).item() == 2  # the plan in force
    assert not switch.pending and switch.waiting == ()
    (warning,) = [r.getMessage() for r in logged if r.levelno >= logging.WARNING]
    assert "graph 7" in warning and "lowering failed" in warning and "plan in force goes on" in warning


def test_the_switch_interval_is_short_while_any_compile_runs_beside_training():
    """Python's switch interval is :data:`beside.SWITCH_INTERVAL_S` from the first compile beside
    training to the end of the last (two here, one failing), and the one set before comes back."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        gates = [threading.Event(), threading.Event()]
        seen = []

        def compile_again(gate: threading.Event, fail: bool):
            def run():
                seen.append(sys.getswitchinterval())
                gate.wait(10)
                if fail:
                    raise RuntimeError("lowering failed")
                return lambda x: x
            return run

        first, second = beside.Switch(lambda x: x, None), beside.Switch(lambda x: x, None)
        first.start(0, compile_again(gates[0], fail=True))
        second.start(1, compile_again(gates[1], fail=False))
        gates[0].set()
        first.wait()
        short = pytest.approx(beside.SWITCH_INTERVAL_S, rel=1e-3)  # (kept in microseconds)
        assert sys.getswitchinterval() == short  # the second still compiles
        gates[1].set()
        second.wait()
        assert seen == [short] * 2
        assert sys.getswitchinterval() == pytest.approx(0.004, rel=1e-3)
    finally:
        sys.setswitchinterval(before)


def test_inputs_gone_are_made_again_and_large_ones_keep_the_compile_before_the_next_call():
    alive = torch.zeros(3)
    gone = torch.empty_strided((4, 8), (1, 4), dtype=torch.int64)
    specs = beside.input_specs([alive, gone, 5])
    made = beside.remade_inputs([alive, None, 5], specs)
    assert made[0] is alive and made[2] == 5
    assert made[1].shape == (4, 8) and made[1].stride() == (1, 4) and made[1].dtype == torch.int64
    big = beside.input_specs([torch.empty(1).expand(2**27, 2)])  # a view: its extent, not its numel
    assert beside.remade_inputs([None], big) is not None
    huge = [((beside.REMADE_INPUT_BYTES // 4 + 1,), (1,), torch.float32, torch.device("cpu"), False)]
    assert beside.remade_inputs([None], huge) is None


@pytest.mark.parametrize("why", ["cpu", "deterministic", "setting"])
def test_where_the_re_plan_stays_a_compile_before_the_next_call(why, monkeypatch):
    cuda = torch.device("cuda", 0)
    if why == "cpu":
        assert not beside.compiles_beside(torch.device("cpu"))
    elif why == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert not beside.compiles_beside(cuda)
    else:
        with settings.patch(compile_beside="0"):
            assert not beside.compiles_beside(cuda)
        with settings.patch(compile_beside="1"):
            assert beside.compiles_beside(cuda)


def test_the_training_thread_runs_its_compiled_step_while_the_compile_traces():
    """FX's tracing flag is one for the process: a compiled module called while another thread traces
    refuses to run, unless the compile beside training lets it (``beside.compiling``)."""
    from torch.fx import _symbolic_trace

    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend="eager")
    assert double(torch.ones(2)).tolist() == [2.0, 2.0]
    tracing, done = threading.Event(), threading.Event()

    def compile_beside():
        with beside.compiling(None):
            flag = _symbolic_trace._is_fx_tracing_flag
            _symbolic_trace._is_fx_tracing_flag = True  # as a trace of the compile holds it
            tracing.set()
            done.wait(30)
            _symbolic_trace._is_fx_tracing_flag = flag

    thread = threading.Thread(target=compile_beside)
    thread.start()
    try:
        assert tracing.wait(30)
        assert double(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        done.set()
        thread.join()
    torch._dynamo.reset()
