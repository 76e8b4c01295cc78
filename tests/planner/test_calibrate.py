"""The rates training reaches, measured over the first training calls and kept for later plans
(``planner/rates.py``, ``profile_cache.note_training_rates`` / ``training_rates``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import protrain_fx
from protrain_fx.planner import first_step
from protrain_fx.planner import problem as planner_problem
from protrain_fx.planner.rates import STEP_TIMED_CALLS, TrainingRates, training_rates
from protrain_fx.profile import cache as profile_cache
from protrain_fx.runtime.offload.step_window import StepWindow
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import MachineProfile
from protrain_fx.search.spread import expected_estimate
from tests.conftest import NOTE_TRAINING_RATES
from tests.planner.test_auto_offload import (  # (its machine stand-in is that module's own fixture)
    TIGHT,
    _setup,
)
from tests.runtime.test_offload import _assert_same_params, _batch, _train_side_by_side
from protrain_fx import settings

GRANULE = profile_cache.CHUNK_RATE_GRANULE
PROFILE = MachineProfile(h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, duplex_bytes_per_s=40e9,
                         cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=1e11, device_step_bytes_per_s=45e9)


def _profile_file(cache, profiled_by_chunk: dict[int, float]) -> None:
    """A profile file as ``measure_machine`` and ``chunk_adam_rate`` leave it (nothing measured here)."""
    path = profile_cache.cache_path("cpu", cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "version": profile_cache.CACHE_VERSION, "profile": PROFILE.to_dict(),
        "cpu_adam_by_chunk": {str(n): r for n, r in profiled_by_chunk.items()},
    }))


@pytest.fixture(autouse=True)
def _kept(monkeypatch):
    """These tests keep rates (on their own cache directories)."""
    monkeypatch.setattr(profile_cache, "note_training_rates", NOTE_TRAINING_RATES)


def test_rates_kept_from_training_replace_the_profiled_ones(tmp_path):
    # nothing kept yet: the profile as it is
    _profile_file(tmp_path, {GRANULE: 1e9, 4 * GRANULE: 0.8e9})
    assert profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path) == (PROFILE, [])
    for rate in (0.5e9, 0.7e9, 0.6e9):
        profile_cache.note_training_rates("cpu", chunk_params=GRANULE - 5, cpu_adam_params_per_s=rate, cache=tmp_path)
    for rate in (40e9, 38e9):
        written = profile_cache.note_training_rates("cpu", device_step_bytes_per_s=rate, cache=tmp_path)
        assert written == profile_cache.cache_path("cpu", tmp_path)
    before = profile_cache.cache_path("cpu", tmp_path).read_text()
    assert profile_cache.note_training_rates("cpu", chunk_params=GRANULE, cache=tmp_path) is None  # 0: not a measurement
    assert profile_cache.cache_path("cpu", tmp_path).read_text() == before
    trained, names = profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path)
    assert names == ["cpu_adam_params_per_s", "device_step_bytes_per_s"]
    assert trained.cpu_adam_params_per_s == 0.6e9  # the median of those kept for this chunk size
    assert trained.device_step_bytes_per_s == 39e9
    assert trained.h2d_bytes_per_s == PROFILE.h2d_bytes_per_s
    # a size not trained, within NEAR_CHUNK_FACTOR of a trained one: the trained size's rate
    other = MachineProfile.from_dict({**PROFILE.to_dict(), "cpu_adam_params_per_s": 0.8e9})
    assert profile_cache.NEAR_CHUNK_FACTOR == 4
    assert profile_cache.training_rates("cpu", other, 4 * GRANULE, cache=tmp_path)[0].cpu_adam_params_per_s == 0.6e9
    # farther: its profiled rate scaled as training scaled the trained size's (0.6 of 1.0)
    assert profile_cache.training_rates("cpu", other, 5 * GRANULE, cache=tmp_path)[0].cpu_adam_params_per_s == pytest.approx(0.48e9)
    # without a chunk size the CPU rate stays
    assert profile_cache.training_rates("cpu", PROFILE, None, cache=tmp_path)[1] == ["device_step_bytes_per_s"]
    # only the newest TRAINING_KEEP are kept
    for rate in range(1, profile_cache.TRAINING_KEEP + 2):
        profile_cache.note_training_rates("cpu", device_step_bytes_per_s=rate * 1e9, cache=tmp_path)
    kept = json.loads(profile_cache.cache_path("cpu", tmp_path).read_text())["in_training"][profile_cache.TRAINING_DEVICE_KEY]
    assert kept == [r * 1e9 for r in range(2, profile_cache.TRAINING_KEEP + 2)]


def test_device_step_rates_kept_before_the_refetches_were_modelled_are_not_read(tmp_path):
    # rates under "device_step_bytes_per_s" were timed over spans with backward's re-fetches in them;
    # the cost model adds those re-fetches itself, so a profile file that holds them is not read for them
    _profile_file(tmp_path, {GRANULE: 1e9})
    path = profile_cache.cache_path("cpu", tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "in_training": {"device_step_bytes_per_s": [30e9, 31e9]}}))
    assert profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path) == (PROFILE, [])
    profile_cache.note_training_rates("cpu", device_step_bytes_per_s=44e9, cache=tmp_path)
    trained, names = profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path)
    assert names == ["device_step_bytes_per_s"] and trained.device_step_bytes_per_s == 44e9


def test_a_size_not_trained_takes_the_rates_of_trained_sizes_near_it(tmp_path):
    # profiled at 1.0 (8 granules) and 2.0 (1 granule); trained at 8 and 16 granules
    _profile_file(tmp_path, {8 * GRANULE: 1e9, GRANULE: 2e9})
    for n, rate in ((8 * GRANULE, 1.4e9), (16 * GRANULE, 1.2e9), (16 * GRANULE, 1.0e9)):
        profile_cache.note_training_rates("cpu", chunk_params=n, cpu_adam_params_per_s=rate, cache=tmp_path)
    def rate(n: int, profiled: float = 2e9) -> float:
        other = MachineProfile.from_dict({**PROFILE.to_dict(), "cpu_adam_params_per_s": profiled})
        trained, names = profile_cache.training_rates("cpu", other, n, cache=tmp_path)
        assert names == ["cpu_adam_params_per_s"]
        return trained.cpu_adam_params_per_s
    assert rate(8 * GRANULE) == 1.4e9 and rate(16 * GRANULE) == 1.1e9  # their own
    assert rate(4 * GRANULE) == pytest.approx(1.25e9)  # both within 4x: the median of 1.4 and 1.1
    assert rate(2 * GRANULE) == 1.4e9  # only 8 granules within 4x
    assert rate(64 * GRANULE) == 1.1e9  # only 16 granules
    # none within 4x (1 granule): the profile scaled by training's median ratio to the profiler's,
    # over the sizes profiled and trained (8 granules: 1.4 of 1.0; 16 were never profiled)
    assert rate(GRANULE, profiled=2e9) == pytest.approx(2.8e9)


def test_no_profile_file_or_another_version_keeps_nothing(tmp_path):
    assert profile_cache.note_training_rates("cpu", device_step_bytes_per_s=40e9, cache=tmp_path) is None
    assert not profile_cache.cache_path("cpu", tmp_path).exists()
    _profile_file(tmp_path, {})
    path = profile_cache.cache_path("cpu", tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": profile_cache.CACHE_VERSION - 1, "in_training": {profile_cache.TRAINING_DEVICE_KEY: [1.0]}}))
    profile_cache.note_training_rates("cpu", device_step_bytes_per_s=40e9, cache=tmp_path)
    assert json.loads(path.read_text())["in_training"] == {profile_cache.TRAINING_DEVICE_KEY: [1.0]}
    assert profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path) == (PROFILE, [])


def test_an_edited_profile_file_prices_only_at_the_rates_it_still_holds(tmp_path):
    _profile_file(tmp_path, {GRANULE: 1e9})
    path = profile_cache.cache_path("cpu", tmp_path)
    data = json.loads(path.read_text())
    for junk in ("fast", {"a": 1}, [None, "x", -1.0, 0, True]):
        path.write_text(json.dumps({**data, "in_training": {profile_cache.TRAINING_DEVICE_KEY: junk,
                                                            "cpu_adam_by_chunk": {str(GRANULE): junk}}}))
        assert profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path) == (PROFILE, []), junk
    # the numbers that are rates still count: 0.5e9 for this size, and for another size scaled by 0.5
    path.write_text(json.dumps({**data, "in_training": {"cpu_adam_by_chunk": {str(GRANULE): ["x", 0.5e9, -3]}}}))
    assert profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path)[0].cpu_adam_params_per_s == 0.5e9
    other, names = profile_cache.training_rates("cpu", PROFILE, 3 * GRANULE, cache=tmp_path)
    assert names == ["cpu_adam_params_per_s"] and other.cpu_adam_params_per_s == pytest.approx(0.5e9)
    path.write_text(json.dumps({**data, "in_training": ["not", "a", "dict"]}))
    assert profile_cache.training_rates("cpu", PROFILE, GRANULE, cache=tmp_path) == (PROFILE, [])


class _Adam:
    def __init__(self) -> None:
        self.computed = (2.0, 100)


class _Handle:
    def __init__(self) -> None:
        self.adam = _Adam()
        self.device_adam = None
        self.store = None  # (nothing spilled: no disk rates)


def test_the_window_counts_only_the_steps_run_while_it_was_open():
    handle = _Handle()
    window = StepWindow(handle)
    handle.adam.computed = (2.5, 400)  # 300 parameters in half a second since the window opened
    rates = training_rates(window.close(), None, None)
    assert (rates.cpu_params, rates.cpu_s, rates.device_steps, rates.device_step_bytes_per_s) == (300, 0.5, (), 0.0)
    assert rates.cpu_adam_params_per_s == 600
    assert TrainingRates(cpu_params=0, cpu_s=0.0).cpu_adam_params_per_s == 0.0


class _Event:
    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def elapsed_time(self, end: _Event) -> float:
        return end.ms - self.ms

    def query(self) -> bool:
        return self.done


class _DeviceSteps:
    cuda = True
    window = None


def test_device_steps_are_priced_by_the_bytes_the_cost_model_copies_out_of_their_own_chunk():
    from protrain_fx.search.cost import CostModel
    from protrain_fx.search.problem import Counts
    from tests.search.test_cost_search import make_problem

    problem = make_problem(3, n_blocks=4)
    config = Counts(n_persist=2, n_buffer=2, n_swap=0, n_checkpoint=0, n_gpu_optim=2)
    model = CostModel(problem)
    handle = _Handle()
    handle.device_adam = _DeviceSteps()
    window = StepWindow(handle)
    assert handle.device_adam.window == []  # timing from now on
    # store chunks 0 and 1 are the model's chunks 2 and 3 (after the 2 persistent ones)
    out = [model.dev_out_bytes[2], model.dev_out_bytes[3]]
    handle.device_adam.window += [
        (0, _Event(0.0), _Event(1000 * out[0] / 40e9)),  # 40 GB/s
        (1, _Event(5.0), _Event(5.0 + 1000 * out[1] / 30e9)),  # 30 GB/s
        (0, _Event(9.0), _Event(9.0 + 1000 * out[0] / 50e9)),  # 50 GB/s
        (1, _Event(20.0), _Event(21.0, done=False)),  # still running at the window's end: left out
    ]
    rates = training_rates(window.close(), problem, config)
    assert handle.device_adam.window is None  # no longer timed
    assert len(rates.device_steps) == 3
    # each timed chunk's own median seconds, in the cost model's numbering
    assert [k for k, _ in rates.device_step_s] == [2, 3]
    seconds = [(out[0] / 40e9 + out[0] / 50e9) / 2, out[1] / 30e9]
    assert [s for _, s in rates.device_step_s] == pytest.approx(seconds)
    # the rate: their bytes out over their seconds less the re-fetches the model puts beside them
    added = model.refetch_beside_steps(config)
    rate = (out[0] + out[1]) / (seconds[0] + seconds[1] - added[2] - added[3])
    assert rates.device_step_bytes_per_s == pytest.approx(rate)
    priced = rates.priced(problem)
    assert priced.machine.device_step_bytes_per_s == pytest.approx(rate)
    assert priced.machine.cpu_adam_params_per_s == problem.machine.cpu_adam_params_per_s  # nothing on the CPU
    assert priced.device_step_s == rates.device_step_s
    timed = CostModel(priced)
    assert timed.dev_out_s[3] == pytest.approx(out[1] / 30e9)  # its own time, not the median rate's
    assert timed.dev_out_s[4:] == pytest.approx([b / rate for b in model.dev_out_bytes[4:]])  # not timed: the rate
    line = rates.line(problem, config)
    assert f"device steps {rate / 1e9:.1f} GB/s each way without the re-fetches beside them, over 3 steps" in line
    # nothing stepped on the CPU: the line says the profiled CPU rate was not put to the test
    cpu = problem.machine.cpu_adam_params_per_s / 1e9
    assert f"no CPU step timed (the profiled CPU rate, {cpu:.2f} G params/s, stands untested)" in line


def test_a_chunk_step_counts_its_seconds_and_the_parameters_it_stepped():
    from protrain_fx.chunks import ParamInfo, pack
    from protrain_fx.runtime.store.chunk_store import ChunkStore
    from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW

    params = {n: torch.nn.Parameter(torch.randn(size)) for n, size in (("a", 300), ("b", 200), ("frozen", 100))}
    params["frozen"].requires_grad_(False)
    layout = pack([ParamInfo((n,), 4 * p.numel(), "blocks.0", 0) for n, p in params.items()], 4 * 1024)
    store = ChunkStore(layout, params, compute_dtype=torch.float32, pin_memory=False)
    trainable = [p for p in params.values() if p.requires_grad]
    adam = ChunkAdamW(store, torch.optim.AdamW(trainable, lr=1e-3, fused=True), params)
    assert adam.computed == (0.0, 0)
    store.write_grads({"a": torch.ones(300), "b": torch.ones(200)})
    adam.step_chunk(0)
    seconds, stepped = adam.computed
    assert stepped == 500 and seconds > 0  # the frozen parameter is not stepped
    store.write_grads({"a": torch.ones(300)})
    adam.step_chunk(0)
    assert adam.computed[1] == 800 and adam.computed[0] > seconds


def test_training_measures_the_cpu_rate_and_the_next_plan_is_priced_at_it(tmp_path, monkeypatch, caplog):
    # A tiny GPT with automatic counts under a budget that offloads some chunks (as in
    # test_auto_offload), the machine read from a profile file written here (nothing measured).
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    _profile_file(None, {GRANULE: PROFILE.cpu_adam_params_per_s})
    first, last = STEP_TIMED_CALLS
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        _train_side_by_side(compiled, reference, opt, ref_opt, last - 1)
        record = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1]
        auto = record.auto_plan
        assert auto.offload and auto.config.n_persist < len(handle.layout.chunks)
        assert auto.training_rates is None  # the window closes when call `last` starts
        assert auto.problem.machine.cpu_adam_params_per_s == PROFILE.cpu_adam_params_per_s
        _train_side_by_side(compiled, reference, opt, ref_opt, 1)
    _assert_same_params(handle, model, reference)  # timing changes nothing trained
    rates = auto.training_rates
    # The window holds the chunk steps that finished between the starts of calls `first` and
    # `last`: all of calls `first` .. `last - 2` (the next forward gathers every offloaded chunk, so
    # waits for its step), and of the calls just before and at its ends, those that had finished.
    offloaded = sum(s.numel for s in handle.store.slots if s.trainable)  # the store holds the offloaded chunks
    assert offloaded > 0
    assert (last - first - 1) * offloaded <= rates.cpu_params <= (last - first + 1) * offloaded
    assert rates.cpu_adam_params_per_s > 0 and rates.device_steps == ()
    assert "in training: CPU Adam" in caplog.text and "in training: CPU Adam" in auto.table()
    assert f"kept for later plans on this machine in {profile_cache.cache_path('cpu')}" in caplog.text
    kept = json.loads(profile_cache.cache_path("cpu").read_text())["in_training"]
    assert kept == {"cpu_adam_by_chunk": {str(GRANULE): [rates.cpu_adam_params_per_s]}}

    # A new model on this machine: its plan is priced at the rate training reached.
    torch._dynamo.reset()
    protrain_fx.reset()
    caplog.clear()
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        _train_side_by_side(compiled, reference, opt, ref_opt, 1)
    record = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1]
    assert record.auto_plan.problem.machine.cpu_adam_params_per_s == rates.cpu_adam_params_per_s
    assert "the rate training reached on this machine" in caplog.text


def test_a_cpu_slower_in_training_moves_chunks_to_device_steps_and_only_when_it_pays():
    from protrain_fx.planner.rates import REPLAN_MIN_GAIN, replan_gpu_optim
    from protrain_fx.search.cost import CostModel
    from protrain_fx.search.problem import Counts
    from tests.search.test_cost_search import make_problem

    # Profiled: a fast CPU, so the plan steps every offloaded chunk there (n_gpu_optim = 0).
    problem = make_problem(9, n_blocks=4, cpu_adam_params_per_s=50e9, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9,
                           duplex_bytes_per_s=100e9)
    model = CostModel(problem)
    n, b = model.n_chunks, model.buffer_range(1).start
    config = Counts(1, b, 0, 0, 0)
    room = model.static_bytes(1, b, 1) - model.static_bytes(1, b, 0)  # what any device step adds
    slow = TrainingRates(cpu_params=10**9, cpu_s=5.0)  # training reached 0.2 G params/s
    replan = replan_gpu_optim(problem, config, slow, predicted_s=0.123, room_bytes=room)
    at_rates = CostModel(slow.priced(problem))
    assert replan is not None and replan.before == config and replan.predicted_s == 0.123
    g = replan.after.n_gpu_optim
    assert replan.after == Counts(1, b, 0, 0, g) and g > 0
    assert replan.before_s == at_rates.step_time(1, b, 0, 0, 0)
    assert replan.after_s == min(at_rates.step_time(1, b, 0, 0, k) for k in range(n))  # the fastest count
    assert replan.after_s < replan.before_s * (1 - REPLAN_MIN_GAIN)
    assert "n_gpu_optim 0 -> " in replan.line()
    # No room for the device steps' staging: nothing to do.
    assert replan_gpu_optim(problem, config, slow, predicted_s=0.1, room_bytes=room - 1) is None
    # Training as fast as the profile: the plan stays.
    assert replan_gpu_optim(problem, config, TrainingRates(cpu_params=50 * 10**9, cpu_s=1.0), predicted_s=0.1,
                            room_bytes=room) is None
    # A gain under the threshold is not taken, one above it is.
    gain = 1 - replan.after_s / replan.before_s
    assert replan_gpu_optim(problem, config, slow, predicted_s=0.1, room_bytes=room, min_gain=gain + 1e-9) is None
    assert replan_gpu_optim(problem, config, slow, predicted_s=0.123, room_bytes=room, min_gain=gain - 1e-9) == replan
    # From device steps already running, back to fewer ones when the CPU is faster than profiled.
    many = Counts(1, b, 0, 0, n - 1)
    fast_cpu = make_problem(9, n_blocks=4, cpu_adam_params_per_s=0.2e9, h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9,
                            duplex_bytes_per_s=3e9)
    back = replan_gpu_optim(fast_cpu, many, TrainingRates(cpu_params=50 * 10**9, cpu_s=1.0), predicted_s=1.0,
                            room_bytes=0)
    assert back is not None and back.after.n_gpu_optim < n - 1


@pytest.mark.parametrize("faster", [True, False])
def test_training_slower_than_profiled_re_plans_the_running_step_and_times_it_again(tmp_path, monkeypatch, caplog,
                                                                                      faster):
    # The tiny GPT of the test above, its CPU steps profiled 10^5x faster than they run here: at the
    # window's end the backend moves chunks to device steps (a CPU "device" runs them, the same bits),
    # training stays exactly eager's, and the calls after the switch are timed against the new
    # prediction. The clock of those calls is driven: a period measured longer than before the
    # switch undoes it, a shorter one keeps it.
    from protrain_fx.planner.rates import replan_gpu_optim

    calls = []

    def clock() -> float:  # 100 ms a call through call `last`, then 50 or 200 ms
        calls.append(None)
        k = len(calls)
        cut = STEP_TIMED_CALLS[1]
        return 0.1 * min(k, cut) + (0.05 if faster else 0.2) * max(0, k - cut)

    monkeypatch.setattr(first_step, "_clock", clock)

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    _profile_file(None, {GRANULE: PROFILE.cpu_adam_params_per_s})
    monkeypatch.setattr(first_step, "replans_device_steps", lambda device: True)  # as on CUDA
    monkeypatch.setattr(planner_problem, "_device_step_staging_bytes", lambda itemsize: 0)  # host memory on a CPU device
    fast = MachineProfile.from_dict({**PROFILE.to_dict(), "cpu_adam_params_per_s": 1e12, "device_step_bytes_per_s": 0.0})
    from protrain_fx.planner import offload as autooffload

    monkeypatch.setattr(autooffload, "offload_machine", lambda device, record, *chunk: fast)
    first, last = STEP_TIMED_CALLS
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        _train_side_by_side(compiled, reference, opt, ref_opt, last)
        record = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1]
        auto = record.auto_plan
        assert auto.config.n_gpu_optim == 0  # on the CPU the search steps none on the device
        replan = auto.replanned
        assert replan is not None, caplog.text
        assert replan.before == auto.config and handle.n_gpu_optim == replan.after.n_gpu_optim > 0
        assert replan.predicted_s == auto.estimate.step_s
        # what the function decides from the same numbers
        room = auto.allocated_cap_bytes - max(auto.analysed_peak_bytes, auto.measured_peak_bytes or 0)
        assert replan == replan_gpu_optim(auto.problem, auto.config, auto.training_rates, predicted_s=auto.estimate.step_s,
                                          room_bytes=room)
        assert "re-planned at the rates training reached" in caplog.text and "re-planned" in auto.table()
        device = handle.device_adam
        steps_before = device.chunk_steps
        _train_side_by_side(compiled, reference, opt, ref_opt, last - first - 1)
        assert replan.step_check is None  # calls last+1 .. 2*last+1-first are timed
        _train_side_by_side(compiled, reference, opt, ref_opt, 2)
        after = device.chunk_steps
        _train_side_by_side(compiled, reference, opt, ref_opt, 2)  # on the count kept, or undone
    assert after > steps_before
    _assert_same_params(handle, model, reference)
    check = replan.step_check
    assert check is not None and check.calls == (last + 1, 2 * last + 1 - first)
    assert len(check.intervals_s) == last - first and check.predicted_step_s == replan.after_s
    assert auto.step_check.predicted_step_s == auto.estimate.step_s  # the first window: the first plan
    assert auto.step_check.measured_step_s == pytest.approx(0.1) and replan.measured_before_s == pytest.approx(0.1)
    assert check.measured_step_s == pytest.approx(0.05 if faster else 0.2)
    assert replan.kept is faster
    if faster:
        assert handle.n_gpu_optim == replan.after.n_gpu_optim and device.chunk_steps > after
        assert "kept (measured before it" in caplog.text
    else:  # undone: the CPU steps every offloaded chunk again
        assert handle.n_gpu_optim == replan.before.n_gpu_optim == 0 and handle.device_adam is None
        assert device.chunk_steps == after
        assert "so undone: n_gpu_optim back to 0" in caplog.text


def test_a_clipping_loop_is_priced_with_its_chunk_steps_held_once_the_window_sees_it(tmp_path, monkeypatch, caplog):
    # The loop clips: from its first step every offloaded chunk's step waits for the norm
    # (``Problem.held_steps``). The counts were chosen before the first step, priced unheld; the rate
    # window prices the running plan held, and training stays exact.
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    _profile_file(None, {GRANULE: PROFILE.cpu_adam_params_per_s})
    model, reference, opt, ref_opt, handle, compiled = _setup(TIGHT)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        for step in range(STEP_TIMED_CALLS[1] + 1):
            batch = _batch(step)
            loss, ref_loss = compiled(*batch), reference(*batch)
            assert torch.equal(loss, ref_loss), step
            loss.backward(), ref_loss.backward()
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in (compiled, reference)]
            assert torch.equal(*norms), step
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            if step == 0:
                auto = [g for g in protrain_fx.captured_graphs() if g.backward is not None][-1].auto_plan
                assert auto.offload and not auto.problem.held_steps  # not known at the compile
                planned = auto.estimate
    _assert_same_params(handle, model, reference)
    assert handle.grad_clipping is True and auto.problem.held_steps and auto.training_rates is not None
    assert "the loop clips: every offloaded chunk's step waits for the norm" in caplog.text
    # the measured period (a held step's) is checked against the held step's prediction, priced as planned
    held = (expected_estimate(auto.problem, auto.config, auto.rate_spread) if auto.rate_spread
            else CostModel(auto.problem).estimate(auto.config))
    assert auto.estimate == held and held.step_s != planned.step_s
    assert auto.step_check is not None and auto.step_check.predicted_step_s == held.step_s
