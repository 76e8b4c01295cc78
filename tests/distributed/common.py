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


def forward_backward(compiled, handle, step: int, rank: int, micro: int) -> torch.Tensor:
    """This rank's ``micro`` micro-batches of ``step`` through ``compiled``, all but the last inside
    ``handle.accumulate()``; the last micro-batch's loss."""
    for m in range(micro - 1):
        with handle.accumulate():
            compiled(*batch(step, rank, m)).backward()
    loss = compiled(*batch(step, rank, micro - 1))
    loss.backward()
    return loss


def reference_step(reference, ref_opt, step: int, world: int, *, micro: int = 1, clip: float | None = None,
                   reduce_each_micro: bool = False):
    """One eager step on the global batch: each rank's gradient (its micro-batches summed), then
    their average ``(g0 + g1) / 2`` (the sum over ranks, then the division), as the ranks reduce.
    ``reduce_each_micro``: each micro-batch's gradients averaged over ranks, then the averages
    summed, as sharded chunks reduce (each backward's reduce-scatter, added on the host).
    Returns each rank's last micro-batch loss."""
    params = [p for p in reference.parameters() if p.requires_grad]
    micro_grads = {}  # (rank, micro) -> gradients
    losses = []
    for rank in range(world):
        for m in range(micro):
            loss = reference(*batch(step, rank, m))
            loss.backward()
            micro_grads[rank, m] = [p.grad.clone() for p in params]
            if reduce_each_micro:
                for p in params:
                    p.grad = None
        losses.append(loss.detach())
        if not reduce_each_micro:  # autograd's sum over the micro-batches
            micro_grads = {**{k: v for k, v in micro_grads.items() if k[0] != rank}, (rank, 0): [p.grad for p in params]}
            for p in params:
                p.grad = None
    rounds = range(micro) if reduce_each_micro else range(1)
    total = [torch.zeros_like(p) for p in params]
    for m in rounds:
        mean = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            for t, g in zip(mean, micro_grads[rank, m]):
                t.add_(g)
        for t, g in zip(total, mean):
            t.add_(g.div_(world))
    for t, p in zip(total, params):
        p.grad = t
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    ref_opt.step()
    ref_opt.zero_grad()
    return losses


def full_params(state, reference) -> dict[str, bool]:
    """Per parameter, whether ``state`` (a full state dict) equals the reference's, bit for bit."""
    return {n: torch.equal(state[n], p.detach()) for n, p in reference.named_parameters()}
