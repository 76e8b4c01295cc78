"""Offloaded parameters read in the compute dtype (``passes/param_casts.py``, ``passes/gather.py``):
under autocast the forward saves no cast of a weight (the backward recasts the parameter, read
from its chunk), and a cast to the chunk buffer's dtype reads the buffer itself instead of a copy
of it in fp32 cast back. CPU, bf16 chunk buffers under CPU autocast, eager codegen: the values are
those of the same step without the rewrite, bit for bit."""

from __future__ import annotations

import pytest
import torch

import protrain_fx
from protrain_fx import meta
from protrain_fx.passes import gather
from protrain_fx.passes.param_casts import is_dtype_cast
from protrain_fx import settings

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=128, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
            attn_implementation="sdpa")


def _train(n_persist: int | None, steps: int = 2, codegen: str = "eager"):
    """An offloaded tiny Llama (bf16 chunk buffers, 2 buffers for 7 chunks: reused every block)
    trained under CPU autocast; returns the losses, the final parameters and the training graph."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.loss_type = "ForCausalLM"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    counts = {"n_persist": n_persist, "n_buffer": 2} if n_persist is not None else {}  # None: the backend's
    handle = protrain_fx.offload(model, opt, device="cpu", compute_dtype=torch.bfloat16, chunk_bytes=64 * 1024,
                                 **counts)
    options = {"codegen": codegen} if n_persist is not None else {"codegen": codegen, "memory_budget": "64GiB"}
    compiled = torch.compile(model, backend="protrain", options=options)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    (record,) = [g for g in protrain_fx.captured_graphs() if g.has_backward]
    return losses, handle.state_dict(model), record


def _cast_chunk_copies(gm) -> int:
    """Casts of a cast copy of a chunk view (the round trip the fold removes)."""
    return sum(
        1 for n in gm.graph.nodes
        if is_dtype_cast(n) and is_dtype_cast(n.args[0])
        and n.args[0].args[0].target is torch.ops.aten.as_strided.default
    )


def _weight_cast(node: torch.fx.Node, state: frozenset[str]) -> bool:
    """``node`` is a dtype cast (or a view of one) of a parameter, or of a chunk buffer."""
    cast = False
    while isinstance(node, torch.fx.Node) and (is_dtype_cast(node) or meta.is_view(node)):
        cast = cast or is_dtype_cast(node)
        node = node.args[0]
    return cast and ((node.op == "placeholder" and node.name in state)
                     or node.target is torch.ops.protrain.chunk_gather.default)


@pytest.mark.parametrize("n_persist, codegen", [(0, "eager"), (1, "eager"), (0, "inductor")])
def test_offloaded_weights_are_read_in_the_compute_dtype_and_no_cast_of_them_is_saved(monkeypatch, n_persist, codegen):
    """With Inductor the chunks' gathers and releases must also keep their order: the backward's
    recomputed casts gave it fusions across a release that hoisted the next gather above it."""
    losses, params, record = _train(n_persist, codegen=codegen)
    forward, backward = record.forward, record.backward
    assert _cast_chunk_copies(forward) == _cast_chunk_copies(backward) == 0
    out = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    saved = [a for a in out.args[0][record.step.num_user_outputs:] if isinstance(a, torch.fx.Node)]
    assert not [a.name for a in saved if _weight_cast(a, record.step.state_inputs)]

    # the same step without the rewrite: the same values, more memory
    protrain_fx.reset()
    torch._dynamo.reset()
    monkeypatch.setenv(settings.DISABLE_PASSES, "recompute_param_casts")
    monkeypatch.setattr(gather, "_foldable", lambda *args: False)
    old_losses, old_params, old = _train(n_persist, codegen=codegen)
    assert _cast_chunk_copies(old.forward) > 0
    old_out = next(n for n in reversed(old.forward.graph.nodes) if n.op == "output")
    assert any(_weight_cast(a, old.step.state_inputs) for a in old_out.args[0] if isinstance(a, torch.fx.Node))
    assert [x.item() for x in losses] == [x.item() for x in old_losses]
    for name, value in old_params.items():
        assert torch.equal(params[name], value), name
    assert record.memory.saved_activation_bytes < old.memory.saved_activation_bytes
    assert record.memory.peak_bytes < old.memory.peak_bytes


def test_a_model_whose_chunks_all_stay_on_the_device_saves_no_weight_cast_either(monkeypatch):
    """The cost model's Problem is measured before the counts are chosen, casts recomputed: every
    placement must save the same, persistent chunks included."""
    chunks = None  # chosen by the backend under a budget that keeps all 7 of the tiny Llama's chunks on the device
    losses, params, record = _train(chunks)
    assert not any(n.target is torch.ops.protrain.chunk_gather.default for n in record.forward.graph.nodes)
    out = next(n for n in reversed(record.forward.graph.nodes) if n.op == "output")
    saved = [a for a in out.args[0] if isinstance(a, torch.fx.Node)]
    assert not [a.name for a in saved if _weight_cast(a, record.step.state_inputs)]
    protrain_fx.reset()
    torch._dynamo.reset()
    monkeypatch.setenv(settings.DISABLE_PASSES, "recompute_param_casts")
    old_losses, old_params, old = _train(chunks)
    old_out = next(n for n in reversed(old.forward.graph.nodes) if n.op == "output")
    assert any(_weight_cast(a, old.step.state_inputs) for a in old_out.args[0] if isinstance(a, torch.fx.Node))
    assert [x.item() for x in losses] == [x.item() for x in old_losses]
    assert all(torch.equal(params[n], v) for n, v in old_params.items())
