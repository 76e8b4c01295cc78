"""CPU tests of the example GPT model in ``examples/gpt.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.gpt import GPT, SIZES, GPTConfig, gpt_config, num_params, random_batch


def _model(size: str = "tiny", **overrides: object) -> GPT:
    """A seeded model of preset ``size`` in eval mode."""
    torch.manual_seed(0)
    return GPT(gpt_config(size, **overrides)).eval()


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("bias", [True, False])
def test_num_params_matches_built_model(size: str, bias: bool) -> None:
    model = _model(size, bias=bias)
    assert num_params(model.config) == sum(p.numel() for p in model.parameters())


def test_num_params_of_protocol_presets() -> None:
    assert num_params(gpt_config("125M")) == 124_475_904  # GPT-2 small with vocab padded to 50304
    counts = [num_params(gpt_config(size)) for size in SIZES if size not in ("tiny", "small")]
    assert counts == sorted(counts)


def test_presets_use_head_dim_128() -> None:
    for size, kwargs in SIZES.items():
        config = gpt_config(size)
        if "n_head" not in kwargs:
            assert config.n_head == config.n_embd // 128 and config.head_dim == 128
    assert gpt_config("1.3B").n_head == 16


def test_config_is_frozen_and_overridable() -> None:
    config = gpt_config("tiny", dropout=0.1, block_size=32)
    assert (config.dropout, config.block_size, config.n_embd) == (0.1, 32, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_layer = 3  # type: ignore[misc]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_layer=1, n_embd=64)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_layer=1, n_embd=64, n_head=3)


def test_unknown_size_raises() -> None:
    with pytest.raises(ValueError, match="valid sizes") as info:
        gpt_config("7B")
    assert "125M" in str(info.value) and "tiny" in str(info.value)


def test_forward_shapes() -> None:
    model = _model()
    config = model.config
    idx, targets = random_batch(config, batch_size=3, seq_len=16)
    logits = model(idx)
    assert logits.shape == (3, 16, config.vocab_size)
    loss = model(idx, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab_size))).item()) < 0.5


def test_backward_reaches_tied_weight() -> None:
    model = _model().train()
    idx, targets = random_batch(model.config, batch_size=2, seq_len=8)
    model(idx, targets).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tied_weights() -> None:
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_blocks_module_list() -> None:
    model = _model("small")
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 4
    assert model.blocks[0].attn.qkv.out_features == 3 * 128


def test_init() -> None:
    model = _model("small")
    assert all(torch.count_nonzero(b) == 0 for n, b in model.named_parameters() if n.endswith("proj.bias"))
    std = model.blocks[0].mlp.fc.weight.std().item()
    resid_std = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(resid_std - 0.02 / (2 * 4) ** 0.5) < 0.001


def test_causal_mask() -> None:
    model = _model()
    idx, _ = random_batch(model.config, batch_size=1, seq_len=16)
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_sequence_longer_than_block_size_raises() -> None:
    model = _model()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_random_batch() -> None:
    config = gpt_config("tiny")
    idx, targets = random_batch(config, 4, 32, generator=torch.Generator().manual_seed(1))
    assert idx.shape == targets.shape == (4, 32) and idx.dtype == torch.long
    assert 0 <= int(idx.min()) and int(idx.max()) < config.vocab_size
    torch.testing.assert_close(idx[:, 1:], targets[:, :-1])
    again, _ = random_batch(config, 4, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(idx, again)
    with pytest.raises(ValueError):
        random_batch(config, 1, config.block_size + 1)


def test_tie_weights_after_meta_build():
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    model.to_empty(device="cpu")
    assert model.lm_head.weight is not model.wte.weight  # what to_empty does
    model.tie_weights()
    model.reset_parameters()
    assert model.lm_head.weight is model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(gpt_config("tiny"))


def test_main_job_runs_with_a_hand_plan(tmp_path, capsys):
    from examples import train_gpt

    assert train_gpt.main(["--size", "tiny", "--steps", "2", "--codegen", "eager", "--plan",
                           "swap=1,checkpoint=1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "blocks.0  swap" in out and "blocks.1  checkpoint" in out
    assert "peak: predicted" in out and (tmp_path / "gpt_tiny.svg").exists()
