"""``protrain_fx/heap.py``: the objects alive before a trial are frozen while it runs, and thawed after."""

from __future__ import annotations

import gc

import pytest

from protrain_fx import heap


def _collected(obj: object) -> bool:
    """Whether the collector's generations hold ``obj`` (a frozen object is in none of them)."""
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_before_are_frozen_during_the_block_and_thawed_after():
    assert gc.get_freeze_count() == 0
    old = [object()]
    with heap.frozen():
        young = [object()]  # made inside the block: its collections see it
        assert gc.get_freeze_count() > 0
        assert not _collected(old) and _collected(young)
    assert gc.get_freeze_count() == 0
    assert _collected(old) and _collected(young)


def test_thawed_after_an_error():
    with pytest.raises(RuntimeError):
        with heap.frozen():
            raise RuntimeError("a trial failed")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_elsewhere_is_left_as_it_was():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with heap.frozen():
            assert gc.get_freeze_count() == count
        assert gc.get_freeze_count() == count  # not thawed: the freeze is not ours
    finally:
        gc.unfreeze()
