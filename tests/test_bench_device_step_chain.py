"""bench/device_step_chain.py's CPU parts: the chunk layouts it measures are the auto plan's B24
chunks (the sizes the profile files recorded), and the two rate definitions."""

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


def test_every_variant_is_known_to_the_profiler_or_the_block_load():
    for beside, waiting, refetch in chain.VARIANTS.values():
        assert beside in ("matmul", "deep_kept", "block")
        assert isinstance(waiting, bool) and isinstance(refetch, bool)
