"""bench/step_trace.py without a GPU: how it names kernels' kinds of work, and how it splits the cost
model's estimate of a captured step into the same kinds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import capture
from protrain_fx import machine as machines
from protrain_fx.backend import register
from protrain_fx.profile.ops import op_signature

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # step_trace imports peers from there
_SPEC = importlib.util.spec_from_file_location("bench_step_trace", ROOT / "bench" / "step_trace.py")
step_trace = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(step_trace)


@pytest.mark.parametrize(
    ("name", "kind"),
    [  # kernel names from a compiled B24 760M step on the H200
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "products"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0",
         "attention"),
        ("triton_per_fused__to_copy_add_native_layer_norm_backward_view_9", "generated"),
        ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>", "other"),
        ("Memset (Device)", "other"),
    ],
)
def test_kernel_kind(name, kind):
    assert step_trace.kernel_kind(name) == kind


def _tiny_step():
    """The captured step (forward and backward graphs) of the tiny GPT, eager codegen."""
    register()
    capture.reset()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    run = torch.compile(model, backend="protrain", options={"auto_plan": False, "codegen": "eager"})
    idx, targets = random_batch(gpt_config("tiny"), 2, 32)
    run(idx, targets).backward()
    return next(g for g in capture.captured_graphs() if g.backward is not None)


def test_estimate_splits_the_step_by_kind():
    record = _tiny_step()
    machine = machines.H200
    plain = step_trace.estimate(record, machine, None)
    for phase, graph in (("forward", record.forward), ("backward", record.backward)):
        nodes = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
        assert sum(plain[phase]["nodes"].values()) == len(nodes)
        assert plain[phase]["seconds"]["products"] > 0 and plain[phase]["seconds"]["generated"] > 0
        assert plain[phase]["timed_nodes"] == 0
    # a measured time for every product: those nodes' seconds become it, counted as products
    nodes = [n for g in (record.forward, record.backward) for n in g.graph.nodes]
    op_times = {sig: 1.0 for n in nodes if (sig := op_signature(n)) is not None}
    timed = step_trace.estimate(record, machine, op_times)
    for phase in ("forward", "backward"):
        products = timed[phase]["nodes"]["products"] + timed[phase]["nodes"]["attention"]
        assert timed[phase]["timed_nodes"] == products > 0
        assert timed[phase]["seconds"]["products"] == pytest.approx(timed[phase]["nodes"]["products"])
        assert timed[phase]["seconds"]["generated"] == pytest.approx(plain[phase]["seconds"]["generated"])


def test_protocol_rounds_times_every_product_afresh_under_both_protocols():
    record = _tiny_step()
    rounds = step_trace.protocol_rounds(record, machines.H200, 2, device="cpu")
    plain = step_trace.estimate(record, machines.H200, None)
    for protocol in ("events", "prefilled"):
        assert len(rounds[protocol]) == 2
        for r in rounds[protocol]:
            for phase in ("forward", "backward"):
                # measured on this CPU: far slower than the H200's roofline the untimed estimate uses
                assert r[phase]["products"] > plain[phase]["seconds"]["products"]
                assert r[phase]["generated"] == pytest.approx(plain[phase]["seconds"]["generated"])


def test_idle_time_splits_the_device_idle_time_by_who_it_waited_for():
    kernels = [  # (start, end, name, correlation), out of order
        (5.0, 7.0, "b", 2),
        (1.0, 3.0, "a", 1),
        (7.5, 9.0, "c", 3),  # its launch began at 7.2, after "b" ended: the device waited for the host
        (8.0, 10.0, "d", 4),  # overlaps "c" (another stream): no gap
        (10.5, 11.0, "e", 5),  # launched long before: a gap, but not the host's
    ]
    launches = {1: (0.5, 0.6), 2: (4.0, 4.1), 3: (7.2, 7.3), 4: (7.4, 7.45), 5: (2.0, 2.1)}
    got = step_trace.idle_time(kernels, launches, 0.0, 12.0)
    assert got["preamble_s"] == pytest.approx(1.0)
    assert got["gaps"] == 3
    assert got["idle_s"] == pytest.approx(2.0 + 0.5 + 0.5)
    assert got["host_bound_s"] == pytest.approx(2.0 + 0.5)  # "b" launched at 4.0 > 3.0; "c" at 7.2 > 7.0
    assert got["by_kernel"] == pytest.approx({"b": 2.0, "c": 0.5})
    assert got["tail_s"] == pytest.approx(1.0)
    assert step_trace.idle_time([], launches, 0.0, 1.0)["idle_s"] == 0.0
