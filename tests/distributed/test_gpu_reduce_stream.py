"""On one GPU with NCCL: sharded chunks' gradients reduce-scattered on the handle's reduction stream.

Skipped without CUDA. Run on one GPU as ``torchrun --nproc_per_node=1 -m pytest -q
tests/distributed/test_gpu_reduce_stream.py`` (or plain ``pytest``: a one-rank NCCL group is made
here). At world size 1 the offload does not shard, so the tests make it take the data-parallel path
anyway (``distributed.active`` gives the one-rank group): every fetch and every gradient then goes
through the collectives' code, each an identity over one rank, and training must equal eager AdamW.
The CPU tests with two gloo ranks (``test_sharded.py``) check the averaging itself."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.runtime.parallel import distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = gpt_config("tiny", n_layer=4)
CHUNK = 256 * 1024


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    """A one-rank NCCL group (torchrun's, or made here), seen by the offload as data-parallel."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    if dist.get_world_size() != 1:
        pytest.skip("a one-rank test: run it under torchrun --nproc_per_node=1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    monkeypatch.setattr(distributed, "active", distributed.current)
    yield
    if made:
        dist.destroy_process_group()


def _batch(step: int):
    return random_batch(CONFIG, 4, 64, device="cuda", generator=torch.Generator().manual_seed(step))


def _setup(n_persist: int, n_buffer: int, n_gpu_optim: int = 0):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, n_persist=n_persist, n_buffer=n_buffer, device="cuda",
                                 chunk_bytes=CHUNK, n_gpu_optim=n_gpu_optim)
    return model, reference, opt, ref_opt, handle


@pytest.mark.parametrize(("n_persist", "n_gpu_optim"), [(0, 0), (1, 2)])
def test_sharded_gradients_reduced_on_their_stream_train_as_eager(one_rank, n_persist, n_gpu_optim):
    model, reference, opt, ref_opt, handle = _setup(n_persist, 8, n_gpu_optim)
    assert handle.group is not None and handle.store.shard == (0, 1)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    for step in range(3):
        loss, ref_loss = compiled(*_batch(step)), reference(*_batch(step))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        loss.backward()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the held norms, read after the reductions
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert handle._reduce_stream is not None and handle._reduced is not None  # the reductions ran there
    state = handle.state_dict(model)
    for name, p in reference.named_parameters():
        # as tests/runtime/test_gpu_offload.py: CPU and GPU fused AdamW round differently in fp32
        torch.testing.assert_close(state[name], p.detach().cpu(), rtol=1e-4, atol=3e-5, msg=name)
    if n_gpu_optim:
        assert handle.device_adam.chunk_steps == 3 * n_gpu_optim
    handle.close()


def test_compute_goes_on_while_a_gradient_is_reduced(one_rank):
    """The reduction stream is held up (a long sleep, standing in for a slow collective); a chunk's
    gradient landed then must leave the compute stream free: a kernel issued after it ends while the
    reduction is still queued. The gradient lands in the host store once the stream gets to it."""
    _, _, _, _, handle = _setup(0, 2)
    store = handle.store
    slots = [s for s in store.slots if s.chunk == 0 and s.trainable]
    grads = [torch.randn(s.shape, device="cuda") for s in slots]
    handle._reduce_stream = torch.cuda.Stream()
    with torch.cuda.stream(handle._reduce_stream):
        torch.cuda._sleep(2_000_000_000)  # about a second at GPU clocks
    with handle.accumulate():  # held: no optimizer step queued
        handle.land_grads(0, [s.name for s in slots], grads)
    after = torch.ones(1, device="cuda") * 2
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert after.item() == 2.0
    assert not handle._reduced.query()  # compute is done, the reduction still queued behind the sleep
    torch.cuda.synchronize()
    store.wait_grad(0)
    flat = store.grad_flat(0)
    for s, g in zip(slots, grads):  # one rank's mean is its own gradient
        assert torch.equal(flat[s.offset : s.offset + s.numel].view(s.shape), g.cpu()), s.name
    handle.close()
