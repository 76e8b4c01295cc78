"""The chunk store's disk tier: optimizer state spilled to a file trains exactly as in host memory.

CPU stands in for the GPU (``device="cpu"``), fp32, eager codegen: bit-exact against
``torch.optim.AdamW(fused=True)``, as ``tests/runtime/test_offload.py`` checks the host tier.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.store import spill as spill_module
from protrain_fx.runtime.store.host_memory import AUTO_HOST_RESERVE, HostMemoryError, planned_store_bytes
from protrain_fx.runtime.store.spill import SpillError
from protrain_fx import settings

CONFIG = gpt_config("tiny", n_layer=4)
CHUNK = 64 * 1024


def _batch(step: int):
    return random_batch(CONFIG, 2, 32, generator=torch.Generator().manual_seed(step))


def _offloaded(folder: Path, **options):
    """The tiny GPT offloaded on the CPU with these ``offload`` options, beside an eager copy: the model,
    the copy, both optimizers and the handle."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, spill_dir=folder, **options)
    return model, reference, opt, ref_opt, handle


def _setup(folder: Path, *, n_persist: int = 0, n_buffer: int = 2, n_spill: int | str = "auto",
           n_lean: int | str = 0, n_gpu_optim: int = 0, available: int | None = None,
           compute_dtype: torch.dtype | None = None, **options):
    model, reference, opt, ref_opt, handle = _offloaded(
        folder, n_persist=n_persist, n_buffer=n_buffer, n_spill=n_spill, n_lean=n_lean, n_gpu_optim=n_gpu_optim,
        available_host_bytes=available, compute_dtype=compute_dtype, **options)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    return model, reference, opt, ref_opt, handle, compiled


def _step(compiled, reference, opt, ref_opt, step: int, clip: bool) -> None:
    loss, ref_loss = compiled(*_batch(step)), reference(*_batch(step))
    assert torch.equal(loss, ref_loss), step
    loss.backward(), ref_loss.backward()
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), 0.5)
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)), step
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()


def _assert_same_params(handle, model, reference) -> None:
    state = handle.state_dict(model)
    for name, p in reference.named_parameters():
        assert torch.equal(state[name], p.detach()), name


@pytest.mark.parametrize(("n_persist", "n_spill", "n_lean", "n_gpu_optim", "clip"),
                         [(0, 3, 0, 0, False), (1, 4, 2, 1, True), (0, "all", 0, 0, True)])
def test_spilled_chunks_train_exactly_like_eager_adamw_and_leave_no_file(tmp_path, n_persist, n_spill, n_lean,
                                                                         n_gpu_optim, clip):
    n_chunks = len(_setup(tmp_path, n_spill=0)[4].layout.chunks) - n_persist
    spill = n_chunks if n_spill == "all" else n_spill
    model, reference, opt, ref_opt, handle, compiled = _setup(
        tmp_path, n_persist=n_persist, n_spill=spill, n_lean=n_lean, n_gpu_optim=n_gpu_optim)
    store = handle.store
    assert handle.n_spill == spill
    assert store.spilled == frozenset(range(n_chunks - n_lean - spill, n_chunks - n_lean))
    assert os.listdir(tmp_path) == []  # the file is unlinked as soon as it is open: nothing left behind
    first = min(store.spilled)
    with pytest.raises(RuntimeError, match="spill file"):
        store.flat("master", first)  # outside a step, its state is on disk only
    for step in range(3):
        _step(compiled, reference, opt, ref_opt, step, clip)
    _assert_same_params(handle, model, reference)
    stats = store.residency.stats()
    assert stats["written_bytes"] == 3 * store.spill_bytes  # each step wrote every spilled chunk's state once
    # fp32 compute: a spilled chunk keeps its 4-byte working copy only; two chunks' state in flight
    per_chunk = [4 if c in store.spilled else 12 if c in store.lean else 16 for c in range(store.num_chunks)]
    assert store.host_bytes() == store.chunk_numel * (sum(per_chunk) + 12 * min(2, spill) + 4 * store.landing_buffers)
    handle.close()


