"""Hugging Face ``transformers.Trainer`` with the protrain backend and, optionally, parameter offload.

:class:`ProTrainTrainer` is a ``transformers.Trainer``::

    trainer = ProTrainTrainer(
        model=model, args=TrainingArguments(...), train_dataset=...,
        protrain_options={"memory_budget": "24GiB"},    # torch.compile(..., backend="protrain", options=...)
        offload=True,                                   # or a dict of protrain_fx.offload(...) keyword arguments
    )
    trainer.train()

What it changes in the Trainer, and why:

- The training forward runs ``torch.compile(model, backend="protrain", options=protrain_options)``;
  ``self.model`` stays the plain module, so the Trainer's signature-based column removal, its saving
  and its evaluation see the model itself (``TrainingArguments(torch_compile=True)`` cannot name
  this backend: accelerate accepts only its built-in ones).
- ``offload``: the optimizer the Trainer builds (``create_optimizer``) is handed with the model to
  :func:`protrain_fx.offload`; the handle is :attr:`ProTrainTrainer.handle`. Only Adam / AdamW
  (``optim="adamw_torch"`` or ``"adamw_torch_fused"``) can be stepped by the CPU chunk optimizer.
- Gradient accumulation: the backward of each micro-batch that is not followed by an optimizer
  step runs inside ``handle.accumulate()``, so the offloaded chunks add their gradients up instead
  of stepping; and ``gradient_accumulation_steps`` above 1 becomes the backend option
  ``accumulation_steps``, so the plan is chosen for the accumulated step (k micro-batches, one
  optimizer step), not for a step per micro-batch.
- Gradient clipping (``max_grad_norm > 0``): ``torch.nn.utils.clip_grad_norm_`` over the model's
  parameters, which the offload handle intercepts and computes over every chunk (accelerate's own
  clipping reads ``p.grad`` directly, which an offloaded parameter never has). Without clipping
  (``max_grad_norm=0``) an offloaded run logs no ``grad_norm``: computing it would hold every chunk
  step until the end of backward.
- Checkpoints: when offloaded, the weights saved are ``handle.state_dict(model)`` and the optimizer
  state ``handle.optimizer_state_dict()`` (full ordinary tensors, the formats of a plain model and a
  plain ``torch.optim.AdamW``); resuming loads them back with ``handle.load_state_dict``. Without
  offload the Trainer's own paths run unchanged.
- Activation checkpointing (``TrainingArguments(gradient_checkpointing=True)``) is turned off at the
  first training step, with a warning: the backend plans recompute against the budget
  (:mod:`protrain_fx.integrations.checkpointing`).
- Evaluation runs the plain module without offload (no compile for it) and the compiled module
  under ``no_grad`` with offload (the plain module's offloaded parameters hold no bytes; the
  backend's inference graph gathers the chunks).
- After the first training step, the backend's plan (:func:`protrain_fx.step_report`'s summary:
  graphs, graph breaks, per-block tables) is logged once on the ``protrain_fx`` logger and kept in
  :attr:`ProTrainTrainer.plan_report`.

This is the only module of the package that imports ``transformers`` (the ``hf`` extra).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn

import protrain_fx
from protrain_fx.backend import register
from protrain_fx.integrations.checkpointing import library_checkpointing_off
from protrain_fx.integrations.loss_type import name_default_loss_type

log = logging.getLogger(__name__)

# File names of a Trainer checkpoint (transformers.trainer's constants, stable across releases).
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"


class ProTrainTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose training forward is compiled with ``backend="protrain"``.

    ``protrain_options``: the backend's options (``torch.compile(..., options=...)``), e.g.
    ``{"memory_budget": "24GiB"}``. ``offload``: ``False`` (default) keeps the parameters where
    the Trainer puts them; ``True`` or a dict of :func:`protrain_fx.offload` keyword arguments puts
    them into chunks (``device`` defaults to ``args.device``, ``grad_clipping`` to whether
    ``args.max_grad_norm > 0``). Every other argument is the Trainer's. See the module docstring."""

    def __init__(self, *args: Any, protrain_options: Mapping[str, Any] | None = None,
                 offload: bool | Mapping[str, Any] = False, **kwargs: Any) -> None:
        if protrain_options is not None and not isinstance(protrain_options, Mapping):
            raise ValueError(f"ProTrainTrainer: protrain_options must be a dict of backend options or None, "
                             f"got {type(protrain_options).__name__}")
        if not isinstance(offload, (bool, Mapping)):
            raise ValueError(f"ProTrainTrainer: offload must be True, False or a dict of protrain_fx.offload(...) "
                             f"keyword arguments, got {type(offload).__name__}")
        if isinstance(offload, Mapping) and {"model", "optimizer"} & set(offload):
            raise ValueError("ProTrainTrainer: offload={...} takes protrain_fx.offload's keyword arguments; the "
                             "model and the optimizer are the Trainer's")
        super().__init__(*args, **kwargs)
        if self.args.torch_compile:
            raise ValueError(
                "ProTrainTrainer: leave TrainingArguments(torch_compile=...) off: the trainer compiles the training "
                "forward itself with backend='protrain' (give the backend's options as protrain_options)"
            )
        self.protrain_options = _with_accumulation(dict(protrain_options or {}), self.args.gradient_accumulation_steps)
        self._offload_kwargs: dict[str, Any] | None = (
            dict(offload) if isinstance(offload, Mapping) else {} if offload else None
        )
        #: The :class:`~protrain_fx.runtime.offload.handle.OffloadHandle` once the optimizer is built (offload only).
        self.handle = None
        #: The backend's plan (a :class:`~protrain_fx.inspect.report.StepReport`) after the first training step.
        self.plan_report = None
        self._compiled: nn.Module | None = None
        self._compiled_for: nn.Module | None = None

    # ---- the compiled module -------------------------------------------------------------------

    def compiled_model(self) -> nn.Module:
        """``torch.compile(self.model, backend="protrain", options=protrain_options)``, made once. The
        model's own activation checkpointing (``TrainingArguments(gradient_checkpointing=True)``) is
        turned off first: the backend plans recompute (:mod:`protrain_fx.integrations.checkpointing`)."""
        library_checkpointing_off(self.model, "ProTrainTrainer")
        name_default_loss_type(self.model)
        if self._compiled is None or self._compiled_for is not self.model:
            register()  # the name resolves from a source tree that is not installed too
            self._compiled = torch.compile(self.model, backend="protrain", options=self.protrain_options)
            self._compiled_for = self.model
        return self._compiled

    def _is_ours(self, model: nn.Module) -> bool:
        return self.accelerator.unwrap_model(model, keep_torch_compile=False) is self.model

    # ---- optimizer and offload ------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer; with ``offload``, the model's parameters then go into chunks."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self._offload_kwargs is not None and self.handle is None:
            inner = _unwrapped(optimizer)
            if not isinstance(inner, torch.optim.Adam):  # AdamW is an Adam
                raise ValueError(
                    f"ProTrainTrainer(offload=...): TrainingArguments(optim={getattr(self.args.optim, 'value', self.args.optim)!r}) builds "
                    f"{type(inner).__name__}, which the CPU chunk optimizer cannot step (it implements Adam and AdamW); "
                    "use optim='adamw_torch' or 'adamw_torch_fused'"
                )
            kwargs = dict(self._offload_kwargs)
            kwargs.setdefault("device", self.args.device)
            kwargs.setdefault("grad_clipping", self.args.max_grad_norm > 0)
            self.handle = protrain_fx.offload(self.model, inner, **kwargs)
        return optimizer

    # ---- training -------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's step on the compiled module; a micro-batch not followed by an optimizer step
        accumulates its offloaded gradients (``handle.accumulate()``)."""
        if self._is_ours(model):
            model = self.compiled_model()
        accumulating = self.handle is not None and not self.accelerator.gradient_state.sync_gradients
        with self.handle.accumulate() if accumulating else contextlib.nullcontext():
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self.plan_report is None:
            self.plan_report = protrain_fx.step_report()
            log.info("protrain_fx plan after the first training step:\n%s", self.plan_report.summary())
        return loss

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        if self.handle is None:
            return super()._clip_grad_norm(model)
        # torch's own function: the handle intercepts it and takes the norm over every chunk.
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.handle is not None and grad_norm is None:
            return None  # no clipping: a norm over every chunk would hold their steps to the end of backward
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ---- evaluation -----------------------------------------------------------------------------

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """Offloaded: the compiled module (under the Trainer's ``no_grad``); else the plain one."""
        if self.handle is not None and self._is_ours(model):
            model = self.compiled_model()
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # ---- saved folders (the Trainer's checkpoints) --------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as full tensors (``handle.state_dict(model)`` when offloaded)."""
        if self.handle is not None:
            return self.handle.state_dict(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.handle is not None and state_dict is None:
            state_dict = _without_tied_copies(self.model, self.handle.state_dict(self.model))
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.handle is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(self.handle.optimizer_state_dict(), os.path.join(output_dir, _OPTIMIZER))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self.handle is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Offloaded already (a later train() call): the weights are loaded with the optimizer state,
        # in _load_optimizer_and_scheduler, where the optimizer exists.
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.handle is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        weights = saved_weights(checkpoint, self.model)
        path = os.path.join(checkpoint, _OPTIMIZER)
        optimizer_state = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
        # Before the counts are chosen the handle keeps both aside and applies them at placement.
        self.handle.load_state_dict(self.model, weights, optimizer_state)
        path = os.path.join(checkpoint, _SCHEDULER)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        if self.handle is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        log.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        self.handle.load_state_dict(self.model, saved_weights(best, self.model))


def saved_weights(checkpoint: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model weights of a Trainer checkpoint folder (safetensors, sharded or not, or
    ``pytorch_model.bin``) by every parameter and buffer name of ``model``: tied names that
    ``save_pretrained`` left out get their twin's tensor, buffers it did not save the model's own."""
    import safetensors.torch

    single, index = os.path.join(checkpoint, _SAFE_WEIGHTS), os.path.join(checkpoint, _SAFE_WEIGHTS_INDEX)
    if os.path.isfile(single):
        state = safetensors.torch.load_file(single, device="cpu")
    elif os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(safetensors.torch.load_file(os.path.join(checkpoint, shard), device="cpu"))
    elif os.path.isfile(os.path.join(checkpoint, _WEIGHTS)):
        state = torch.load(os.path.join(checkpoint, _WEIGHTS), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"ProTrainTrainer: no model weights ({_SAFE_WEIGHTS}, {_SAFE_WEIGHTS_INDEX} or {_WEIGHTS}) "
                         f"in checkpoint {checkpoint}")
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        present = next((n for n in names if n in state), None)
        if present is None:
            raise ValueError(f"ProTrainTrainer: checkpoint {checkpoint} has no weight for {names[0]!r}")
        for name in names:
            state.setdefault(name, state[present])
    for name, b in model.named_buffers():  # non-persistent buffers are not saved: the model's own stay
        state.setdefault(name, b.detach())
    return state


def _without_tied_copies(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``handle.state_dict``: the keys of ``model.state_dict()``) with one entry per tied
    parameter (its first name): ``save_pretrained`` would otherwise see two distinct tensors for one
    weight."""
    seen: set[int] = set()
    out = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in state.items():
        p = params.get(name)
        if p is not None:
            if id(p) in seen:
                continue
            seen.add(id(p))
        out[name] = value
    return out


def _with_accumulation(options: dict[str, Any], steps: int) -> dict[str, Any]:
    """The backend's ``options`` with ``accumulation_steps`` = the Trainer's ``gradient_accumulation_steps``
    (when above 1); a different count given in the options is refused (the plan would be priced
    for a step the Trainer does not take)."""
    given = options.get("accumulation_steps")
    if steps > 1 and given is None:
        options["accumulation_steps"] = steps
    elif given is not None and given != steps:
        raise ValueError(
            f"ProTrainTrainer: protrain_options={{'accumulation_steps': {given!r}}} but TrainingArguments("
            f"gradient_accumulation_steps={steps}); leave accumulation_steps out of protrain_options (the trainer "
            "passes gradient_accumulation_steps)"
        )
    return options


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__name__ == "AcceleratedOptimizer":
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer
