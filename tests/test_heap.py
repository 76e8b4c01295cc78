"""``protrain_fx/heap.py``: no full garbage collection while a trial runs, the young ones as before."""

from __future__ import annotations

import gc

import pytest

from protrain_fx import heap


@pytest.fixture
def eager_collector():
    """A collector that runs a full collection every few allocations (and the thresholds back after)."""
    before = gc.get_threshold()
    gc.set_threshold(10, 1, 1)
    yield
    gc.set_threshold(*before)


def _generations_collected(allocations: int) -> set[int]:
    collected: set[int] = set()

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collected.add(info["generation"])

    gc.callbacks.append(seen)
    try:
        kept = [[] for _ in range(allocations)]  # tracked containers that survive: they grow old
        del kept
    finally:
        gc.callbacks.remove(seen)
    return collected


def test_only_young_generations_are_collected_inside_and_every_one_after(eager_collector):
    survivors = len(gc.get_objects())  # enough for a full collection: a quarter of the old ones is
    with heap.young_only():
        inside = _generations_collected(survivors)
    assert 0 in inside and 2 not in inside
    assert gc.get_threshold() == (10, 1, 1)
    assert 2 in _generations_collected(survivors)


def test_thresholds_come_back_after_an_error(eager_collector):
    with pytest.raises(RuntimeError):
        with heap.young_only():
            raise RuntimeError("a trial failed")
    assert gc.get_threshold() == (10, 1, 1)
