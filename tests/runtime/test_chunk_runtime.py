"""Chunk runtime without the graph (issue 5): host chunk store, device buffer pool, CPU Adam(W)
worker, checkpoints, gradient accumulation -- all checked against eager PyTorch on the CPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from protrain_fx.chunks import ChunkLayout, dedupe_tied, pack
from protrain_fx.runtime.store.buffer_pool import ChunkBufferPool
from protrain_fx.runtime.store.chunk_store import ChunkStore
from protrain_fx.runtime.optim.cpu_adam import ChunkAdamW, OptimizerWorker
from protrain_fx.runtime.store.host_memory import HostMemoryError, available_host_bytes

VOCAB, D = 32, 16
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# the largest parameter (fc1: 16 x 64 fp32 = 4096 bytes) alone, a few per chunk, everything in one
CHUNK_SIZES = [4096, 6144, 1 << 20]
# the runtime never calls the user's optimizer.step() (the backend is to route it)
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Two OpenMP teams (this thread's and the worker's) spinning on few cores make these tiny
    steps 40x slower; correctness does not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyLM(nn.Module):
    """Embedding, two MLP layers with biases, a LayerNorm, a frozen layer and a tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.wte(idx))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _batches(
    n: int, batch: int = 4, seq: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (batch, seq), generator=g),
            torch.randint(VOCAB, (batch, seq), generator=g),
        )
        for _ in range(n)
    ]


