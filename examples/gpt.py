"""A small, self-contained GPT (GPT-2 / nanoGPT style) used by examples, tests and benchmarks.

Architecture (the B24 protocol):

* token embedding + learned position embedding (+ dropout),
* ``n_layer`` pre-LayerNorm blocks held in ``GPT.blocks`` (an ``nn.ModuleList``):
  ``x = x + proj(causal_sdpa(qkv(ln_1(x))))`` then ``x = x + fc2(gelu(fc(ln_2(x))))``,
  with a single fused ``qkv`` Linear of width ``3 * n_embd`` and exact (erf) GELU,
* final LayerNorm and an LM head whose weight is tied to the token embedding.

``forward(idx, targets=None)`` returns the mean cross-entropy loss when ``targets`` are
given, else the logits. Only ``torch`` is required; running this file prints the
parameter counts of all presets (computed analytically, no model is built).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "SIZES",
    "gpt_config",
    "num_params",
    "random_batch",
    "example",
]

HEAD_DIM = 128
"""Head dimension of the protocol presets: ``n_head = n_embd // HEAD_DIM``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Hyper-parameters of a :class:`GPT`.

    ``n_head`` defaults to ``n_embd // 128`` when ``n_embd >= 128``; smaller models must
    give it explicitly. ``block_size`` is the maximum sequence length.
    """

    n_layer: int
    n_embd: int
    n_head: Optional[int] = None
    vocab_size: int = 50304
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_head is None:
            if self.n_embd < HEAD_DIM:
                raise ValueError(f"n_head must be given when n_embd < {HEAD_DIM} (got n_embd={self.n_embd})")
            object.__setattr__(self, "n_head", self.n_embd // HEAD_DIM)
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Per-head width ``n_embd // n_head``."""
        return self.n_embd // self.n_head


SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, block_size=64),
    "small": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=512, block_size=128),
    "125M": dict(n_embd=768, n_layer=12),
    "350M": dict(n_embd=1024, n_layer=24),
    "760M": dict(n_embd=1536, n_layer=24),
    "1.3B": dict(n_embd=2048, n_layer=24),
    "2.7B": dict(n_embd=2560, n_layer=32),
    "4.2B": dict(n_embd=3072, n_layer=36),
    "6.7B": dict(n_embd=4096, n_layer=32),
    "10B": dict(n_embd=4096, n_layer=50),
    "13B": dict(n_embd=5120, n_layer=40),
}
"""Named presets as :class:`GPTConfig` keyword arguments (protocol sizes use ``n_head = n_embd / 128``)."""


def gpt_config(size: str, **overrides: Any) -> GPTConfig:
    """Return the :class:`GPTConfig` of preset ``size``, with ``overrides`` applied."""
    if size not in SIZES:
        raise ValueError(f"unknown GPT size {size!r}; valid sizes: {', '.join(SIZES)}")
    return GPTConfig(**{**SIZES[size], **overrides})


def num_params(config: GPTConfig) -> int:
    """Number of parameters of ``GPT(config)``, counting the tied embedding / LM head once."""
    d, bias = config.n_embd, int(config.bias)
    layer_norm = d + bias * d
    attention = (d * 3 * d + bias * 3 * d) + (d * d + bias * d)
    mlp = (d * 4 * d + bias * 4 * d) + (4 * d * d + bias * d)
    block = 2 * layer_norm + attention + mlp
    embeddings = config.vocab_size * d + config.block_size * d
    return embeddings + config.n_layer * block + layer_norm


def random_batch(
    config: GPTConfig,
    batch_size: int,
    seq_len: int,
    device: Optional[torch.device | str] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(idx, targets)`` int64 tensors of shape ``(batch_size, seq_len)``.

    ``targets`` is ``idx`` shifted left by one position (next-token prediction). When a
    ``generator`` is given, tokens are drawn on its device and then moved to ``device``.
    """
    if not 0 < seq_len <= config.block_size:
        raise ValueError(f"seq_len must be in [1, {config.block_size}], got {seq_len}")
    sample_device = generator.device if generator is not None else device
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, seq_len + 1), device=sample_device, generator=generator
    ).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity`` when ``p == 0`` so graphs carry no RNG ops."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Feed-forward block: Linear(d, 4d) -> exact GELU -> Linear(4d, d)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block with residual attention and MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT language model; the LM head weight is the token embedding weight."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = _dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Share the token embedding with the LM head again (``to_empty`` after a ``meta`` build
        gives each module its own new tensor, untying them)."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2L)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill one parameter (by name) with the distribution :meth:`reset_parameters` gives it: for
        a model built on the ``meta`` device and materialised parameter by parameter, e.g. by
        ``protrain_fx.offload(..., init=model.init_parameter)``. Same distributions, not the same
        random stream as ``reset_parameters`` (which draws module by module)."""
        module = self.get_submodule(name.rpartition(".")[0])
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(tensor) if name.endswith("weight") else nn.init.zeros_(tensor)
        elif name.endswith("bias"):
            nn.init.zeros_(tensor)
        elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            nn.init.normal_(tensor, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        else:
            nn.init.normal_(tensor, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)``, or the mean cross-entropy loss if ``targets`` is given."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def example(
    size: str = "tiny", batch_size: int = 2, seq_len: int | None = None, device: str | None = None, seed: int = 0
) -> tuple["GPT", tuple[torch.Tensor, torch.Tensor]]:
    """A model and one batch, for ``protrain-fx inspect examples.gpt:example --kw size=...``."""
    config = gpt_config(size)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = GPT(config)
    batch = random_batch(config, batch_size, seq_len or config.block_size, device=device,
                         generator=torch.Generator().manual_seed(seed))
    return model, batch


def _format_count(count: int) -> str:
    """Human-readable parameter count, e.g. ``124.48M``."""
    if count >= 10**9:
        return f"{count / 10**9:.2f}B"
    if count >= 10**6:
        return f"{count / 10**6:.2f}M"
    return f"{count / 10**3:.1f}K"


def _main() -> None:
    """Print the analytic parameter counts of all presets."""
    print(f"{'size':>6} {'n_layer':>7} {'n_embd':>6} {'n_head':>6} {'vocab':>6} {'block':>5} {'params':>14}")
    for size in SIZES:
        c = gpt_config(size)
        n = num_params(c)
        print(
            f"{size:>6} {c.n_layer:>7} {c.n_embd:>6} {c.n_head:>6} {c.vocab_size:>6} "
            f"{c.block_size:>5} {n:>14,} ({_format_count(n)})"
        )


if __name__ == "__main__":
    _main()
