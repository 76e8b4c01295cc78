"""The machine measured ahead of a first compile's plan, on a thread beside the capture
(``profile/machine_profile.measure_ahead``). CUDA is stood in for: what is tested is the order, the
waiting and the random streams, not a rate."""

from __future__ import annotations

import threading

import pytest
import torch

from protrain_fx.profile import keeps_rng, machine_profile, on_ahead_thread, ops


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA as measure_ahead sees it, and its three measurements recorded (thread, name, args)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(machine_profile, "pinned_profile", lambda device, cache=None: None)
    calls = []

    def recorder(name):
        def measure(device, *args, **kwargs):
            calls.append((threading.current_thread().name, on_ahead_thread(), name, args))
        return measure

    for name in ("card_machine", "measure_machine", "chunk_adam_rate"):
        monkeypatch.setattr(machine_profile, name, recorder(name))
    yield calls
    machine_profile.wait_ahead()


def test_an_offload_s_machine_is_measured_on_a_thread_of_its_own_in_order(fake_cuda):
    assert machine_profile.measure_ahead(torch.device("cuda", 0), chunk_params=1 << 20)
    machine_profile.wait_ahead()
    assert [(c[2], c[3]) for c in fake_cuda] == [("card_machine", ()), ("measure_machine", ()),
                                                  ("chunk_adam_rate", (1 << 20,))]
    assert all(c[0] == "protrain_fx-measure-ahead" and c[1] for c in fake_cuda)
    assert not on_ahead_thread()  # the flag is the thread's own


def test_without_an_offload_only_the_card_is_measured_and_never_off_cuda(fake_cuda):
    assert machine_profile.measure_ahead("cuda:0")
    machine_profile.wait_ahead()
    assert [c[2] for c in fake_cuda] == ["card_machine"]
    assert not machine_profile.measure_ahead("cpu", chunk_params=1 << 20)


def test_another_thread_s_measurement_waits_until_the_ahead_one_ends(monkeypatch, fake_cuda):
    go = threading.Event()
    monkeypatch.setattr(machine_profile, "card_machine", lambda device: go.wait(10))
    machine_profile.measure_ahead("cuda:0")
    waited = threading.Thread(target=machine_profile.wait_ahead)
    waited.start()
    waited.join(0.3)
    assert waited.is_alive()  # held while the measurement ahead runs
    go.set()
    waited.join(10)
    assert not waited.is_alive()


def test_a_failure_ahead_is_left_to_the_compile_s_own_call(monkeypatch, fake_cuda):
    def oom(device):
        raise torch.OutOfMemoryError("tight budget")

    monkeypatch.setattr(machine_profile, "card_machine", oom)
    assert machine_profile.measure_ahead("cuda:0", chunk_params=1 << 20)
    machine_profile.wait_ahead()  # returns: nothing raised here, nothing measured after the failure
    assert fake_cuda == []


def test_the_thread_ahead_leaves_the_callers_random_streams_as_its_own_thread_drew_them(fake_cuda, monkeypatch):
    # keeps_rng restores the streams after a measurement; on the thread ahead that would rewind what
    # the compile's thread drew meanwhile, so it does not fork there.
    entered, drawn, measured = threading.Event(), threading.Event(), threading.Event()

    @keeps_rng
    def measurement(device):
        entered.set()
        drawn.wait(10)
        measured.set()

    monkeypatch.setattr(machine_profile, "card_machine", measurement)
    torch.manual_seed(0)
    machine_profile.measure_ahead("cuda:0")
    assert entered.wait(10)
    torch.rand(3)  # the compile's thread draws while the measurement runs
    after_draw = torch.get_rng_state()
    drawn.set()
    machine_profile.wait_ahead()
    assert measured.is_set() and torch.equal(torch.get_rng_state(), after_draw)


def test_a_measurement_s_random_inputs_come_from_its_own_generator():
    fake = torch.empty(64, 32)
    before = torch.get_rng_state()
    a = ops._real_tensor(fake, torch.device("cpu"))
    b = ops._real_tensor(fake, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(a, b) and a.std() > 0
