"""The backward lowered in a child process beside the forward (``protrain_fx/codegen_child.py``).

CPU, ``PROTRAIN_CODEGEN_CHILD=1`` (on a CPU step the child is off unless asked for), the 2-block tiny
GPT of ``test_lowering.py`` with Inductor's FX graph cache and the allocation plans kept emptied first:
the compile's own lowering of the backward must be a hit on the child's entry, with the child's
allocation plan read back and the gradients of a compile without the child."""

from __future__ import annotations

import time

import pytest
import torch

import protrain_fx
from protrain_fx import codegen_child, settings, state
from protrain_fx.planner.budget import budget_for_peak
from tests.planner.test_auto_plan import logged  # noqa: F401
from tests.planner.test_lowering import _cache_counts, _emptied, _step


@pytest.fixture(scope="module")
def alone():
    """The step compiled without the child: its peak and gradients."""
    _emptied()
    with settings.patch(codegen_child="0"):
        hits, misses = _cache_counts()
        record, grads = _step({"auto_plan": False})
        assert (_cache_counts()[0] - hits, _cache_counts()[1] - misses) == (0, 2)
    return record, grads


def test_a_trial_lowering_sends_its_backward_to_the_child_and_the_compile_hits_both(alone, logged):  # noqa: F811
    plain, grads = alone
    budget = budget_for_peak(plain.memory.peak_bytes) * 4  # the step fits as it is: one trial
    _emptied()
    logged.clear()
    hits, misses = _cache_counts()
    with settings.patch(codegen_child="1"):
        judged, got = _step({"memory_budget": budget, "verify": "inductor"})
    # the trial lowered the forward here (a miss) and hit the child's backward; the compile hit both,
    # sending nothing to the child
    assert (_cache_counts()[0] - hits, _cache_counts()[1] - misses) == (3, 1)
    assert sum("sent to a child" in r.getMessage() for r in logged) == 1
    assert judged.auto_plan.judged_by == "inductor" and judged.auto_plan.trials_run == 1
    assert judged.memory.peak_bytes == judged.auto_plan.analysed_peak_bytes == plain.memory.peak_bytes
    for name, g in grads.items():
        torch.testing.assert_close(got[name], g, msg=name)


def test_a_child_that_fails_leaves_the_backward_to_this_process(logged):  # noqa: F811
    from concurrent.futures import Future

    failed = Future()
    failed.set_exception(RuntimeError("Traceback (most recent call last):\n  File ...\n"
                                      "torch._inductor.exc.InductorError: RuntimeError: no such op\n"
                                      "Use tlparse to see full graph."))
    assert codegen_child.wait(codegen_child.Pending(failed, time.perf_counter()), 0) is None
    said = [r.getMessage() for r in logged if "the child's lowering of the backward failed" in r.getMessage()]
    assert said and "InductorError: RuntimeError: no such op" in said[0] and "lowered here" in said[0]


def test_the_child_lowers_for_cuda_steps_unless_told_and_never_beside_training():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    with settings.patch(codegen_child=None):
        assert not codegen_child.enabled(cpu) and codegen_child.enabled(cuda)
    with settings.patch(codegen_child="0"):
        assert not codegen_child.enabled(cuda)
    with settings.patch(codegen_child="1"):
        assert codegen_child.enabled(cpu)
        state.set_compiling_beside(object())  # a compile beside training: its child would hold device memory
        try:
            assert not codegen_child.enabled(cuda) and not codegen_child.enabled(cpu)
        finally:
            state.set_compiling_beside(None)
        with torch._inductor.config.patch(fx_graph_cache=False):  # the child's code could not reach the compile
            assert not codegen_child.enabled(cpu)


