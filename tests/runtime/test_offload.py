"""Parameter chunks through the backend: offloaded parameters train exactly like eager AdamW.

CPU stands in for the GPU here (``device="cpu"``): host chunks still live in the store, the model
keeps empty shells, the graphs gather chunks into ``n_buffer`` buffers and the worker thread steps
chunks during backward. fp32, eager codegen: bit-exact against ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.plan import from_counts

CONFIG = gpt_config("tiny", n_layer=4)
CHUNK = 64 * 1024



def _batch(step: int):
    return random_batch(CONFIG, 2, 32, generator=torch.Generator().manual_seed(step))


def _setup(n_persist: int, n_buffer: int, *, codegen: str = "eager", frozen: str | None = None, plan=None,
           n_gpu_optim: int = 0, n_lean: int | str = "auto", grad_pool: int = 4, grad_clipping: bool | None = None):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1, fused=True)
    handle = protrain_fx.offload(model, opt, n_persist=n_persist, n_buffer=n_buffer, device="cpu", chunk_bytes=CHUNK,
                                 n_gpu_optim=n_gpu_optim, n_lean=n_lean, grad_pool=grad_pool,
                                 grad_clipping=grad_clipping)
    options = {"codegen": codegen} if plan is None else {"codegen": codegen, "plan": plan}
    compiled = torch.compile(model, backend="protrain", options=options)
    return model, reference, opt, ref_opt, handle, compiled


def _train_side_by_side(compiled, reference, opt, ref_opt, steps: int, schedules=()):
    """``steps`` training steps of both models on the same batches; the losses must be equal."""
    for step in range(steps):
        loss, ref_loss = compiled(*_batch(step)), reference(*_batch(step))
        assert torch.equal(loss, ref_loss), step
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for schedule in schedules:
            schedule.step()


def _train_hf_side_by_side(compiled, reference, opt, ref_opt, steps: int, vocab_size: int):
    """The same for a Hugging Face causal LM: ``steps`` steps of ``model(input_ids=x, labels=x).loss``
    on the same random 2 x 32 tokens."""
    for step in range(steps):
        x = torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(step))
        loss, ref_loss = compiled(input_ids=x, labels=x).loss, reference(input_ids=x, labels=x).loss
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def _train_accumulating(compiled, reference, handle, opt, ref_opt, steps: int = 2, micro: tuple[int, ...] = (),
                        clip: float | None = None):
    """``steps`` optimizer steps of ``micro[step]`` micro-batches each (default two; all but the last
    under ``handle.accumulate()``) against the reference's summed gradients; with ``clip``, both
    clip their gradients to that norm before the step, and the norms must be equal."""
    for step in range(steps):
        k = micro[step] if micro else 2
        with handle.accumulate():
            for m in range(k - 1):
                compiled(*_batch(10 * step + m)).backward()
        compiled(*_batch(10 * step + k - 1)).backward()
        norm = None if clip is None else torch.nn.utils.clip_grad_norm_(compiled.parameters(), clip)
        opt.step(), opt.zero_grad()
        for m in range(k):
            reference(*_batch(10 * step + m)).backward()
        ref_norm = None if clip is None else torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step(), ref_opt.zero_grad()
        assert clip is None or torch.equal(norm, ref_norm), step


def _assert_resumes_in_a_plain_model(handle, model, compiled, opt, frozen: str | None = None):
    """A plain GPT and AdamW loaded from the handle's checkpoint train on exactly like the offloaded model."""
    plain = GPT(CONFIG)
    plain.load_state_dict(handle.state_dict(model))
    plain_opt = torch.optim.AdamW([p for n, p in plain.named_parameters() if n != frozen],
                                  lr=1e-3, weight_decay=0.1, fused=True)
    plain_opt.load_state_dict(copy.deepcopy(handle.optimizer_state_dict()))
    if frozen:
        plain.get_parameter(frozen).requires_grad_(False)
    for step in (5, 6):
        compiled(*_batch(step)).backward()
        opt.step(), opt.zero_grad()
        plain(*_batch(step)).backward()
        plain_opt.step(), plain_opt.zero_grad()
    _assert_same_params(handle, model, plain)