def _layout(model: nn.Module, chunk_bytes: int) -> ChunkLayout:
    """Registration order as first use; one block per top-level module."""
    rows = [
        (name, id(p), p.numel() * p.element_size(), name.split(".")[0], i)
        for i, (name, p) in enumerate(model.named_parameters(remove_duplicate=False))
    ]
    return pack(dedupe_tied(rows), chunk_bytes)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def _adamw(
    model: nn.Module,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def _eager_steps(model, opt, sched, batches) -> None:
    for idx, targets in batches:
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


class Chunked:
    """The chunk runtime driven by eager autograd: fetch values, backward, land grads, step."""

    def __init__(self, model: nn.Module, chunk_bytes: int, **store_options) -> None:
        self.model = model
        self.store = ChunkStore(
            _layout(model, chunk_bytes),
            _named(model),
            pin_memory=False,
            **store_options,
        )
        self.opt, self.sched = _adamw(model)
        self.adam = ChunkAdamW(self.store, self.opt, _named(model))
        self.worker = OptimizerWorker(self.adam.step_chunk)
        self.pool = ChunkBufferPool(self.store, 2, "cpu", wait_host=self.worker.wait)

    def forward_backward(
        self,
        idx,
        targets,
        *,
        scale: float = 1.0,
        accumulate: bool = False,
        flat: bool = False,
    ):
        params = _named(self.model)
        with torch.no_grad():  # the graph would use the pool's buffers directly
            for c in range(self.store.num_chunks):
                for name, value in self.store.unflatten(
                    c, self.pool.acquire(c)
                ).items():
                    params[name].copy_(value)
                self.pool.release(c)
        (self.model(idx, targets) * scale).backward()
        grads = {
            n: p.grad for n, p in self.model.named_parameters() if p.grad is not None
        }
        if flat:
            self._land_flat(grads, accumulate)
        else:
            self.store.write_grads(grads, accumulate=accumulate)
        self.model.zero_grad(set_to_none=True)

    def _land_flat(self, grads, accumulate: bool) -> None:
        for c in range(self.store.num_chunks):
            if any(s.trainable for s in self.store.chunk_slots(c)):
                flat = torch.zeros(self.store.chunk_numel)
                views = self.store.unflatten(c, flat)
                for name, grad in grads.items():
                    if name in views:
                        views[name].copy_(grad)
                self.store.write_grad(c, flat, accumulate=accumulate)

    def step(self) -> None:
        for c in reversed(range(self.store.num_chunks)):  # backward order
            self.worker.submit(c)
        self.worker.wait_all()
        self.sched.step()

    def train(self, batches, *, flat: bool = False) -> None:
        for idx, targets in batches:
            self.forward_backward(idx, targets, flat=flat)
            self.step()


def _assert_params_equal(expected: nn.Module, actual: dict[str, torch.Tensor]) -> None:
    for name, p in expected.named_parameters(remove_duplicate=False):
        assert torch.equal(actual[name], p.detach()), name


@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
@pytest.mark.parametrize("flat", [False, True], ids=["by_name", "flat"])
def test_training_equals_eager_fused_adamw_bit_for_bit(chunk_bytes, flat):
    batches = _batches(4)
    ref = _model()
    initial_frozen = ref.frozen.weight.detach().clone()
    _eager_steps(ref, *_adamw(ref), batches)

    run = Chunked(_model(), chunk_bytes)
    run.train(batches, flat=flat)
    run.worker.close()

    _assert_params_equal(ref, run.store.views("master"))
    _assert_params_equal(
        ref, run.store.views("working")
    )  # written back after each step
    assert torch.equal(run.store.views("master")["frozen.weight"], initial_frozen)
    assert run.opt.param_groups[0]["lr"] == HYPER["lr"] * _schedule(len(batches))


@pytest.mark.parametrize("slice_elems", [64, 100, 1000])
@pytest.mark.parametrize("flat", [False, True], ids=["by_name", "flat"])
def test_sliced_optimizer_steps_are_bit_exact(slice_elems, flat):
    # The CPU step runs the fused kernel over slices of a chunk (cache-sized on real models); slices
    # split parameters on a 64-element grid, which keeps every element's rounding as in eager.
    batches = _batches(3)
    ref = _model()
    _eager_steps(ref, *_adamw(ref), batches)
    run = Chunked(_model(), CHUNK_SIZES[-1])
    run.adam.slice_elems = slice_elems
    assert max(s.numel for s in run.store.slots) > slice_elems  # some parameter is really split
    run.train(batches, flat=flat)
    run.worker.close()
    _assert_params_equal(ref, run.store.views("master"))
    _assert_params_equal(ref, run.store.views("working"))


def test_tied_parameters_are_stored_once():
    model = _model()
    store = ChunkStore(_layout(model, 1 << 20), _named(model), pin_memory=False)
    assert len(store.slots) == len(
        list(model.parameters())
    )  # the head is the embedding
    views = store.views("master")
    assert views["head.weight"] is views["wte.weight"]
    n_params = sum(p.numel() for p in model.parameters())
    assert (
        store.host_bytes() == store.chunk_numel * 16
    )  # fp32: working + master + 2 moments
    assert store.bytes_per_param() == pytest.approx(16 * store.chunk_numel / n_params)
    state = store.param_state_dict()
    assert state["head.weight"] is state["wte.weight"]
    with pytest.raises(ValueError, match="tied"):
        store.write_grads(
            {"wte.weight": torch.zeros(VOCAB, D), "head.weight": torch.zeros(VOCAB, D)}
        )


def test_a_background_fill_gives_the_same_buffers_and_every_read_waits_for_it():
    """``fill(background=True)`` (what the backend does beside Inductor's compile): the buffers equal a
    fill on the caller's thread, a read before the fill is done waits for it, and the fill's error
    is raised at every read."""
    model = _model()
    layout = _layout(model, 4096)
    plain = ChunkStore(layout, _named(model), compute_dtype=torch.bfloat16, pin_memory=False)
    started, release = threading.Event(), threading.Event()

    def slow_init(name: str, tensor: torch.Tensor) -> None:  # holds the fill until the test lets it go
        started.set()
        assert release.wait(30)
        tensor.copy_(meta_values[name])

    meta_values = {n: p.detach() for n, p in _named(model).items()}
    metas: dict[int, torch.Tensor] = {}  # tied names keep one tensor
    on_meta = {n: metas.setdefault(id(p), torch.empty_like(p, device="meta").requires_grad_(p.requires_grad))
               for n, p in _named(model).items()}
    store = ChunkStore(layout, on_meta, compute_dtype=torch.bfloat16, pin_memory=False, init=slow_init,
                       fill=False)
    store.fill(background=True)
    assert started.wait(30) and store._filling is not None  # running, not done
    threading.Timer(0.2, release.set).start()
    started_reading = time.monotonic()
    first = store.flat("master", 0)  # waits for the fill
    assert time.monotonic() - started_reading > 0.1 and store.filled
    assert torch.equal(first, plain.flat("master", 0))
    for kind in ("master", "working", "exp_avg", "exp_avg_sq"):
        for c in range(store.num_chunks):
            if plain.has_buffer(kind, c):
                assert torch.equal(store.flat(kind, c), plain.flat(kind, c)), (kind, c)
    assert store.host_bytes() == plain.host_bytes()

    def failing_init(name: str, tensor: torch.Tensor) -> None:
        raise MemoryError(f"no room for {name}")

    broken = ChunkStore(layout, on_meta, compute_dtype=torch.bfloat16, pin_memory=False, init=failing_init,
                        fill=False)
    broken.fill(background=True)
    for _ in range(2):  # raised where the values are read, every time
        with pytest.raises(MemoryError, match="no room for"):
            broken.flat("master", 0)


def test_frozen_parameters_are_stored_but_take_no_gradient():
    model = _model()
    store = ChunkStore(_layout(model, 4096), _named(model), pin_memory=False)
    frozen = store.slot("frozen.weight")
    assert not frozen.trainable
    with pytest.raises(ValueError, match="frozen"):
        store.write_grads({"frozen.weight": torch.zeros(D, D)})
    # a chunk with only frozen parameters has no Adam state (and costs 16 - 8 bytes per parameter)
    two = nn.Sequential(nn.Linear(D, D).requires_grad_(False), nn.Linear(D, D))
    store = ChunkStore(_layout(two, (D * D + D) * 4), _named(two), pin_memory=False)
    assert [s.trainable for s in store.chunk_slots(0)] == [False, False]
    with pytest.raises(ValueError, match="no trainable"):
        store.flat("exp_avg", 0)
    assert store.host_bytes() == store.chunk_numel * (8 + 16)


def test_bf16_compute_needs_at_most_14_bytes_per_parameter():
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
    layout = _layout(model, 16 * 16 * 4)  # one full chunk per layer: no padding
    store = ChunkStore(
        layout, _named(model), compute_dtype=torch.bfloat16, pin_memory=False
    )
    assert store.bytes_per_param() == 14  # 2 working + 4 master + 8 moments
    assert store.host_bytes() == 2 * 256 * 14 + 256 * 4  # and one fp32 scratch gradient
    frozen = nn.Linear(16, 16, bias=False).requires_grad_(False)
    frozen_store = ChunkStore(
        _layout(frozen, 1024),
        _named(frozen),
        compute_dtype=torch.bfloat16,
        pin_memory=False,
    )
    assert frozen_store.bytes_per_param() == 6  # no moments, no scratch


def test_bf16_compute_steps_the_master_with_the_rounded_gradient():
    """The gradient lands in the bf16 working buffer, so Adam sees it rounded to bf16; the master
    stays fp32 and the new working copy is the master rounded."""
    model = _model()
    ref = _model()
    store = ChunkStore(
        _layout(model, 4096),
        _named(model),
        compute_dtype=torch.bfloat16,
        pin_memory=False,
    )
    assert torch.equal(
        store.views("working")["fc1.weight"], model.fc1.weight.detach().bfloat16()
    )
    adam = ChunkAdamW(
        store, torch.optim.AdamW(model.parameters(), **HYPER), _named(model)
    )
    ((idx, targets),) = _batches(1)
    ref(idx, targets).backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    store.write_grads(grads)
    assert store.holds_grad(0)
    for p in ref.parameters():
        if p.grad is not None:
            p.grad = p.grad.bfloat16().float()
    torch.optim.AdamW(ref.parameters(), fused=True, **HYPER).step()
    for c in range(store.num_chunks):
        adam.step_chunk(c)
    _assert_params_equal(ref, store.views("master"))
    for name, p in ref.named_parameters():
        assert torch.equal(store.views("working")[name], p.detach().bfloat16()), name


def test_host_memory_is_refused_up_front_with_both_numbers():
    model = _model()
    needed = ChunkStore(
        _layout(model, 4096), _named(model), pin_memory=False
    ).host_bytes()
    with pytest.raises(HostMemoryError) as error:
        ChunkStore(
            _layout(model, 4096),
            _named(model),
            pin_memory=False,
            available_bytes=needed - 1,
        )
    message = str(error.value)
    assert f"needs {needed} bytes" in message and f"only {needed - 1} bytes" in message
    assert "MemAvailable" in message


def test_available_host_bytes_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:  42 kB\n")
    assert available_host_bytes(meminfo) == 42 * 1024
    assert available_host_bytes(tmp_path / "missing") is None


def test_layout_and_model_must_agree():
    model = _model()
    layout = _layout(model, 1 << 20)
    named = _named(model)
    with pytest.raises(ValueError, match="'extra' is not in the chunk layout"):
        ChunkStore(
            layout, named | {"extra": nn.Parameter(torch.zeros(3))}, pin_memory=False
        )
    with pytest.raises(ValueError, match="'ln.bias'"):
        ChunkStore(
            layout, {n: t for n, t in named.items() if n != "ln.bias"}, pin_memory=False
        )
    untied = _named(_model()) | {"head.weight": nn.Parameter(torch.zeros(VOCAB, D))}
    with pytest.raises(ValueError, match="different tensors"):
        ChunkStore(layout, untied, pin_memory=False)


def test_state_dict_round_trip_through_plain_pytorch_resumes_exactly():
    first, second = _batches(6)[:3], _batches(6)[3:]
    run = Chunked(_model(), 6144)
    run.train(first)
    model_state, opt_state = run.store.param_state_dict(), run.adam.state_dict()
    sched_state = run.sched.state_dict()

    # the same state from eager training: the export is the plain optimizer's state dict
    ref = _model()
    ref_opt, ref_sched = _adamw(ref)
    _eager_steps(ref, ref_opt, ref_sched, first)
    _assert_state_dicts_equal(opt_state, ref_opt.state_dict())
    assert set(model_state) == set(ref.state_dict())  # both tied names

    # chunked -> plain PyTorch, continue there; chunked continues too: same values
    plain = _model(seed=5)
    plain.load_state_dict(model_state)
    plain_opt, plain_sched = _adamw(plain)
    plain_opt.load_state_dict(opt_state)
    plain_sched.load_state_dict(sched_state)
    _eager_steps(plain, plain_opt, plain_sched, second)
    run.train(second)
    _assert_params_equal(plain, run.store.views("master"))

    # eager -> a fresh chunked run, continue: same values as eager continuing
    fresh = Chunked(_model(seed=7), 4096)
    fresh.store.load_param_state_dict(ref.state_dict())
    fresh.adam.load_state_dict(ref_opt.state_dict())
    fresh.sched.load_state_dict(ref_sched.state_dict())
    _eager_steps(ref, ref_opt, ref_sched, second)
    fresh.train(second)
    _assert_params_equal(ref, fresh.store.views("master"))
    for r in (run, fresh):
        r.worker.close()


def test_binding_adopts_state_the_optimizer_already_holds():
    batches = _batches(4)
    ref = _model()
    ref_opt, ref_sched = _adamw(ref)
    _eager_steps(ref, ref_opt, ref_sched, batches[:2])

    model = _model(seed=3)
    model.load_state_dict(ref.state_dict())
    opt, sched = _adamw(model)
    opt.load_state_dict(ref_opt.state_dict())  # a checkpoint loaded before compiling
    sched.load_state_dict(ref_sched.state_dict())
    store = ChunkStore(_layout(model, 4096), _named(model), pin_memory=False)
    adam = ChunkAdamW(store, opt, _named(model))
    assert not opt.state  # moved into the store
    _assert_state_dicts_equal(adam.state_dict(), ref_opt.state_dict())


def _assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert actual["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(actual["state"][index][key], value), (index, key)


@pytest.mark.parametrize("flat", [False, True], ids=["by_name", "flat"])
def test_two_accumulated_micro_batches_equal_one_big_batch(flat):
    ((idx, targets),) = _batches(1, batch=8)
    ref = _model()
    ref_opt, ref_sched = _adamw(ref)
    _eager_steps(ref, ref_opt, ref_sched, [(idx, targets)])

    run = Chunked(_model(), 4096)
    run.forward_backward(idx[:4], targets[:4], scale=0.5, flat=flat)
    run.forward_backward(idx[4:], targets[4:], scale=0.5, accumulate=True, flat=flat)
    run.step()
    run.worker.close()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            run.store.views("master")[name], p.detach(), rtol=1e-5, atol=1e-6
        )


def test_accumulate_adds_and_without_a_gradient_writes():
    model = nn.Linear(4, 4, bias=False)
    store = ChunkStore(_layout(model, 64), _named(model), pin_memory=False)
    a, b = torch.randn(16), torch.randn(16)
    store.write_grad(0, a, accumulate=True)  # nothing held yet: a write
    assert torch.equal(store.grad_fp32(0), a)
    store.write_grad(0, b, accumulate=True)
    assert torch.equal(store.grad_fp32(0), a + b)
    store.write_grad(0, b)
    assert torch.equal(store.grad_fp32(0), b)


def test_accumulated_adds_run_on_the_worker_from_two_staging_buffers_and_are_waited_for(monkeypatch):
    # Three one-parameter chunks; the worker's adds are held back until released. Two adds fill the
    # two staging buffers; the third landing waits for one, and nothing is added in this thread.
    # The sources are copied at landing (the graph may reuse their memory): overwriting them after
    # does not change the sums, which wait_grad (here through grad_fp32) waits for.
    from protrain_fx.runtime.store import grad_adds

    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))
    store = ChunkStore(_layout(model, 64), _named(model), pin_memory=False)
    assert store.num_chunks == 3
    release, threads, add = threading.Event(), [], grad_adds._add

    def held_back(dsts, srcs):
        release.wait(timeout=10)
        threads.append(threading.get_ident())
        add(dsts, srcs)

    monkeypatch.setattr(grad_adds, "_add", held_back)
    first, second = torch.randn(3, 16), torch.randn(3, 16)
    expected = first + second
    with OptimizerWorker(lambda chunk_id: None) as worker:
        store.adds.run = worker.run
        for c in range(3):
            store.write_grad(c, first[c].clone(), accumulate=True)  # nothing held: written here
        for c in range(2):
            store.write_grad(c, second[c], accumulate=True)
        assert store.adds.pending(0) and store.adds.pending(1) and store.adds.staging_wait_s == 0
        threading.Timer(0.05, release.set).start()
        store.write_grad(2, second[2], accumulate=True)  # both staging buffers busy: waits for an add
        assert store.adds.staging_wait_s > 0
        second.fill_(float("nan"))
        for c in range(3):
            assert torch.equal(store.grad_fp32(c), expected[c]), c
    assert store.adds.queued == len(threads) == 3 and threading.get_ident() not in threads
    assert store.adds.staging_bytes == grad_adds.STAGING_BUFFERS * 16 * 4
    assert store.host_bytes() == 3 * 16 * 16 + store.adds.staging_bytes


