"""The loops users write around an offloaded model: gradient clipping, skipped steps, and misuse.

CPU, fp32, eager codegen: everything is compared bit for bit with the same loop on a plain model and
``torch.optim.AdamW(fused=True)``. The offloaded chunks' optimizer steps normally run as their
gradients land in backward; clipping needs the norm over every chunk first, so the handle holds them
(learned at the first step, or ``grad_clipping=True``) and ``torch.nn.utils.clip_grad_norm_`` reaches
the handle for an offloaded model's parameters.
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.errors import UnsupportedError
from protrain_fx.planner.budget import budget_for_peak
from tests.runtime.test_offload import _train_hf_side_by_side

CONFIG = gpt_config("tiny", n_layer=4)
CHUNK = 64 * 1024


def _batch(step: int):
    return random_batch(CONFIG, 2, 32, generator=torch.Generator().manual_seed(step))


def _pair(**offload_kwargs):
    """An offloaded GPT compiled with eager codegen, and a plain copy, each with fused AdamW."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    kwargs = dict(n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    kwargs.update(offload_kwargs)
    handle = protrain_fx.offload(model, opt, **kwargs)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    return model, reference, opt, ref_opt, handle, compiled


def _assert_same_params(handle, model, reference):
    state = handle.state_dict(model)
    for name, p in reference.named_parameters():
        assert torch.equal(state[name], p.detach()), name


