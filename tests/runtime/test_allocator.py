"""The backend's switch of the CUDA caching allocator to expandable segments (runtime/allocator.py)."""

import pytest
import torch

from protrain_fx.runtime import allocator


@pytest.fixture
def calls(monkeypatch):
    """The settings the allocator would receive, with the process-wide switch not yet made."""
    seen: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append)
    monkeypatch.setattr(allocator, "_switched", False)
    for name in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    return seen


def test_cuda_work_switches_once(calls):
    assert allocator.expandable_segments("cuda:0")
    assert not allocator.expandable_segments(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]


def test_cpu_and_unknown_devices_leave_it(calls):
    assert not allocator.expandable_segments("cpu")
    assert not allocator.expandable_segments(None)
    assert calls == []


@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:128,expandable_segments:True"])
@pytest.mark.parametrize("name", allocator.ALLOC_CONF_VARS)
def test_a_users_choice_is_kept(calls, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not allocator.expandable_segments("cuda")
    assert calls == []


def test_other_settings_do_not_count_as_a_choice(calls, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert allocator.expandable_segments("cuda")
    assert calls == ["expandable_segments:True"]


def _offload_tiny(device):
    import protrain_fx
    from examples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    return protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), device=device, n_persist=0, n_buffer=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_refused_offload_leaves_the_allocator(calls):
    with pytest.raises(ValueError, match="no CUDA device"):
        _offload_tiny("cuda")
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_to_cuda_switches_it(calls):
    handle = _offload_tiny("cuda")
    handle.close()
    assert calls == ["expandable_segments:True"]
