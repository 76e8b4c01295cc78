"""Checkpoints of an offloaded model: its parameters and optimizer state as ordinary full tensors.

:class:`Checkpoints` is the part of ``OffloadHandle`` that saves and loads. Data-parallel (chunks
sharded over the ranks: ``runtime/shard.py``), ``state_dict`` and ``optimizer_state_dict`` gather
every rank's pieces, so each rank gets the whole checkpoint (every rank must call them: they are
collectives; save from rank 0), and loading slices a whole checkpoint to each rank's pieces: a
checkpoint saved at N ranks loads at M ranks, or into a plain model and AdamW.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from protrain_fx.runtime import shard


class Checkpoints:
    """Saving and loading for ``OffloadHandle`` (which holds ``store``, ``adam``, ``optimizer``,
    ``group`` and the values kept aside before the chunks are placed)."""

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()``'s keys (parameters, tied ones under each name, and persistent
        buffers) as ordinary full CPU tensors: it loads into a plain model with ``load_state_dict``."""
        self.synchronize()
        host = {}
        if self.store is not None:  # sharded: gathered from every rank (each must call this)
            host = shard.gather_params(self.store) if self.group is not None else self.store.param_state_dict()
        if not self._built:  # automatic counts not chosen yet: the values kept aside
            self._require_values("state_dict")
            host = {n: t.to("cpu", copy=True) for n, t in self._sources.items()}
        # keep_vars: the entries are the module's own tensors, not read here (a shell has no bytes)
        return {
            name: host[name] if name in host else t.detach().to("cpu", copy=True)
            for name, t in model.state_dict(keep_vars=True).items()
        }

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict with the host chunks' state filled in (loads into a plain AdamW)."""
        self.synchronize()
        return self.adam.state_dict() if self.adam else self.optimizer.state_dict()

    def load_state_dict(
        self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, Any] | None = None
    ) -> None:
        """Set parameters (and optionally the optimizer state) from ordinary full tensors: what
        :meth:`state_dict` and :meth:`optimizer_state_dict` (or a plain model and AdamW) saved.
        Non-persistent buffers are not in a state dict and keep their values. Before the counts are
        chosen (automatic counts, before the first compile) the optimizer state is kept aside and
        applied when the chunks are placed."""
        self.synchronize()
        if not self._built:  # automatic counts not chosen yet: into the values kept aside
            self._require_values("load_state_dict")
            with torch.no_grad():
                for name, t in self._sources.items():
                    t.copy_(state_dict[name])
                for name, b in model.named_buffers():
                    if name in state_dict:
                        b.copy_(state_dict[name])
            if optimizer_state is not None:
                self._optimizer_state_aside = optimizer_state
            return
        if self.store:
            self.store.load_param_state_dict(state_dict)
        host = {n for s in (self.store.full_slots if self.store else ()) for n in s.names}
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                if name not in host:
                    p.copy_(state_dict[name])
            for name, b in model.named_buffers():
                if name in state_dict:
                    b.copy_(state_dict[name])
        if optimizer_state is not None:
            self._load_optimizer_state(optimizer_state)

    def _load_optimizer_state(self, optimizer_state: Mapping[str, Any]) -> None:
        """The offloaded chunks' moments into the store and the rest into the optimizer (never the
        whole state into the optimizer: it would put every moment on the device first)."""
        if self.adam:
            self.adam.load_state_dict(optimizer_state)
        else:
            self.optimizer.load_state_dict(optimizer_state)

    def _require_values(self, what: str) -> None:
        if any(t.is_meta for t in self._sources.values()):
            raise RuntimeError(
                f"offload: {what} before the model's first compile: its parameters are still on the meta "
                "device (they are initialised when the backend places the chunks, at the first compile)"
            )
