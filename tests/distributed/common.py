"""What the data-parallel tests share: the tiny GPT, each rank's micro-batches, and the eager
reference of one process stepping on the ranks' gradients averaged as ``(g0 + g1) / 2``."""

from __future__ import annotations

import copy

import torch

from examples.gpt import GPT, gpt_config, random_batch

CONFIG = gpt_config("tiny", n_layer=4)
CHUNK = 64 * 1024
LR = 1e-3


def batch(step: int, rank: int, micro: int = 0):
    """Rank ``rank``'s micro-batch ``micro`` of step ``step`` (the global batch is every rank's)."""
    return random_batch(CONFIG, 2, 32, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def models(frozen: str | None = None):
    """The model to train and its eager reference, same weights; their AdamW optimizers (fused, as
    the chunks' CPU steps: bit-exact)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    reference = copy.deepcopy(model)

    def adamw(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=0.1, fused=True)

    return model, reference, adamw(model), adamw(reference)


def reference_step(reference, ref_opt, step: int, world: int, *, micro: int = 1, clip: float | None = None):
    """One eager step on the global batch: each rank's gradient (its micro-batches summed), then
    their average ``(g0 + g1) / 2`` (the sum over ranks, then the division), as the ranks reduce.
    Returns each rank's last micro-batch loss."""
    params = [p for p in reference.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    losses = []
    for rank in range(world):
        for m in range(micro):
            loss = reference(*batch(step, rank, m))
            loss.backward()
        losses.append(loss.detach())
        for t, p in zip(total, params):
            t.add_(p.grad)
            p.grad = None
    for t, p in zip(total, params):
        p.grad = t.div_(world)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    ref_opt.step()
    ref_opt.zero_grad()
    return losses


def full_params(state, reference) -> dict[str, bool]:
    """Per parameter, whether ``state`` (a full state dict) equals the reference's, bit for bit."""
    return {n: torch.equal(state[n], p.detach()) for n, p in reference.named_parameters()}
