"""``offload(..., init="model")``: a model built on ``meta`` materialised with its own initialisation
(``protrain_fx/integrations``): a Hugging Face Llama through ``_init_weights`` (its rotary
``inv_freq`` recomputed), a plain module through ``reset_parameters()``. CPU, fp32, eager codegen:
training matches an eager copy built from the same initial values bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import protrain_fx
from tests.runtime.test_offload import _assert_same_params

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=128, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
            attn_implementation="sdpa")


def _llama(device: str) -> nn.Module:
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.loss_type = "ForCausalLM"  # no graph break in the loss-type lookup
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(step))


def test_a_meta_hf_llama_offloaded_with_its_own_init_trains_exactly_like_eager():
    torch.manual_seed(0)
    model = _llama("meta")
    assert model.model.rotary_emb.inv_freq.is_meta
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=64 * 1024,
                                 init="model")
    assert 0 < handle.n_persist < len(handle.layout.chunks)  # both kinds of chunk initialised
    state = handle.state_dict(model)
    eager = _llama("cpu")  # HF's own construction: the values init="model" must reproduce in kind
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, eager.model.rotary_emb.inv_freq)
    assert torch.equal(rotary.original_inv_freq, eager.model.rotary_emb.inv_freq)
    assert not any(b.is_meta for b in model.buffers())
    std = eager.config.initializer_range
    params = dict(eager.named_parameters())
    assert set(params) <= set(state)
    for name, value in state.items():
        assert not torch.isnan(value).any(), name
        if name not in params:
            continue
        if name.endswith("norm.weight"):
            assert value.eq(1).all(), name
        else:
            assert value.std().item() == pytest.approx(std, rel=0.2), name  # normal(0, initializer_range)
    reference = _llama("cpu")
    reference.load_state_dict({name: state[name] for name in reference.state_dict()})  # rotary buffers: not persistent
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    for step in range(2):
        idx = _batch(step)
        loss, ref_loss = compiled(input_ids=idx, labels=idx).loss, reference(input_ids=idx, labels=idx).loss
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _assert_same_params(handle, model, reference)


def test_a_meta_hf_llama_with_automatic_counts_is_initialised_when_its_chunks_are_placed():
    torch.manual_seed(0)
    model = _llama("meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=64 * 1024, init="model")
    idx = _batch(0)
    smallest = protrain_fx.what_fits(model, input_ids=idx, labels=idx, options={"codegen": "eager"}).min_budget_bytes
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": smallest})
    losses = []
    for _ in range(3):  # one batch again and again: the loss must fall
        loss = compiled(input_ids=_batch(0), labels=_batch(0)).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    assert handle.n_persist < len(handle.layout.chunks)  # chunks on the host, initialised there
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_a_plain_module_is_initialised_by_its_reset_parameters():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = protrain_fx.offload(model, opt, n_persist=0, n_buffer=1, device="cpu", init="model")
    state = handle.state_dict(model)
    bound = 1 / 64**0.5  # nn.Linear's reset_parameters: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert state["0.weight"].abs().max() <= bound and state["0.weight"].std() > bound / 4
    assert state["1.weight"].eq(1).all() and state["1.bias"].eq(0).all()
    assert model[2].running_mean.eq(0).all() and model[2].running_var.eq(1).all()  # buffers: reset_running_stats


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x):
        return self.linear(x) + self.table


def test_what_the_model_cannot_initialise_is_refused_by_name():
    with torch.device("meta"):
        scaled = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(ValueError, match="_Scale has no reset_parameters.*init=fn"):
        protrain_fx.offload(scaled, torch.optim.AdamW(scaled.parameters()), n_persist=0, n_buffer=1, device="cpu",
                            init="model")
    with torch.device("meta"):
        table = _Table()
    with pytest.raises(ValueError, match="buffer 'table' is on the meta device"):
        protrain_fx.offload(table, torch.optim.AdamW(table.parameters()), n_persist=0, n_buffer=1, device="cpu",
                            init="model")


def test_transformers_is_imported_only_for_a_model_that_needs_it():
    code = (
        "import sys, torch, protrain_fx\n"
        "from torch import nn\n"
        "with torch.device('meta'):\n"
        "    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))\n"
        "protrain_fx.offload(m, torch.optim.AdamW(m.parameters()), n_persist=0, n_buffer=1, device='cpu',\n"
        "                    init='model')\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parent.parent.parent))


def test_the_initial_weights_depend_on_the_seed_not_on_where_the_chunks_are_placed():
    def initial(n_persist: int, seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        model = _llama("meta")
        handle = protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), n_persist=n_persist, n_buffer=2,
                                     device="cpu", chunk_bytes=64 * 1024, init="model")
        return handle.state_dict(model)

    a, b, other = initial(0, seed=1), initial(3, seed=1), initial(0, seed=2)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
