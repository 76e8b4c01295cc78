"""bench/device_step_chain.py's CPU parts: the chunk layouts it measures are the auto plan's B24
chunks (the sizes the profile files recorded), the two rate definitions, and the loads."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "device_step_chain.py"
_spec = importlib.util.spec_from_file_location("device_step_chain", _PATH)
chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chain)


def test_layouts_are_the_recorded_b24_chunks():
    # the profile files' layout keys (docs/raw/session18_machine_c2/c3.json): params and tensor count
    assert sum(chain.block_parts(chain.LAYOUTS["1.3B"])) == 100716544
    assert sum(chain.block_parts(chain.LAYOUTS["4.2B"])) == 226572288
    assert len(chain.block_parts(3072)) == 24


def test_round_and_step_rates():
    n = 1000
    # two rounds of 3 steps: each round spans 3 s; steps 1 s (the first of each round) then 2 s
    got = chain.rates(n, 3, [3.0, 3.0], [1.0, 2.0, 2.0, 1.0, 2.0, 2.0])
    assert got["round"] == pytest.approx(3 * 14 * n / 3.0)
    assert got["step"] == pytest.approx(14 * n / 2.0)
    assert got["step_after_first"] == pytest.approx(14 * n / 2.0)
    one = chain.rates(n, 1, [1.0], [1.0])
    assert one["step_after_first"] == 0.0  # no step waits behind another


def test_block_load_runs_a_whole_block_backward_until_done():
    # a shape mistake in any of its products or gradients raises here
    calls = []

    def done():
        calls.append(1)
        return len(calls) > 2

    chain.block_backward_until(done, width=128, batch=2, seq=16, head_dim=32, device="cpu")
    assert len(calls) == 3  # two blocks, then done


def test_the_profilers_load_of_a_block_is_its_products():
    # ``ops``: opprofile.compute_load of the block's traced nodes. On the CPU attention has no FLOP
    # formula, so the load is the block's matrix products: 4 forward, 8 gradient, each shape once.
    from protrain_fx.opprofile import compute_load

    nodes = chain.block_nodes(128, device="cpu", batch=2, seq=16, head_dim=32)
    load, signatures = compute_load(nodes, "cpu")
    assert len(signatures) == 12 and all(s.startswith("aten.mm.default(") for s in signatures)
    assert signatures[0].startswith("aten.mm.default(T[32,128](128,1)bfloat16@cpu, T[128,384]")  # QKV
    calls = []
    load(lambda: calls.append(1) or len(calls) > 2)
    assert len(calls) == 3


def test_every_variant_is_known_to_the_profiler_or_the_block_load():
    for beside, waiting, refetch in chain.VARIANTS.values():
        assert beside in ("matmul", "deep_kept", "block", "ops")
        assert isinstance(waiting, bool) and isinstance(refetch, bool)
