"""The state dicts of an offloaded model (what a training run saves to resume): its parameters and
optimizer state as ordinary full tensors.

:class:`StateDicts` is the part of ``OffloadHandle`` that saves and loads. Data-parallel (chunks
sharded over the ranks: ``runtime/parallel/shard.py``), ``state_dict`` and ``optimizer_state_dict`` gather
every rank's pieces, so each rank gets the whole state (every rank must call them: they are
collectives; save from rank 0), and loading slices a whole state dict to each rank's pieces: a
state saved at N ranks loads at M ranks, or into a plain model and AdamW.

The loop's own calls work too (:func:`install_state_hooks`): ``model.state_dict()`` (of the model
or any of its modules) gives an offloaded parameter's values (a view of its fp32 master in the host
store, or the value kept aside before the chunks are placed) where it would give a shell of 0 bytes,
which ``torch.save`` writes as a tensor that cannot be loaded back; ``model.load_state_dict(...)``
writes an offloaded parameter into the store (or into the value kept aside) where it would copy
into a shell, which crashes the process; ``optimizer.state_dict()`` holds the offloaded chunks'
moments, and ``optimizer.load_state_dict(...)`` puts them back into the store (kept aside before the
chunks are placed) instead of moving every moment to the device. Data-parallel, ``model.state_dict()``
and ``optimizer.state_dict()`` are refused naming the handle's collectives (a call on rank 0 alone
would wait for the other ranks for ever); loading works on each rank alone.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.parallel import shard
from protrain_fx.runtime.offload.shells import hollow


class StateDicts:
    """Saving and loading for ``OffloadHandle`` (which holds ``store``, ``adam``, ``optimizer``,
    ``group`` and the values kept aside before the chunks are placed)."""

    #: Calls of the handle's own into the model's and the optimizer's state dicts now running
    #: (:meth:`_own_call`): the state hooks let them through.
    _own_calls = 0

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
        with self._own_call():
            entries = model.state_dict(keep_vars=True)
        return {name: host[name] if name in host else t.detach().to("cpu", copy=True) for name, t in entries.items()}

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict with the host chunks' state filled in (loads into a plain AdamW);
        before the chunks are placed, the state loaded and kept aside for them, if any."""
        self.synchronize()
        if not self._built and self._optimizer_state_aside is not None:
            return dict(self._optimizer_state_aside)
        with self._own_call():
            return self.adam.state_dict() if self.adam else self.optimizer.state_dict()

    def param_value(self, name: str) -> torch.Tensor:
        """Offloaded parameter ``name``'s values as an ordinary CPU tensor: a view of its fp32 master
        in the store (the values kept aside before the chunks are placed), as ``model.state_dict()``
        gives a view of a plain parameter."""
        if not self._built:
            self._require_values("model.state_dict()")
            return self._sources[name].detach()
        if self.group is not None:
            raise UnsupportedError(
                "protrain_fx: model.state_dict() of a data-parallel offloaded model: each rank holds a piece of "
                "every offloaded chunk; call handle.state_dict(model) on every rank (it gathers the pieces: a "
                "collective) and save it from rank 0"
            )
        self.synchronize()
        slot = self.store.full_slot(name)
        if slot.chunk in self.store.spilled:  # (its master is in the spill file: a copy read back)
            with self.store.state_held(slot.chunk, write=False):
                return self.store.view("master", slot).clone()
        return self.store.view("master", slot).detach()

    def load_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set offloaded parameters (their names in the model -> full tensors) where their values live:
        the store (each rank its piece), or the values kept aside before the chunks are placed (a
        parameter still on ``meta`` takes the loaded value instead of its initialisation)."""
        if self._built:
            self.synchronize()
            self.store.load_param_state_dict(values, strict=False)
            return
        with torch.no_grad():
            for name, value in values.items():
                source = self._sources[name]
                if not source.is_meta:
                    source.copy_(value)
                    continue
                loaded = value.detach().to("cpu", source.dtype, copy=True).requires_grad_(source.requires_grad)
                for n, t in self._sources.items():  # tied names share the value kept aside
                    if t is source:
                        self._sources[n] = loaded

    @contextlib.contextmanager
    def _own_call(self) -> Iterator[None]:
        """The handle reads or loads the model's and the optimizer's state dicts itself: the state
        hooks (:func:`install_state_hooks`) let these calls through unchanged."""
        self._own_calls += 1
        try:
            yield
        finally:
            self._own_calls -= 1

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
        with self._own_call():
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


def install_state_hooks(
    handle: StateDicts, model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[RemovableHandle]:
    """Hooks that make the loop's own ``state_dict`` / ``load_state_dict`` calls of ``model`` (each
    module owning parameters) and ``optimizer`` read and write the offloaded values (module
    docstring); the handles to remove them."""
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    taken: dict[int, list[str]] = {}  # module -> the keys its load pre-hook took from the state dict
    # The model's hooks hold the handle weakly: the model does not keep it (and its chunk store) alive;
    # the optimizer, which holds it, does (runtime/offload/chunk_ops.py: a compile refuses an orphaned model).
    ref = weakref.ref(handle)
    hooks = []
    for module in model.modules():
        if module._parameters:
            hooks += [
                module.register_state_dict_post_hook(functools.partial(_fill_values, ref, first_name)),
                module.register_load_state_dict_pre_hook(functools.partial(_take_values, ref, first_name, taken)),
                module.register_load_state_dict_post_hook(functools.partial(_not_missing, taken)),
            ]
    hooks += [
        optimizer.register_state_dict_post_hook(functools.partial(_optimizer_state, handle)),
        optimizer.register_load_state_dict_pre_hook(functools.partial(_load_optimizer_state, handle)),
    ]
    return hooks


def _alive(ref: weakref.ref) -> StateDicts:
    handle = ref()
    if handle is None:
        raise UnsupportedError(
            "protrain_fx: the model's offloaded parameters are empty shells whose offload handle was garbage-"
            "collected (with the optimizer given to protrain_fx.offload(...), which holds it): their values went "
            "with it. Keep that optimizer for the whole training"
        )
    return handle


def _fill_values(ref: weakref.ref, first_name: Mapping[int, str], module: nn.Module,
                 state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    shells = [k for k, p in module._parameters.items() if p is not None and prefix + k in state_dict and hollow(p)]
    if not shells or getattr(ref(), "_own_calls", 0):
        return
    handle = _alive(ref)
    for k in shells:
        state_dict[prefix + k] = handle.param_value(first_name[id(module._parameters[k])])


def _take_values(ref: weakref.ref, first_name: Mapping[int, str], taken: dict[int, list[str]],
                 module: nn.Module, state_dict: dict[str, Any], prefix: str, *rest: Any) -> None:
    """Load pre-hook: an offloaded parameter's entry goes to the handle (and out of the state dict,
    so torch does not copy it into the shell); a mismatched shape is left to torch to report."""
    if not any(p is not None and hollow(p) for p in module._parameters.values()) or getattr(ref(), "_own_calls", 0):
        return
    handle = _alive(ref)
    values = {}
    for k, p in module._parameters.items():
        value = state_dict.get(prefix + k)
        if p is None or not hollow(p) or not isinstance(value, torch.Tensor) or value.shape != p.shape:
            continue
        values[first_name[id(p)]] = state_dict.pop(prefix + k)
        taken.setdefault(id(module), []).append(prefix + k)
    if values:
        handle.load_values(values)


def _not_missing(taken: dict[int, list[str]], module: nn.Module, incompatible_keys: Any) -> None:
    """Load post-hook: the entries the pre-hook took were loaded, not missing."""
    for key in taken.pop(id(module), []):
        if key in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(key)


def _optimizer_state(handle: StateDicts, optimizer: torch.optim.Optimizer,
                     state_dict: dict[str, Any]) -> dict[str, Any] | None:
    if handle._own_calls:
        return None
    if handle.group is not None and handle.store is not None:
        raise UnsupportedError(
            "protrain_fx: optimizer.state_dict() of a data-parallel offloaded model: each rank holds a piece of "
            "every offloaded chunk's moments; call handle.optimizer_state_dict() on every rank (it gathers the "
            "pieces: a collective) and save it from rank 0"
        )
    return handle.optimizer_state_dict()


def _load_optimizer_state(handle: StateDicts, optimizer: torch.optim.Optimizer,
                          state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
    """Load pre-hook: the offloaded chunks' moments go to the store (kept aside until the chunks are
    placed); what torch then loads is the rest, hyper-parameters included."""
    if handle._own_calls:
        return None
    if not handle._built:
        handle._optimizer_state_aside = state_dict
        return {"state": {}, "param_groups": state_dict["param_groups"]}
    if handle.adam is None:  # nothing offloaded
        return None
    handle.synchronize()
    return handle.adam.load_stored(state_dict)