def test_a_checkpoint_of_spilled_chunks_resumes_exactly_in_host_memory_and_back(tmp_path):
    model, reference, opt, ref_opt, handle, compiled = _setup(tmp_path, n_spill=5)
    for step in range(2):
        _step(compiled, reference, opt, ref_opt, step, clip=False)
    params, optim = handle.state_dict(model), handle.optimizer_state_dict()
    ref_optim = ref_opt.state_dict()
    for index, entry in ref_optim["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim["state"][index][key], entry[key]), (index, key)
    # loaded into a model whose state is all in host memory, and from there into a spilled one
    model2, _, opt2, _, handle2, compiled2 = _setup(tmp_path, n_spill=0)
    handle2.load_state_dict(model2, params, optim)
    model3, _, opt3, _, handle3, compiled3 = _setup(tmp_path, n_spill=7)
    handle3.load_state_dict(model3, handle2.state_dict(model2), handle2.optimizer_state_dict())
    for step in range(2, 4):
        _step(compiled3, reference, opt3, ref_opt, step, clip=True)
    _assert_same_params(handle3, model3, reference)
    for h in (handle, handle2, handle3):
        h.close()


def test_accumulated_micro_batches_of_spilled_chunks_sum_exactly(tmp_path):
    model, reference, opt, ref_opt, handle, compiled = _setup(tmp_path, n_spill=4, n_lean=2)
    for step in range(2):
        with handle.accumulate():
            compiled(*_batch(10 * step)).backward()
        compiled(*_batch(10 * step + 1)).backward()
        reference(*_batch(10 * step)).backward()
        reference(*_batch(10 * step + 1)).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _assert_same_params(handle, model, reference)
    handle.close()


def test_a_host_too_small_for_every_chunk_lean_spills_the_fewest_that_fit(tmp_path, caplog):
    full = _setup(tmp_path, n_spill=0, n_lean=0, compute_dtype=torch.bfloat16)[4]
    store = full.store
    numel, n = store.chunk_numel, store.num_chunks
    trainable = [True] * n
    all_lean = planned_store_bytes(numel, trainable, 2, n, 4)
    full.close()
    # one byte short of every chunk lean: one chunk spills (working copy 2 bytes, state on disk, two
    # chunks' state in flight), and fewer of the others are lean than all
    available = all_lean + AUTO_HOST_RESERVE - 1
    model, reference, opt, ref_opt, handle, compiled = _setup(tmp_path, n_spill="auto", n_lean="auto",
                                                              available=available, compute_dtype=torch.bfloat16)
    spill = handle.n_spill
    assert spill >= 1
    assert planned_store_bytes(numel, trainable, 2, n - spill, 4, spill) + AUTO_HOST_RESERVE <= available
    assert planned_store_bytes(numel, trainable, 2, n - spill + 1, 4, spill - 1) + AUTO_HOST_RESERVE > available
    assert handle.n_lean <= n - spill
    with caplog.at_level("WARNING", logger="protrain_fx"):
        handle.store.fill()
    assert f"only with the optimizer state of {spill} chunk(s)" in caplog.text  # the user is told: each step waits on disk
    landing = 2 * numel * min(4, handle.n_lean)  # (the lean chunks' landing buffers are made as gradients land)
    assert handle.store.host_bytes() + landing == planned_store_bytes(numel, trainable, 2, handle.n_lean, 4, spill)
    handle.close()
    # no spilling allowed: refused as before, naming what spilling everything would need
    everything = planned_store_bytes(numel, trainable, 2, 0, 4, n)
    with pytest.raises(HostMemoryError, match=rf"spilled to disk \(n_spill={n}\) it would need {everything} bytes"):
        _setup(tmp_path, n_spill=0, n_lean=0, available=all_lean - 1, compute_dtype=torch.bfloat16)


def test_a_loop_that_clips_has_its_lean_gradients_sized_in_and_one_that_does_not_say_so_is_told_first(
        tmp_path, caplog):
    """A lean chunk saves host memory only while its gradient need not wait. With ``grad_clipping=True``
    every lean chunk's gradient waits for the norm in a landing buffer of its own: the tiers count
    them (spilling does the saving), and a clipped loop trains exactly within the host memory
    planned. Without it, the store says before any compile that a clipping loop must say so, and the
    first step's clip is refused naming the fix."""
    probe = _setup(tmp_path, n_spill=0)[4]
    numel, n = probe.store.chunk_numel, probe.store.num_chunks
    probe.close()
    # room for every chunk lean with the default pool of 4 landing buffers, not one byte more
    available = planned_store_bytes(numel, [True] * n, 4, n, 4) + AUTO_HOST_RESERVE
    assert n > 4

    model, reference, opt, ref_opt, handle, compiled = _setup(
        tmp_path, n_lean="auto", n_spill="auto", available=available, grad_clipping=True)
    store = handle.store
    assert handle.n_spill >= 1 and store.grad_pool == handle.n_lean  # a buffer per lean chunk, planned
    planned = planned_store_bytes(numel, [True] * n, 4, handle.n_lean, n, handle.n_spill)
    assert planned + AUTO_HOST_RESERVE <= available
    for step in range(3):
        _step(compiled, reference, opt, ref_opt, step, clip=True)
    _assert_same_params(handle, model, reference)
    assert store.landing_buffers <= store.grad_pool  # no buffer past the plan
    assert store.host_bytes() <= planned
    handle.close()

    with caplog.at_level("WARNING", logger="protrain_fx"):
        model, reference, opt, ref_opt, handle, compiled = _setup(
            tmp_path, n_lean="auto", n_spill="auto", available=available)
    assert handle.n_spill == 0 and handle.n_lean == n
    assert caplog.text.count("grad_clipping was not given") == 1
    with pytest.raises(UnsupportedError, match="pass grad_clipping=True"):
        _step(compiled, reference, opt, ref_opt, 0, clip=True)
    handle.close()


def test_a_spill_folder_missing_not_writable_or_too_small_is_refused_naming_the_bytes(tmp_path, monkeypatch):
    with pytest.raises(SpillError, match=r"spill folder .*missing.* does not exist; the chunk store needs \d+ bytes"):
        _setup(tmp_path / "missing", n_spill=2)
    (tmp_path / "file").write_text("")
    with pytest.raises(SpillError, match="is not a folder"):
        _setup(tmp_path / "file", n_spill=2)
    if os.geteuid() != 0:  # (root writes anywhere)
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SpillError, match="is not writable"):
            _setup(locked, n_spill=2)
    real = shutil.disk_usage
    monkeypatch.setattr(spill_module.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(SpillError, match=r"has 1000 bytes \(0.00 GiB\) free; the chunk store needs \d+ bytes"):
        _setup(tmp_path, n_spill=2)
    monkeypatch.undo()
    # the environment variable names the folder when the option does not
    monkeypatch.setenv(settings.SPILL_DIR, str(tmp_path / "elsewhere"))
    torch._dynamo.reset()
    model = GPT(CONFIG)
    with pytest.raises(SpillError, match="elsewhere does not exist"):
        protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), n_persist=0, n_buffer=2, device="cpu",
                            chunk_bytes=CHUNK, n_spill=2)


