"""Shared test set-up: the repository root on ``sys.path`` (for ``examples``), a fresh compile state per
test, and a machine profile of the suite's own.

The planner prices plans with rates measured on the host (``profile/machine_profile.py``), so a test
that checks a choice would pass or fail with the speed of the machine that runs it. The suite runs
instead against a **pinned** profile (``profile.cache.pin_machine_profile``) in a cache folder of its
own, made when the suite starts and removed when it ends: ``PROTRAIN_CACHE_DIR`` points there for
every test and every process a test starts, so the user's ``~/.cache/protrain_fx`` is neither read
nor written (Inductor's caches are there too). ``PROTRAIN_TEST_HOST`` picks the pinned host (:data:`HOSTS`: ``default``, ``slow``,
``fast``); ``tests/test_host_profiles.py`` runs the planner-facing tests under ``slow`` and ``fast``.
Tests of the profiler and of calibration measure in folders of their own (``tmp_path``).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

#: torch's logging and trace settings of the shell that runs the suite are dropped before torch is
#: imported (it reads them then): a TORCH_TRACE or TORCH_LOGS left set would make torch build and write
#: every compile's trace, and the tests of the backend's log and trace would read another setting.
for _name in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT"):
    os.environ.pop(_name, None)
#: Inductor's CPU kernels are generated and compiled scalar: its vectorized C++ (the legality analysis
#: per kernel and the compile of SIMD code) is half of a CPU lowering's time, and nothing this suite
#: checks (the passes, the plans, the memory, training against eager) depends on it; the GPU's kernels
#: are Triton's. Set before torch is imported (Inductor reads it then), for every process a test starts.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # ``python -m pytest`` adds the cwd, plain ``pytest`` does not
    sys.path.insert(0, str(ROOT))

import protrain_fx  # noqa: E402
from protrain_fx.backend import register  # noqa: E402
from protrain_fx.profile import cache as profile_cache  # noqa: E402
from protrain_fx.search.problem import MachineProfile  # noqa: E402
from protrain_fx import settings  # noqa: E402

register()  # backend="protrain" from a checkout that is not installed (the GPU machine runs the suite so)

#: The real one, for the tests of it (``tests/planner/test_calibrate.py``, on their own cache directory).
NOTE_TRAINING_RATES = profile_cache.note_training_rates

#: The CPU hosts the suite can be pinned to (``PROTRAIN_TEST_HOST``). ``default``: the CPU "device"'s
#: constants (``protrain_fx.machine.CPU``: 20 GB/s copies, its Adam from 50 GB/s at 70%) with a CPU
#: chunk step of 0.4 G parameters/s, about what a busy 2-core host measures; ``slow`` and ``fast``
#: are a tenth-speed and a fast host, far apart on every rate the offload counts depend on.
HOSTS = {
    "default": MachineProfile(h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, duplex_bytes_per_s=20e9,
                              cpu_adam_params_per_s=0.4e9, gpu_adam_params_per_s=1.25e9),
    "slow": MachineProfile(h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, duplex_bytes_per_s=5e9,
                           cpu_adam_params_per_s=0.1e9, gpu_adam_params_per_s=1.25e9),
    "fast": MachineProfile(h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, duplex_bytes_per_s=50e9,
                           cpu_adam_params_per_s=5e9, gpu_adam_params_per_s=1.25e9),
}

HOST = os.environ.get("PROTRAIN_TEST_HOST", "default")
if HOST not in HOSTS:
    raise pytest.UsageError(f"PROTRAIN_TEST_HOST={HOST!r}; accepted: {', '.join(HOSTS)}")

#: The user's cache folder (what ``PROTRAIN_CACHE_DIR`` unset means), which no test may touch.
USER_CACHE = Path.home() / ".cache" / "protrain_fx"


def pin_cpu_profile(folder: str | os.PathLike[str] | None = None) -> Path:
    """Pin the CPU's machine profile to the suite's host (:data:`HOST`) in ``folder`` (default: the
    folder ``PROTRAIN_CACHE_DIR`` names); returns the profile file."""
    return profile_cache.pin_machine_profile("cpu", HOSTS[HOST], cache=folder)


def use_cache_dir(monkeypatch: pytest.MonkeyPatch, folder: str | os.PathLike[str]) -> Path:
    """Point ``PROTRAIN_CACHE_DIR`` at ``folder`` for one test, with the suite's pinned CPU profile in it."""
    monkeypatch.setenv(settings.CACHE_DIR, str(folder))
    pin_cpu_profile(folder)
    return Path(folder)


SUITE_CACHE = Path(tempfile.mkdtemp(prefix="protrain_fx_tests_"))
os.environ[settings.CACHE_DIR] = str(SUITE_CACHE)  # inherited by every process a test starts
# Inductor's caches too, in the suite's folder: every run starts cold, as CI does, and no test reuses
# code an earlier run compiled beside allocation plans it did not keep (protrain_fx/lowering.py)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(SUITE_CACHE / "inductor")
pin_cpu_profile(SUITE_CACHE)


def _user_cache_state() -> dict[str, tuple[int, int]]:
    """Name -> (size, mtime in ns) of every file in the user's cache folder."""
    if not USER_CACHE.is_dir():
        return {}
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in USER_CACHE.iterdir() if p.is_file()}


USER_CACHE_AT_START = _user_cache_state()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SUITE_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _user_cache_untouched():
    """No test writes the user's cache folder (the suite's own is ``PROTRAIN_CACHE_DIR``)."""
    yield
    assert _user_cache_state() == USER_CACHE_AT_START, f"a test wrote {USER_CACHE}"


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    """Every test starts (and leaves) with no Dynamo cache and no captured records."""
    torch._dynamo.reset()
    protrain_fx.reset()
    yield
    torch._dynamo.reset()
    protrain_fx.reset()


def _trace_log_without_pytests_capture() -> None:
    """pytest 9 attaches its log-capture handlers to every logger that does not propagate, torch's
    structured-trace log among them, and torch builds every trace payload of every compile whenever
    that log has a handler (minutes over the suite): they are taken off it for each test phase."""
    from torch._logging._internal import trace_log

    for handler in list(trace_log.handlers):
        if type(handler).__module__.startswith("_pytest."):
            trace_log.removeHandler(handler)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _trace_log_without_pytests_capture()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _trace_log_without_pytests_capture()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    _trace_log_without_pytests_capture()


@pytest.fixture(autouse=True)
def _no_structured_trace_left():
    """No test leaves torch's structured trace on for the tests after it: with a handler on its log,
    torch builds every trace payload of every compile (minutes over the suite), and the backend's
    artifacts with them (``inspect/structured.py``)."""
    yield
    from torch._logging._internal import LazyTraceHandler, trace_log

    trace_log.propagate = False
    for handler in list(trace_log.handlers):
        if not isinstance(handler, LazyTraceHandler) or handler.root_dir is not None or handler.stream is not None:
            trace_log.removeHandler(handler)


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
    monkeypatch.setenv(settings.PLAN_CACHE, "0")


@pytest.fixture
def replans(monkeypatch):
    """A faster plan the first step finds is compiled whatever the compile cost: the tiny models' steps
    save microseconds (or nothing the cost model prices), so ``planner.first_step.REPLAN_PAYBACK_STEPS``
    holds every such re-plan back, and the tests of the re-plan itself opt in here."""
    from protrain_fx.planner import first_step

    monkeypatch.setattr(first_step, "REPLAN_PAYBACK_STEPS", math.inf)