@pytest.mark.parametrize("spare_chunks, buffers", [(6, 3), (3, 2), (0, 2)])
def test_accumulating_takes_a_staging_buffer_per_landing_chunk_within_half_the_spare_host_memory(
        monkeypatch, spare_chunks, buffers):
    # Three chunks land an add each micro-batch; the store's limit leaves room for ``spare_chunks``
    # chunks of staging, half of which the adds may take. With a buffer per chunk the third landing
    # does not wait for the held-back worker; with two it does.
    from protrain_fx.runtime.store import grad_adds

    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))
    store = ChunkStore(_layout(model, 64), _named(model), pin_memory=False)
    per = store.chunk_numel * 4
    store.adds.accumulating(3, store.host_bytes() + spare_chunks * per, store.host_bytes)
    store.adds.accumulating(3, None, store.host_bytes)  # decided once
    assert store.adds.limit == buffers
    release, add = threading.Event(), grad_adds._add

    def held_back(dsts, srcs):
        release.wait(timeout=10)
        add(dsts, srcs)

    monkeypatch.setattr(grad_adds, "_add", held_back)
    with OptimizerWorker(lambda chunk_id: None) as worker:
        store.adds.run = worker.run
        for c in range(3):
            store.write_grad(c, torch.ones(16), accumulate=True)  # nothing held: written here
        threading.Timer(0.05, release.set).start()
        for c in range(3):
            store.write_grad(c, torch.ones(16), accumulate=True)  # adds, held back until the release
        assert (store.adds.staging_wait_s > 0) == (buffers < 3)
        release.set()
        for c in range(3):
            assert torch.equal(store.grad_fp32(c), torch.full((16,), 2.0)), c
    assert store.adds.staging_bytes == buffers * per and store.adds.add_s > 0


