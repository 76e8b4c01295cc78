"""``protrain_fx/settings.py``: the environment variables the package reads, and ``patch``."""

from __future__ import annotations

import os

import pytest

from protrain_fx import settings
from protrain_fx.passes import pipeline
from protrain_fx.planner import plan_cache
from protrain_fx.profile import cache as profile_cache


def test_patch_sets_the_variables_for_the_block_and_puts_them_back(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.PLAN_CACHE, "1")
    monkeypatch.delenv(settings.DUMP_DIR, raising=False)
    with settings.patch(plan_cache=False, cache_dir=tmp_path, dump_dir=None):
        assert os.environ[settings.PLAN_CACHE] == "0" and not plan_cache.enabled()
        assert profile_cache.cache_dir() == tmp_path and settings.dump_dir() is None
    assert os.environ[settings.PLAN_CACHE] == "1" and plan_cache.enabled()
    assert settings.DUMP_DIR not in os.environ
    with pytest.raises(TypeError, match="unknown setting.*plan_cashe.*known: cache_dir"):
        with settings.patch(plan_cashe=False):
            pass


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("off", False), ("YES", True), ("1", True),
                                                  ("", None), ("maybe", None)])
def test_progress_reads_on_off_or_leaves_it_to_the_stream(monkeypatch, value, expected):
    monkeypatch.setenv(settings.PROGRESS, value)
    assert settings.progress() is expected


def test_the_passes_named_off_are_checked_by_the_pipeline(monkeypatch):
    with settings.patch(disable_passes=" gather_chunks , annotate_plan"):
        assert pipeline.disabled_passes() == {"gather_chunks", "annotate_plan"}
    with settings.patch(disable_passes="gather_chunk"), pytest.raises(ValueError, match="gather_chunk cannot"):
        pipeline.disabled_passes()


def test_torchruns_local_ranks_else_one_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert settings.local_ranks(4, 3) == (4, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert settings.local_ranks(4, 3) == (2, 1)
