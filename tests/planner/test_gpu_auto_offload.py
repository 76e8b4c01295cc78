"""On a GPU: ``offload`` with automatic counts under a budget the model does not fit as it is. The
backend chooses the chunk counts and the activation plan, the first step is measured against the
prediction, and the bf16 losses follow eager's. Skipped without CUDA; run on the GPU machine with
``python -m pytest -q tests/planner/test_gpu_auto_offload.py``.

The machine's rates are measured on the first compile (``measure_machine`` in ``profile/machine_profile.py``,
cached in a temporary directory for this module, so the first test also covers the measurement).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.planner import first_step, rates
from tests.planner.test_gpu_auto_plan import _train
from protrain_fx import settings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = gpt_config("125M", n_layer=8)


@pytest.fixture(scope="module")
def machine_cache(tmp_path_factory):
    """One machine-cache directory for this module: the first test measures the machine, the others
    read it (each measurement took about 60 s of a test on the H200)."""
    return tmp_path_factory.mktemp("machine")


def _model_and_eager(machine_cache, monkeypatch, steps: int):
    """The test GPT on the GPU, a batch, the losses of ``steps`` eager steps of a copy of it and
    their allocated peak (every parameter on the device). Machine rates are measured into
    ``machine_cache`` (once for the module)."""
    monkeypatch.setenv(settings.CACHE_DIR, str(machine_cache))
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    batch = random_batch(CONFIG, 4, 512, device="cuda", generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, fused=True)
    eager = _train(reference, reference, batch, steps, ref_opt)
    all_on_device = torch.cuda.max_memory_allocated()
    del reference, ref_opt
    torch.cuda.empty_cache()
    return model, batch, eager, all_on_device


def test_counts_chosen_for_a_budget_train_within_it(machine_cache, monkeypatch):
    model, batch, eager, all_on_device = _model_and_eager(machine_cache, monkeypatch, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    handle = protrain_fx.offload(model, optimizer, device="cuda", compute_dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    budget = int(0.6 * all_on_device)
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": budget})
    losses = _train(model, compiled, batch, 3, optimizer)
    handle.synchronize()

    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    auto = record.auto_plan
    assert auto is not None and auto.offload and auto.budget_bytes == budget
    n = len(handle.layout.chunks)
    assert (handle.n_persist, handle.n_buffer, handle.n_gpu_optim) == (
        auto.config.n_persist, auto.config.n_buffer, auto.config.n_gpu_optim)
    # The budget changed the plan: some chunks stream, or (the search raised past the cost model's
    # margin, verify.raised_choice) all stay and blocks are checkpointed or swapped.
    assert handle.n_persist < n or auto.plan.blocks_with("checkpoint") or auto.plan.blocks_with("swap")
    print("trials:", auto.trials)
    check = auto.peak_check
    assert check is not None, "first step not measured"
    assert not check.over, check.line()
    assert torch.cuda.max_memory_reserved() <= budget * 1.02  # the allocator stayed within the budget
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=2e-2, atol=0)
    print(auto.table(record.index))
    print(check.line())


def test_what_fits_places_nothing_and_a_second_shape_keeps_the_counts(machine_cache, monkeypatch):
    """``what_fits`` on an offload without counts answers as training chooses and leaves no chunk
    placed; training then chooses and places the counts, and a second input shape compiles its own
    activation plan for the chunks as placed (both are CPU-tested; this is the GPU run)."""
    model, batch, _, all_on_device = _model_and_eager(machine_cache, monkeypatch, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    handle = protrain_fx.offload(model, optimizer, device="cuda", compute_dtype=torch.bfloat16)
    budget = int(0.6 * all_on_device)

    def what_fits(budget: int):
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as the training steps run
            return protrain_fx.what_fits(model, *batch, memory_budget=budget)

    report = what_fits(budget)
    assert report.fits == (report.min_budget_bytes <= budget), report
    if not report.fits:  # the minimum it names is one training accepts (test_what_fits_minimum_trains)
        budget = report.min_budget_bytes
        report = what_fits(budget)
    assert report.fits and report.counts is not None
    if report.counts["n_persist"] == len(handle.layout.chunks) and not report.plan.blocks_with("checkpoint"):
        # every chunk fits on the device with the optimizer state on the host: ask at the minimum, where
        # the counts or the activation plan must give way (training there: test_what_fits_minimum_trains)
        budget = report.min_budget_bytes
        report = what_fits(budget)
        assert report.fits and report.counts is not None
    assert report.min_budget_bytes <= budget
    assert report.counts["n_persist"] < len(handle.layout.chunks) or report.plan.blocks_with("checkpoint")
    assert not handle.configured  # the chunks it placed to check the answer were removed
    print(report)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": budget})
    torch.cuda.reset_peak_memory_stats()
    losses = _train(model, compiled, batch, 2, optimizer)
    shorter = random_batch(CONFIG, 2, 256, device="cuda", generator=torch.Generator().manual_seed(1))
    losses += _train(model, compiled, shorter, 2, optimizer)
    handle.synchronize()
    first, second = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-2:]
    assert first.auto_plan is not None and second.auto_plan is not None and second.auto_plan.offload
    assert second.auto_plan.config.n_persist == first.auto_plan.config.n_persist == handle.n_persist
    assert second.memory.peak_bytes <= second.auto_plan.allocated_cap_bytes
    peaks = (f"reserved {torch.cuda.max_memory_reserved()}, allocated {torch.cuda.max_memory_allocated()}, "
             f"caps {first.auto_plan.allocated_cap_bytes} / {second.auto_plan.allocated_cap_bytes}, budget {budget}; "
             f"first step {first.auto_plan.peak_check and first.auto_plan.peak_check.line()}; "
             f"second {second.auto_plan.peak_check and second.auto_plan.peak_check.line()}")
    assert torch.cuda.max_memory_reserved() <= budget * 1.02, peaks
    assert all(torch.isfinite(torch.tensor(losses)))
    print(first.auto_plan.table(first.index))
    print(second.auto_plan.table(second.index))


def test_what_fits_minimum_trains(machine_cache, monkeypatch):
    """The smallest budget ``what_fits`` names for an offload without counts is one training accepts."""
    model, batch, _, all_on_device = _model_and_eager(machine_cache, monkeypatch, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    protrain_fx.offload(model, optimizer, device="cuda", compute_dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        report = protrain_fx.what_fits(model, *batch, memory_budget=int(0.3 * all_on_device))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": report.min_budget_bytes})
    losses = _train(model, compiled, batch, 1, optimizer)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_re_plan_of_the_device_steps_keeps_training_within_the_budget(machine_cache, monkeypatch):
    # The re-plan at the end of the rate window (``planner/rates.py``, ``replan_gpu_optim``) applied on CUDA. Which
    # count the measured rates pick depends on this host's CPU, so the decision is forced here to the
    # nearest other count that fits the plan's room (the decision itself is tested on the CPU,
    # tests/planner/test_calibrate.py): the switch between calls, the losses against eager's, the budget.
    from protrain_fx.planner.rates import Replan
    from protrain_fx.search.cost import CostModel

    forced = []

    def nearest_other(problem, config, rates, *, predicted_s, room_bytes, **_):
        model = CostModel(rates.priced(problem))
        p, b, s, c, g = config.n_persist, config.n_buffer, config.n_swap, config.n_checkpoint, config.n_gpu_optim
        fits = [k for k in range(model.n_chunks - p + 1) if k != g
                and model.static_bytes(p, b, k) - model.static_bytes(p, b, g) <= room_bytes]
        assert fits, f"no other n_gpu_optim fits the room of {room_bytes} bytes"
        k = min(fits, key=lambda k: (abs(k - g), -k))
        forced.append(Replan(before=config, after=dataclasses.replace(config, n_gpu_optim=k), predicted_s=predicted_s,
                             before_s=model.step_time(p, b, s, c, g), after_s=model.step_time(p, b, s, c, k)))
        return forced[-1]

    monkeypatch.setattr(first_step, "replan_gpu_optim", nearest_other)
    first, last = rates.STEP_TIMED_CALLS
    steps = 2 * last + 1 - first  # through the calls timed after the re-plan
    model, batch, eager, all_on_device = _model_and_eager(machine_cache, monkeypatch, steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    # chunks of 32 MiB: enough of them that some budget offloads a few and steps one of those on the device
    handle = protrain_fx.offload(model, optimizer, device="cuda", compute_dtype=torch.bfloat16, chunk_bytes=32 * 2**20)
    torch.cuda.empty_cache()
    n_chunks = len(handle.layout.chunks)
    # the largest budget whose plan offloads some chunk (a host store) and steps some on the device: one
    # fewer device step always fits the plan's room (a plan with none may have no room for one)
    for fraction in (0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2):
        budget = int(fraction * all_on_device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            report = protrain_fx.what_fits(model, *batch, memory_budget=budget)
        if (report.fits and report.counts is not None and report.counts["n_persist"] < n_chunks
                and report.counts["n_gpu_optim"] > 0):
            break
    else:
        pytest.fail(f"no budget down to {budget} bytes offloads a chunk and steps one on the device: {report}")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain", options={"memory_budget": budget})
    losses = _train(model, compiled, batch, steps, optimizer)
    handle.synchronize()
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    auto = record.auto_plan
    assert auto is not None and auto.offload and handle.store is not None, "nothing was offloaded"
    (replan,) = forced
    assert auto.replanned is replan and replan.after.n_gpu_optim != auto.config.n_gpu_optim
    assert replan.step_check is not None and replan.step_check.calls == (last + 1, steps)
    # measured slower than before it, the change is undone at the start of the last call
    assert replan.kept is not None
    assert handle.n_gpu_optim == (replan.after if replan.kept else replan.before).n_gpu_optim
    print(auto.table(record.index))
    assert torch.cuda.max_memory_reserved() <= budget * 1.02  # the allocator stayed within the budget
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=2e-2, atol=0)