@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipped at every step / never clipped
@pytest.mark.parametrize("settings", [
    {},                                     # learned at the first step
    {"grad_clipping": True, "n_persist": 0},
    {"n_gpu_optim": 2},                     # held chunks meant for the device are stepped on the CPU
    {"n_lean": 3, "grad_pool": 1, "grad_clipping": True},  # lean chunks hold landing buffers until the norm
])
def test_clip_grad_norm_on_an_offloaded_model_equals_eager(max_norm, settings):
    model, reference, opt, ref_opt, handle, compiled = _pair(**settings)
    norms = []
    for step in range(3):
        loss = compiled(*_batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step(), opt.zero_grad()
        ref_loss = reference(*_batch(step))
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step(), ref_opt.zero_grad()
        assert torch.equal(loss, ref_loss) and torch.equal(norm, ref_norm), step
        norms.append(float(norm))
    assert (min(norms) > max_norm) if max_norm < 1 else (max(norms) < max_norm)  # both regimes exercised
    assert handle.grad_clipping is True
    _assert_same_params(handle, model, reference)
    handle.close()


def test_clipping_accumulated_micro_batches_equals_eager():
    model, reference, opt, ref_opt, handle, compiled = _pair(grad_clipping=True)
    for step in range(2):
        with handle.accumulate():
            compiled(*_batch(10 * step)).backward()
        compiled(*_batch(10 * step + 1)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step(), opt.zero_grad()
        reference(*_batch(10 * step)).backward()
        reference(*_batch(10 * step + 1)).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step(), ref_opt.zero_grad()
        assert torch.equal(norm, ref_norm), step
    _assert_same_params(handle, model, reference)
    handle.close()


def test_a_loop_without_clipping_is_learned_and_steps_chunks_during_backward():
    model, reference, opt, ref_opt, handle, compiled = _pair()
    for step in range(3):
        compiled(*_batch(step)).backward()
        if step == 1:  # from the second step on, the chunks' steps are queued as their gradients land
            assert handle.worker.steps + len(handle.worker._pending) > 0 and not handle._pending
        opt.step(), opt.zero_grad()
        reference(*_batch(step)).backward()
        ref_opt.step(), ref_opt.zero_grad()
    assert handle.grad_clipping is False
    _assert_same_params(handle, model, reference)
    # A clip after the chunks were stepped unclipped cannot be made exact: refused, naming the way out.
    compiled(*_batch(5)).backward()
    with pytest.raises(UnsupportedError, match="grad_clipping=True"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    handle.close()


def test_lean_chunks_hold_their_gradients_for_a_clip_only_when_told():
    # Learning at the first step, lean chunks may not take landing buffers beyond the pool (host
    # memory the store was not sized for): they are stepped, and a clip in that step is refused.
    model, _, opt, _, handle, compiled = _pair(n_lean=3, grad_pool=1)
    compiled(*_batch(0)).backward()
    with pytest.raises(UnsupportedError, match="grad_clipping=True .* lean chunks"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert handle.store.landing_buffers <= 1
    handle.close()


def test_an_offloaded_parameter_prints_without_reading_memory_it_lacks():
    model, _, _, _, handle, _ = _pair()
    shell = model.get_parameter("blocks.3.mlp.fc.weight")
    assert "offloaded by protrain_fx" in repr(shell) and "dtype=torch.float32" in repr(shell)
    assert "offloaded" not in repr(torch.ones(2))
    handle.close()


def test_clipping_part_of_an_offloaded_model_is_refused():
    model, _, opt, _, handle, compiled = _pair(grad_clipping=True)
    compiled(*_batch(0)).backward()
    some = [p for name, p in model.named_parameters() if name.startswith("blocks.0.")]
    with pytest.raises(UnsupportedError, match="every parameter"):
        torch.nn.utils.clip_grad_norm_(some, 1.0)
    handle.close()


def test_a_non_finite_gradient_norm_skips_the_step_everywhere():
    model, _, opt, _, handle, compiled = _pair()
    compiled(*_batch(0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(), opt.zero_grad()
    before = handle.state_dict(model)
    optimizer_before = copy.deepcopy(handle.optimizer_state_dict())
    (compiled(*_batch(1)) * float("inf")).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm)
    opt.step(), opt.zero_grad()
    after = handle.state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert handle.skipped_steps == 1
    steps = lambda state: [float(s["step"]) for s in state["state"].values()]  # noqa: E731
    assert steps(handle.optimizer_state_dict()) == steps(optimizer_before)
    # ... and training goes on from there
    compiled(*_batch(2)).backward()
    assert torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    assert any(not torch.equal(after[k], v) for k, v in handle.state_dict(model).items())
    with pytest.raises(RuntimeError, match="non-finite"):
        (compiled(*_batch(3)) * float("nan")).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    handle.close()


def test_clip_grad_norm_of_other_models_is_torchs_own():
    model, reference, opt, _, handle, compiled = _pair()
    reference(*_batch(0)).backward()
    grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert torch.equal(norm, expected)
    handle.close()


def test_micro_batches_without_accumulate_name_the_fix():
    model, _, opt, _, handle, compiled = _pair(grad_clipping=False)
    compiled(*_batch(0)).backward()
    with pytest.raises(UnsupportedError, match=r"handle\.accumulate\(\)"):
        compiled(*_batch(1)).backward()
    handle.close()


def test_micro_batches_without_accumulate_seen_at_the_first_step_add_up_as_in_eager_at_every_step(caplog):
    # The first step holds every chunk's step (to learn whether the loop clips), so two backward
    # passes before optimizer.step() add their gradients, as eager autograd does; seen there, every
    # later step's chunks are held too.
    model, reference, opt, ref_opt, handle, compiled = _pair()
    for step in range(3):
        for m, o in ((compiled, opt), (reference, ref_opt)):
            m(*_batch(2 * step)).backward()
            m(*_batch(2 * step + 1)).backward()
            o.step(), o.zero_grad()
    _assert_same_params(handle, model, reference)
    assert handle._hold_always and "got gradients twice before optimizer.step()" in caplog.text
    handle.close()


def test_one_backward_through_two_calls_of_the_model_trains_as_torchs_compile():
    # Against torch.compile's own graphs (aot_eager): the tied embedding's four gradient terms add in
    # another order than eager autograd's, by torch, not by the offload.
    model, reference, opt, ref_opt, handle, compiled = _pair()
    traced = torch.compile(reference, backend="aot_eager")
    for step in range(3):
        for m, o in ((compiled, opt), (traced, ref_opt)):
            (m(*_batch(2 * step)) + 0.5 * m(*_batch(2 * step + 1))).backward()
            o.step(), o.zero_grad()
    _assert_same_params(handle, model, reference)
    handle.close()


def _set_lr(opt, step):
    for group in opt.param_groups:
        group["lr"] = 1e-3 * (step + 1) / 4  # a warm-up, written just before optimizer.step()


def test_a_learning_rate_set_between_backward_and_step_trains_as_eager(caplog):
    model, reference, opt, ref_opt, handle, compiled = _pair()
    for step in range(3):
        for m, o in ((compiled, opt), (reference, ref_opt)):
            m(*_batch(step)).backward()
            _set_lr(o, step)
            o.step(), o.zero_grad()
    _assert_same_params(handle, model, reference)
    assert handle._hold_always and "are set between backward and optimizer.step()" in caplog.text
    handle.close()


def test_a_learning_rate_set_after_the_chunks_stepped_says_so_and_later_steps_are_held():
    # Without a held first step (grad_clipping=False) the chunks step as their gradients land: a
    # learning rate written later in the step reaches them at the next step only, which is said.
    model, reference, opt, ref_opt, handle, compiled = _pair(grad_clipping=False)
    compiled(*_batch(0)).backward()
    opt.step(), opt.zero_grad()
    assert not handle._hold_always
    compiled(*_batch(1)).backward()
    _set_lr(opt, 1)
    with pytest.warns(UserWarning, match=r"changed between this step's backward and optimizer.step\(\); offloaded "
                                         r"chunks \[.*\].* were already stepped"):
        opt.step()
    opt.zero_grad()
    assert handle._hold_always
    compiled(*_batch(2)).backward()
    assert handle._pending and not handle._submitted  # held until optimizer.step()
    _set_lr(opt, 2)
    opt.step(), opt.zero_grad()
    handle.close()


def test_an_optimizer_of_none_of_the_models_parameters_is_refused():
    model = GPT(CONFIG)
    other = torch.optim.AdamW(GPT(CONFIG).parameters(), fused=True)
    with pytest.raises(ValueError, match="the optimizer holds none of the model's parameters"):
        protrain_fx.offload(model, other, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    part = torch.optim.AdamW(model.blocks[0].parameters(), fused=True)  # some of them: trains those, as eager
    protrain_fx.offload(model, part, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK).close()


def test_offloading_a_model_twice_is_refused():
    model, _, opt, _, handle, _ = _pair()
    with pytest.raises(ValueError, match="already offloaded"):
        protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), n_persist=1, n_buffer=2, device="cpu",
                            chunk_bytes=CHUNK)
    handle.close()
    with pytest.raises(ValueError, match="already offloaded"):  # closed: the parameters are still shells
        protrain_fx.offload(model, opt, device="cpu")


def test_calling_an_offloaded_model_without_compile_names_the_fix():
    model, _, _, _, handle, compiled = _pair()
    with pytest.raises(UnsupportedError, match="torch.compile"):
        model(*_batch(0))
    compiled(*_batch(0)).backward()  # the compiled module still runs
    handle.close()


@pytest.mark.parametrize("counts", [{}, {"n_persist": 1, "n_buffer": 2}], ids=["automatic", "by-hand"])
def test_a_model_whose_offload_optimizer_was_dropped_names_the_fix(counts):
    """``offload(model, AdamW(...))`` with an optimizer kept nowhere: the handle, and the chunks' values
    with it, are garbage-collected and the parameters stay empty shells; the compile says so."""
    import gc

    torch.manual_seed(0)
    model = GPT(CONFIG)
    protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), device="cpu", chunk_bytes=CHUNK, **counts)
    gc.collect()
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": 3_000_000})
    with pytest.raises(Exception, match="Keep that optimizer"):
        compiled(*_batch(0))


def test_hand_counts_that_offload_nothing_are_refused():
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="nothing would be offloaded"):
        protrain_fx.offload(model, opt, n_persist=1, n_buffer=1, device="cpu")  # one 32 MiB chunk holds it all


@pytest.mark.parametrize("clip", [True, False])
def test_a_loop_that_skips_a_step_trains_like_eager_when_the_chunk_steps_are_held(clip):
    """A loop that, after backward (and clipping), decides not to step (a loss spike, a bad batch) and
    calls zero_grad(): the gradients the offloaded chunks hold are dropped, as zero_grad drops .grad.
    A clipping loop holds the chunk steps anyway; one that does not clip holds them with
    grad_clipping=True."""
    model, reference, opt, ref_opt, handle, compiled = _pair(**({} if clip else {"grad_clipping": True}))
    for step in range(5):
        for m, o, params in ((compiled, opt, model.parameters()), (reference, ref_opt, reference.parameters())):
            loss = m(*_batch(step))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 0.05)
            if step != 2:
                o.step()
            o.zero_grad()
            if m is compiled:
                ours = loss
        assert torch.equal(ours, loss), step
    _assert_same_params(handle, model, reference)
    handle.close()


