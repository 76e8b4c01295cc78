"""Gradients of replicated parameters averaged over the ranks in backward, as DDP averages them.

The persistent chunks' parameters (every parameter, when all chunks stay on the device) are
ordinary tensors replicated on every rank, stepped by the user's optimizer from ``.grad``. Each
one's gradient is all-reduced as soon as autograd has accumulated it (a post-accumulate-grad hook:
the reduction overlaps the rest of backward), asynchronously; the end of backward (a callback
queued on autograd's engine, as DDP's reducer does) waits for every reduction and divides by the
world size, so ``loss.backward()`` returns averaged gradients: ``clip_grad_norm_`` and
``optimizer.step()`` see what DDP would give them. The sum and the division are separate, so two
ranks give exactly ``(g0 + g1) / 2``.

While ``holding()`` is true (``handle.accumulate()``: micro-batches before the last) nothing is
reduced; the last micro-batch's backward reduces the accumulated sum once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


class GradAverager:
    """Averages the ``.grad`` of ``params`` over the default process group of ``world_size`` ranks
    in every backward (see the module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], world_size: int, holding: Callable[[], bool]) -> None:
        self.world_size = world_size
        self._holding = holding
        self._works: list[tuple[torch.Tensor, dist.Work]] = []
        self._queued = False
        unique = {id(p): p for p in params if p.requires_grad}
        self._hooks = [p.register_post_accumulate_grad_hook(self._reduce) for p in unique.values()]
        #: Gradient tensors reduced so far (every parameter once per optimizer step).
        self.reduced = 0

    def _reduce(self, p: torch.Tensor) -> None:
        if self._holding() or p.grad is None:
            return
        if not self._queued:  # once per backward: wait at its end
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._queued = True
        self._works.append((p.grad, dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True)))

    def finish(self) -> None:
        """Wait for the reductions started in this backward and divide by the world size."""
        works, self._works, self._queued = self._works, [], False
        for grad, work in works:
            work.wait()
            grad.div_(self.world_size)
        self.reduced += len(works)

    def close(self) -> None:
        self.finish()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
