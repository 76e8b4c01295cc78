"""An offloaded model with a graph break Dynamo cannot resume (``runtime/offload/eager.py``): the
frame around the blocks runs eagerly, each block's ``forward`` is still compiled, and the modules run
eagerly read device copies of their offloaded parameters. CPU, eager codegen, the tiny GPT of
``tests/runtime/test_offload.py`` with a ``.item()`` branch inside one block: exact against eager."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import protrain_fx
from examples.gpt import GPT
from protrain_fx.errors import UnsupportedError
from tests.runtime.test_offload import (
    CHUNK,
    CONFIG,
    _assert_same_params,
    _batch,
    _train_accumulating,
    _train_side_by_side,
)


def _with_a_break(model: GPT, block: int = 1) -> GPT:
    """``model`` whose block ``block`` branches on a value read with ``.item()`` (never taken): a graph
    break inside the loop over the blocks."""
    inner = model.blocks[block].forward

    def forward(x):
        if x.abs().sum().item() > 1e30:  # BREAK_LINE
            print("never")
        return inner(x)

    model.blocks[block].forward = forward
    return model


def _setup(**counts):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = _with_a_break(copy.deepcopy(model))
    _with_a_break(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, **counts)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    return model, reference, opt, ref_opt, handle, compiled


def test_an_offloaded_model_with_a_graph_break_in_its_loop_trains_exactly_like_eager(caplog):
    model, reference, opt, ref_opt, handle, compiled = _setup(n_persist=0, n_buffer=2)
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        _train_side_by_side(compiled, reference, opt, ref_opt, 3)
    _assert_same_params(handle, model, reference)
    # the embeddings, the final norm and the head (tied to the token embedding) ran eagerly: one copy
    # of each parameter a step
    outside = {id(p) for n, p in model.named_parameters() if not n.startswith("blocks.")}
    assert len(outside) == 4 and handle.eager.copies == 3 * len(outside)
    assert handle._split_chunks  # a chunk's gradients landed in parts: its steps wait for optimizer.step()
    warned = [r.getMessage() for r in caplog.records if "ran outside the compiled graphs" in r.getMessage()]
    assert len(warned) == 1 and "Tensor.item()" in warned[0]  # once, naming the break
    handle.close()


def test_micro_batches_and_clipping_through_a_graph_break_are_exact():
    model, reference, opt, ref_opt, handle, compiled = _setup(n_persist=1, n_buffer=2)
    _train_accumulating(compiled, reference, handle, opt, ref_opt, steps=3, micro=(1, 2, 3), clip=0.05)
    _assert_same_params(handle, model, reference)
    handle.close()


def test_automatic_counts_refuse_a_module_run_eagerly_before_the_first_graph_naming_the_break():
    model, _, opt, _, handle, compiled = _setup()
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": "64MiB"})
    with pytest.raises(UnsupportedError, match=r"(?s)chunk counts are not chosen.*by hand.*Tensor\.item\(\)") as e:
        compiled(*_batch(0))
    # the user's line of the break, not only the frame Dynamo skipped (examples/gpt.py's forward)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# BREAK_LINE"))
    assert f"test_eager_modules.py:{line} in forward" in str(e.value)
    handle.close()