def _bf16_losses(compiled, opt, steps: int = 3) -> list[float]:
    """``steps`` training steps under CPU bf16 autocast; their losses."""
    losses = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(*_batch(step))
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_params(handle, model, reference, exact=True):
    state = handle.state_dict(model)
    for name, p in reference.named_parameters():
        if exact:
            assert torch.equal(state[name], p.detach()), name
        else:
            torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_a_cpu_step_that_runs_after_the_scheduler_keeps_its_own_steps_learning_rate(monkeypatch):
    # The CPU steps of the last chunks to land overlap the next forward, so they can run after the
    # user's scheduler.step(). Each chunk step is held back here until well after it: they must
    # still use the learning rate of the step that queued them, bit-exact against eager (before,
    # they read the scheduler's next rate: the loss differed from the second step on).
    import time

    from protrain_fx.runtime.optim import cpu_adam

    step_chunk = cpu_adam.ChunkAdamW.step_chunk

    def late(self, chunk_id, *hyper):
        time.sleep(0.02)
        return step_chunk(self, chunk_id, *hyper)

    monkeypatch.setattr(cpu_adam.ChunkAdamW, "step_chunk", late)
    model, reference, opt, ref_opt, handle, compiled = _setup(0, 2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    _train_side_by_side(compiled, reference, opt, ref_opt, 3, schedules=(schedule, ref_schedule))
    handle.synchronize()
    _assert_same_params(handle, model, reference)


@pytest.mark.parametrize(("n_persist", "n_buffer"), [(0, 2), (1, 2), (3, 2), (5, 4)])
def test_training_equals_eager_adamw(n_persist, n_buffer):
    model, reference, opt, ref_opt, handle, compiled = _setup(n_persist, n_buffer)
    assert len(handle.layout.chunks) > n_persist + n_buffer  # some chunks really stream
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    _train_side_by_side(compiled, reference, opt, ref_opt, 3, schedules=(schedule, ref_schedule))
    _assert_same_params(handle, model, reference)
    # The model's offloaded parameters hold no bytes; the persistent ones are ordinary tensors.
    host = {n for s in handle.store.slots for n in s.names}
    for name, p in model.named_parameters():
        assert (p.untyped_storage().nbytes() == 0) == (name in host), name
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    assert record.gathered and {g.phase for g in record.gathered} == {"forward", "backward"}
    # Each gather but the last hints the next other chunk's fetch right after it.
    nodes = list(record.forward.graph.nodes)
    gathers = [n for n in nodes if n.target is torch.ops.protrain.chunk_gather.default]
    hints = [n for n in nodes if n.target is torch.ops.protrain.chunk_prefetch.default]
    assert len(hints) >= len(gathers) - 1 - sum(1 for g in gathers if g.args[1] == gathers[-1].args[1])
    assert all(h.args[0].target is torch.ops.protrain.chunk_gather.default for h in hints)
    # No gradient of an offloaded parameter reaches autograd.
    assert all(p.grad is None for n, p in model.named_parameters() if n in host)
    handle.close()


@pytest.mark.parametrize(("n_persist", "n_gpu_optim", "slice_elems"), [(0, 1, None), (1, 3, 1000), (0, 99, 64)])
def test_chunks_stepped_on_the_device_train_exactly_like_eager_adamw(n_persist, n_gpu_optim, slice_elems):
    # The device step (runtime/optim/device_adam.py) on a CPU "device": states copied out to staging
    # slices, stepped there, copied back -- the same bits as eager, in slices smaller than a
    # parameter (1000 -> 960 on the kernel's grid; 64: the smallest) or one slice a chunk.
    n_chunks = len(_setup(0, 2)[4].layout.chunks)
    n_gpu_optim = min(n_gpu_optim, n_chunks - n_persist)
    model, reference, opt, ref_opt, handle, compiled = _setup(n_persist, 2, n_gpu_optim=n_gpu_optim)
    if slice_elems:
        handle.device_adam.slice_elems = slice_elems
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    _train_side_by_side(compiled, reference, opt, ref_opt, 3, schedules=(schedule, ref_schedule))
    _assert_same_params(handle, model, reference)
    # Exactly the first n_gpu_optim offloaded chunks went through the device, once a step: as their
    # gradients landed, or at the first (whose chunk steps wait for the end of backward, to learn
    # whether the loop clips) from the host store.
    assert handle.device_adam.chunk_steps == 3 * n_gpu_optim
    assert handle.worker.steps == 3 * (n_chunks - n_persist - n_gpu_optim)
    # Their moments are in the optimizer's state dict like the others'.
    state = handle.optimizer_state_dict()["state"]
    ref_state = ref_opt.state_dict()["state"]
    for index, entry in ref_state.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key], entry[key]), (index, key)
    handle.close()


def test_chunks_moved_between_the_cpu_and_the_device_steps_keep_training_exactly_like_eager_adamw():
    # The backend re-plans n_gpu_optim between steps (``planner/rates.py``, ``replan_gpu_optim``): 0 -> 3 -> 1 -> 0
    # here, each kept for a step or two. The state never moves, so every step is eager's bits.
    n_chunks = len(_setup(0, 2)[4].layout.chunks)
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2)
    assert handle.device_adam is None
    device_steps = cpu_steps = 0
    for g, steps in ((0, 1), (3, 2), (1, 1), (0, 1)):
        handle.set_gpu_optim(g)
        assert handle.n_gpu_optim == g and (handle.device_adam is not None) == bool(g)
        before_dev = handle.device_adam.chunk_steps if handle.device_adam else 0
        before_cpu = handle.worker.steps
        _train_side_by_side(compiled, reference, opt, ref_opt, steps)
        handle.synchronize()
        if handle.device_adam:
            assert handle.device_adam.chunk_steps - before_dev == steps * g
        assert handle.worker.steps - before_cpu == steps * (n_chunks - 1 - g)
        device_steps += steps * g
        cpu_steps += steps * (n_chunks - 1 - g)
        _assert_same_params(handle, model, reference)
    assert device_steps and cpu_steps
    state, ref_state = handle.optimizer_state_dict()["state"], ref_opt.state_dict()["state"]
    for index, entry in ref_state.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key], entry[key]), (index, key)
    with pytest.raises(ValueError, match=r"n_gpu_optim must be in \[0, \d+\]"):
        handle.set_gpu_optim(n_chunks)
    handle.close()


