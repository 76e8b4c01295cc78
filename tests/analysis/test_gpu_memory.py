"""On a GPU: the predicted peak of a training step against ``torch.cuda.max_memory_allocated``, and
bf16 training through the backend against eager. Skipped without CUDA (CI has none); run on the GPU
machine with ``python -m pytest -q tests/analysis/test_gpu_memory.py``."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(model, compiled, batch, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    losses = []
    for i in range(steps):
        if i == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_predicted_peak_within_5_percent_and_bf16_loss_matches_eager(codegen):
    torch.manual_seed(0)
    config = gpt_config("125M")
    model = GPT(config).cuda()
    reference = copy.deepcopy(model).cpu()  # off the GPU while the step is measured
    batch = random_batch(config, 4, 512, device="cuda", generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="protrain", options={"codegen": codegen})
    losses, measured = _train(model, compiled, batch, steps=3)
    (record,) = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    predicted = record.memory.peak_bytes
    reference.cuda()
    eager_losses, _ = _train(reference, reference, batch, steps=3)
    del model, reference, compiled, record, batch
    gc.collect()
    torch.cuda.empty_cache()
    assert abs(predicted - measured) / measured < 0.05, f"predicted {predicted}, measured {measured}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-2, atol=0)
