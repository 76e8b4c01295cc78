"""``ProTrainTrainer`` (``protrain_fx/integrations/trainer.py``): the real ``transformers.Trainer`` on
CPU with a tiny fp32 Llama, against the plain Trainer on the same model, data and seed: the backend
alone, the backend with offloaded chunks (``device="cpu"``: the store, the shells and the CPU AdamW
worker all run), gradient accumulation, gradient clipping, evaluation and resuming from a checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch

import protrain_fx

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from protrain_fx.integrations.trainer import ProTrainTrainer  # noqa: E402
from protrain_fx.planner.problem import problem_from_record
from protrain_fx.search.problem import MachineProfile

pytestmark = pytest.mark.slow  # a few seconds a Trainer run on CPU

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
            vocab_size=64, max_position_embeddings=32, use_cache=False, tie_word_embeddings=False,
            attn_implementation="sdpa")
SEQ = 16
#: Hand counts on chunks of 8 KiB: the tiny Llama (~33k fp32 parameters) spans 16 chunks, the
#: first stays on the "device", the others live in the host store and stream through 2 buffers.
OFFLOAD = dict(n_persist=1, n_buffer=2, chunk_bytes=8 * 1024)
OPTIONS = {"codegen": "eager"}
#: A budget under which the backend keeps some of those chunks on the "device" and streams the rest.
BUDGET = 400_000
#: Any machine: the test reads what the search problem of a captured graph says of accumulation.
MACHINE = MachineProfile(h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, duplex_bytes_per_s=30e9,
                         cpu_adam_params_per_s=1e9, gpu_adam_params_per_s=50e9, gpu_bytes=80 * 2**30)


class _Data(torch.utils.data.Dataset):
    """Random token sequences, labels = inputs, and a column the model does not take (the
    Trainer's signature-based column removal must drop it)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, TINY["vocab_size"], (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source_row": torch.tensor(i)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.loss_type = "ForCausalLM"  # no graph break in the loss-type lookup
    return model


def _args(tmp_path, **overrides) -> transformers.TrainingArguments:
    settings = dict(output_dir=str(tmp_path), report_to=[], max_steps=4, per_device_train_batch_size=2,
                    learning_rate=1e-3, use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
                    max_grad_norm=0.0, optim="adamw_torch_fused", weight_decay=0.1, dataloader_num_workers=0,
                    disable_tqdm=True)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


class _StopAfter(transformers.TrainerCallback):
    """Ends training after ``steps`` optimizer steps (the schedule stays that of ``max_steps``)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


def _train(tmp_path, *, protrain: bool, offload=False, model=None, resume=None, stop_after=None, **overrides):
    """One Trainer run; its trainer (losses in ``state.log_history``)."""
    model = model if model is not None else _model()
    args = _args(tmp_path, **overrides)
    if protrain:
        torch._dynamo.reset()
        protrain_fx.reset()
        trainer = ProTrainTrainer(model=model, args=args, train_dataset=_Data(), eval_dataset=_Data(4),
                                  protrain_options=OPTIONS, offload=OFFLOAD if offload else False)
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(), eval_dataset=_Data(4))
    if stop_after is not None:
        trainer.add_callback(_StopAfter(stop_after))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _weights(trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer, ProTrainTrainer):
        return trainer.model_state_dict()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_same_run(trainer, reference, rtol: float, atol: float) -> None:
    losses, ref_losses = _losses(trainer), _losses(reference)
    assert len(losses) == len(ref_losses) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    weights, ref_weights = _weights(trainer), _weights(reference)
    assert set(ref_weights) <= set(weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize(("steps", "offload"), [
    ("plain", False), ("accumulate-clip", False),  # without offload micro-batches need nothing of ours
    ("plain", True), ("accumulate", True), ("accumulate-clip", True),
], ids=["plain-backend", "accumulate-clip-backend", "plain-offload", "accumulate-offload", "accumulate-clip-offload"])
def test_trainer_trains_like_the_plain_trainer(tmp_path, caplog, offload, steps):
    # (1) backend: the same losses as the plain Trainer within 1e-5; (2) offload: eager codegen, fp32
    # and torch's fused AdamW stepping the host chunks give the same bits, as in tests/runtime/test_offload.py,
    # so the same 1e-5 holds; (3) two micro-batches a step (the first under handle.accumulate()) and
    # max_grad_norm=1.0, which clips at this learning rate's first steps (asserted below). Without
    # clipping an offloaded chunk steps as soon as its gradients land: the first micro-batch must
    # not (handle.accumulate()); with clipping every chunk step waits for the norm.
    extra = {"plain": {}, "accumulate": dict(gradient_accumulation_steps=2),
             "accumulate-clip": dict(gradient_accumulation_steps=2, max_grad_norm=1.0)}[steps]
    reference = _train(tmp_path / "plain", protrain=False, **extra)
    with caplog.at_level(logging.INFO, logger="protrain_fx"):
        trainer = _train(tmp_path / "protrain", protrain=True, offload=offload, **extra)
    _assert_same_run(trainer, reference, rtol=1e-5, atol=1e-6)
    # The model the Trainer holds is the plain module (its signature drove the column removal); the
    # compiled one ran the training forward: its graphs were captured.
    assert trainer.model is trainer.compiled_model()._orig_mod
    training = [g for g in protrain_fx.captured_graphs() if g.backward is not None]
    assert training
    # The plan is chosen for the Trainer's accumulated step: gradient_accumulation_steps reached the
    # backend as accumulation_steps, and the search problem of the training graph prices it.
    k = extra.get("gradient_accumulation_steps", 1)
    assert all(g.config.accumulation_steps == k for g in training)
    assert problem_from_record(training[0], MACHINE).accumulation == k
    # The plan was logged once, after the first step.
    plans = [r for r in caplog.records if "plan after the first training step" in r.getMessage()]
    assert len(plans) == 1 and trainer.plan_report is not None
    if offload:
        handle = trainer.handle
        assert handle is not None and handle.store is not None
        host = {n for s in handle.store.slots for n in s.names}
        assert host and all(trainer.model.get_parameter(n).untyped_storage().nbytes() == 0 for n in host)
    if steps == "accumulate-clip":
        norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
        ref_norms = [e["grad_norm"] for e in reference.state.log_history if "grad_norm" in e]
        assert len(norms) == 4 and max(ref_norms) > 1.0  # the clip changed the steps
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    # Evaluation: the plain module without offload, the compiled one (no_grad graph) with it.
    metrics, ref_metrics = trainer.evaluate(), reference.evaluate()
    assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=1e-5)
    if trainer.handle is not None:
        trainer.handle.close()


@pytest.mark.parametrize("offload", [False, True], ids=["backend", "offload"])
def test_a_run_resumed_from_its_step_2_checkpoint_continues_exactly(tmp_path, offload):
    # (4) Save at step 2 (weights, optimizer state, scheduler, RNG, trainer state), resume in a new
    # trainer on a fresh model: steps 3-4 and the final weights are the uninterrupted run's.
    full = _train(tmp_path / "full", protrain=True, offload=offload)
    first = _train(tmp_path / "first", protrain=True, offload=offload, save_strategy="steps", save_steps=2,
                   stop_after=2)
    assert len(_losses(first)) == 2
    checkpoint = tmp_path / "first" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    # The weights file has the keys of the plain model's state dict (no non-persistent buffer).
    import safetensors.torch

    assert set(safetensors.torch.load_file(checkpoint / "model.safetensors")) == set(_model().state_dict())
    # The checkpoint holds ordinary full tensors: the optimizer state of every parameter, each
    # moment of its parameter's shape (an offloaded chunk's too, filled in from the host store).
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    n_params = sum(1 for _ in _model().parameters())
    assert len(state["state"]) == n_params
    assert all(float(s["step"]) == 2 for s in state["state"].values())
    fresh = _model()
    with torch.no_grad():  # the resumed weights must come from the checkpoint, not from the seed
        for p in fresh.parameters():
            p.add_(1.0)
    resumed = _train(tmp_path / "first", protrain=True, offload=offload, model=fresh,
                     resume=str(checkpoint), save_strategy="steps", save_steps=2)
    full_losses, resumed_losses = _losses(full), _losses(resumed)
    assert len(resumed_losses) == 4  # the first two from the checkpoint's trainer state
    assert resumed_losses == full_losses
    full_weights, weights = _weights(full), _weights(resumed)
    for name, value in full_weights.items():
        assert torch.equal(weights[name], value), name
    for trainer in (full, first, resumed):
        if trainer.handle is not None:
            trainer.handle.close()


def test_offload_refuses_an_optimizer_the_cpu_worker_cannot_step(tmp_path):
    trainer = ProTrainTrainer(model=_model(), args=_args(tmp_path, optim="sgd"), train_dataset=_Data(),
                              protrain_options=OPTIONS, offload=OFFLOAD)
    with pytest.raises(ValueError, match=r"TrainingArguments\(optim='sgd'\) builds SGD.*optim='adamw_torch'"):
        trainer.create_optimizer()
    with pytest.raises(ValueError, match="offload must be"):
        ProTrainTrainer(model=_model(), args=_args(tmp_path), offload="yes")


def test_an_accumulation_count_other_than_the_trainers_is_refused(tmp_path):
    # The trainer passes gradient_accumulation_steps; a different count in the options would price
    # the plan for a step the Trainer does not take. The same count is accepted.
    same = ProTrainTrainer(model=_model(), args=_args(tmp_path, gradient_accumulation_steps=2),
                           protrain_options={"accumulation_steps": 2})
    assert same.protrain_options["accumulation_steps"] == 2
    with pytest.raises(ValueError, match="leave accumulation_steps out of protrain_options"):
        ProTrainTrainer(model=_model(), args=_args(tmp_path, gradient_accumulation_steps=2),
                        protrain_options={"accumulation_steps": 4})


def test_automatic_counts_with_the_trainers_gradient_checkpointing_train_like_the_plain_trainer(tmp_path, caplog):
    # The fine-tuner's arguments: offload with the counts left to the backend under a budget that
    # streams chunks, and TrainingArguments(gradient_checkpointing=True), which the trainer turns off
    # (the backend plans recompute): the plain Trainer's losses and weights (it checkpoints).
    args = dict(gradient_checkpointing=True, max_grad_norm=1.0, gradient_accumulation_steps=2)
    reference = _train(tmp_path / "plain", protrain=False, **args)
    torch._dynamo.reset()
    protrain_fx.reset()
    trainer = ProTrainTrainer(model=_model(), args=_args(tmp_path / "protrain", **args), train_dataset=_Data(),
                              protrain_options={**OPTIONS, "memory_budget": BUDGET},
                              offload={"chunk_bytes": OFFLOAD["chunk_bytes"]})
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        trainer.train()
    _assert_same_run(trainer, reference, rtol=1e-5, atol=1e-6)
    assert any("activation checkpointing" in r.getMessage() and "turned off" in r.getMessage() for r in caplog.records)
    handle = trainer.handle
    assert handle.counts_chosen and 0 < handle.n_persist < len(handle.layout.chunks)  # chosen, and chunks streamed
    assert not any(g.breaks for g in protrain_fx.captured_graphs())
    handle.close()


def test_automatic_counts_under_a_budget_too_small_raise_naming_the_minimum(tmp_path):
    """A budget no offload plan meets stops the Trainer's first step with ``NoPlanFits`` (the smallest
    budget named), not a warning and a run over the budget; nothing stays placed."""
    from protrain_fx.search.search import NoPlanFits

    trainer = ProTrainTrainer(model=_model(), args=_args(tmp_path, max_steps=1), train_dataset=_Data(),
                              protrain_options={**OPTIONS, "memory_budget": "64KiB"},
                              offload={"chunk_bytes": OFFLOAD["chunk_bytes"]})
    with pytest.raises(NoPlanFits, match=r"budget must be at least \d+ bytes") as raised:
        trainer.train()
    assert raised.value.min_budget_bytes > 64 * 1024
    assert not trainer.handle.counts_chosen
    trainer.handle.close()
