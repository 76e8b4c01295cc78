"""Which graphs the backend captures: graph breaks, inference (no backward), a compiled optimizer step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch

CONFIG = gpt_config("tiny")


class _BrokenMLP(nn.Module):
    """Two halves with a forced graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
        self.second = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h).pow(2).mean()


def _placeholder_sources(record) -> str:
    return " ".join(n.name for n in record.dynamo_graph.graph.nodes if n.op == "placeholder")


def _run_broken(steps: int = 2):
    torch.manual_seed(0)
    model = _BrokenMLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        loss, ref_loss = compiled(x), ref(x)
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), step
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.grad is not None and torch.equal(p.grad, q.grad), (step, name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return protrain_fx.captured_graphs()


def test_graph_break_gives_two_training_graphs_with_correct_grads() -> None:
    records = _run_broken()
    assert len(records) == 2, [r.describe() for r in records]  # no recompiles on the second step
    first, second = records
    assert "first" in _placeholder_sources(first) and "second" not in _placeholder_sources(first)
    assert "second" in _placeholder_sources(second) and "first" not in _placeholder_sources(second)
    for record in records:
        assert record.forward is not None and record.backward is not None and record.inference is None
    # The break is reported, once, with Dynamo's reason.
    reasons = protrain_fx.graph_break_reasons()
    assert len(reasons) == 1 and "graph_break()" in reasons[0], reasons
    assert sum(len(r.graph_breaks_after) for r in records) == 1


def test_graph_break_is_reported_on_the_graph_it_ends() -> None:
    """Dynamo counts a break before it compiles the graph the break ends."""
    first, second = _run_broken(steps=1)
    assert len(first.graph_breaks_after) == 1 and "graph_break()" in first.graph_breaks_after[0]
    assert second.graph_breaks_after == ()


def test_reset_forgets_graph_breaks() -> None:
    _run_broken(steps=1)
    assert protrain_fx.graph_break_reasons()
    protrain_fx.reset()
    assert protrain_fx.captured_graphs() == [] and protrain_fx.graph_break_reasons() == []
    # Without a new break, a new graph reports none (the old counter values are not reported again).
    torch.compile(nn.Linear(3, 3), backend="protrain", options={"codegen": "eager"})(torch.randn(2, 3)).sum().backward()
    (record,) = protrain_fx.captured_graphs()
    assert record.graph_breaks_after == ()


# --------------------------------------------------------------------------- inference


def _inference_record():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    x, _ = random_batch(CONFIG, 2, 16, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    with torch.no_grad():
        out = compiled(x)
        ref = model(x)
    (record,) = protrain_fx.captured_graphs()
    return model, out, ref, record


def test_inference_under_no_grad() -> None:
    model, out, ref, record = _inference_record()
    assert not out.requires_grad
    assert torch.equal(out, ref)
    assert record.inference is not None
    assert record.backward is None and record.forward is None and not record.has_backward
    assert "inference" in record.describe()
    # Passes ran on the inference graph too.
    assert record.blocks.container == "blocks" and record.blocks.labels == ("blocks.0", "blocks.1")
    from protrain_fx import meta

    for n in record.inference.graph.nodes:
        if n.op == "call_function":
            assert n.meta[meta.PHASE] == "forward" and meta.BLOCK in n.meta, n.name
    assert record.memory is not None and record.memory.gradient_bytes == 0
    assert record.memory.saved_activation_bytes == 0


def test_inference_memory_counts_parameters() -> None:
    model, _, _, record = _inference_record()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weight counted once
    assert record.step.state_inputs
    assert record.memory.parameter_bytes == param_bytes


# --------------------------------------------------------------------------- compiled optimizer step


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _optimizer_run(kind: str, backend: str | None, options: dict | None = None, steps: int = 3):
    """Train a small Linear ``steps`` times; ``backend=None`` runs ``opt.step`` uncompiled."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = _optimizer(kind, model.parameters())
    step = opt.step if backend is None else torch.compile(opt.step, backend=backend, options=options)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model(torch.randn(5, 8, generator=g)).pow(2).sum().backward()
        step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_compiled_optimizer_step(kind: str) -> None:
    params = _optimizer_run(kind, "protrain", {"codegen": "eager"})
    records = protrain_fx.captured_graphs()
    assert records, "the optimizer step was not captured"
    for record in records:
        assert record.inference is not None and record.backward is None  # no backward for an update
        assert record.memory is not None
    # Bit-identical to the same Dynamo capture run by AOTAutograd's own eager backend ...
    torch._dynamo.reset()
    for p, q in zip(params, _optimizer_run(kind, "aot_eager")):
        assert torch.equal(p, q)
    # ... and equal to uncompiled PyTorch up to a rounding or two: Dynamo itself rewrites
    # ``p.add_(g, alpha=-lr)`` into ``p.add_(g * -lr)`` (two roundings instead of one fused op), which
    # plain backend="eager" shows as well; tolerances are float32's defaults.
    for p, q in zip(params, _optimizer_run(kind, None)):
        torch.testing.assert_close(p, q)
    for p, q in zip(params, _optimizer_run(kind, None, steps=0)):
        assert not torch.equal(p, q)  # it did train


def test_compiled_optimizer_step_inductor() -> None:
    params = _optimizer_run("adamw", "protrain")  # default codegen: Inductor
    assert all(r.config.codegen == "inductor" and r.inference is not None for r in protrain_fx.captured_graphs())
    for p, q in zip(params, _optimizer_run("adamw", None)):
        torch.testing.assert_close(p, q)
