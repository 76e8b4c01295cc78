"""Measured op times (CPU): signatures of compute-bound nodes, the cached measurement, use in block times."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from protrain_fx import meta
from protrain_fx.machine import H200
from protrain_fx.planner import problem as planner_problem
from protrain_fx.profile import ops as opprofile


def _graph():
    """Two mm of one shape, one of another, pointwise ops; every node labelled ``blocks.0``."""

    def f(x, w, v):
        a = torch.mm(x, w)
        b = torch.mm(x, w + 1)  # same shapes as ``a``
        c = torch.mm(x, v)
        return (a + b).sum() + c.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 32), torch.randn(32, 48), torch.randn(32, 16))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for n in nodes:
        n.meta[meta.BLOCK] = "blocks.0"
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    return nodes, mms


def test_signatures_key_shapes_not_nodes():
    nodes, (a, b, c) = _graph()
    sig = opprofile.op_signature(a)
    assert sig is not None and sig.startswith("aten.mm.default(")
    assert "64,32" in sig and "float32" in sig and "@cpu" in sig
    assert opprofile.op_signature(b) == sig
    assert opprofile.op_signature(c) not in (None, sig)
    (add,) = [n for n in nodes if n.target is torch.ops.aten.add.Tensor and n.args[0] in (a, b)]
    assert opprofile.op_signature(add) is None
    placeholder = next(iter(a.graph.nodes))
    assert opprofile.op_signature(placeholder) is None


def test_measured_once_then_read_from_the_cache(tmp_path, capsys, monkeypatch):
    nodes, (a, _, c) = _graph()
    times = opprofile.measure_op_times(nodes, "cpu", cache=tmp_path, repeat=2)
    assert set(times) == {opprofile.op_signature(a), opprofile.op_signature(c)}
    assert all(t > 0 for t in times.values())
    err = capsys.readouterr().err
    assert err.count("protrain_fx: timing 2 matrix/attention ops") == 1
    path = opprofile.ops_cache_path("cpu", tmp_path)
    assert path.parent == tmp_path and path.name.startswith("ops-") and path.exists()
    data = json.loads(path.read_text())
    assert data["version"] == opprofile.CACHE_VERSION and data["times"] == times

    calls = []
    monkeypatch.setattr(opprofile, "time_node", lambda *a, **k: calls.append((a, k)) or 1.0)
    assert opprofile.measure_op_times(nodes, "cpu", cache=tmp_path) == times
    assert calls == [] and capsys.readouterr().err == ""
    # refresh measures again and rewrites the file
    again = opprofile.measure_op_times(nodes, "cpu", cache=tmp_path, refresh=True)
    assert len(calls) == 2 and set(again.values()) == {1.0}
    assert json.loads(path.read_text())["times"] == again
    # times taken with the device kept busy are other readings: measured into a file of their own
    calls.clear()
    prefilled = opprofile.measure_op_times(nodes, "cpu", cache=tmp_path, prefill=True)
    assert len(calls) == 2 and all(k == {"prefill": True} for _, k in calls)
    other = opprofile.ops_cache_path("cpu", tmp_path, prefill=True)
    assert other != path and json.loads(other.read_text())["times"] == prefilled
    assert json.loads(path.read_text())["times"] == again


def test_a_measurement_leaves_the_callers_random_stream_where_it_was(tmp_path):
    """The inputs it draws come from a fork of torch's generator: a seeded script draws the same numbers
    after a compile that timed its ops as after one that read them from the cache."""
    nodes, _ = _graph()
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    assert opprofile.measure_op_times(nodes, "cpu", cache=tmp_path, repeat=1)  # measured: nothing cached there
    assert torch.equal(torch.rand(4), expected)


def test_an_op_that_fails_is_left_out(tmp_path, caplog):
    _, (a, _, c) = _graph()
    v = c.args[1]
    # an input without a traced value: no signature, nothing to measure
    val = v.meta.pop("val")
    assert opprofile.op_signature(c) is None
    # c's traced inputs disagree (64 x 32 @ 5 x 16): the call raises, and a's timing stands
    v.meta["val"] = val.new_empty(5, 16)
    assert opprofile.op_signature(c) is not None
    with caplog.at_level("DEBUG", logger="protrain_fx.profile.ops"):
        times = opprofile.measure_op_times([a, c], "cpu", cache=tmp_path, repeat=1)
    assert set(times) == {opprofile.op_signature(a)}
    assert "could not time aten.mm.default" in caplog.text


def test_phase_times_use_measured_op_times():
    nodes, (a, b, c) = _graph()
    base = planner_problem._phase_times(nodes, [], H200)["blocks.0"][0]
    big = 1.0
    measured = planner_problem._phase_times(nodes, [], H200, op_times={opprofile.op_signature(a): big})
    measured = measured["blocks.0"][0]
    from protrain_fx.analysis.estimate import node_time

    # a and b share the signature: both take the measured second instead of their roofline
    assert measured == pytest.approx(base + 2 * big - node_time(a, H200) - node_time(b, H200))
    fused = planner_problem._phase_times(nodes, [], H200, fused=True)["blocks.0"][0]
    c_measured = {opprofile.op_signature(c): big}
    fused_measured = planner_problem._phase_times(nodes, [], H200, fused=True, op_times=c_measured)
    assert fused_measured["blocks.0"][0] == pytest.approx(fused + big - node_time(c, H200))


def test_the_load_runs_each_distinct_call_in_order_until_done():
    nodes, (a, _, c) = _graph()
    load, signatures = opprofile.compute_load(nodes, "cpu")
    assert signatures == [opprofile.op_signature(a), opprofile.op_signature(c)]  # b shares a's call
    passes = []
    load(lambda: passes.append(1) or len(passes) > 3)
    assert len(passes) == 4  # three passes, then done
    # with no compute-bound call there is no load
    assert opprofile.compute_load([n for n in nodes if opprofile.op_signature(n) is None], "cpu") is None


def test_the_load_keeps_its_inputs_under_the_limit_and_leaves_out_what_fails(caplog):
    nodes, (a, _, c) = _graph()
    # a's inputs (64x32 and 32x48 fp32) take 14336 bytes; c adds 32x16 (2048) to the shared x
    assert opprofile.compute_load(nodes, "cpu", max_bytes=14336)[1] == [opprofile.op_signature(a)]
    assert opprofile.compute_load(nodes, "cpu", max_bytes=16384)[1] == [opprofile.op_signature(a),
                                                                      opprofile.op_signature(c)]
    assert opprofile.compute_load(nodes, "cpu", max_bytes=1000) is None
    c.args[1].meta["val"] = c.args[1].meta["val"].new_empty(5, 16)  # c raises when tried
    with caplog.at_level("DEBUG", logger="protrain_fx.profile.ops"):
        assert opprofile.compute_load(nodes, "cpu")[1] == [opprofile.op_signature(a)]
    assert "load leaves out aten.mm.default" in caplog.text


def test_a_load_that_runs_out_of_memory_stops_and_says_so():
    nodes, (a, _, c) = _graph()
    load, _ = opprofile.compute_load(nodes, "cpu")
    assert load.out_of_memory is False
    calls = []

    def oom(*args, **kwargs):
        calls.append(1)
        raise torch.OutOfMemoryError("planted")

    load.calls = [load.calls[0], (oom, (), {}), load.calls[1]]
    checks = []
    load(lambda: checks.append(1) or len(checks) > 5)
    assert load.out_of_memory is True and len(calls) == 1 and len(checks) == 6  # it stopped, then waited
