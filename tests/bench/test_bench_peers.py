"""bench/peers.py's bookkeeping, without training: plan specs, ladder / resume / deadline decisions,
host RAM and FLOPs estimates, the Llama's parameter count; and one CPU dry run cut by a deadline and
resumed (marked slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch

ROOT = Path(__file__).resolve().parent.parent.parent
_SPEC = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
peers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peers)


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [("swap=2,checkpoint=10", (2, 10)), ("checkpoint=all", (0, None)), ("swap=3", (3, 0)),
     ("swap=all,checkpoint=4", (None, 4))],
)
def test_plan_spec(spec, parsed):
    assert peers.parse_plan_spec(spec) == parsed


@pytest.mark.parametrize("spec", ["swap=2;checkpoint=1", "keep=1", "swap=-1", "swap=all,checkpoint=all", "swap=1,swap=2"])
def test_bad_plan_spec(spec):
    with pytest.raises(ValueError):
        peers.parse_plan_spec(spec)


def test_plan_from_spec_counts():
    labels = peers.block_labels("350M")
    assert labels[0] == "blocks.0" and len(labels) == 24
    for spec, counts in [("swap=2,checkpoint=10", (2, 10, 12)), ("checkpoint=all", (0, 24, 0)),
                         ("swap=2,checkpoint=all", (2, 22, 0))]:
        plan = peers.plan_from_spec(spec, labels)
        assert tuple(sum(plan.policy(b) == p for b in labels) for p in ("swap", "checkpoint", "none")) == counts
    assert peers.block_labels("llama1.1B")[-1] == "model.layers.21"
    assert peers.system_names(["protrain", "protrain_plan"], ["checkpoint=all", "swap=1"]) == [
        "protrain", "protrain_plan[checkpoint=all]", "protrain_plan[swap=1]"]


def test_block_labels_are_the_backends():
    config = gpt_config("tiny")
    model = torch.compile(GPT(config), backend="protrain", options={"codegen": "eager"})
    model(*random_batch(config, 2, 16, generator=torch.Generator().manual_seed(0))).backward()
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    assert list(record.blocks.labels) == peers.block_labels("tiny")


@pytest.mark.parametrize("size", ["llama1.1B", "llama_tiny"])
def test_llama_params_and_flops(size):
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = peers.build_model(size)
    assert sum(p.numel() for p in model.parameters()) == peers.num_params(size)
    c = peers.LLAMA_SIZES[size]
    d = c["hidden_size"]
    expected = 6 * (peers.num_params(size) - c["vocab_size"] * d) + 12 * c["num_hidden_layers"] * d * 1024
    assert peers.flops_per_token(size, 1024) == expected
    if size == "llama1.1B":
        assert 1.0e9 < peers.num_params(size) < 1.2e9


def test_gpt_flops_unchanged():
    cfg = gpt_config("350M")
    n = peers.num_params("350M")
    assert peers.flops_per_token("350M", 1024) == 6 * (n - 1024 * cfg.n_embd) + 12 * cfg.n_layer * cfg.n_embd * 1024


def test_host_ram_estimates():
    # anchors.md: on the 125 GiB host both offloading peers ran 4.2B and failed (host RAM) at 6.7B.
    assert peers.host_bytes_needed("compile", "6.7B") is None
    for system in ("fsdp2", "deepspeed"):
        assert peers.host_bytes_needed(system, "4.2B") < 115 * 2**30
        assert peers.host_bytes_needed(system, "6.7B") > 125 * 2**30
    available, source = peers.host_bytes_available()
    assert available > 0 and source


def _r(size, system, status, **kw):
    if status == "ok":
        kw = {"tokens_per_s": 4800.0, "step_s": 1.7, "mfu": 0.1, "loss": 10.0, **kw}
    return {"size": size, "system": system, "status": status, **kw}


def test_ledger_ladder_and_resume(tmp_path):
    previous = [
        _r("350M", "compile", "ok", wall_s=50.0),
        _r("760M", "compile", "OOM", wall_s=70.0),
        _r("350M", "fsdp2", "ok", wall_s=30.0),
        _r("760M", "fsdp2", "not_run", reason="deadline"),
        _r("760M", "deepspeed", "skipped_host_ram"),
        _r("760M", "eager", "not_run", cut_off_after_s=120.0),
    ]
    ledger = peers.Ledger(tmp_path, previous)
    assert ledger.done("350M", "compile") and ledger.done("760M", "compile")
    assert ledger.stopped("1.3B", "compile")["status"] == "OOM"
    assert ledger.stopped("760M", "compile") is None
    assert not ledger.done("760M", "fsdp2") and ledger.stopped("1.3B", "fsdp2") is None  # not_run is no failure
    assert ledger.done("760M", "deepspeed") and ledger.stopped("1.3B", "deepspeed")
    assert ledger.stopped("llama1.1B", "compile") is None  # another model: its own ladder
    assert ledger.estimate_s("compile", "1.3B", 90.0)[0] == 70.0
    assert ledger.estimate_s("eager", "1.3B", 90.0)[0] == 120.0
    assert ledger.estimate_s("protrain", "1.3B", 90.0) == (90.0, "--default-estimate-s")
    # a smaller size is estimated from its own size or smaller ones, else the shortest larger run
    assert ledger.estimate_s("compile", "350M", 90.0)[0] == 50.0
    assert ledger.estimate_s("eager", "350M", 90.0)[0] == 120.0
    big_first = peers.Ledger(tmp_path, [_r("4.2B", "compile", "ok", wall_s=210.0), _r("1.3B", "compile", "ok", wall_s=95.0)])
    assert big_first.estimate_s("compile", "350M", 90.0)[0] == 95.0
    assert big_first.estimate_s("compile", "1.3B", 90.0)[0] == 95.0
    forced = peers.Ledger(tmp_path, previous, force_host_ram=True)
    assert not forced.done("760M", "deepspeed") and forced.stopped("1.3B", "deepspeed") is None
    ledger.add(_r("1.3B", "fsdp2", "ok", wall_s=40.0))
    written = json.loads((tmp_path / "peers.json").read_text())
    assert [(r["size"], r["system"]) for r in written][:3] == [("350M", "compile"), ("350M", "fsdp2"),
                                                               ("760M", "eager")]
    md = (tmp_path / "peers.md").read_text()
    assert "host RAM (est.)" in md and "not a measured failure" in md and "4.8k" in md


def test_resume_protocol_must_match(tmp_path):
    path = tmp_path / "peers.json"
    path.write_text(json.dumps([_r("350M", "compile", "ok", batch=8, seq=512)]))
    protocol = {"batch": 8, "seq": 1024, "cap_gib": 24.0, "steps": 3, "warmup": 2, "device": "cuda"}
    with pytest.raises(SystemExit, match="seq"):
        peers.load_results(path, protocol)


def test_resume_command(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    args = peers.parse_args(["--sizes", "350M", "--ladder", "--out", str(tmp_path), "--resume", "old.json"])
    cmd = peers.resume_command(args, ["--sizes", "350M", "--ladder", "--out", str(tmp_path), "--resume", "old.json"])
    assert "old.json" not in cmd and cmd.endswith(f"--resume {tmp_path / 'peers.json'}")
    assert "--ladder" in cmd


@pytest.mark.slow
def test_cpu_dry_run_deadline_then_resume(tmp_path):
    base = [sys.executable, str(ROOT / "bench" / "peers.py"), "--device", "cpu", "--sizes", "tiny", "--systems",
            "eager", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--ladder",
            "--out", str(tmp_path)]
    first = subprocess.run([*base, "--deadline-s", "0"], capture_output=True, text=True, check=True)
    results = json.loads((tmp_path / "peers.json").read_text())
    assert [r["status"] for r in results] == ["not_run"], first.stdout
    assert f"--resume {tmp_path / 'peers.json'}" in first.stdout
    subprocess.run([*base, "--resume", str(tmp_path / "peers.json")], capture_output=True, text=True, check=True)
    results = json.loads((tmp_path / "peers.json").read_text())
    assert [(r["system"], r["status"]) for r in results] == [("eager", "ok")]
    assert all(r["wall_s"] > 0 and r["first_step_s"] > 0 for r in results)


def test_offload_specs_read_every_count_and_refuse_bad_ones():
    assert peers.parse_offload_spec("persist=2,buffer=3,gpu_optim=1,lean=4,checkpoint=all") == (
        2, 3, "checkpoint=all", 1, 4)
    assert peers.parse_offload_spec("buffer=3,lean=auto") == (0, 3, "", 0, "auto")
    assert peers.parse_offload_spec("auto") == ("auto", "auto", "", "auto", "auto")  # the backend chooses
    assert peers.parse_offload_spec("auto:inductor") == ("auto", "auto", "", "auto", "auto")  # verify="inductor"
    assert peers.parse_offload_spec("auto:graph") == ("auto", "auto", "", "auto", "auto")  # verify="graph"
    assert peers.parse_offload_spec("buffer=2")[4] == "auto"  # the library's default
    with pytest.raises(ValueError, match="lean needs a whole number"):
        peers.parse_offload_spec("buffer=2,lean=x")
    with pytest.raises(ValueError, match="buffer=N"):
        peers.parse_offload_spec("persist=1")


def test_merged_results_take_reruns_keep_results_over_not_run_and_pick_the_best_hand_plan(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_merge", ROOT / "bench" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)

    def run(size, system, status="ok", tps=None, cap=24.0):
        return {"size": size, "system": system, "status": status, "tokens_per_s": tps, "cap_gib": cap}

    first = tmp_path / "first.json"
    first.write_text(json.dumps([run("350M", "deepspeed", tps=16.0), run("760M", "deepspeed", tps=12.0),
                                 run("4.2B", "protrain_offload[buffer=3]", tps=3.0)]))
    second = tmp_path / "second.json"
    second.write_text(json.dumps({"calls": {"c1": {"a": [run("350M", "deepspeed", tps=13.0),
                                                         run("760M", "deepspeed", "not_run"),
                                                         run("6.7B", "eager_ac", tps=10.0, cap=0.0)],
                                                   "b": [run("4.2B", "protrain_offload[persist=3,buffer=3]", tps=6.0),
                                                         run("4.2B", "protrain_offload[persist=9,buffer=3]", "OOM")]}}}))
    merged = {(r["size"], r["system"]): r for r in merge_results.merge([first, second], ["protrain_offload"], 24.0)}
    assert merged[("350M", "deepspeed")]["tokens_per_s"] == 13.0  # the rerun
    assert merged[("350M", "deepspeed")]["source"] == "second.json"
    assert merged[("760M", "deepspeed")]["tokens_per_s"] == 12.0  # not_run is no result
    assert ("6.7B", "eager_ac") not in merged  # another cap
    best = merged[("4.2B", "protrain_offload[best hand plan]")]
    assert best["tokens_per_s"] == 6.0 and best["settings"] == "protrain_offload[persist=3,buffer=3]"
    assert not any(s.startswith("protrain_offload[") and "best" not in s for _, s in merged)


def test_stream_steps_run_after_the_timed_ones():
    # (an offloaded step's switch to untimed steps only drops CUDA events: checked on the GPU by
    # bench/device.sh STREAM=N, which records stream_step_s beside the synced steps)
    result = peers.run_one("tiny", "eager", steps=2, warmup=1, batch=2, seq=16, cap_gib=0.0, device="cpu",
                           stream_steps=3)
    assert result["status"] == "ok", result.get("reason")
    assert len(result["step_times_s"]) == 2 and len(result["stream_starts_s"]) == 3
    starts = result["stream_starts_s"]
    assert starts == sorted(starts) and result["stream_end_s"] > starts[-1]
    assert result["stream_step_s"] == pytest.approx(result["stream_end_s"] / 3)


def test_overlap_table_has_a_row_for_a_run_that_keeps_nothing_on_the_host():
    step = {"forward_s": 0.016, "backward_s": 0.028, "gpu_optimizer_s": 0.003, "cpu_optimizer_busy_s": 0.0}
    on_device = {"size": "350M", "system": "protrain_offload[auto]", "status": "ok", "steps": 2, "step_s": 0.048,
                 "breakdown": [step, step, step], "offload": {"host_bytes_per_param": 0.0}}
    offloaded = {**on_device, "size": "4.2B", "offload": {"host_bytes_per_param": 14.19}}
    rows = [line for line in peers._overlap_table([on_device, offloaded]) if line.startswith("| 350M") or
            line.startswith("| 4.2B")]
    assert rows == ["| 350M | protrain_offload[auto] | 16 | 28 | 3 | 0 | 44 | 48 | – |",
                    "| 4.2B | protrain_offload[auto] | 16 | 28 | 3 | 0 | 44 | 48 | 14.19 |"]


def test_reread_after_a_run_sums_each_phases_timed_ops_under_each_protocol():
    result = peers.run_one("tiny", "protrain", steps=1, warmup=1, batch=2, seq=16, cap_gib=0.0, device="cpu")
    assert result["status"] == "ok", result.get("reason")
    got = peers._reread(2)
    assert "error" not in got, got
    assert set(got["op_sums_s"]) == {"cached", "events", "prefilled"}
    assert len(got["ops_timed"]) == 2 and min(got["ops_timed"]) > 0  # forward and backward both have products
    for sums in got["op_sums_s"].values():
        assert len(sums) == 2 and min(sums) > 0
    assert "device_step_bytes_per_s" not in got  # no offloaded chunks: nothing of theirs to read


# ------------------------------------------------------------------ newer peers, B24-L, data-parallel mode

configs = peers.peer_configs  # bench/peer_configs.py, as peers.py imports it


@pytest.mark.parametrize("system", ["deepspeed", "superoffload", "deepcompile", "zenflow"])
def test_each_deepspeed_mode_has_its_documented_keys(system):
    """The config dicts as DeepSpeed 0.19.8 reads them (checked there against its own config classes,
    DeepSpeedConfig; here without importing deepspeed)."""
    c = configs.deepspeed_config(system, micro_batch=8, world_size=2)
    assert c["train_micro_batch_size_per_gpu"] == 8 and c["gradient_accumulation_steps"] == 1
    assert c["train_batch_size"] == 16  # DeepSpeed checks micro x accumulation x world
    assert c["bf16"] == {"enabled": True} and c["optimizer"]["type"] == "AdamW"
    zero = c["zero_optimization"]
    cpu = {"device": "cpu", "pin_memory": True}
    if system == "zenflow":
        assert zero["stage"] == 2 and zero["offload_optimizer"] == cpu and "offload_param" not in zero
        assert zero["zenflow"]["topk_ratio"] == 0.05 and zero["zenflow"]["update_interval"] == 4
        assert zero["zenflow"]["overlap_step"] is True
    else:
        assert zero["stage"] == 3 and zero["offload_param"] == cpu
    if system == "superoffload":
        assert zero["offload_optimizer"] == {**cpu, "super_offload": True, "ratio": 1.0, "cpuadam_cores_perc": 0.8}
    elif system in ("deepspeed", "deepcompile"):
        assert zero["offload_optimizer"] == cpu
    assert ("compile" in c) == (system == "deepcompile")
    if system == "deepcompile":
        assert c["compile"] == {"deepcompile": True}
    assert configs.exact(system) == (system != "zenflow")


def test_deepspeed_accumulation_and_what_is_refused():
    c = configs.deepspeed_config("deepspeed", micro_batch=8, accumulation=8)
    assert (c["gradient_accumulation_steps"], c["train_batch_size"]) == (8, 64)
    with pytest.raises(ValueError, match="update_interval"):
        configs.deepspeed_config("zenflow", micro_batch=8, accumulation=8)
    with pytest.raises(ValueError, match="not one of"):
        configs.deepspeed_config("fsdp2", micro_batch=8)


def test_deepspeed_jit_builds_get_an_arch_list_they_can_parse(monkeypatch):
    """DeepSpeed's JIT builder parses each architecture's parts as integers: a Hopper image's ``9.0a``
    stopped DeepCompile's native op build; the DeepSpeed modes' runs get it without the suffix."""
    assert configs.jit_arch_list("9.0a") == "9.0"
    assert configs.jit_arch_list("8.0 9.0a;9.0+PTX") == "8.0;9.0;9.0+PTX"
    assert configs.jit_arch_list("9.0") == "9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    args = peers.parse_args(["--sizes", "350M"])
    for system, expected in (("deepcompile", "9.0"), ("protrain_offload", "9.0a")):
        _, env = peers.run_command("350M", system, args)
        assert env["TORCH_CUDA_ARCH_LIST"] == expected


def test_host_estimates_of_the_newer_peers_count_every_rank():
    n = peers.num_params("4.2B")
    assert peers.host_bytes_needed("superoffload", "4.2B") == peers.host_bytes_needed("deepspeed", "4.2B")
    assert peers.host_bytes_needed("zenflow", "4.2B") == 24 * n + peers.HOST_BASE_BYTES
    assert peers.host_bytes_needed("zenflow", "4.2B", 8) == 48 * n + 8 * peers.HOST_BASE_BYTES
    assert peers.host_bytes_needed("fsdp2", "4.2B", 2) == 20 * n + 2 * peers.HOST_BASE_BYTES
    assert peers.host_bytes_needed("protrain_offload[auto]", "4.2B", 2) is None  # it checks its own


def test_protocols_and_data_parallel_arguments(tmp_path, monkeypatch):
    for key in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    out = ["--out", str(tmp_path)]
    assert peers.parse_args(out).accumulate == 1
    assert peers.parse_args(["--protocol", "B24-L", *out]).accumulate == 8
    assert peers.parse_args(["--accumulate", "4", *out]).accumulate == 4
    with pytest.raises(SystemExit):
        peers.parse_args(["--protocol", "B24-L", "--accumulate", "4", *out])
    with pytest.raises(SystemExit):  # compile would train one model per rank
        peers.parse_args(["--dp", "2", "--systems", "compile", "fsdp2", *out])
    args = peers.parse_args(["--dp", "2", "--protocol", "B24-L", "--systems", "protrain_offload", "fsdp2",
                             "superoffload", "--offload", "auto", *out])
    assert args.world_size == 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cmd, env = peers.run_command("4.2B", "protrain_offload[auto]", args)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    rest = cmd[cmd.index("--") + 1:]  # after "--": torchrun passes them on untouched
    assert rest[:3] == ["--run", "4.2B", "protrain_offload[auto]"] and rest[-2:] == ["--dp", "2"]
    assert rest[rest.index("--accumulate") + 1] == "8"
    assert int(env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) // 2)
    one, _ = peers.run_command("4.2B", "fsdp2", peers.parse_args(out))
    assert one[1].endswith("peers.py") and "--" not in one
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):  # the parent is not started by torchrun
        peers.parse_args(["--dp", "2", "--systems", "fsdp2", *out])
    assert peers.parse_args(["--run", "tiny", "fsdp2", "--dp", "2", *out]).dp == 2
    with pytest.raises(SystemExit):  # a run for 4 ranks in a torchrun of 2
        peers.parse_args(["--run", "tiny", "fsdp2", "--dp", "4", *out])


def test_exposed_collective_time_is_what_no_other_kernel_overlaps():
    kernels = [("gemm", 0.0, 1.0), ("ncclAllGather", 0.5, 2.0), ("gemm", 1.5, 1.8), ("ncclReduceScatter", 3.0, 4.0),
               ("elementwise", 3.2, 3.4), ("elementwise", 3.3, 3.6), ("gemm", 5.0, 6.0)]
    got = peers.collective_times(kernels)
    # collectives run 0.5-2.0 and 3.0-4.0 (2.5 s); other kernels cover 0.5-1.0, 1.5-1.8 and 3.2-3.6
    assert got["collective_s"] == pytest.approx(2.5)
    assert got["exposed_collective_s"] == pytest.approx(2.5 - 0.5 - 0.3 - 0.4)
    assert peers.collective_times([("gemm", 0.0, 1.0)]) == {"collective_s": 0.0, "exposed_collective_s": 0.0}


def test_ranks_merge_into_one_result_the_slowest_step_and_the_first_failure():
    def rank(i, **kw):
        return {"size": "4.2B", "system": "fsdp2", "rank": i, "status": "ok", "step_s": 1.0 + i, "loss": 2.0 * i,
                "peak_allocated_bytes": 10 - i, "exposed_collective_s": 0.1 * i, **kw}

    merged = peers.merge_ranks([rank(1), rank(0)])
    assert merged["world_size"] == 2 and [r["rank"] for r in merged["ranks"]] == [0, 1]
    assert merged["step_s"] == 2.0 and merged["loss"] == 1.0 and merged["peak_allocated_bytes"] == 10
    assert merged["exposed_collective_s"] == pytest.approx(0.1)
    failed = peers.merge_ranks([rank(0), rank(1, status="OOM", reason="CUDA out of memory")])
    assert failed["status"] == "OOM" and failed["reason"].startswith("rank 1:")


def test_clipping_is_each_systems_own():
    """``--clip``: a norm far below the gradients' changes the update (Adam's eps then dominates), and
    DeepSpeed is configured with ``gradient_clipping``."""
    def run(system, clip):
        r = peers.run_one("tiny", system, steps=2, warmup=1, batch=2, seq=16, cap_gib=0.0, device="cpu", clip=clip)
        assert r["status"] == "ok", r.get("reason")
        return r

    free, clipped = run("eager", 0.0), run("eager", 1e-9)
    assert clipped["loss"] != free["loss"]
    assert clipped["launch_to_last_step_s"] >= clipped["first_step_s"] > 0
    assert configs.deepspeed_config("superoffload", micro_batch=8, clip=1.0)["gradient_clipping"] == 1.0
    assert "gradient_clipping" not in configs.deepspeed_config("superoffload", micro_batch=8)


def test_a_traced_protrain_run_records_its_top_ops(monkeypatch):
    """``PEERS_TRACE=1``: one more step under ``torch.profiler`` after the timed ones, its top CPU ops kept."""
    monkeypatch.setenv(peers.TRACE_ENV, "1")
    result = peers.run_one("tiny", "protrain", steps=1, warmup=1, batch=2, seq=16, cap_gib=0.0, device="cpu")
    assert result["status"] == "ok", result.get("reason")
    trace = result["trace"]
    assert trace["wall_s_per_step"] > 0 and trace["top_cpu"] and all(op["cpu_ms"] >= 0 for op in trace["top_cpu"])
    monkeypatch.setenv(peers.TRACE_ENV, "0")
    assert "trace" not in peers.run_one("tiny", "protrain", steps=1, warmup=1, batch=2, seq=16, cap_gib=0.0,
                                        device="cpu")


def test_accumulated_steps_average_the_micro_batches_losses_and_count_their_tokens():
    result = peers.run_one("tiny", "eager", steps=1, warmup=1, batch=2, seq=16, cap_gib=0.0, device="cpu",
                           accumulate=3)
    assert result["status"] == "ok", result.get("reason")
    assert result["tokens_per_step"] == 3 * 2 * 16
    assert result["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / result["step_s"])
    assert result["exact"] and result["versions"]["torch"] == torch.__version__


@pytest.mark.slow
def test_data_parallel_dry_run_under_torchrun_with_gloo(tmp_path):
    """World size 1 under torchrun on the CPU (gloo): FSDP2 through the whole parent path."""
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--dp", "1", "--device", "cpu", "--sizes", "tiny",
           "--systems", "fsdp2", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--accumulate", "2",
           "--out", str(tmp_path)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    (result,) = json.loads((tmp_path / "peers.json").read_text())
    assert result["status"] == "ok", result.get("reason")
    assert (result["world_size"], result["accumulate"], result["tokens_per_step"]) == (1, 2, 64)
    assert [r["rank"] for r in result["ranks"]] == [0]


def test_the_compute_bound_is_the_cost_models_compute_and_no_run_beats_it():
    # a recorded 4.2B@24 offloaded run (H200): its problem's forward + backward compute bounds its tokens/s
    from protrain_fx.search.cost import CostModel
    from protrain_fx.search.problem import Problem

    run = next(r for r in json.loads((ROOT / "docs/raw/b24_auto_4.2B_cap24_7.4k_h200.json").read_text())
               if r.get("auto_plan"))
    problem = Problem.from_dict(run["auto_plan"]["problem"])
    compute_s = CostModel(problem).compute_s
    blocks = sum(b.fwd_s + b.bwd_s for b in problem.blocks) + problem.outside_fwd_s + problem.outside_bwd_s
    assert compute_s == pytest.approx(blocks)
    bound = run["batch"] * run["seq"] / compute_s  # one micro-batch a step
    assert run["tokens_per_s"] < bound
    row = peers._row({**run, "compute_bound_tok_s": bound})
    assert f"{100 * run['tokens_per_s'] / bound:.0f}% of the compute bound" in row


def test_oom_blocks_group_live_blocks_by_who_allocated_them():
    """An OOM's report: live blocks by the innermost frame of ours (or generated code), blocks without
    frames as allocated before the recording, freed blocks left out, largest total first."""
    ours = {"filename": "/w/protrain_fx/runtime/offload/landing.py", "line": 162, "name": "_staged"}
    torch_frame = {"filename": "/x/site-packages/torch/_ops.py", "line": 1, "name": "redispatch"}
    snapshot = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": 100, "frames": [torch_frame, ours]},
        {"state": "active_allocated", "size": 50, "frames": [torch_frame, ours]},
        {"state": "inactive", "size": 10_000, "frames": [ours]},
        {"state": "active_allocated", "size": 300},
        {"state": "active_allocated", "size": 7, "frames": [torch_frame]},
    ]}]}
    rows = peers.oom_blocks(snapshot)
    assert [(r["owner"], r["bytes"], r["blocks"]) for r in rows] == [
        ("before the recording", 300, 1), ("offload/landing.py:162 _staged", 150, 2),
        ("/x/site-packages/torch/_ops.py:1", 7, 1)]
    assert rows[1]["sizes"] == [100, 50]