def test_memory_analysis_counts_the_device_steps_in_flight():
    # On a GPU a device-stepped chunk's gradient buffer lives until its step is done; the runtime lets
    # MAX_IN_FLIGHT steps run at once (make_room), and the analysis counts exactly that: each buffer
    # until just before the one MAX_IN_FLIGHT device chunks later is made.
    from protrain_fx.analysis.memory import grad_staging
    from protrain_fx.runtime.optim.device_adam import MAX_IN_FLIGHT

    _, _, _, _, handle, compiled = _setup(0, 2, n_gpu_optim=4)
    compiled(*_batch(0)).backward()
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    rows = [("backward", 1, n) for n in record.backward.graph.nodes]
    buffers = grad_staging(rows, torch.device("cuda"), record.step.offload)  # the GPU rule; only the type is read
    grads_rows = [i for i, (_, _, n) in enumerate(rows) if n.target is torch.ops.protrain.chunk_grads.default]
    on_device = [rows[i][2].args[3] < 4 for i in grads_rows]
    assert len(buffers) == len(grads_rows) and sum(on_device) == 4
    device_bufs = [b for b, d in zip(buffers, on_device) if d]
    for k, b in enumerate(device_bufs):
        later = device_bufs[k + MAX_IN_FLIGHT :]
        assert b.last_use == (later[0].alloc - 1 if later else len(rows) - 1), k
    for i in range(len(rows)):
        assert sum(b.alloc <= i <= b.last_use for b in device_bufs) <= MAX_IN_FLIGHT, i
    handle.close()


def test_device_stepped_chunks_accumulate_resume_and_keep_frozen_parameters():
    # Accumulated gradients are on the host: the CPU steps them as their last micro-batch lands, but
    # at the first step, held to learn whether the loop clips, the device streams them from there
    # (not the chunk with a frozen parameter: the CPU path steps it); that parameter stays; a
    # checkpoint resumes exactly.
    model, reference, opt, ref_opt, handle, compiled = _setup(0, 2, frozen="blocks.0.attn.qkv.weight", n_gpu_optim=3)
    frozen_before = reference.get_parameter("blocks.0.attn.qkv.weight").detach().clone()
    with_frozen = {c for c in range(3) for s in handle.store.chunk_slots(c) if s.name == "blocks.0.attn.qkv.weight"}
    _train_accumulating(compiled, reference, handle, opt, ref_opt)
    assert with_frozen and handle.device_adam.chunk_steps == 3 - len(with_frozen)
    _train_side_by_side(compiled, reference, opt, ref_opt, 2)
    assert handle.device_adam.chunk_steps == 3 - len(with_frozen) + 2 * 3
    _assert_same_params(handle, model, reference)
    assert torch.equal(handle.state_dict(model)["blocks.0.attn.qkv.weight"], frozen_before)
    _assert_resumes_in_a_plain_model(handle, model, compiled, opt, frozen="blocks.0.attn.qkv.weight")
    handle.close()


def test_offload_with_an_activation_plan_equals_eager_adamw():
    # Chunks and activation plans together: a swapped block, checkpointed blocks (whose recompute in
    # backward reads the gathered chunks again) and a plain one. A block spans several of these
    # small chunks, and a checkpointed block holds all of them from its recompute to its backward.
    plan = from_counts("swap=1,checkpoint=2", [f"blocks.{i}" for i in range(CONFIG.n_layer)])
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 8, plan=plan)
    _train_side_by_side(compiled, reference, opt, ref_opt, 3)
    _assert_same_params(handle, model, reference)
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    assert record.swapped and record.gathered
    handle.close()


def test_a_plan_needing_more_buffers_than_the_offload_has_is_refused_before_running():
    plan = from_counts("checkpoint=all", [f"blocks.{i}" for i in range(CONFIG.n_layer)])
    model, _, _, _, handle, compiled = _setup(0, 2, plan=plan)
    with pytest.raises(Exception, match=r"holds \d+ parameter chunks at once .* use n_buffer >= \d+"):
        compiled(*_batch(0)).backward()
    handle.close()