def test_a_failed_accumulated_add_is_raised_where_the_gradient_is_waited_for(monkeypatch):
    from protrain_fx.runtime.store import grad_adds

    def broken(dsts, srcs):
        raise RuntimeError("no add")

    monkeypatch.setattr(grad_adds, "_add", broken)
    model = nn.Linear(4, 4, bias=False)
    store = ChunkStore(_layout(model, 64), _named(model), pin_memory=False)
    with OptimizerWorker(lambda chunk_id: None) as worker:
        store.adds.run = worker.run
        store.write_grad(0, torch.randn(16), accumulate=True)
        store.write_grad(0, torch.randn(16), accumulate=True)  # queued: this thread goes on
        with pytest.raises(RuntimeError, match="no add") as failure:
            store.wait_grad(0)
        assert "adding an accumulated gradient into chunk 0" in str(failure.value.__notes__)
        store.wait_grad(0)  # raised once


def test_worker_steps_in_the_background_and_surfaces_errors():
    stepped, release = [], threading.Event()

    def step(chunk_id: int) -> None:
        if chunk_id == 0:
            release.wait(timeout=10)  # still running while the caller goes on
        if chunk_id == 1:
            raise RuntimeError("boom")
        stepped.append(chunk_id)
        if chunk_id == 2:
            done.set()

    done = threading.Event()
    with OptimizerWorker(step) as worker:
        for c in (0, 1, 2):
            worker.submit(c)
        assert stepped == []  # submit does not wait
        release.set()
        assert done.wait(timeout=10)  # chunk 1 failed before chunk 2 ran
        with pytest.raises(RuntimeError, match="boom") as error:
            worker.submit(3)
        assert "stepping chunk 1" in "".join(error.value.__notes__)
        worker.submit(3)  # the error is raised once
        worker.wait_all()
        assert stepped == [0, 2, 3]

        worker.submit(1)
        with pytest.raises(RuntimeError, match="boom"):
            worker.wait(1)
        worker.submit(1)
        with pytest.raises(RuntimeError, match="boom"):
            worker.wait_all()


