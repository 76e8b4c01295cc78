"""The suite's results do not depend on the host that runs it (``tests/conftest.py``).

The tests below run in a folder of their own that the suite pins a CPU machine profile in, never the
user's cache; here the tests whose plans read that profile run again under a slow and a fast pinned
host, each in a pytest process of its own, and must pass under both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protrain_fx.planner import offload as autooffload
from protrain_fx.profile import cache as profile_cache
from tests.conftest import HOST, HOSTS, SUITE_CACHE, USER_CACHE
from protrain_fx import settings

ROOT = Path(__file__).resolve().parent.parent

#: Tests whose plans read the CPU machine profile (offloads with automatic counts that do not replace
#: the machine by hand), found by recording which tests read it: the four that choose counts in one
#: compile. The others that read it (torchrun's, the model-init and Hugging Face loops') cost more and
#: choose the same way.
PLANNER_FACING = [
    "tests/integration/test_hf_trainer.py::test_automatic_counts_with_the_trainers_gradient_checkpointing_train_like_the_plain_trainer",
    "tests/integration/test_training_loops.py::test_an_offloaded_model_past_the_recompile_limit_names_the_limit",
    "tests/passes/test_param_casts.py::test_a_model_whose_chunks_all_stay_on_the_device_saves_no_weight_cast_either",
    "tests/runtime/test_state_dict_hooks.py::test_the_loops_own_save_and_restart_continue_exactly[automatic]",
]


def test_the_suite_plans_from_its_own_pinned_profile_not_the_users_cache():
    assert os.environ[settings.CACHE_DIR] == str(SUITE_CACHE)
    assert profile_cache.cache_dir() == SUITE_CACHE != USER_CACHE
    pinned = profile_cache.pinned_profile("cpu")
    assert pinned == HOSTS[HOST]
    # what the planner prices an offload with on the CPU: the pinned profile, nothing measured
    assert autooffload.offload_machine(__import__("torch").device("cpu"), None, 1 << 20, [1 << 20]) == pinned


@pytest.fixture(scope="module")
def runs_on_each_host():
    """The planner-facing tests, in a pytest process per host, both started at once (the second core of
    a two-core machine runs the other): host -> (return code, output)."""
    started = {}
    for host in ("slow", "fast"):
        env = {**os.environ, "PROTRAIN_TEST_HOST": host}
        env.pop(settings.CACHE_DIR)  # the run's own suite folder, pinned to ``host``
        env.pop("TORCHINDUCTOR_CACHE_DIR")
        started[host] = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *PLANNER_FACING],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = {}
    for host, proc in started.items():
        out, _ = proc.communicate(timeout=900)
        done[host] = (proc.returncode, out)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("host", ["slow", "fast"])
def test_the_planner_facing_tests_pass_on_a_slow_and_a_fast_host(host, runs_on_each_host):
    code, out = runs_on_each_host[host]
    assert code == 0, out[-4000:]
