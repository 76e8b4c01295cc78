"""The loop's own checkpoint calls on an offloaded model (``runtime/offload/state_dict.py``'s state hooks):
``torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})`` and the restart's
``model.load_state_dict(...)`` / ``optimizer.load_state_dict(...)`` work as on a plain model. Without
the hooks the saved offloaded parameters were shells of 0 bytes (a file that does not load back), the
optimizer's state lacked the offloaded chunks' moments, and a load copied into the shells (a crash).

CPU, fp32, eager codegen: bit for bit against the uninterrupted run and against a plain GPT and AdamW.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain_fx
from examples.gpt import GPT
from tests.runtime.test_offload import CHUNK, CONFIG, _assert_same_params, _batch

#: A budget under which the backend keeps some of the tiny GPT's chunks and streams the others.
TIGHT = 3_000_000


def _offloaded(counts: str):
    """A fresh tiny GPT offloaded with counts by hand, or left to the backend under ``TIGHT``."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    kwargs = {"n_persist": 1, "n_buffer": 2} if counts == "by-hand" else {}
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, **kwargs)
    options = {"codegen": "eager"} if counts == "by-hand" else {"codegen": "eager", "memory_budget": TIGHT}
    return model, opt, handle, torch.compile(model, backend="protrain", options=options)


def _train(compiled, opt, steps):
    for step in steps:
        compiled(*_batch(step)).backward()
        opt.step(), opt.zero_grad()


@pytest.mark.parametrize("counts", ["by-hand", "automatic"])
def test_the_loops_own_save_and_restart_continue_exactly(tmp_path, counts):
    model, opt, handle, compiled = _offloaded(counts)
    _train(compiled, opt, range(2))
    assert 0 < handle.n_persist < len(handle.layout.chunks)  # some chunks offloaded
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    _train(compiled, opt, (2, 3))  # the uninterrupted run
    handle.close()

    # The file holds ordinary tensors: a plain GPT and AdamW load it strictly and continue alike.
    # (Each reader loads the file anew: a loaded optimizer holds the checkpoint's tensors and steps them.)
    checkpoint = torch.load(path, weights_only=True)
    plain = GPT(CONFIG)
    plain.load_state_dict(checkpoint["model"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    plain_opt.load_state_dict(checkpoint["optimizer"])
    assert len(plain_opt.state_dict()["state"]) == len(list(plain.parameters()))  # every moment saved
    _train(plain, plain_opt, (2, 3))

    # The restart: a fresh offloaded model (before its first compile when the counts are automatic)
    # loads the file with the plain calls and continues as the uninterrupted run did.
    torch._dynamo.reset()
    protrain_fx.reset()
    resumed, resumed_opt, resumed_handle, resumed_compiled = _offloaded(counts)
    checkpoint = torch.load(path, weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed_compiled, resumed_opt, (2, 3))
    _assert_same_params(resumed_handle, resumed, plain)
    resumed_handle.close()


def test_a_modules_state_dict_gives_its_offloaded_values():
    model, opt, handle, compiled = _offloaded("by-hand")
    _train(compiled, opt, range(1))
    whole = handle.state_dict(model)
    block = model.blocks[2].state_dict()
    assert block.keys() and all(torch.equal(v, whole[f"blocks.2.{k}"]) for k, v in block.items())
    assert any(model.get_parameter(f"blocks.2.{k}").untyped_storage().nbytes() == 0 for k in block)  # offloaded
    handle.close()


def test_a_load_that_lacks_or_mismatches_an_offloaded_parameter_is_reported_as_torch_reports_it():
    model, opt, handle, compiled = _offloaded("by-hand")
    _train(compiled, opt, range(1))
    state = handle.state_dict(model)
    name = next(n for n in state if model.get_parameter(n).untyped_storage().nbytes() == 0)
    before = copy.deepcopy(state)
    with pytest.raises(RuntimeError, match=f"Missing key.*{name}"):
        model.load_state_dict({k: v for k, v in state.items() if k != name})
    assert model.load_state_dict({k: v for k, v in state.items() if k != name}, strict=False).missing_keys == [name]
    wrong = dict(state, **{name: torch.zeros(3)})
    with pytest.raises(RuntimeError, match=f"size mismatch for {name}"):
        model.load_state_dict(wrong)
    after = handle.state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the same values, loaded back
    # and a load of other values reaches the chunks
    model.load_state_dict({k: v + 1 for k, v in state.items()})
    assert all(torch.equal(handle.state_dict(model)[k], v + 1) for k, v in state.items())
    handle.close()
