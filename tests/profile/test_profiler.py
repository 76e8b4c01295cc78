"""The profiler (CPU): a Problem built from a captured GPT step, and the cached machine measurement."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.analysis.params import parameter_infos
from protrain_fx.chunks import pack
from protrain_fx.plan import Plan
from protrain_fx.planner import problem as planner_problem
from protrain_fx.profile import cache as profile_cache
from protrain_fx.profile import device as profile_device
from protrain_fx.profile import host as profile_host
from protrain_fx.profile import machine_profile
from protrain_fx.search import cost, search
from protrain_fx.search import problem as search_problem
from protrain_fx import settings

MACHINE = search_problem.MachineProfile(
    h2d_bytes_per_s=20e9,
    d2h_bytes_per_s=20e9,
    duplex_bytes_per_s=30e9,
    cpu_adam_params_per_s=1e9,
    gpu_adam_params_per_s=50e9,
    gpu_bytes=80 * 2**30,
)
N_LAYER = 4
#: One GPT-tiny block's parameters (199936 B) plus room for the final norm: several chunks.
CHUNK_BYTES = 200704


@pytest.fixture
def record():
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_layer=N_LAYER)
    model = GPT(cfg)
    x, y = random_batch(cfg, 2, 16)
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(x, y).backward()
    return next(r for r in protrain_fx.captured_graphs() if r.has_backward)


def test_problem_from_gpt_record(record, tmp_path):
    problem = planner_problem.problem_from_record(record, MACHINE, chunk_bytes=CHUNK_BYTES)
    labels = [f"blocks.{i}" for i in range(N_LAYER)]
    assert [b.name for b in problem.blocks] == labels
    rows = {r.block: r for r in record.memory.blocks}
    for b in problem.blocks:
        assert b.saved_bytes == rows[b.name].saved_activation_bytes > 0
        assert b.transient_bytes == rows[b.name].transient_peak_bytes
        assert 0 < b.checkpoint_saved_bytes < b.saved_bytes  # its input: 2 x 16 x 64 fp32 (+ nothing else)
        assert b.swap_bytes == 0  # every saved value of a tiny GPT is under 1 MiB
        assert b.fwd_s > 0 and b.bwd_s > 0
        # alone, a checkpointed block reruns all of its forward; chained, all but its output's work
        assert b.recompute_s == pytest.approx(b.fwd_s)
        assert 0 < b.recompute_chained_s < b.recompute_s
    assert problem.blocks[1].checkpoint_saved_bytes == 2 * 16 * 64 * 4
    # device-step staging of an fp32 model: master, moments, gradient (4 x fp32) and the fp32 copy
    from protrain_fx.runtime.optim.device_adam import DEVICE_SLICE_ELEMS, N_SETS

    assert problem.device_step_bytes == N_SETS * DEVICE_SLICE_ELEMS * (16 + 4)
    # chunks: every chunk used, each block's chunks hold its parameters
    params = parameter_infos(record.step, record.dynamo_graph)
    layout = pack(params, CHUNK_BYTES)
    assert len(problem.chunks) == len(layout.chunks) > N_LAYER
    used = set(problem.outside_chunk_ids).union(*(b.chunk_ids for b in problem.blocks))
    assert used == set(range(len(problem.chunks)))
    for b in problem.blocks:
        mine = {layout.chunk_of(p.names[0]) for p in params if p.block == b.name}
        assert set(b.chunk_ids) == mine
    assert sum(c.n_params for c in problem.chunks) == sum(p.numel() for p in record_params(record))
    assert problem.fixed_bytes == record.memory.input_bytes
    assert problem.master_bytes_per_param == 0 and problem.adam_state_bytes_per_param == 8
    # JSON round trip
    assert search_problem.Problem.from_dict(problem.to_dict()) == problem
    problem.dump(tmp_path / "p.json")
    assert search_problem.Problem.load(tmp_path / "p.json") == problem
    # the search runs on it
    est = cost.estimate(problem, search_problem.Counts(len(problem.chunks), 0, 0, 0))
    result = search.search(problem, est.peak_bytes)
    assert isinstance(result.best, search_problem.Counts)
    assert result.estimate.peak_bytes <= est.peak_bytes


def record_params(record):
    """The model-state inputs of the forward graph, one per storage (tied weights once)."""
    seen, out = set(), []
    for node in record.forward.graph.nodes:
        if node.op == "placeholder" and node.name in record.step.state_inputs:
            t = node.meta["val"]
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                out.append(t)
    return out


def test_recompute_is_what_the_partitioner_reruns(record):
    """The forward a checkpointed block reruns, priced per node: counted in matrix products, the
    estimate agrees with what torch's partitioner puts in the backward graph. Chained (the next block
    checkpointed too), a GPT block keeps its output and reruns 3 of its 4 products (not the MLP's
    second); alone (the last block, before the final norm), all 4."""
    from protrain_fx import meta
    from protrain_fx.analysis.memory import output_args
    from protrain_fx.plan import Plan

    def is_mm(n):
        return n.op == "call_function" and meta.op_name(n) == "aten.addmm.default"

    fw_nodes = [n for n in record.forward.graph.nodes if n.op not in ("placeholder", "output")]
    saved = output_args(record.forward)[record.step.num_user_outputs :]
    counted = planner_problem._recompute_times(fw_nodes, {n: float(is_mm(n)) for n in fw_nodes}, saved)
    labels = [f"blocks.{i}" for i in range(N_LAYER)]
    assert all(counted[label] == (4.0, 3.0) for label in labels)

    protrain_fx.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_layer=N_LAYER)
    plan = Plan(blocks={label: "checkpoint" for label in labels})
    x, y = random_batch(cfg, 2, 16)
    torch.compile(GPT(cfg), backend="protrain", options={"codegen": "eager", "plan": plan})(x, y).backward()
    planned = next(r for r in protrain_fx.captured_graphs() if r.has_backward)
    rerun = {label: sum(1 for n in planned.backward.graph.nodes if is_mm(n) and n.meta.get(meta.BLOCK) == label
                        and n.meta.get("partitioner_tag") != "is_backward" and "recompute" in n.meta)
             for label in labels}
    assert rerun == {label: 3 for label in labels[:-1]} | {labels[-1]: 4}


def test_problem_options(record):
    base = planner_problem.problem_from_record(record, MACHINE)
    assert len(base.chunks) == 1  # choose_layout: one 32 MiB chunk holds the tiny model
    swap_all = planner_problem.problem_from_record(record, MACHINE, min_swap_bytes=0)
    # what the swap rewrite moves when it swaps every block with that threshold, no more, no less
    cfg = gpt_config("tiny", n_layer=N_LAYER)
    torch.manual_seed(0)
    plan = Plan(blocks={f"blocks.{i}": "swap" for i in range(N_LAYER)})
    options = {"codegen": "eager", "plan": plan, "machine": {"min_swap_bytes": 0}}
    torch.compile(GPT(cfg), backend="protrain", options=options)(*random_batch(cfg, 2, 16)).backward()
    swapped = [r for r in protrain_fx.captured_graphs() if r.has_backward][-1].swapped
    moved = {b.name: sum(s.nbytes for s in swapped if s.block == b.name) for b in swap_all.blocks}
    assert [b.swap_bytes for b in swap_all.blocks] == list(moved.values())
    assert all(0 < b.swap_bytes <= b.saved_bytes for b in swap_all.blocks)
    assert [sum(x for *_, x in b.swap_parts) for b in swap_all.blocks] == list(moved.values())
    times = {f"blocks.{i}": (0.001 * (i + 1), 0.002) for i in range(N_LAYER)} | {"outside": 0.3}
    timed = planner_problem.problem_from_record(record, MACHINE, block_times=times)
    assert [b.fwd_s for b in timed.blocks] == [0.001 * (i + 1) for i in range(N_LAYER)]
    assert timed.outside_fwd_s == pytest.approx(0.1) and timed.outside_bwd_s == pytest.approx(0.2)
    # compute_scale multiplies every estimated time, recompute included, and leaves memory as it was
    scaled = planner_problem.problem_from_record(record, MACHINE, compute_scale=1.5)
    for b, s in zip(base.blocks, scaled.blocks):
        for name in ("fwd_s", "bwd_s", "recompute_s", "recompute_chained_s"):
            assert getattr(s, name) == pytest.approx(1.5 * getattr(b, name)) and getattr(b, name) > 0
        assert dataclasses.replace(s, fwd_s=b.fwd_s, bwd_s=b.bwd_s, recompute_s=b.recompute_s,
                                   recompute_chained_s=b.recompute_chained_s) == b
    assert scaled.outside_bwd_s == pytest.approx(1.5 * base.outside_bwd_s)
    # times given by hand are taken as given
    timed_scaled = planner_problem.problem_from_record(record, MACHINE, block_times=times, compute_scale=1.5)
    assert [b.fwd_s for b in timed_scaled.blocks] == [b.fwd_s for b in timed.blocks]


def test_problem_needs_a_backward():
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_layer=2)
    x, _ = random_batch(cfg, 1, 8)
    with torch.no_grad():
        torch.compile(GPT(cfg), backend="protrain", options={"codegen": "eager"})(x)
    (rec,) = protrain_fx.captured_graphs()
    with pytest.raises(ValueError, match="no backward"):
        planner_problem.problem_from_record(rec, MACHINE)


def test_measure_machine_cpu_is_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path / "env"))
    kw = {"copy_bytes": 8 * 2**20, "adam_params": 2**20, "repeat": 1}
    first = machine_profile.measure_machine("cpu", cache=tmp_path, **kw)
    for name, value in first.to_dict().items():
        assert value > 0 or name == "device_step_bytes_per_s", name
    assert first.device_step_bytes_per_s == 0  # no GPU to stream steps through: not measured
    path = profile_cache.cache_path("cpu", tmp_path)
    assert path.exists() and path.parent == tmp_path
    assert "measuring" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(machine_profile, "_chunk_adam_params_per_s", lambda *a: calls.append(a) or 1.0)
    assert machine_profile.measure_machine("cpu", cache=tmp_path, **kw) == first
    assert calls == [] and capsys.readouterr().err == ""
    # the environment variable picks the directory when no argument does
    assert profile_cache.cache_path("cpu").parent == tmp_path / "env"
    again = machine_profile.measure_machine("cpu", refresh=True, **kw)
    assert calls and again.cpu_adam_params_per_s == 1.0 and profile_cache.cache_path("cpu").exists()


def test_a_pinned_profile_is_every_rate_and_nothing_is_measured_or_learned(tmp_path, monkeypatch):
    """``pin_machine_profile``: the profile read back as it was pinned, the CPU step of any chunk size
    and the device steps of any layout at its rates, no measurement (``refresh`` too), nothing kept
    from training beside it, and a rate that is not a positive number refused naming it."""
    calls = []
    monkeypatch.setattr(machine_profile, "_chunk_adam_params_per_s", lambda *a: calls.append(a) or 1.0)
    monkeypatch.setattr(machine_profile, "device_step_spans", lambda *a, **k: calls.append(a) or [1.0])
    path = profile_cache.pin_machine_profile("cpu", MACHINE.to_dict(), cache=tmp_path)
    assert path == profile_cache.cache_path("cpu", tmp_path) and json.loads(path.read_text())["pinned"] is True
    assert profile_cache.pinned_profile("cpu", tmp_path) == MACHINE
    assert machine_profile.measure_machine("cpu", cache=tmp_path) == MACHINE
    assert machine_profile.measure_machine("cpu", cache=tmp_path, refresh=True) == MACHINE
    for params in (1, 2**20, 2**30):
        assert machine_profile.chunk_adam_rate("cpu", params, cache=tmp_path, readings=2) == MACHINE.cpu_adam_params_per_s
    assert calls == []
    assert profile_cache.note_training_rates("cpu", chunk_params=2**20, cpu_adam_params_per_s=7.0, cache=tmp_path) is None
    assert profile_cache.training_rates("cpu", MACHINE, 2**20, cache=tmp_path) == (MACHINE, [])
    assert "in_training" not in json.loads(path.read_text())
    with pytest.raises(ValueError, match="cpu_adam_params_per_s"):
        profile_cache.pin_machine_profile("cpu", {**MACHINE.to_dict(), "cpu_adam_params_per_s": 0}, cache=tmp_path)
    # a measured profile is not a pinned one
    profile_cache.write_json(path, {**json.loads(path.read_text()), "pinned": False})
    assert profile_cache.pinned_profile("cpu", tmp_path) is None


def test_fused_times_count_only_what_enters_and_leaves_a_pointwise_chain():
    from torch.fx.experimental.proxy_tensor import make_fx

    from protrain_fx.analysis.estimate import LAUNCH_S, fused_node_times, node_time
    from protrain_fx.machine import H200

    def step(x, w):
        y = torch.mm(x, w)
        return (y * 2 + 1).relu().sum(0)  # pointwise ops and a reduction: one fused kernel

    gm = make_fx(step, tracing_mode="fake")(torch.randn(256, 128), torch.randn(128, 512))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    fused = fused_node_times(nodes, H200)
    plain = {n: node_time(n, H200) for n in nodes}
    (mm,) = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert fused[mm] == plain[mm] > 0
    chain = [n for n in nodes if n is not mm]
    assert len(chain) == 4
    # One kernel: it reads the product (256 x 512 fp32) and writes the sum (512 fp32).
    expected = LAUNCH_S + (256 * 512 * 4 + 512 * 4) / (H200.hbm_bytes * H200.hbm_efficiency)
    assert sum(fused[n] for n in chain) == pytest.approx(expected)
    assert sum(plain[n] for n in chain) > 3 * expected  # unfused: every intermediate goes through memory

    def twice(x, w):
        y = torch.mm(x, w)
        return (y * 2 + y).relu() * y  # three nodes of one kernel read the product: it is read once

    gm = make_fx(twice, tracing_mode="fake")(torch.randn(256, 128), torch.randn(128, 512))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    chain = [n for n in nodes if n.target is not torch.ops.aten.mm.default]
    fused = fused_node_times(nodes, H200)
    # reads the product once, writes the result (both 256 x 512 fp32)
    expected = LAUNCH_S + 2 * 256 * 512 * 4 / (H200.hbm_bytes * H200.hbm_efficiency)
    assert sum(fused[n] for n in chain) == pytest.approx(expected)


def test_cpu_chunk_rate_is_measured_per_chunk_size_and_cached(tmp_path, monkeypatch, capsys):
    kw = {"copy_bytes": 8 * 2**20, "adam_params": 2**20, "repeat": 1}
    machine_profile.measure_machine("cpu", cache=tmp_path, **kw)
    capsys.readouterr()
    sizes = []
    monkeypatch.setattr(machine_profile, "_chunk_adam_params_per_s", lambda cuda, n, repeat: sizes.append(n) or n / 1e9)
    granule = profile_cache.CHUNK_RATE_GRANULE
    # measured at the size rounded up to the granule, once per size
    assert machine_profile.chunk_adam_rate("cpu", granule + 1, cache=tmp_path) == 2 * granule / 1e9
    assert sizes == [2 * granule] and "measuring the CPU step" in capsys.readouterr().err
    assert machine_profile.chunk_adam_rate("cpu", 2 * granule, cache=tmp_path) == 2 * granule / 1e9
    assert sizes == [2 * granule] and capsys.readouterr().err == ""
    assert machine_profile.chunk_adam_rate("cpu", 1, cache=tmp_path) == granule / 1e9 and sizes[-1] == granule
    # the profile itself is untouched, and the rates live in its file
    data = json.loads(profile_cache.cache_path("cpu", tmp_path).read_text())
    assert set(data["cpu_adam_by_chunk"]) == {str(granule), str(2 * granule)}
    # each measurement's seconds are kept beside its rate (a first compile's wait, taken apart)
    assert set(data["seconds"]) == {"the CPU step", f"the CPU step of {granule}-parameter chunks",
                                    f"the CPU step of {2 * granule}-parameter chunks"}
    assert all(s >= 0 for s in data["seconds"].values()) and data["seconds"]["the CPU step"] > 0
    assert machine_profile.measure_machine("cpu", cache=tmp_path, **kw).cpu_adam_params_per_s == data["profile"]["cpu_adam_params_per_s"]


def test_a_second_reading_of_the_cpu_chunk_rate_keeps_the_faster(tmp_path, monkeypatch, capsys):
    # A host's CPU can be slow for a while: with readings=2 a second reading is taken (once, then
    # kept) and the faster one stands, whichever came first.
    kw = {"copy_bytes": 8 * 2**20, "adam_params": 2**20, "repeat": 1}
    machine_profile.measure_machine("cpu", cache=tmp_path, **kw)
    capsys.readouterr()
    readings = iter([0.2e9, 1.2e9, 0.9e9, 0.5e9])
    monkeypatch.setattr(machine_profile, "_chunk_adam_params_per_s", lambda cuda, n, repeat: next(readings))
    granule = profile_cache.CHUNK_RATE_GRANULE
    assert machine_profile.chunk_adam_rate("cpu", granule, cache=tmp_path) == 0.2e9  # one reading so far
    assert machine_profile.chunk_adam_rate("cpu", granule, cache=tmp_path, readings=2) == 1.2e9
    assert "again: the fastest of readings apart in time is kept" in capsys.readouterr().err
    assert machine_profile.chunk_adam_rate("cpu", granule, cache=tmp_path, readings=2) == 1.2e9  # kept: not again
    assert machine_profile.chunk_adam_rate("cpu", granule, cache=tmp_path) == 1.2e9 and capsys.readouterr().err == ""
    data = json.loads(profile_cache.cache_path("cpu", tmp_path).read_text())
    assert data["cpu_adam_chunk_readings"] == {str(granule): [0.2e9, 1.2e9]}
    assert data["cpu_adam_by_chunk"] == {str(granule): 1.2e9}
    # a slow second reading does not lower the first; both at once on a fresh size
    assert machine_profile.chunk_adam_rate("cpu", 2 * granule, cache=tmp_path, readings=2) == 0.9e9
    data = json.loads(profile_cache.cache_path("cpu", tmp_path).read_text())
    assert data["cpu_adam_chunk_readings"][str(2 * granule)] == [0.9e9, 0.5e9]
    assert data["cpu_adam_by_chunk"][str(2 * granule)] == 0.9e9


def test_the_chunk_step_rate_is_the_median_of_its_steps(monkeypatch):
    ticks = iter([0.0, 9.0, 10.0, 11.0, 20.0, 22.0, 30.0, 33.0])  # warm-up 9 s, then 1, 2, 3 s
    monkeypatch.setattr(profile_host.time, "perf_counter", lambda: next(ticks))
    assert profile_host._chunk_adam_params_per_s(False, 1024, 3) == 1024 / 2.0


def test_device_steps_of_a_chunk_layout_are_measured_on_cuda_only(tmp_path):
    # On the CPU there are no device steps: nothing is measured and no profile file is written.
    assert machine_profile.device_step_rate("cpu", [1024, 16], cache=tmp_path) == 0.0
    assert not profile_cache.cache_path("cpu", tmp_path).exists()
    # the layout's key tells layouts apart by their sizes in order
    assert profile_device.layout_key([1024, 16]) != profile_device.layout_key([16, 1024])
    assert profile_device.layout_key([1024, 16]).startswith("1040:2:")
    with pytest.raises(ValueError, match="sizes must be positive, got 0"):
        machine_profile.device_step_rate("cpu", [1024, 0], cache=tmp_path)


def test_the_typical_chunk_of_a_layout_is_a_blocks_chunk():
    # A GPT layout: the embedding's chunk (one tensor), block chunks of 4 tensors, the final norm.
    # The device steps stream block chunks: their parameters' sizes, in order.
    import types

    from protrain_fx.chunks import ParamInfo
    from protrain_fx.planner.offload import chunk_parts

    infos = [ParamInfo(("wte",), 4 * 4000, "embed", 0)]
    for b in range(3):
        infos += [ParamInfo((f"h{b}.{k}",), 4 * size, f"blocks.{b}", 1 + b)
                  for k, size in enumerate((1000, 10, 2000, 10 + b))]
    infos.append(ParamInfo(("ln_f",), 4 * 10, "final", 9))
    layout = pack(infos, 4 * 4100)
    handle = types.SimpleNamespace(param_dtype=torch.float32, layout=layout)
    # block 2's chunk also holds the final norm (5 tensors); of the two others, the fullest
    assert [len(c.slots) for c in layout.chunks] == [1, 4, 4, 5]
    assert chunk_parts(handle) == [1000, 10, 2000, 11]
    assert chunk_parts(types.SimpleNamespace(param_dtype=torch.float32, layout=pack([], 64))) == []


def test_cpu_time_of_other_processes_is_read_from_proc(monkeypatch):
    busy = profile_host.cpus_busy_elsewhere(0.05)
    assert busy is None if not Path("/proc/stat").exists() else 0.0 <= busy <= 1.0
    # over the window: 400 ticks, 100 idle, 120 this process's -> 180 of 400 elsewhere
    ticks = iter([(1000, 500, 50), (1400, 600, 170)])
    monkeypatch.setattr(profile_host, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(profile_host.time, "sleep", lambda s: None)
    assert profile_host.cpus_busy_elsewhere() == pytest.approx(180 / 400)
    monkeypatch.setattr(profile_host, "_cpu_ticks", lambda: (_ for _ in ()).throw(OSError("no /proc")))
    assert profile_host.cpus_busy_elsewhere() is None


def test_a_process_stat_line_gives_its_name_and_cpu_ticks():
    # the name may hold spaces and parentheses; utime and stime are fields 14 and 15
    line = "4242 (py (worker) 2) S 1 2 3 4 5 6 7 8 9 10 700 55 0 0 20 0 1"
    assert profile_host._process_ticks(line) == ("py (worker) 2", 755)
    if Path("/proc/stat").exists():
        times = profile_host.host_cpu_times()
        assert len(times) == 8 and all(t >= 0 for t in times) and sum(times) > 0


def test_the_busiest_other_processes_are_named():
    # a child process spinning for the window is found, by name and pid; this process is not
    import subprocess
    import sys

    if not Path("/proc/self/stat").exists():
        assert profile_host.busiest_elsewhere(0.05) == []
        return
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        top = profile_host.busiest_elsewhere(0.5, top=5)
    finally:
        child.kill()
        child.wait()
    assert any(pid == child.pid and cpus > 0.3 for _, pid, cpus in top), top
    assert all(pid != os.getpid() for _, pid, _ in top)


def test_cpu_measurements_on_cuda_wait_for_the_host_to_be_quiet(monkeypatch, capsys):
    seen = iter([0.5, 0.4, 0.05])
    monkeypatch.setattr(profile_host, "cpus_busy_elsewhere", lambda window_s=0.5: next(seen))
    monkeypatch.setattr(profile_host, "busiest_elsewhere", lambda: [("python3", 42, 1.0)])
    assert profile_host.wait_for_quiet_cpus(torch.device("cuda"), "the CPU step") == 0.05
    err = capsys.readouterr().err
    assert "waiting for the host's CPUs before the CPU step: 50% busy" in err and "may read low" not in err
    assert "(python3 42 (1.0 CPUs); up to 60 s)" in err
    # off CUDA nothing is read or awaited; off Linux (None) nothing is awaited
    monkeypatch.setattr(profile_host, "cpus_busy_elsewhere", lambda window_s=0.5: pytest.fail("read"))
    assert profile_host.wait_for_quiet_cpus(torch.device("cpu"), "the CPU step") is None
    monkeypatch.setattr(profile_host, "cpus_busy_elsewhere", lambda window_s=0.5: None)
    assert profile_host.wait_for_quiet_cpus(torch.device("cuda"), "the CPU step") is None
    # a host that stays busy: it gives up at the deadline and says the rate may read low; the
    # process's waits share one budget, so once it is spent the next measurement does not wait
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(profile_host.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(profile_host, "cpus_busy_elsewhere", lambda window_s=0.5: 0.9)
    monkeypatch.setattr(profile_host, "_quiet_wait_left", [25.0])
    assert profile_host.wait_for_quiet_cpus(torch.device("cuda"), "the CPU step") == 0.9
    assert "may read low" in capsys.readouterr().err and profile_host._quiet_wait_left == [0.0]
    assert profile_host.wait_for_quiet_cpus(torch.device("cuda"), "the CPU step") == 0.9
    assert "; up to 0 s)" in capsys.readouterr().err


def test_a_cards_own_rates_are_measured_once_cached_and_priced_with(tmp_path, monkeypatch):
    """``card_machine``: the card's matrix, memory and link rates measured once (a second compile, or
    process, reads the file) and handed to ``machine.machine_for``, which prices that card with them
    (memory-bound kernels at ``MEASURED_HBM_EFFICIENCY`` of the measured copy) instead of the table's
    numbers for its name. CUDA faked on the CPU: one card named "Fake GPU"."""
    from protrain_fx import machine

    rates = {"flops": 700e12, "hbm_bytes": 3.0e12, "h2d_bytes": 50e9, "d2h_bytes": 51e9, "duplex_bytes": 90e9}
    measured = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(machine_profile, "card_rates", lambda device: measured.append(device) or dict(rates))
    monkeypatch.setattr(machine, "_CARDS", {})
    assert machine.machine_for(torch.device("cuda")) == machine.GENERIC_GPU  # not measured yet: the table's
    first = machine_profile.card_machine("cuda", cache=tmp_path)
    again = machine_profile.card_machine("cuda", cache=tmp_path)
    assert len(measured) == 1 and first == again
    assert json.loads(profile_cache.card_path("cuda", tmp_path).read_text())["rates"] == rates
    priced = machine.machine_for(torch.device("cuda"))
    assert (priced.flops, priced.hbm_bytes, priced.h2d_bytes, priced.duplex_bytes) == (700e12, 3.0e12, 50e9, 90e9)
    assert priced.hbm_efficiency == machine.MEASURED_HBM_EFFICIENCY
    assert machine.machine_for(torch.device("cuda"), {"hbm_bytes": 1e12}).hbm_bytes == 1e12  # the option still wins
    assert machine_profile.card_machine("cpu", cache=tmp_path) is None


def test_a_layout_beside_its_models_ops_at_other_sizes_reads_the_rate_kept_for_them():
    """Another input shape of a model (its ops at other sizes: another ``ops:`` load) reads the device-step
    rate of its chunk layout measured beside the first shape's; the stand-in matrix products do not
    stand in for a model's ops, nor another layout's rates."""
    from protrain_fx.profile.device import layout_key
    from protrain_fx.profile.machine_profile import kept_device_step_rate

    parts, other = [3 * 2**20, 64, 2**20], [2**20, 64]
    rates = {f"{layout_key(parts)}|ops:aaaa": {"device_step_bytes_per_s": 2e10},
             f"{layout_key(parts)}|ops:bbbb": {"device_step_bytes_per_s": 4e10},
             f"{layout_key(parts)}|matmul": {"device_step_bytes_per_s": 9e10},
             f"{layout_key(other)}|ops:cccc": {"device_step_bytes_per_s": 7e10}}
    assert kept_device_step_rate(rates, parts, "ops:aaaa") == 2e10  # its own
    assert kept_device_step_rate(rates, parts, "ops:dddd") == 3e10  # the median beside the model's other shapes
    assert kept_device_step_rate(rates, parts, "matmul") == 9e10
    del rates[f"{layout_key(parts)}|matmul"]
    assert kept_device_step_rate(rates, parts, "matmul") == 0.0  # measured: no model's ops stand in for products
    assert kept_device_step_rate(rates, [5, 6], "ops:aaaa") == 0.0  # another layout: measured