def test_optimizer_must_be_adam_without_amsgrad():
    model = _model()
    store = ChunkStore(_layout(model, 4096), _named(model), pin_memory=False)
    with pytest.raises(TypeError, match="SGD"):
        ChunkAdamW(store, torch.optim.SGD(model.parameters(), lr=0.1), _named(model))
    with pytest.raises(ValueError, match="amsgrad"):
        ChunkAdamW(
            store, torch.optim.AdamW(model.parameters(), amsgrad=True), _named(model)
        )


def test_buffer_pool_fetches_once_and_refuses_more_than_n_buffer():
    model = _model()
    store = ChunkStore(_layout(model, 4096), _named(model), pin_memory=False)
    waited = []
    pool = ChunkBufferPool(store, 2, "cpu", wait_host=waited.append)
    b0 = pool.acquire(0)
    assert torch.equal(b0, store.flat("working", 0))
    pool.acquire(1)
    with pytest.raises(
        RuntimeError, match=r"all 2 buffers \(n_buffer\) hold chunks in use: \[0, 1\]"
    ):
        pool.acquire(2)
    pool.release(0)
    assert pool.resident(0)
    pool.acquire(1)  # already there: no copy
    assert pool.fetches == 2
    pool.acquire(2)  # takes chunk 0's buffer
    assert not pool.resident(0) and pool.fetches == 3
    assert waited == [0, 1, 2, 1, 2]
    for c in (1, 1, 2):
        pool.release(c)
    with pytest.raises(RuntimeError, match="released but not acquired"):
        pool.release(1)
    pool.acquire(1)
    pool.release(1)
    assert pool.fetches == 3  # resident chunks are not fetched again