@pytest.mark.parametrize("settings", [
    {"n_persist": 1, "n_buffer": 2, "n_lean": 0},
    {"n_persist": 0, "n_buffer": 3, "n_lean": 4, "grad_pool": 1},  # lean: landing buffers held across micro-batches
    {"n_persist": 3, "n_buffer": 2, "n_lean": "all", "grad_clipping": True, "clip": 0.05},  # the norm reads the sums
    {"n_persist": 2, "n_buffer": 4, "n_lean": 2, "clip": 100.0},  # clipping learned at the first step; never clips
], ids=["working", "lean", "all-lean-clipped", "clip-learned"])
def test_gradient_accumulation_equals_the_summed_gradients(settings, monkeypatch):
    # k = 2 then 3 micro-batches: every landing after a chunk's first in a step is an add, staged and
    # added on the CPU optimizer's worker thread, never in the thread running backward. The adds are
    # slowed down so that the step, the clip's norm and the checkpoint each find some still queued:
    # they must wait for them (exact, bit for bit).
    import threading
    import time

    from protrain_fx.runtime.store import grad_adds

    settings = dict(settings)
    clip, n_lean = settings.pop("clip", None), settings.pop("n_lean")
    if n_lean == "all":
        torch._dynamo.reset()
        n_lean = len(_setup(0, 2)[4].layout.chunks) - settings["n_persist"]
        torch._dynamo.reset()
    model, reference, opt, ref_opt, handle, compiled = _setup(**settings, n_lean=n_lean)
    threads, add = [], grad_adds._add

    def slow_add(dsts, srcs):
        threads.append(threading.get_ident())
        time.sleep(0.002)
        add(dsts, srcs)

    monkeypatch.setattr(grad_adds, "_add", slow_add)
    monkeypatch.setattr(grad_adds, "available_host_bytes", lambda: 64 * 2**30)  # the host's room, pinned
    _train_accumulating(compiled, reference, handle, opt, ref_opt, micro=(2, 3), clip=clip)
    _assert_same_params(handle, model, reference)
    store = handle.store
    trainable = store.num_chunks  # (every offloaded chunk holds a trainable parameter)
    assert store.adds.queued == len(threads) == (1 + 2) * trainable  # k - 1 adds per chunk and step
    assert threading.get_ident() not in threads and len(set(threads)) == 1  # the worker's thread
    # accumulating: a staging buffer per landing chunk at most (the host has room for these), reused
    landing = len(handle.layout.chunks) - handle.n_persist
    assert store.adds.limit == min(grad_adds.ACCUMULATING_STAGING_BUFFERS, landing) > grad_adds.STAGING_BUFFERS
    assert grad_adds.STAGING_BUFFERS * store.chunk_numel * 4 <= store.adds.staging_bytes
    assert store.adds.staging_bytes <= store.adds.limit * store.chunk_numel * 4
    handle.close()


@pytest.mark.parametrize("grad_clipping", [True, None], ids=["held", "learned"])
def test_held_chunk_steps_stream_through_the_device_with_the_clip_exactly(grad_clipping):
    # A clipping loop holds every chunk's step until the norm is known; optimizer.step() then streams
    # the first n_gpu_optim chunks' held gradients through the device (slices smaller than a
    # parameter) while the CPU steps the rest: the same bits as eager AdamW after clip_grad_norm_,
    # with micro-batches too.
    n_gpu_optim = 3
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2, n_gpu_optim=n_gpu_optim, grad_clipping=grad_clipping)
    handle.device_adam.slice_elems = 1000
    _train_accumulating(compiled, reference, handle, opt, ref_opt, steps=3, micro=(1, 2, 1), clip=0.05)
    _assert_same_params(handle, model, reference)
    assert handle.device_adam.chunk_steps == 3 * n_gpu_optim
    assert handle.worker.steps == 3 * (handle.store.num_chunks - n_gpu_optim)
    handle.close()


def test_frozen_parameters_stay_and_train_nothing():
    name = "blocks.2.mlp.fc.weight"
    model, reference, opt, ref_opt, handle, compiled = _setup(0, 2, frozen=name)
    before = reference.get_parameter(name).detach().clone()
    for step in range(2):
        compiled(*_batch(step)).backward()
        reference(*_batch(step)).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert torch.equal(handle.state_dict(model)[name], before)
    _assert_same_params(handle, model, reference)


