"""The backend's log under torch's logging controls (``protrain_fx/logs.py``) and its artifacts in
torch's structured trace (``protrain_fx/inspect/structured.py``, ``TORCH_TRACE`` and ``tlparse``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import protrain_fx
from protrain_fx import logs
from protrain_fx.inspect import structured

ROOT = Path(__file__).resolve().parents[2]

#: Trains the tiny GPT for one step under a budget that needs a plan (eager codegen).
SCRIPT = """
import torch
from examples.gpt import GPT, gpt_config, random_batch
cfg = gpt_config("tiny", n_layer=4)
torch.manual_seed(0)
model = GPT(cfg)
x, y = random_batch(cfg, 4, 32, generator=torch.Generator().manual_seed(0))
torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": "5MB"})(x, y).backward()
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_torchs_private_registration_api_is_where_the_package_uses_it():
    """Fails loudly when the pinned torch moves what logs.py relies on."""
    from torch._logging import _internal

    assert callable(_internal.register_log) and hasattr(_internal, "log_registry")
    assert _internal.log_registry.is_log(logs.ALIAS)
    assert _internal.log_registry.log_alias_to_log_qnames[logs.ALIAS] == [logs.LOGGER]


@pytest.fixture
def torch_logs_restored():
    """torch's set_logs() takes over every registered log's level, handlers and propagation; the
    package's logger is put back as it was for the tests after."""
    logger = logging.getLogger(logs.LOGGER)
    saved = logger.level, logger.propagate, list(logger.handlers)
    yield
    torch._logging.set_logs()
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def test_set_logs_turns_the_packages_log_up_by_its_short_name_and_back(torch_logs_restored):
    logger = logging.getLogger(logs.LOGGER)
    try:
        torch._logging.set_logs(modules={"protrain": logging.DEBUG})
        assert logger.getEffectiveLevel() == logging.DEBUG
        torch._logging.set_logs(modules={"protrain": logging.INFO})
        assert logger.getEffectiveLevel() == logging.INFO
    finally:
        torch._logging.set_logs()
    assert logger.getEffectiveLevel() == logging.WARNING


@pytest.mark.slow
def test_torch_logs_shows_the_backends_info_and_debug_lines_and_an_unrelated_setting_does_not():
    debug = _run({"TORCH_LOGS": "+protrain_fx"})
    assert debug.returncode == 0, debug.stderr[-3000:]
    assert "automatic activation plan for graph 0" in debug.stderr  # INFO: the plan table
    assert "judged at" in debug.stderr and "nothing to do" in debug.stderr  # DEBUG: the trials, the passes
    other = _run({"TORCH_LOGS": "recompiles"})  # an unrelated setting leaves the package's lines off
    assert "automatic activation plan" not in other.stderr and "judged at" not in other.stderr


def _trace_records(folder: Path) -> list[dict]:
    records = []
    for log_file in folder.glob("*.log"):
        for line in log_file.read_text().splitlines():
            start = line.find("{")
            if start >= 0 and '"artifact"' in line:
                records.append(json.loads(line[start:]))
    return records


@pytest.mark.slow
def test_torch_trace_holds_each_artifact_once_under_the_compile_id_and_tlparse_renders_them(tmp_path):
    done = _run({"TORCH_TRACE": str(tmp_path / "trace")})
    assert done.returncode == 0, done.stderr[-3000:]
    ours = [r for r in _trace_records(tmp_path / "trace") if r["artifact"]["name"].startswith(structured.PREFIX)]
    names = [r["artifact"]["name"] for r in ours]
    assert sorted(names) == sorted(f"protrain_{n}" for n in (
        "plan", "candidates", "block_table", "forward_graph", "backward_graph", "memory_timeline"))
    assert {(r["frame_id"], r["frame_compile_id"]) for r in ours} == {(0, 0)}  # the compile's id
    if shutil.which("tlparse") is None:
        pytest.skip("tlparse is not installed (pip install 'protrain_fx[tlparse]')")
    (log_file,) = (tmp_path / "trace").glob("*.log")
    rendered = subprocess.run(["tlparse", str(log_file), "-o", str(tmp_path / "out"), "--no-browser"],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    directory = json.loads((tmp_path / "out" / "compile_directory.json").read_text())
    artifacts = [a["name"] for entry in directory.values() for a in entry["artifacts"]]
    assert any(a.startswith("protrain_plan") for a in artifacts), artifacts


def test_a_test_runs_with_nothing_on_torchs_trace_log_but_its_lazy_handler():
    """The suite takes pytest's capture handlers off torch's trace log (``tests/conftest.py``): with
    them there, torch would build every compile's trace payloads through the whole suite."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    assert all(isinstance(h, LazyTraceHandler) and h.root_dir is None for h in trace_log.handlers)
    assert not structured.tracing()


def test_only_a_handler_that_writes_the_trace_somewhere_counts_as_tracing(monkeypatch):
    """torch's lazy handler without a folder and a test runner's log capture are not a trace; a
    handler the user puts on torch's trace log, or the lazy one with a folder, is."""
    from _pytest.logging import LogCaptureHandler
    from torch._logging._internal import LazyTraceHandler, trace_log

    monkeypatch.setattr(trace_log, "handlers", [LazyTraceHandler(None), LogCaptureHandler()])
    assert not structured.tracing()
    monkeypatch.setattr(trace_log, "handlers", [LazyTraceHandler("/some/folder")])
    assert structured.tracing()
    monkeypatch.setattr(trace_log, "handlers", [logging.StreamHandler()])
    assert structured.tracing()


def test_without_torch_trace_no_artifact_is_built(monkeypatch, torch_logs_restored):
    """The payloads are built only for a trace: with ``TORCH_TRACE`` unset, none is, even right after
    ``set_logs()`` put torch's lazy trace handler back."""
    def refuse(*args, **kwargs):
        raise AssertionError("an artifact was built without TORCH_TRACE")

    torch._logging.set_logs()
    assert not structured.tracing()

    monkeypatch.setattr(structured, "plan_json", refuse)
    monkeypatch.setattr(structured, "candidates_json", refuse)
    monkeypatch.setattr(structured, "to_chrome_trace", refuse)
    from examples.gpt import GPT, gpt_config, random_batch

    cfg = gpt_config("tiny", n_layer=4)
    x, y = random_batch(cfg, 4, 32, generator=torch.Generator().manual_seed(0))
    torch.compile(GPT(cfg), backend="protrain", options={"codegen": "eager", "memory_budget": "5MB"})(x, y).backward()
    assert protrain_fx.captured_graphs()[0].auto_plan is not None