def test_an_offloaded_step_lowered_by_the_child_keeps_its_chunk_buffers_and_trains_like_eager(logged):  # noqa: F811
    """The compile hits the backward the child lowered, with our hooks: its allocation plan (chunk
    buffers never reused) is the one this process reads lowering it itself, to the row, and the step
    trains as eager does."""
    from tests.runtime.test_offload import _batch, _setup

    plans = {}
    for child in ("0", "1"):
        _emptied()
        torch._dynamo.reset()
        protrain_fx.reset()
        logged.clear()
        hits, misses = _cache_counts()
        with settings.patch(codegen_child=child):
            model, reference, opt, ref_opt, handle, compiled = _setup(1, 2, codegen="inductor")
            loss, ref_loss = compiled(*_batch(0)), reference(*_batch(0))
            loss.backward(), ref_loss.backward()
            opt.step(), ref_opt.step()  # the step reads the gradients the backward handed over
            torch.testing.assert_close(compiled(*_batch(1)), reference(*_batch(1)), rtol=1e-5, atol=0)
        record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
        assert any(n.target is torch.ops.protrain.chunk_gather.default for n in record.backward.graph.nodes)
        plans[child] = record.rewritten.inductor_plans
        messages = [r.getMessage() for r in logged]
        assert any("the child lowered the backward" in m for m in messages) == (child == "1")
        assert not any("lowered again" in m for m in messages)  # the child's plan was kept for the hit
        # with the child, this process lowered the forward (a miss) and found the child's backward (a hit)
        assert (_cache_counts()[0] - hits, _cache_counts()[1] - misses) == ((1, 1) if child == "1" else (0, 2))
        assert codegen_child._pool is None  # gone with the compile that started it
        handle.close()
    assert plans["1"] == plans["0"]  # both phases' allocation plans, to the row


def test_a_child_that_takes_too_long_is_stopped_and_the_compile_goes_on(monkeypatch, logged):  # noqa: F811
    from concurrent.futures import Future

    stopped = []
    monkeypatch.setattr(codegen_child, "shut", lambda: stopped.append(True))
    monkeypatch.setattr(codegen_child, "WAIT_MIN_S", 0.2)
    never = codegen_child.Pending(Future(), time.perf_counter())  # a child that never answers
    start = time.perf_counter()
    assert codegen_child.wait(never, 0) is None
    assert time.perf_counter() - start < 5 and stopped == [True]
    assert any("had not lowered the backward" in r.getMessage() for r in logged)


def test_no_child_where_a_filling_store_leaves_the_host_too_little_memory(monkeypatch, logged):  # noqa: F811
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    monkeypatch.setattr(codegen_child, "available_host_bytes", lambda: 40 * 2**30)
    monkeypatch.setattr(codegen_child.chunk_ops, "filling_host_bytes", lambda: 30 * 2**30)
    assert codegen_child.send_backward(0, gm, None, False) is None
    assert codegen_child._pool is None  # nothing started
    assert any("the backward is lowered in this process" in r.getMessage() and "16 GiB" in r.getMessage()
               for r in logged)


def test_a_hugging_face_models_backward_crosses_to_the_child(monkeypatch):
    """A Hugging Face model's nodes carry module stacks whose entries are classes made at run time;
    they stay behind (Inductor does not read them), and the graph and its fake inputs arrive whole."""
    from concurrent.futures import Future

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    transformers = pytest.importorskip("transformers")
    sent = []

    class Pool:  # stands in for the child: keeps what is sent, lowers nothing (the compile lowers it here)
        def submit(self, fn, payload, env):
            sent.append(payload)
            done = Future()
            done.set_result({"seconds": 0.0, "planned": False})
            return done

    monkeypatch.setattr(codegen_child, "_get_pool", lambda: Pool())
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=128, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    torch._dynamo.reset()
    protrain_fx.reset()
    with settings.patch(codegen_child="1"):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        torch.compile(model, backend="protrain")(ids, labels=ids).loss.backward()
    (payload,) = sent
    job = GraphPickler.loads(payload, FakeTensorMode(shape_env=ShapeEnv()))
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    assert len(job["gm"].graph.nodes) == len(record.backward.graph.nodes)
    assert [tuple(t.shape) for t in job["inputs"]] == [
        tuple(n.meta["val"].shape) for n in record.backward.graph.nodes if n.op == "placeholder"]