def test_device_steps_of_spilled_chunks_are_refused_by_hand(tmp_path):
    n = len(_setup(tmp_path, n_spill=0)[4].layout.chunks)
    with pytest.raises(ValueError, match=rf"n_gpu_optim={n - 1} would step chunks whose optimizer state is spilled"):
        _setup(tmp_path, n_spill=3, n_gpu_optim=n - 1)


def test_a_write_that_fails_mid_run_stops_training_and_every_later_step(tmp_path, monkeypatch):
    model, reference, opt, ref_opt, handle, compiled = _setup(tmp_path, n_spill=3)
    _step(compiled, reference, opt, ref_opt, 0, clip=False)
    file = handle.store._residency.file

    def failing_write(i, tensors):
        raise SpillError("disk gone (simulated)")

    monkeypatch.setattr(file, "write", failing_write)
    with pytest.raises(SpillError):
        for step in range(1, 3):
            compiled(*_batch(step)).backward()
            opt.step()
            opt.zero_grad()
            handle.synchronize()
    with pytest.raises(SpillError, match="an earlier write to the spill file failed"):
        handle.store.param_state_dict()  # nothing reads the stale state as if it were current


def _host_short_of_memory(folder: Path, monkeypatch) -> tuple[int, int, int]:
    """The planner on a GPU-like machine profile and a disk of pinned rates (2 GB/s read, 1 GB/s
    write), and the tiny GPT's ``(chunk elements, chunks, host bytes)``: host memory for every chunk's
    working copy and two chunks' state in flight, so that unless the budget keeps most chunks on the
    device, offloaded chunks spill."""
    from protrain_fx.planner import offload as autooffload
    from protrain_fx.profile.disk import pin_disk_rates
    from tests.planner.test_auto_offload import GPU_LIKE

    monkeypatch.setattr(autooffload, "offload_machine", lambda device, record, *chunk: GPU_LIKE)
    pin_disk_rates(folder, 2e9, 1e9)
    probe = _setup(folder, n_spill=0)[4]
    numel, n = probe.store.chunk_numel, len(probe.layout.chunks)
    probe.close()
    return numel, n, planned_store_bytes(numel, [True] * n, 4, 0, 4, n) + AUTO_HOST_RESERVE