def test_a_skipped_step_whose_chunks_were_already_stepped_is_refused_naming_the_fix():
    """Without clipping the chunks step as their gradients land: a skipped optimizer.step() cannot be
    honoured, so its zero_grad() is refused instead of training on."""
    model, reference, opt, ref_opt, handle, compiled = _pair()
    for step in range(2):
        compiled(*_batch(step)).backward()
        opt.step(), opt.zero_grad()
    compiled(*_batch(2)).backward()
    with pytest.raises(UnsupportedError, match="optimizer.step\\(\\) was skipped.*grad_clipping=True"):
        opt.zero_grad()
    handle.close()


def test_clipping_twice_in_one_step_is_refused():
    model, reference, opt, ref_opt, handle, compiled = _pair(grad_clipping=True)
    compiled(*_batch(0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(UnsupportedError, match="ran twice in one step"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    handle.close()


def test_a_block_frozen_after_offload_stops_training_as_in_eager():
    """Freezing part of the model mid-training: Dynamo does not recompile when a parameter's
    requires_grad changes, so the compiled backward still makes the frozen parameters' gradients.
    Autograd drops them for plain parameters; the offloaded chunks drop them as they land, so the
    frozen parameters stay as they are, bit for bit eager's."""
    model, reference, opt, ref_opt, handle, compiled = _pair(n_persist=0, n_buffer=4)
    for step in range(4):
        if step == 2:
            model.blocks[0].requires_grad_(False), reference.blocks[0].requires_grad_(False)
            frozen = {n: p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
        loss, ref_loss = compiled(*_batch(step)), reference(*_batch(step))
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    _assert_same_params(handle, model, reference)
    state = handle.state_dict(model)
    assert frozen and all(torch.equal(state[n], value) for n, value in frozen.items())
    handle.close()


def test_a_parameter_frozen_at_offload_and_trained_later_is_refused_naming_the_fix():
    """The store keeps no optimizer state for a parameter frozen at offload, and the compiled graphs
    make no gradient for it: unfrozen later it would silently stay as it is."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.blocks[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    compiled(*_batch(0)).backward()
    opt.step(), opt.zero_grad()
    model.blocks[0].requires_grad_(True)
    compiled(*_batch(1)).backward()
    with pytest.raises(UnsupportedError, match="frozen when the model was offloaded now require a gradient.*"
                                               "Set requires_grad before offload"):
        opt.step()
    handle.close()


def test_an_optimizer_the_chunks_cannot_step_is_refused_at_offload():
    model = GPT(CONFIG)
    with pytest.raises(TypeError, match="AdamW"):
        protrain_fx.offload(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")  # counts: automatic
    with pytest.raises(ValueError, match="grad_clipping"):
        protrain_fx.offload(GPT(CONFIG), torch.optim.AdamW(model.parameters()), device="cpu", grad_clipping="yes")
    with pytest.raises(ValueError, match="bfloat16"):
        protrain_fx.offload(GPT(CONFIG), torch.optim.AdamW(model.parameters()), device="cpu",
                            compute_dtype=torch.float16)


def _tiny_llama(transformers):
    """A 3-layer Hugging Face Llama with grouped-query attention and rotary positions, seeded."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_hugging_face_llama_with_the_loss_outside_clipped_and_accumulated_trains_like_eager():
    """The loop a fine-tuner writes: a Hugging Face Llama (GQA, rotary) offloaded without counts under
    a budget, logits returned and the loss computed outside the compiled module, two micro-batches per
    step through ``handle.accumulate()``, ``clip_grad_norm_`` every step: bit for bit the eager loop."""
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F

    model = _tiny_llama(transformers)
    config = model.config
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
    # a budget under what the step needs with every chunk on the device (2.0 MiB): some chunks stream
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": 2_000_000})
    generator = torch.Generator().manual_seed(1)

    def loss_of(m, idx):
        logits = m(input_ids=idx).logits
        return F.cross_entropy(logits.float().view(-1, config.vocab_size), idx.view(-1)) / 2

    for _ in range(3):
        for micro in range(2):
            idx = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
            context = handle.accumulate() if micro == 0 else contextlib.nullcontext()
            with context:
                loss = loss_of(compiled, idx)
                loss.backward()
            ref_loss = loss_of(reference, idx)
            ref_loss.backward()
            assert torch.equal(loss, ref_loss)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        assert torch.equal(norm, ref_norm) and ref_norm > 0.5  # the clip scales
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert handle.configured and handle.n_persist < len(handle.layout.chunks)  # chunks really offloaded
    state = handle.state_dict(model)
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name


def _tiny_gpt2(transformers):
    """A 3-layer Hugging Face GPT-2 without dropout, seeded: its class name tells Hugging Face no
    loss type (``loss_type`` is ``None``)."""
    config = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=64, vocab_size=128,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_a_hugging_face_gpt2_trains_in_one_graph_when_offloaded_and_names_the_fix_when_not(caplog):
    """GPT-2's loss lookup logs that its loss type is unset, which breaks the graph between the logits
    and the loss. ``offload`` names the type Hugging Face falls back to (the same loss): one graph,
    bit for bit eager. Compiled without offload, the break's warning names that setting."""
    transformers = pytest.importorskip("transformers")
    model = _tiny_gpt2(transformers)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK, n_persist=1, n_buffer=2)
    assert model.loss_type == "ForCausalLM" and reference.loss_type is None
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    _train_hf_side_by_side(compiled, reference, opt, ref_opt, 2, model.config.vocab_size)
    assert len(protrain_fx.captured_graphs()) == 1 and not protrain_fx.graph_break_reasons()
    handle.close()

    protrain_fx.reset()
    torch._dynamo.reset()
    plain = torch.compile(reference, backend="protrain", options={"codegen": "eager"})
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with caplog.at_level("WARNING", logger="protrain_fx"):
        plain(input_ids=idx, labels=idx).loss.backward()
    assert "set model.loss_type = 'ForCausalLM' before torch.compile" in caplog.text


def test_hugging_face_gradient_checkpointing_is_turned_off_and_the_loop_trains_like_eager():
    """``model.gradient_checkpointing_enable()``, as fine-tuners do, then ``offload``: the model's own
    checkpointing is turned off with a warning (the backend plans recompute against the budget; in
    some transformers releases Dynamo cannot trace it and the layer loop would run eagerly), the step
    is one graph, and the loop is bit for bit eager's with Hugging Face's checkpointing on."""
    import logging
    import warnings

    transformers = pytest.importorskip("transformers")
    model = _tiny_llama(transformers)
    config = model.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in newer releases
        model.gradient_checkpointing_enable()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("protrain_fx").addHandler(handler)
    try:
        handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        assert any(getattr(m, "gradient_checkpointing", False) for m in reference.modules())
        compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": 2_000_000})
        for step in range(2):
            idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
            loss, ref_loss = compiled(input_ids=idx, labels=idx).loss, reference(input_ids=idx, labels=idx).loss
            assert torch.equal(loss, ref_loss)
            loss.backward(), ref_loss.backward()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    finally:
        logging.getLogger("protrain_fx").removeHandler(handler)
    assert any("activation checkpointing" in r.getMessage() and "turned off" in r.getMessage() for r in records)
    graphs = [g for g in protrain_fx.captured_graphs() if g.has_backward]
    assert len(graphs) == 1 and graphs[0].blocks.labels and not graphs[0].breaks
    assert handle.n_persist < len(handle.layout.chunks)  # chunks really offloaded
    _assert_same_params(handle, model, reference)


class _LoopWithABreak(torch.nn.Module):
    """Blocks called in a loop with a graph break inside it: Dynamo cannot resume a frame there and
    runs the whole frame eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
            torch._dynamo.graph_break()
        return x.sum()


def test_a_module_that_runs_eagerly_inside_the_compiled_call_is_refused_by_name():
    torch.manual_seed(0)
    model = _LoopWithABreak()
    handle = protrain_fx.offload(model, torch.optim.AdamW(model.parameters()), n_persist=1, n_buffer=1, device="cpu",
                                 chunk_bytes=256 * 257 * 4)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    with pytest.raises(UnsupportedError, match=r"blocks\.1 \(Linear\).*ran outside the compiled graphs.*graph break"):
        compiled(torch.randn(2, 256))
    handle.close()


def test_an_offloaded_model_past_the_recompile_limit_names_the_limit(monkeypatch):
    """Each input shape is a compile of its own; past Dynamo's recompile limit the frame runs eagerly,
    where the offloaded parameters hold nothing: refused, naming the limit and the fix."""
    from torch._dynamo import config as dynamo_config

    torch.manual_seed(0)
    model = GPT(CONFIG)
    # a budget under the step with every parameter on the device, as the backend reports it for the codegen
    # trained with: some chunks are shells outside the graphs, so the frame run eagerly reads one (with all
    # of them on the device it would run unplanned); 70% of it leaves room for both shapes' plans with the
    # counts the first one chose (on the slow, default and fast pinned hosts of tests/conftest.py)
    full = protrain_fx.what_fits(copy.deepcopy(model), *random_batch(CONFIG, 2, 32),
                                 options={"codegen": "eager"}).predicted_peak_bytes
    budget = int(0.7 * budget_for_peak(full))
    torch._dynamo.reset()
    protrain_fx.reset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = protrain_fx.offload(model, opt, device="cpu", chunk_bytes=CHUNK)  # each shape planned apart
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": budget})
    with dynamo_config.patch(recompile_limit=2):
        for seq in (32, 24):
            compiled(*random_batch(CONFIG, 2, seq)).backward()
            opt.step(), opt.zero_grad()
        assert handle.n_persist < len(handle.layout.chunks)
        with pytest.raises(UnsupportedError, match="recompile_limit.*pad the inputs"):
            compiled(*random_batch(CONFIG, 2, 16))
    handle.close()


def test_casting_moving_or_deep_copying_an_offloaded_model_is_refused_and_changes_nothing():
    """``model.double()``, ``.half()``, ``.to(dtype)``, ``copy.deepcopy(model)`` or ``torch.save(model)``
    after offload would copy the shells' missing bytes (a crash, or a file without the values):
    refused naming the way out, before any parameter is converted; a move to the device the
    parameters are on already is a no-op and runs."""
    model, _, opt, _, handle, compiled = _pair()
    before = {n: (p.dtype, p.untyped_storage().nbytes()) for n, p in model.named_parameters()}
    for convert in (model.double, model.half, lambda: model.to(torch.bfloat16), lambda: model.blocks[2].double()):
        with pytest.raises(UnsupportedError, match="offloaded: converting its parameters.*before protrain_fx.offload"):
            convert()
        assert {n: (p.dtype, p.untyped_storage().nbytes()) for n, p in model.named_parameters()} == before
    with pytest.raises(UnsupportedError, match="deepcopy.*load_state_dict"):
        copy.deepcopy(model)
    with pytest.raises(UnsupportedError, match=r"torch.save\(model\).*model.state_dict\(\)"):
        torch.save(model, io.BytesIO())
    model.to("cpu")  # where the parameters are: nothing to copy
    compiled(*_batch(0)).backward()  # still trains
    opt.step()
    handle.close()


def test_reading_or_writing_an_offloaded_parameter_raises_instead_of_crashing():
    """Logging a weight's norm, flattening the parameters or scaling one in place reads or writes a
    shell's data, which it lacks (the process crashed on the null pointer): a clear error instead."""
    model, _, _, _, handle, compiled = _pair()
    shell = model.get_parameter("blocks.2.mlp.fc.weight")
    assert shell.untyped_storage().nbytes() == 0  # offloaded
    for touch in (shell.norm, lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
                  lambda: shell.detach().mul_(2), shell.clone):
        with pytest.raises(RuntimeError, match="offloaded.*state_dict"):
            touch()
    assert shell.shape == (4 * CONFIG.n_embd, CONFIG.n_embd) and shell.dtype == torch.float32  # still readable
    compiled(*_batch(0)).backward()
    handle.close()


def test_torchs_own_clipping_of_an_offloaded_model_is_refused_instead_of_clipping_part_of_it():
    """A ``clip_grad_norm_`` imported before ``offload`` (torch's own), ``clip_grads_with_norm_`` with a
    norm from ``get_total_norm`` over ``.grad``, and ``clip_grad_value_`` see only the persistent
    chunks' gradients: refused before any gradient is scaled; the module path still clips exactly."""
    from protrain_fx.runtime.optim import clipping

    model, _, opt, _, handle, compiled = _pair(grad_clipping=True)
    compiled(*_batch(0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads and len(grads) < len(list(model.parameters()))  # persistent ones hold .grad, offloaded not
    total = torch.nn.utils.get_total_norm(list(grads.values()))
    for clip in (lambda: clipping._TORCH_CLIP_GRAD_NORM(model.parameters(), 0.01),  # bound before offload
                 lambda: torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.01, total),
                 lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)):
        with pytest.raises(UnsupportedError, match="never reach .grad.*clip_grad_norm_\\(model.parameters"):
            clip()
    assert all(torch.equal(model.get_parameter(n).grad, g) for n, g in grads.items())  # nothing scaled
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01) > total  # over every chunk
    opt.step()
    handle.close()


def test_float16_autocast_on_an_offloaded_model_is_refused_naming_bfloat16():
    """float16 needs loss scaling, and GradScaler's unscaling and skipped steps reach ``.grad`` only:
    the offloaded chunks would step on scaled (or overflowed) gradients. bfloat16 trains."""
    model, _, opt, _, handle, compiled = _pair()
    with pytest.raises(UnsupportedError, match="float16.*GradScaler.*bfloat16"):
        with torch.autocast("cpu", dtype=torch.float16):
            compiled(*_batch(0))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(*_batch(0))
    loss.backward()
    opt.step()
    handle.close()
