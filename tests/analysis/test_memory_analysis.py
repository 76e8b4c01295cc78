"""The memory analysis against bytes computed by hand, and against the liveness of a real run.

Sizes are chosen so that one 512x512 fp32 tensor is exactly 1 MiB: asserts are in whole MiB.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.analysis.memory import StepGraphs, analyze_memory

MiB = 2**20


def _analyze_fn(fn, *inputs, user_outputs=1, granule=None):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    step = StepGraphs(gm, None, user_outputs, frozenset(), frozenset())
    return analyze_memory(step, granule=granule)


def _by_name(analysis):
    return {e.name: e for e in analysis.timeline.entries}


def test_views_and_inplace_add_no_bytes():
    def f(x):
        a = x * 2  # +1 MiB
        b = a.view(-1)  # view: +0
        c = b + 1  # +1 MiB; a dies after this node (its view b's last use)
        c.mul_(3)  # in place: +0
        d = c.view(512, 512).t()  # views: +0
        return d.sum()  # +4 B; c dies

    m = _analyze_fn(f, torch.randn(512, 512))
    e = _by_name(m)
    assert m.timeline.baseline_bytes["input"] == 1 * MiB
    assert (e["mul"].alloc_bytes, e["mul"].peak_bytes, e["mul"].live_bytes) == (MiB, 2 * MiB, 2 * MiB)
    assert e["view"].alloc_bytes == 0
    assert (e["add"].peak_bytes, e["add"].live_bytes, e["add"].freed_bytes) == (3 * MiB, 2 * MiB, MiB)
    for name in ("mul_", "view_1", "t"):
        assert (e[name].alloc_bytes, e[name].freed_bytes, e[name].live_bytes) == (0, 0, 2 * MiB)
    assert (e["sum_1"].alloc_bytes, e["sum_1"].live_bytes) == (4, MiB + 4)
    assert m.peak_bytes == 3 * MiB
    assert m.peak_entry.name == "add"


def test_multi_output_ops_and_split_views():
    def f(x):
        y = x * 1  # +1 MiB
        top, bottom = torch.chunk(y, 2)  # two views of y: +0
        var, mean = torch.var_mean(top, dim=1)  # two new 256-float buffers: +2 KiB
        return (bottom.sum() + var.sum() + mean.sum(),)

    m = _analyze_fn(f, torch.randn(512, 512))
    e = _by_name(m)
    assert e["mul"].alloc_bytes == MiB
    assert e["split"].alloc_bytes == 0
    assert e["var_mean"].alloc_bytes == 2 * 256 * 4
    # y stays live while its second half (bottom) is still to be read.
    assert m.peak_bytes == MiB + MiB + 2 * 1024 + 4
    assert e["getitem_2"].alloc_bytes == 0 and e["getitem_3"].alloc_bytes == 0


def test_cuda_granule_rounds_each_buffer():
    def f(x):
        return (x + 1).sum()  # +1 MiB, +4 B -> +512 B with the CUDA granule

    m = _analyze_fn(f, torch.randn(512, 512), granule=512)
    assert _by_name(m)["sum_1"].alloc_bytes == 512


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(512, 512, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum()


def test_train_step_by_hand():
    """A bias-free 512x512 Linear + relu + sum, through the backend, AdamW state counted."""
    model = _Linear()
    x = torch.randn(512, 512)
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(x).backward()
    (record,) = protrain_fx.captured_graphs()
    m = record.memory
    # Model state and input: W 1 MiB, AdamW exp_avg + exp_avg_sq 2 MiB, x 1 MiB.
    assert (m.parameter_bytes, m.optimizer_state_bytes, m.input_bytes) == (MiB, 2 * MiB, MiB)
    assert m.gradient_bytes == MiB
    assert m.saved_activation_bytes == MiB  # relu's output, for threshold_backward
    e = _by_name(m)
    assert e["mm"].live_bytes == 5 * MiB  # state 4 + mm
    assert e["relu"].peak_bytes == 6 * MiB and e["relu"].live_bytes == 5 * MiB  # mm dies, relu saved
    # backward: tangent (4 B) + relu-grad (1 MiB) while relu is still live ...
    assert e["threshold_backward"].peak_bytes == 6 * MiB + 4 + 4
    # ... then grad W (1 MiB) while relu-grad is live, loss (4 B) still held by the user.
    assert e["mm_1"].peak_bytes == 6 * MiB + 4
    assert m.peak_bytes == 6 * MiB + 8
    assert m.timeline.entries[-1].phase == "optimizer"
    assert m.timeline.entries[-1].live_bytes == 4 * MiB + 4  # gradient released after the step


def test_optimizer_option_changes_state_bytes():
    x = torch.randn(512, 512)
    for optimizer, states in (("sgd", 0), ("sgd_momentum", 1), ("adamw", 2)):
        torch._dynamo.reset()
        protrain_fx.reset()
        model = _Linear()
        torch.compile(model, backend="protrain", options={"codegen": "eager", "optimizer": optimizer})(x).backward()
        assert protrain_fx.captured_graphs()[0].memory.optimizer_state_bytes == states * MiB


def test_frozen_parameters_get_no_state_or_grad():
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False))
    model[0].weight.requires_grad_(False)
    x = torch.randn(512, 512)
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(x).sum().backward()
    m = protrain_fx.captured_graphs()[0].memory
    assert m.parameter_bytes == 2 * MiB
    assert m.optimizer_state_bytes == 2 * MiB  # one trainable weight x 2 AdamW states
    assert m.gradient_bytes == MiB


class _LiveStorages(fx.Interpreter):
    """Runs a graph node by node, freeing values at their last use (as the generated code does), and
    records the bytes of distinct storages still alive after each node, among the tensors the graph
    produced (not the persistent ones)."""

    def __init__(self, gm, produced, persistent_ptrs, samples):
        super().__init__(gm, garbage_collect_values=True)
        self.produced, self.persistent, self.samples = produced, persistent_ptrs, samples
        self.started = False

    def live_bytes(self):
        storages = {}
        for ref in self.produced:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in self.persistent:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def run_node(self, n):
        if n.op not in ("placeholder", "output"):
            if self.started:
                self.samples.append(self.live_bytes())  # after the previous node's frees
            self.started = True
        out = super().run_node(n)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.produced.append(weakref.ref(t))
        return out


def test_liveness_matches_a_real_run_of_the_gpt():
    """Bytes live after every node of the tiny GPT's forward and backward, as predicted, equal what
    a real run holds when each value is released at its last use."""
    torch.manual_seed(0)
    cfg = gpt_config("tiny")
    model = GPT(cfg)
    idx, targets = random_batch(cfg, 2, 32, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(copy.deepcopy(model), backend="protrain", options={"codegen": "eager"})
    compiled(idx, targets).backward()
    (record,) = protrain_fx.captured_graphs()
    inputs = record.real_inputs()
    assert all(x is not None for x in inputs)
    persistent = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}

    produced, samples = [], []
    with torch.no_grad():
        fw = _LiveStorages(record.forward, produced, persistent, samples)
        outs = list(fw.boxed_run(list(inputs)))
        samples.append(fw.live_bytes())
        fw.env.clear()  # the interpreter keeps the output tuple; the generated code does not
        n_user = record.step.num_user_outputs
        by_name = dict(zip([a.name for a in _outputs(record.forward)], outs))
        bw_args = []
        for node in record.backward.graph.nodes:
            if node.op == "placeholder":
                if node.name.startswith("tangents"):
                    tangent = torch.ones_like(outs[0])
                    produced.append(weakref.ref(tangent))
                    bw_args.append(tangent)
                elif node.name in by_name:
                    bw_args.append(by_name[node.name])
                else:
                    bw_args.append(inputs[int(node.name.split("_")[1]) - 1])
        user = outs[:n_user]
        del outs, by_name, tangent
        bw = _LiveStorages(record.backward, produced, persistent, samples)
        grads = bw.boxed_run(bw_args)
        samples.append(bw.live_bytes())
        del user, grads

    base = sum(record.memory.timeline.baseline_bytes.values())
    predicted = [e.live_bytes - base for e in record.memory.timeline.entries if e.phase != "optimizer"]
    assert len(predicted) == len(samples)
    assert predicted == samples


def _outputs(gm):
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(out.args[0])