def test_automatic_counts_on_a_host_short_of_memory_price_the_disk_and_train_exactly(tmp_path, monkeypatch):
    """The backend's counts for a host that holds the store only with optimizer state on disk: the
    problem carries how many chunks spill at each ``n_persist`` and the disk's rates (pinned here, as
    the machine's are), the search never steps a spilled chunk on the device, what_fits names the
    tiers, and training is exact."""
    from protrain_fx.search.cost import CostModel
    from tests.planner.test_auto_offload import TIGHT, _train_record

    numel, n, available = _host_short_of_memory(tmp_path, monkeypatch)

    def automatic():
        return _offloaded(tmp_path, available_host_bytes=available)

    model, reference, opt, ref_opt, handle = automatic()
    report = protrain_fx.what_fits(model, *_batch(0), memory_budget=TIGHT, options={"codegen": "eager"})
    assert report.tiers is not None and report.tiers["n_spill"] >= 1
    assert report.tiers["disk_bytes"] == report.tiers["n_spill"] * 3 * numel * 4
    assert f"the optimizer state of {report.tiers['n_spill']} chunk(s) in {tmp_path}" in str(report)
    handle.close()

    model, reference, opt, ref_opt, handle = automatic()
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    for step in range(3):
        _step(compiled, reference, opt, ref_opt, step, clip=False)
    _assert_same_params(handle, model, reference)
    problem = _train_record().auto_plan.problem
    tiers = handle.tier_counts()
    assert problem.spill_chunks == tuple(s for _, s in tiers) and problem.spill_chunks[0] >= 1
    assert (problem.disk_read_bytes_per_s, problem.disk_write_bytes_per_s) == (2e9, 1e9)
    assert handle.n_spill == tiers[handle.n_persist][1] and handle.n_spill >= 1
    assert handle.n_gpu_optim <= min(handle.store.spilled)
    # the cost model prices a spilled chunk's step at its state's disk time, when that is longer
    model_ = CostModel(problem)
    p = handle.n_persist
    state_s = [c.n_params * 12 / 2e9 + c.n_params * 12 / 1e9 for c in problem.chunks]
    spilled = range(n - tiers[p][0] - tiers[p][1], n - tiers[p][0])
    for ch, a in enumerate(model_.adam_for(p)):
        assert a == (max(model_.adam_s[ch], state_s[ch]) if ch in spilled else model_.adam_s[ch])
    assert model_.max_gpu_optim(p) == min(spilled) - p
    handle.close()


def test_the_spill_files_rates_in_training_replace_the_probes_for_later_plans(tmp_path, monkeypatch):
    """Over the backend's rate window the store's spill file is read and written at the rates the
    running store reaches; they replace the probe's for later plans on this filesystem (the probe's
    kept beside them), and a pinned pair is never replaced."""
    from protrain_fx.planner import offload as autooffload
    from protrain_fx.profile import disk as profile_disk
    from tests.conftest import use_cache_dir
    from tests.planner.test_auto_offload import TIGHT, _train_record

    cache = use_cache_dir(monkeypatch, tmp_path / "cache")
    folder = tmp_path / "spill"
    folder.mkdir()
    _numel, _n, available = _host_short_of_memory(folder, monkeypatch)
    for f in cache.glob("disk-*.json"):  # measured, not pinned
        f.unlink()
    monkeypatch.setattr(profile_disk, "measure_disk", lambda folder, nbytes=0: (2e9, 1e9))
    model, reference, opt, ref_opt, handle = _offloaded(folder, available_host_bytes=available)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": TIGHT})
    for step in range(10):  # past the rate window (training calls 3 to 8)
        _step(compiled, reference, opt, ref_opt, step, clip=False)
    _assert_same_params(handle, model, reference)
    assert handle.n_spill >= 1
    auto = _train_record().auto_plan
    rates = auto.training_rates
    assert rates.disk_read_bytes_per_s > 0 and rates.disk_write_bytes_per_s > 0
    assert "spill file read" in rates.line(auto.problem, auto.config)
    assert rates.priced(auto.problem).disk_read_bytes_per_s == rates.disk_read_bytes_per_s
    handle.close()
    (kept_file,) = cache.glob("disk-*.json")
    kept = json.loads(kept_file.read_text())
    assert kept["source"] == "training" and kept["probe"] == {"read_bytes_per_s": 2e9, "write_bytes_per_s": 1e9}
    assert profile_disk.disk_rates(folder) == (rates.disk_read_bytes_per_s, rates.disk_write_bytes_per_s)
    assert autooffload.disk_rates is profile_disk.disk_rates  # what the next plan reads
    # a later training's rate in one direction only keeps the other; a pinned pair stays
    assert profile_disk.note_disk_rates(folder, 5e9, 0.0) == kept_file
    assert profile_disk.disk_rates(folder) == (5e9, rates.disk_write_bytes_per_s)
    profile_disk.pin_disk_rates(folder, 1e9, 1e9)
    assert profile_disk.note_disk_rates(folder, 7e9, 7e9) is None and profile_disk.disk_rates(folder) == (1e9, 1e9)


