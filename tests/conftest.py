"""Shared test set-up: the repository root on ``sys.path`` (for ``examples``) and a fresh compile state per test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python -m pytest`` adds the cwd, plain ``pytest`` does not
    sys.path.insert(0, str(ROOT))

import protrain_fx  # noqa: E402
from protrain_fx.profile import cache as profile_cache

#: The real one, for the tests of it (``tests/planner/test_calibrate.py``, on their own cache directory).
NOTE_TRAINING_RATES = profile_cache.note_training_rates


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    """Every test starts (and leaves) with no Dynamo cache and no captured records."""
    torch._dynamo.reset()
    protrain_fx.reset()
    yield
    torch._dynamo.reset()
    protrain_fx.reset()


@pytest.fixture(autouse=True)
def _training_rates_not_kept(monkeypatch):
    """Rates one test's training reaches are not kept in this machine's profile file, where later
    tests' plans would be priced at them (``planner/rates.py``)."""
    monkeypatch.setattr(profile_cache, "note_training_rates", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    """Plans are chosen at every compile, as the tests of the planner expect, and none is kept in the
    user's cache directory (``planner/plan_cache.py``; ``tests/planner/test_plan_cache.py`` turns it on,
    in a folder of its own)."""
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "0")
