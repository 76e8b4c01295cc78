"""The launch users write: ``torchrun --nproc_per_node=2 examples/train_dp.py`` on CPU (gloo), offloaded
with the counts left to the backend under a budget, so that the planner's exchanges between ranks (rank 0's
measurements broadcast, the chosen plan agreed) run inside the compile, under its fake mode."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import pin_cpu_profile

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_trains_the_example_with_automatic_counts_and_the_ranks_agree(tmp_path):
    env = {**os.environ, "PROTRAIN_PLAN_CACHE": "0", "PROTRAIN_CACHE_DIR": str(pin_cpu_profile(tmp_path / "cache").parent),
           "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "examples" / "train_dp.py"), "--steps", "3", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1", "step 2", "step 3"]
    (summary,) = [line for line in lines if "every rank holds the same parameters" in line]
    assert summary.endswith("True")
    n_persist, n_chunks = (int(w) for w in summary.split(" chunks")[0].split(" of "))
    # the budget shards chunks over the ranks; how many stay is the planner's close call on a CPU (a
    # persistent chunk is stepped after backward by the loop's optimizer, an offloaded one beside it by
    # the worker), decided by rates measured on a busy machine: 0 or 1 here
    assert n_persist < n_chunks, summary
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    from examples.gpt import GPT, gpt_config

    GPT(gpt_config("small")).load_state_dict(checkpoint["model"])  # whole tensors: a plain model loads them