def test_the_search_keeps_enough_chunks_persistent_for_the_spill_folder_s_free_space(tmp_path, monkeypatch):
    """A store that would spill more than the spill folder has free is refused at its build, after the
    compile: the search never picks such an ``n_persist`` (``Problem.min_persist``)."""
    import shutil as shutil_module

    from protrain_fx.planner import offload as autooffload
    from tests.planner.test_auto_offload import TIGHT

    numel, n, available = _host_short_of_memory(tmp_path, monkeypatch)
    model, reference, opt, ref_opt, handle = _offloaded(tmp_path, available_host_bytes=available)
    tiers = handle.tier_counts()
    disk = [sum(numel * 12 for _ in range(spill)) for _, spill in tiers]
    assert disk[0] > disk[1] > disk[2]
    free = disk[2]  # room for the store with two chunks persistent, not with fewer
    facts = handle.facts()
    assert autooffload.min_persist_for_disk(facts, free) == 2 and autooffload.min_persist_for_disk(facts, disk[0]) == 0
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(autooffload.shutil, "disk_usage", lambda path: usage._replace(free=free))
    report = protrain_fx.what_fits(model, *_batch(0), memory_budget=TIGHT, options={"codegen": "eager"})
    assert report.counts is not None and report.counts["n_persist"] >= 2
    assert report.tiers is not None and report.tiers["disk_bytes"] <= free
    handle.close()


def test_a_holder_waiting_for_a_buffer_takes_the_one_a_read_ahead_holds_once_its_read_ends(tmp_path):
    """Two buffers: one held by a reader (a state dict), the other by a read ahead still reading. A step of
    a third chunk waits for that read to end and then evicts it; it must not wait forever."""
    import threading
    import time

    from protrain_fx.runtime.store.spill import Residency, SpillFile

    numel = 1024
    buffers = {k: [None] * 3 for k in ("master", "exp_avg", "exp_avg_sq")}
    file = SpillFile(tmp_path, [3 * numel * 4] * 3)
    residency = Residency(file, [0, 1, 2], numel, buffers, [True] * 3)
    for c in range(3):
        residency.write_initial(c, [torch.full((numel,), float(c))] * 3)
    slow_read = file.read

    def read(i, tensors):
        time.sleep(0.3)
        slow_read(i, tensors)

    file.read = read
    done = threading.Event()
    with residency.held(0, write=False):  # the reader's buffer
        residency.prefetch(1)  # the other buffer, its read in flight

        def step():
            with residency.held(2, write=True):
                assert torch.equal(buffers["master"][2], torch.full((numel,), 2.0))
                buffers["master"][2].add_(1)
            done.set()

        threading.Thread(target=step, daemon=True).start()
        assert done.wait(10), "the step waited forever for a buffer"
    with residency.held(2, write=False):
        assert torch.equal(buffers["master"][2], torch.full((numel,), 3.0))  # written back, read again
    residency.close()


def test_a_spill_folder_in_host_memory_is_refused_and_the_default_avoids_one(tmp_path, monkeypatch):
    """A ``/tmp`` on tmpfs is common: spilling there would take the host memory spilling saves."""
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs rw 0 0\n")
    monkeypatch.setattr(spill_module, "MOUNTS", mounts)
    assert spill_module.filesystem_type(tmp_path / "a" / "b") == "tmpfs"
    assert spill_module.filesystem_type(Path("/var/tmp")) == "ext4"
    with pytest.raises(SpillError, match=r"is in host memory \(tmpfs\): spilling there takes the memory"):
        _setup(tmp_path, n_spill=2)
    monkeypatch.setattr(spill_module.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv(settings.SPILL_DIR, raising=False)
    assert spill_module.spill_dir(None) == Path("/var/tmp")  # the temporary folder is in memory: /var/tmp
    assert spill_module.spill_dir(tmp_path) == tmp_path  # given: as given (and refused when used)