def test_buffer_pool_refetches_after_a_step_and_fetches_values_while_a_gradient_is_held():
    model = _model()
    store = ChunkStore(_layout(model, 4096), _named(model), pin_memory=False)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    adam = ChunkAdamW(store, opt, _named(model))
    pool = ChunkBufferPool(store, 1, "cpu")
    c = store.slot("fc1.weight").chunk
    values = store.flat("working", c).clone()
    pool.acquire(c)
    pool.release(c)
    store.write_grads({"fc1.weight": torch.ones(4 * D, D)})
    other = store.slot("fc2.weight").chunk
    pool.acquire(other)  # evicts chunk c
    pool.release(other)
    # the working buffer holds the gradient: the values come from the master
    assert torch.equal(pool.acquire(c), values)
    pool.release(c)
    adam.step_chunk(c)
    assert not torch.equal(pool.acquire(c), values)  # stepped: fetched again
    assert torch.equal(pool.acquire(c), store.flat("working", c))


def test_the_worker_leaves_cores_to_the_threads_driving_the_gpu():
    """Its OpenMP team is the process' less two cores (less one on small machines), at least one,
    set on the worker's own thread: the caller's count stays."""
    from protrain_fx.runtime.optim.cpu_adam import worker_threads

    assert [worker_threads(n) for n in (1, 2, 4, 5, 16, 128)] == [1, 1, 3, 3, 14, 126]
    seen = []
    before = torch.get_num_threads()
    with OptimizerWorker(lambda chunk_id: seen.append(torch.get_num_threads())) as worker:
        worker.submit(0)
        worker.wait(0)
        assert worker.threads == worker_threads(before) and seen == [worker.threads]
    assert torch.get_num_threads() == before
