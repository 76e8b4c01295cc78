"""On a GPU: the backward lowered by a child process beside the forward (``protrain_fx/codegen_child.py``,
on by default for CUDA steps). Skipped without CUDA; run on the GPU machine with
``python -m pytest -q tests/planner/test_gpu_codegen_child.py -o log_cli=true --log-cli-level=INFO``
(the log says how long the child took and how long the compile waited for it).

The same offloaded GPT (counts by hand: chunks stream through gathers), fresh caches, lowered with and without the child: the compile hits the
child's backward, Inductor's allocation plans are the same to the row, the child is gone before the
first step (with the CUDA context it made to load its kernels), and the losses of three bf16 steps
agree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import codegen_child, settings
from tests.planner.test_auto_plan import logged  # noqa: F401 (a fixture)
from tests.planner.test_lowering import _cache_counts, _emptied

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = gpt_config("125M", n_layer=6, vocab_size=4096)


def _launch(child: bool, logged) -> tuple[list[float], object, tuple[int, int]]:  # noqa: F811
    torch._dynamo.reset()
    protrain_fx.reset()
    _emptied()
    logged.clear()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cuda", chunk_bytes=32 * 2**20)
    compiled = torch.compile(model, backend="protrain")
    losses = []
    before = _cache_counts()
    with settings.patch(codegen_child=child):
        for step in range(3):
            idx, targets = random_batch(CONFIG, 4, CONFIG.block_size, device="cuda",
                                        generator=torch.Generator().manual_seed(step))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = compiled(idx)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 0:
                assert codegen_child._pool is None  # the child (and its CUDA context) went with the compile
    counts = tuple(b - a for a, b in zip(before, _cache_counts()))
    record = next(g for g in protrain_fx.captured_graphs() if g.has_backward)
    assert any(n.target is torch.ops.protrain.chunk_gather.default for n in record.backward.graph.nodes)
    handle.close()
    return losses, record, counts


def test_the_child_lowers_the_backward_of_an_offloaded_step_and_it_trains_the_same(logged, tmp_path):  # noqa: F811
    with settings.patch(cache_dir=str(tmp_path), plan_cache=False):
        alone, plain, counts = _launch(False, logged)
        assert counts[0] == 0  # both graphs lowered here
        beside, record, counts = _launch(True, logged)
    messages = [r.getMessage() for r in logged]
    assert any("the child lowered the backward" in m for m in messages), messages
    assert counts[0] >= 1  # the compile's backward: a hit on the child's entry
    assert record.rewritten.inductor_plans["backward"] == plain.rewritten.inductor_plans["backward"]
    assert record.memory.peak_bytes == plain.memory.peak_bytes
    torch.testing.assert_close(torch.tensor(beside), torch.tensor(alone), rtol=2e-2, atol=0)