def test_state_dict_loads_into_a_plain_model_and_resumes_exactly():
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2)
    for step in range(2):
        compiled(*_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    plain = GPT(CONFIG)
    plain.load_state_dict(handle.state_dict(model))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    # (a state dict holds references to live state tensors, as torch's own does: copy it, as saving
    # it to disk would)
    plain_opt.load_state_dict(copy.deepcopy(handle.optimizer_state_dict()))
    for step in (2, 3):
        compiled(*_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        plain(*_batch(step)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    _assert_same_params(handle, model, plain)


def test_state_dict_has_the_models_keys_without_its_non_persistent_buffers():
    """A model with a non-persistent buffer (a Hugging Face rotary ``inv_freq``): the handle's state
    dict has exactly ``model.state_dict()``'s keys, so a plain model loads it strictly, and the handle
    loads such a dict back (the buffer keeps its value)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    state = handle.state_dict(model)
    assert "inv_freq" not in state and state.keys() == model.state_dict(keep_vars=True).keys()
    plain = GPT(CONFIG)
    plain.register_buffer("inv_freq", torch.zeros(4), persistent=False)
    plain.load_state_dict(state)  # strict
    handle.load_state_dict(model, {k: v + 1 for k, v in state.items()})
    assert torch.equal(model.inv_freq, torch.arange(4.0))
    name = next(iter(handle.store.param_state_dict()))
    assert torch.equal(handle.state_dict(model)[name], state[name] + 1)


def test_inductor_codegen_trains_like_eager():
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2, codegen="inductor")
    for step in range(2):
        loss, ref_loss = compiled(*_batch(step)), reference(*_batch(step))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    state = handle.state_dict(model)
    for name, p in reference.named_parameters():
        # Adam normalises each update: fp32 rounding differences of fused kernels show on
        # parameters whose gradient is near zero (absolute differences of a few 1e-6 after 2 steps).
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=2e-5)


def test_inductor_never_reads_a_shells_data_when_it_checks_input_alignment(monkeypatch):
    """On a GPU, Inductor checks the alignment of every graph input it cannot prove aligned, at every
    call, by its data pointer; a shell's data pointer raises (``runtime/offload/shells.py``). The shells are
    parameters, static inputs Inductor proves aligned at compile time, so they are never checked:
    here CPU inputs are checked as GPU ones would be, and training runs."""
    from torch._inductor import compile_fx
    from torch._inductor.utils import tensor_is_aligned

    checked: list[int] = []

    def as_on_a_gpu(inputs, static_input_idxs):
        idxs = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)
                and not (i in static_input_idxs and tensor_is_aligned(x))]
        checked.extend(idxs)
        return idxs

    monkeypatch.setattr(compile_fx, "get_input_idxs_to_check", as_on_a_gpu)
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2, codegen="inductor")
    assert any(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # shells among the inputs
    for step in range(2):
        compiled(*_batch(step)).backward()
        opt.step(), opt.zero_grad()
    assert checked  # the token ids and the saved activations were checked
    handle.close()


def test_inductor_frees_each_chunks_gradients_once_they_are_handed_over():
    # Found at 4.2B on the H200: Inductor kept the gradients given to chunk_grads allocated to the
    # end of backward (a buffer it may not reuse is never freed), i.e. all offloaded chunks' fp32
    # gradients at once. In Inductor's plan, what is live at the last hand-over must be far less.
    model, _, opt, _, handle, compiled = _setup(0, 3, codegen="inductor")
    compiled(*_batch(0)).backward()
    record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
    timeline = record.memory.timeline
    assert "Inductor" in timeline.label
    handed = [n for n in record.backward.graph.nodes if n.target is torch.ops.protrain.chunk_grads.default]
    assert len(handed) > 3
    last = max(e.index for e in timeline.entries if e.name == handed[-1].name)
    live = timeline.entries[last].peak_bytes - sum(timeline.baseline_bytes.values())
    gradient_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert live < gradient_bytes / 2, (live, gradient_bytes)  # 0.06x here; 1.0x before the fix
    handle.close()


def test_bad_settings_are_refused_with_the_numbers():
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="n_persist must be in"):
        protrain_fx.offload(model, opt, n_persist=999, n_buffer=1, device="cpu", chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match=r"n_gpu_optim must be in \[0, \d+\]"):
        protrain_fx.offload(model, opt, n_persist=1, n_buffer=1, device="cpu", chunk_bytes=CHUNK, n_gpu_optim=999)
    with pytest.raises(ValueError, match="grad_pool must be at least 1, got 0"):
        protrain_fx.offload(model, opt, n_persist=0, n_buffer=1, device="cpu", chunk_bytes=CHUNK, grad_pool=0)
    with pytest.raises(ValueError, match="n_buffer >= 1"):
        protrain_fx.offload(model, opt, n_persist=0, n_buffer=0, device="cpu", chunk_bytes=CHUNK)
    # refused before anything moves, the automatic counts' settings too
    for kwargs, match in [({"chunk_bytes": 0}, "chunk_bytes.*must be positive"),
                          ({"chunk_bytes": "64 bytes"}, "chunk_bytes.*as a size"),
                          ({"n_lean": -1}, "n_lean must be 'auto' or a count"),
                          ({"grad_pool": 0}, "grad_pool must be at least 1, got 0"),
                          ({"n_persist": -1, "n_buffer": 2}, "n_persist must be a count")]:
        with pytest.raises(ValueError, match=match):
            protrain_fx.offload(model, opt, device="cpu", **kwargs)
    fresh = GPT(CONFIG)  # a size as memory_budget reads one
    handle = protrain_fx.offload(fresh, torch.optim.AdamW(fresh.parameters()), device="cpu", chunk_bytes="64KiB")
    assert handle.layout.chunk_bytes == 64 * 1024
    handle.close()
    with pytest.raises(MemoryError, match="bytes"):
        protrain_fx.offload(model, opt, n_persist=0, n_buffer=1, device="cpu", chunk_bytes=CHUNK, available_host_bytes=1000)
    with pytest.raises((TypeError, ValueError), match="Adam"):
        protrain_fx.offload(GPT(CONFIG), torch.optim.SGD(model.parameters(), lr=0.1), n_persist=0, n_buffer=2,
                            device="cpu", chunk_bytes=CHUNK)


def test_too_few_buffers_is_a_clear_error():
    # The tied embedding / head chunk is used at the start and at the end of forward: with one
    # buffer, the next chunk has nowhere to go.
    model, _, _, _, handle, compiled = _setup(0, 1)
    with pytest.raises(Exception, match="n_buffer|buffer"):
        compiled(*_batch(0))


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_memory_analysis_counts_the_chunk_pool_once_as_model_state(codegen):
    peaks = {}
    for n_persist in (0, 6):
        protrain_fx.reset()
        torch._dynamo.reset()
        model, _, opt, _, handle, compiled = _setup(n_persist, 3, codegen=codegen)
        compiled(*_batch(0)).backward()
        record = next(g for g in protrain_fx.captured_graphs() if g.backward is not None)
        memory = record.memory
        pool = [e for e in memory.timeline.events if "chunk buffers" in e.name]
        assert not pool, "the pool is baseline state, not an event of the step"
        assert memory.timeline.baseline_bytes["parameter"] >= 3 * CHUNK
        gathers = {n.name for g in (record.forward, record.backward) for n in g.graph.nodes
                   if n.target is torch.ops.protrain.chunk_gather.default}
        assert not [e for e in memory.timeline.events if e.name in gathers], "gathers allocate nothing new"
        if n_persist == 0:  # every parameter is streamed: the device holds the pool, no Adam state
            assert memory.parameter_bytes == 3 * CHUNK and memory.optimizer_state_bytes == 0
        peaks[n_persist] = memory.peak_bytes
        handle.close()
    # more chunks on the device: more parameter bytes there
    assert peaks[6] > peaks[0]


def _seeded_init(model):
    """``model.init_parameter`` with a generator seeded per name: the same values whatever the order."""
    import zlib

    def init(name, tensor):
        state = torch.random.get_rng_state()
        torch.manual_seed(zlib.crc32(name.encode()))
        try:
            model.init_parameter(name, tensor)
        finally:
            torch.random.set_rng_state(state)

    return init


@pytest.mark.parametrize("n_persist", [0, 2])
def test_a_meta_model_is_materialised_straight_into_chunks(n_persist):
    with torch.device("meta"):
        model = GPT(CONFIG)
    reference = GPT(CONFIG)
    init = _seeded_init(reference)
    for name, p in reference.named_parameters():
        init(name, p.data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt_fused = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True) if n_persist else opt
    handle = protrain_fx.offload(model, opt_fused, n_persist=n_persist, n_buffer=2, device="cpu",
                                 chunk_bytes=CHUNK, init=_seeded_init(model))
    assert not any(p.is_meta for p in model.parameters())
    host = {n for s in handle.store.slots for n in s.names}
    assert all(p.untyped_storage().nbytes() == 0 for n, p in model.named_parameters() if n in host)
    assert model.lm_head.weight is model.wte.weight  # still tied, stored once
    _assert_same_params(handle, model, reference)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    _train_side_by_side(compiled, reference, opt_fused, ref_opt, 2)
    _assert_same_params(handle, model, reference)
    handle.close()


def test_a_meta_model_without_init_or_with_meta_buffers_is_refused():
    with torch.device("meta"):
        model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="meta device; give init="):
        protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    model.register_buffer("mask", torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="buffer 'mask' is on the meta device"):
        protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu", chunk_bytes=CHUNK, init=model.init_parameter)


def test_device_steps_with_bf16_compute_give_the_host_paths_bits():
    # bf16 working copies: the device path converts the bf16 gradient to fp32 in its staging slice
    # and writes the new bf16 copy back, as the host path does in its scratch -- the same bits.
    def train(n_gpu_optim):
        torch._dynamo.reset()  # one offloaded model per compiled graph (see the test below)
        torch.manual_seed(0)
        model = GPT(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        handle = protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu", chunk_bytes=CHUNK,
                                     compute_dtype=torch.bfloat16, n_gpu_optim=n_gpu_optim)
        if handle.device_adam is not None:
            handle.device_adam.slice_elems = 1000
        compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
        losses = _bf16_losses(compiled, opt)
        state = handle.state_dict(model)
        working = {n: t.clone() for n, t in handle.store.views("working").items()}
        steps = handle.device_adam.chunk_steps if handle.device_adam else 0
        handle.close()
        return losses, state, working, steps

    host_losses, host_state, host_working, _ = train(0)
    dev_losses, dev_state, dev_working, steps = train(3)
    assert steps == 9  # 3 chunks on the device at every step (the first from the host store: held to learn the clip)
    assert dev_losses == host_losses
    for name in host_state:
        assert torch.equal(dev_state[name], host_state[name]), name
        assert torch.equal(dev_working[name], host_working[name]), name


def test_a_second_offloaded_model_of_the_class_gets_its_own_graphs_and_a_shared_one_is_refused():
    # Dynamo keys compiled code by code object: a second instance of the class reused the first one's
    # graph, which names the first handle (before the shell check it silently computed with the first
    # model's weights; then it was refused). offload() gives each model a forward of its own: both
    # train as eager in one process (a notebook cell run again), each on its own chunks.
    def make(seed, own_forward=True):
        torch.manual_seed(seed)
        model = GPT(CONFIG)
        reference = copy.deepcopy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        handle = protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
        if not own_forward:  # the classes' forwards: one code object for both instances
            for module in model.modules():
                del module.forward
        return torch.compile(model, backend="protrain", options={"codegen": "eager"}), reference, handle

    first, first_ref, first_handle = make(0)
    second, second_ref, second_handle = make(1)
    for step in range(2):
        assert torch.equal(first(*_batch(step)), first_ref(*_batch(step)))
        assert torch.equal(second(*_batch(step)), second_ref(*_batch(step)))
    # sharing the class's code, the fourth model is compiled for itself all the same (Dynamo guards on
    # each model's own forward hooks: runtime/offload/eager.py); a graph that would read the third's
    # chunks with the fourth's parameters is refused by the shell check inside its gather
    third, third_ref, third_handle = make(2, own_forward=False)
    fourth, fourth_ref, fourth_handle = make(3, own_forward=False)
    assert torch.equal(third(*_batch(0)), third_ref(*_batch(0)))
    assert torch.equal(fourth(*_batch(0)), fourth_ref(*_batch(0)))
    from protrain_fx.runtime.offload import chunk_ops

    hid, chunk, _, name = next(chunk_ops.offloaded(p) for p in third_handle._named.values() if chunk_ops.offloaded(p))
    fourths = next(p for n, p in fourth_handle._named.items() if n == name)
    with pytest.raises(RuntimeError, match="another model's parameters.*torch._dynamo.reset"):
        chunk_ops.check_shell(hid, chunk, fourths)
    for handle in (first_handle, second_handle, third_handle, fourth_handle):
        handle.close()


def test_an_offloaded_model_evaluates_under_no_grad():
    # The inference graph (no_grad: no backward) reads the chunks too; before it was rewritten, it
    # read the 0-byte shells and failed inside the first op ("out of bounds for storage of size 0").
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2)
    for step in range(2):
        with torch.no_grad():
            assert torch.equal(compiled(*_batch(7)), reference(*_batch(7))), step
        _train_side_by_side(compiled, reference, opt, ref_opt, 1)
    record = next(g for g in protrain_fx.captured_graphs() if g.inference is not None)
    assert record.gathered and {g.phase for g in record.gathered} == {"forward"}
    handle.close()


# ---- lean chunks: no host working copy, fetched from the fp32 master --------------------------


@pytest.mark.parametrize(("n_persist", "n_lean", "grad_pool", "n_gpu_optim"),
                         [(0, "all", 1, 0), (1, 3, 2, 0), (0, "all", 1, 2), (2, 2, 4, 1)])
def test_lean_chunks_train_exactly_like_eager_adamw(n_persist, n_lean, grad_pool, n_gpu_optim):
    torch._dynamo.reset()
    n_chunks = len(_setup(0, 2)[4].layout.chunks)
    torch._dynamo.reset()
    lean = n_chunks - n_persist if n_lean == "all" else n_lean
    model, reference, opt, ref_opt, handle, compiled = _setup(n_persist, 2, n_lean=lean, grad_pool=grad_pool,
                                                              n_gpu_optim=n_gpu_optim)
    store = handle.store
    assert handle.n_lean == lean and store.lean == frozenset(range(store.num_chunks - lean, store.num_chunks))
    with pytest.raises(ValueError, match="lean"):
        store.flat("working", store.num_chunks - 1)
    _train_side_by_side(compiled, reference, opt, ref_opt, 3)
    _assert_same_params(handle, model, reference)
    # More lean chunks than landing buffers: backward waited for the CPU steps instead of making more.
    assert store.landing_buffers <= min(grad_pool, lean)
    assert len(handle._landed_lean) <= lean  # the queue of steps to wait for does not grow with the steps
    # fp32 compute: a lean chunk keeps 4 + 8 bytes per element, the others 4 + 4 + 8.
    per_chunk = [12 if c in store.lean else 16 for c in range(store.num_chunks)]
    assert store.host_bytes() == store.chunk_numel * (sum(per_chunk) + 4 * store.landing_buffers)
    handle.close()


def test_lean_chunks_accumulate_past_the_pool_and_resume_exactly():
    # Accumulated gradients hold their landing buffers across backward passes: the pool grows
    # (nothing to wait for) and the sums are still exact; a checkpoint then resumes exactly.
    torch._dynamo.reset()
    model, reference, opt, ref_opt, handle, compiled = _setup(1, 2, n_lean=3, grad_pool=1)
    _train_accumulating(compiled, reference, handle, opt, ref_opt)
    _assert_same_params(handle, model, reference)
    assert handle.store.landing_buffers == 3  # one per lean chunk while accumulating
    handle.load_state_dict(model, handle.state_dict(model), handle.optimizer_state_dict())
    _assert_resumes_in_a_plain_model(handle, model, compiled, opt)
    handle.close()


def test_lean_chunks_with_bf16_compute_give_the_working_copys_bits():
    # The fetch casts the fp32 master as the working copy was cast from it: the same bf16 values,
    # so the same losses and the same new masters, with host and device steps.
    def train(n_lean, n_gpu_optim):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        handle = protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu", chunk_bytes=CHUNK,
                                     compute_dtype=torch.bfloat16, n_gpu_optim=n_gpu_optim, n_lean=n_lean,
                                     grad_pool=1)
        compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
        losses = _bf16_losses(compiled, opt)
        result = losses, handle.state_dict(model), handle.host_bytes_per_param(), handle.store.num_chunks
        handle.close()
        return result

    base_losses, base_state, base_bytes, n_chunks = train(0, 0)
    assert base_bytes > 14  # chunk padding
    for n_lean, n_gpu_optim in ((3, 0), (n_chunks, 2)):
        losses, state, per_param, _ = train(n_lean, n_gpu_optim)
        assert losses == base_losses, (n_lean, n_gpu_optim)
        for name in base_state:
            assert torch.equal(state[name], base_state[name]), (name, n_lean, n_gpu_optim)
        if n_lean == n_chunks:
            assert per_param == pytest.approx(base_bytes * 12 / 14)  # 12 bytes per chunk element, not 14


def test_auto_makes_the_fewest_last_chunks_lean_that_fit_the_host():
    from protrain_fx.runtime.store.host_memory import AUTO_HOST_RESERVE, HostMemoryError

    def handle_with(available, n_lean="auto"):  # (no optimizer state spilled to disk: tests/runtime/test_spill.py)
        torch._dynamo.reset()
        model = GPT(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return protrain_fx.offload(model, opt, n_persist=0, n_buffer=2, device="cpu", chunk_bytes=CHUNK,
                                   compute_dtype=torch.bfloat16, available_host_bytes=available, grad_pool=2,
                                   n_lean=n_lean, n_spill=0)

    full = handle_with(None)  # plenty: nothing lean
    assert full.n_lean == 0
    store = full.store
    numel, n = store.chunk_numel, store.num_chunks
    need0 = store.host_bytes()
    # k lean chunks save 2 bytes per element each and add min(2, k) landing buffers of 2 bytes per
    # element: one or two lean chunks save nothing, three save one chunk's bf16 copy
    for k in (3, n):
        need = need0 - 2 * numel * k + 2 * numel * min(2, k)
        assert handle_with(need + AUTO_HOST_RESERVE).n_lean == k
        if k < n:
            assert handle_with(need + AUTO_HOST_RESERVE - 1).n_lean == k + 1
    all_lean = need0 - 2 * numel * n + 4 * numel
    with pytest.raises(HostMemoryError, match=rf"{n} of them lean\) needs {all_lean} bytes"):
        handle_with(all_lean - 1)
    all_spilled = need0 - 12 * numel * n + 12 * numel * 2  # working copies, and two chunks' state in flight
    with pytest.raises(HostMemoryError, match=rf"With every chunk's optimizer state spilled to disk \(n_spill={n}\) "
                                              rf"it would need {all_spilled} bytes"):
        handle_with(all_lean - 1, n_lean=0)
    with pytest.raises(ValueError, match=r"n_lean must be 'auto' or in \[0, \d+\]"):
        other = GPT(CONFIG)
        protrain_fx.offload(other, torch.optim.AdamW(other.parameters()), n_persist=0, n_buffer=2,
                            device="cpu", chunk_bytes=CHUNK, n_lean=999)


def test_the_settings_are_one_options_object_checked_when_made():
    """offload()'s keywords are the fields of OffloadOptions: an object made once serves several calls,
    keywords beside it replace its fields, an unknown keyword names the accepted ones, and a bad value
    is refused when the object is made, before any model is touched."""
    from protrain_fx.api import OffloadOptions

    with pytest.raises(ValueError, match="grad_pool must be at least 1, got 0"):
        OffloadOptions(device="cpu", grad_pool=0)
    options = OffloadOptions(n_persist=1, n_buffer=2, device="cpu", chunk_bytes="64KiB")
    assert options.chunk_bytes == CHUNK and options.device == torch.device("cpu") and not options.automatic
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"'n_persit'.*n_persist, n_buffer, device"):
        protrain_fx.offload(model, opt, options, n_persit=2)
    handle = protrain_fx.offload(model, opt, options, n_persist=0)
    assert handle.options == options.replace(n_persist=0) and handle.n_persist == 0 and handle.n_buffer == 2
    handle.close()


def test_a_refused_offload_leaves_the_model_and_optimizer_as_they_were():
    """Counts refused by hand (found only once the layout is known) leave no hook behind: the model
    and optimizer then offload, save and step as if the refused call had not been made."""
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooks = lambda: (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_state_dict_post_hooks),  # noqa: E731
                     sum(len(m._state_dict_hooks) + len(m._forward_pre_hooks) for m in model.modules()))
    before = hooks()
    with pytest.raises(ValueError, match="n_persist must be in"):
        protrain_fx.offload(model, opt, n_persist=999, n_buffer=1, device="cpu", chunk_bytes=CHUNK)
    assert hooks() == before and model.get_parameter("wte.weight").untyped_storage().nbytes()
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    assert set(model.state_dict()) == set(handle.state_dict(model))
    handle.close()


def test_counts_by_hand_over_the_budget_are_told_to_change_the_counts(caplog):
    """Counts by hand keep the budget a check (nothing is chosen): the warning names the counts, not a
    plan by hand, which the offloaded model does not need."""
    import logging

    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=CHUNK)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager", "memory_budget": "64KiB"})
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        compiled(*_batch(0)).backward()
    (line,) = [r.getMessage() for r in caplog.records if "over its memory budget" in r.getMessage()]
    assert "n_persist=" in line and "leave the counts out" in line and "options={'plan'" not in line
    handle.close()
