"""Block attribution: every forward and backward node is tagged with its transformer block (or "outside")."""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch import nn

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx import meta
from protrain_fx.analysis.blocks import normalize_module_path

N_LAYER = 3
CONFIG = gpt_config("tiny", n_layer=N_LAYER)
LABELS = tuple(f"blocks.{i}" for i in range(N_LAYER))

_VIEWS = {
    torch.ops.aten.t.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.reshape.default,
}
_MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _compute(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _ops(nodes) -> Counter:
    return Counter(str(n.target) for n in nodes)


def _by_block(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    out: dict[str, list[fx.Node]] = {}
    for n in _compute(gm):
        out.setdefault(n.meta[meta.BLOCK], []).append(n)
    return out


@functools.lru_cache(maxsize=None)
def _gpt_record():
    """Compile and run one training step of the tiny GPT (3 blocks) with eager codegen; cached per session."""
    torch._dynamo.reset()
    protrain_fx.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    x, y = random_batch(CONFIG, 2, 16, generator=torch.Generator().manual_seed(0))
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(x, y).backward()
    records = protrain_fx.captured_graphs()
    assert len(records) == 1
    protrain_fx.reset()
    torch._dynamo.reset()
    return records[0]


def _param_placeholders(record) -> dict[str, str]:
    """Dynamo placeholder name (``l_self_modules_blocks_modules_0_..._weight_``) -> forward placeholder name.

    AOTAutograd's ``primals_i`` are the Dynamo graph's inputs in order.
    """
    dyn = [n for n in record.dynamo_graph.graph.nodes if n.op == "placeholder"]
    fwd = [n for n in record.forward.graph.nodes if n.op == "placeholder"]
    assert len(dyn) == len(fwd)
    return {d.name: f.name for d, f in zip(dyn, fwd)}


def _mm_users(node: fx.Node) -> list[fx.Node]:
    """Matmuls reached from ``node`` through views only."""
    found, todo = [], list(node.users)
    while todo:
        u = todo.pop()
        if u.target in _MM:
            found.append(u)
        elif u.target in _VIEWS:
            todo += list(u.users)
    return found


def _mm_producer(node: fx.Node) -> fx.Node | None:
    """The matmul that ``node`` is a view of, if any."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node if node.op == "call_function" and node.target in _MM else None


def _weight_grads(record) -> dict[str, fx.Node]:
    """Forward placeholder name -> backward node producing its gradient."""
    fwd = [n for n in record.forward.graph.nodes if n.op == "placeholder"]
    out = next(n for n in reversed(record.backward.graph.nodes) if n.op == "output")
    return {p.name: g for p, g in zip(fwd, out.args[0]) if isinstance(g, fx.Node)}


# --------------------------------------------------------------------------- our GPT


def test_gpt_blocks_found_in_order() -> None:
    record = _gpt_record()
    assert record.blocks.container == "blocks"
    assert record.blocks.layer_class == "Block"
    assert record.blocks.labels == LABELS
    assert [record.blocks.order(lab) for lab in LABELS] == list(range(N_LAYER))
    assert record.blocks.order(meta.OUTSIDE) == N_LAYER


def test_a_model_of_one_layer_has_that_layer_as_its_block() -> None:
    """No container repeats in a model built with one layer: its one indexed child is the block (else
    nothing could be planned or offloaded for it)."""
    config = gpt_config("tiny", n_layer=1)
    torch.manual_seed(0)
    x, y = random_batch(config, 2, 16, generator=torch.Generator().manual_seed(0))
    torch.compile(GPT(config), backend="protrain", options={"codegen": "eager"})(x, y).backward()
    (record,) = protrain_fx.captured_graphs()
    assert (record.blocks.container, record.blocks.labels) == ("blocks", ("blocks.0",))


def test_gpt_every_node_has_block_and_phase() -> None:
    record = _gpt_record()
    allowed = set(LABELS) | {meta.OUTSIDE}
    for phase, gm in (("forward", record.forward), ("backward", record.backward)):
        for n in gm.graph.nodes:
            if n.op == "output":
                continue
            assert n.meta.get(meta.PHASE) == phase, (phase, n.name)
            assert n.meta.get(meta.BLOCK) in allowed, (phase, n.name, n.meta.get(meta.BLOCK))
        # Every block appears in each graph; forward runs them in order, backward in reverse.
        first_seen = list(dict.fromkeys(n.meta[meta.BLOCK] for n in _compute(gm) if n.meta[meta.BLOCK] != meta.OUTSIDE))
        assert first_seen == (list(LABELS) if phase == "forward" else list(reversed(LABELS))), phase


def test_gpt_forward_nodes_per_block_are_identical() -> None:
    by_block = _by_block(_gpt_record().forward)
    counts = {lab: _ops(by_block[lab]) for lab in LABELS}
    assert sum(counts[LABELS[0]].values()) > 30  # a whole block, not a few stray nodes
    for lab in LABELS[1:]:
        assert counts[lab] == counts[LABELS[0]], (lab, counts[lab] - counts[LABELS[0]], counts[LABELS[0]] - counts[lab])


def test_gpt_backward_nodes_of_interior_blocks_are_identical() -> None:
    by_block = _by_block(_gpt_record().backward)
    counts = {lab: _ops(by_block[lab]) for lab in LABELS}
    assert sum(counts[LABELS[1]].values()) > 40
    for lab in LABELS[2:]:
        assert counts[lab] == counts[LABELS[1]], lab


def test_gpt_backward_nodes_per_block_are_identical() -> None:
    by_block = _by_block(_gpt_record().backward)
    counts = {lab: _ops(by_block[lab]) for lab in LABELS}
    for lab in LABELS[1:]:
        assert counts[lab] == counts[LABELS[0]], (lab, counts[LABELS[0]] - counts[lab])


def test_gpt_position_embedding_gradient_is_outside() -> None:
    record = _gpt_record()
    names = _param_placeholders(record)
    wpe = names["l_self_modules_wpe_parameters_weight_"]
    grad = _weight_grads(record)[wpe]
    assert grad.target == torch.ops.aten.embedding_dense_backward.default
    assert grad.meta[meta.BLOCK] == meta.OUTSIDE
    # Its incoming gradient is the reduction over the batch of the broadcast in `wte(idx) + wpe(pos)`.
    upstream = []
    todo = [grad.args[0]]
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.target not in (torch.ops.aten.sum.dim_IntList, *_VIEWS):
            continue
        upstream.append(n)
        todo += list(n.all_input_nodes)
    assert upstream, grad.args
    assert {n.meta[meta.BLOCK] for n in upstream} == {meta.OUTSIDE}, [(n.name, n.meta[meta.BLOCK]) for n in upstream]


def test_gpt_embedding_head_and_loss_are_outside() -> None:
    record = _gpt_record()
    outside_ops = {
        "forward": {
            torch.ops.aten.embedding.default,
            torch.ops.aten.mm.default,  # the tied LM head (block Linears are addmm)
            torch.ops.aten._log_softmax.default,
            torch.ops.aten.nll_loss_forward.default,
            torch.ops.aten.arange.default,
        },
        "backward": {
            torch.ops.aten.embedding_dense_backward.default,
            torch.ops.aten._log_softmax_backward_data.default,
            torch.ops.aten.nll_loss_backward.default,
        },
    }
    for phase, gm in (("forward", record.forward), ("backward", record.backward)):
        seen = Counter()
        for n in _compute(gm):
            if n.target in outside_ops[phase]:
                seen[n.target] += 1
                assert n.meta[meta.BLOCK] == meta.OUTSIDE, (phase, n.name)
        assert set(seen) == outside_ops[phase], (phase, seen)
    assert _ops(n for n in _compute(record.forward) if n.target == torch.ops.aten.embedding.default) == {
        "aten.embedding.default": 2
    }

    # Final LayerNorm (ln_f) forward and backward, and the LM head matmuls in backward, are outside.
    names = _param_placeholders(record)
    ln_f = names["l_self_modules_ln_f_parameters_weight_"]
    wte = names["l_self_modules_wte_parameters_weight_"]
    fwd_nodes = {n.name: n for n in record.forward.graph.nodes}
    bwd_nodes = {n.name: n for n in record.backward.graph.nodes}
    for node in (fwd_nodes[ln_f], bwd_nodes[ln_f]):
        users = [u for u in node.users if u.op != "output"]  # the forward also returns it, saved for backward
        assert users and {u.meta[meta.BLOCK] for u in users} == {meta.OUTSIDE}
    head_mms = _mm_users(bwd_nodes[wte])
    assert head_mms and {m.meta[meta.BLOCK] for m in head_mms} == {meta.OUTSIDE}
    wte_grad = _weight_grads(record)[wte]
    assert wte_grad.meta[meta.BLOCK] == meta.OUTSIDE  # embedding grad + head grad (tied weight)


_BLOCK_LINEAR = re.compile(
    r"^l_self_modules_blocks_modules_(\d+)_modules_(attn_modules_qkv|attn_modules_proj|mlp_modules_fc|mlp_modules_proj)"
    r"_parameters_weight_$"
)


def test_gpt_block_matmuls_are_attributed_to_their_block() -> None:
    """The matmuls using block i's weights (forward addmm, backward input-grad and weight-grad mm) are in block i."""
    record = _gpt_record()
    names = _param_placeholders(record)
    fwd_nodes = {n.name: n for n in record.forward.graph.nodes}
    bwd_nodes = {n.name: n for n in record.backward.graph.nodes}
    grads = _weight_grads(record)
    checked = Counter()
    for dyn_name, placeholder in names.items():
        m = _BLOCK_LINEAR.match(dyn_name)
        if not m:
            continue
        label, which = f"blocks.{m.group(1)}", m.group(2)

        (fwd_mm,) = _mm_users(fwd_nodes[placeholder])
        assert fwd_mm.target == torch.ops.aten.addmm.default
        assert fwd_mm.meta[meta.BLOCK] == label, (which, fwd_mm.name)

        (input_grad_mm,) = _mm_users(bwd_nodes[placeholder])  # grad_out @ W
        assert input_grad_mm.meta[meta.PHASE] == "backward"
        assert input_grad_mm.meta[meta.BLOCK] == label, (which, input_grad_mm.name, input_grad_mm.meta[meta.BLOCK])

        weight_grad_mm = _mm_producer(grads[placeholder])  # grad_out^T @ x
        assert weight_grad_mm is not None and weight_grad_mm is not input_grad_mm
        assert weight_grad_mm.meta[meta.BLOCK] == label, (which, weight_grad_mm.name, weight_grad_mm.meta[meta.BLOCK])
        assert grads[placeholder].meta[meta.BLOCK] == label
        checked[which] += 1
    assert checked == {w: N_LAYER for w in ("attn_modules_qkv", "attn_modules_proj", "mlp_modules_fc", "mlp_modules_proj")}

    # All mm nodes of the backward graph are either a block's Linear or the (outside) LM head.
    bwd_mms = [n for n in _compute(record.backward) if n.target == torch.ops.aten.mm.default]
    assert Counter(n.meta[meta.BLOCK] for n in bwd_mms) == {**{lab: 8 for lab in LABELS}, meta.OUTSIDE: 2}


def test_memory_table_has_one_row_per_block() -> None:
    record = _gpt_record()
    assert record.memory is not None
    rows = {b.block: b for b in record.memory.blocks}
    for lab in LABELS:
        assert lab in rows
        assert rows[lab].forward_nodes > 0 and rows[lab].backward_nodes > 0
    assert len({rows[lab].parameter_bytes for lab in LABELS}) == 1  # identical blocks, identical weights


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("L['self'].blocks.0.attn", "blocks.0.attn"),
        ("L['self']._modules['blocks']._modules['0']", "blocks.0"),
        ("L['self'].transformer.h.1", "transformer.h.1"),
        ("L['self']", ""),
        ("L['mod'].model.layers.3.mlp", "model.layers.3.mlp"),
        ("L['args'][0].model.layers.0", "model.layers.0"),  # forward wrapped by a (*args, **kwargs) decorator
    ],
)
def test_normalize_module_path(path: str, expected: str) -> None:
    assert normalize_module_path(path) == expected


class _TopLevelOps(nn.Module):
    """Top-level (module-less) ops before and after a repeated container."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2 + self.pos  # broadcast: pos's gradient is a sum over the batch
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _compile_once(model: nn.Module, *inputs: torch.Tensor):
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(*inputs).backward()
    (record,) = protrain_fx.captured_graphs()
    return record


def test_top_level_ops_forward_is_outside() -> None:
    record = _compile_once(_TopLevelOps(), torch.randn(3, 4))
    assert record.blocks.container == "layers" and record.blocks.labels == ("layers.0", "layers.1")
    fwd = _compute(record.forward)
    assert [n.meta[meta.BLOCK] for n in fwd if n.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.sum.default)] == [
        meta.OUTSIDE,
        meta.OUTSIDE,
    ]


def test_top_level_ops_backward_is_outside() -> None:
    record = _compile_once(_TopLevelOps(), torch.randn(3, 4))
    (pos,) = [f for d, f in _param_placeholders(record).items() if d.endswith("_parameters_pos_")]
    pos_grad = _weight_grads(record)[pos]
    assert tuple(pos_grad.meta["val"].shape) == (4,)
    chain = [pos_grad]
    while chain[-1].op == "call_function" and chain[-1].target in (torch.ops.aten.sum.dim_IntList, *_VIEWS):
        chain.append(chain[-1].args[0])
    expand = [n for n in _compute(record.backward) if n.target == torch.ops.aten.expand.default]
    assert len(chain) >= 2 and len(expand) == 1
    tagged = {n.name: n.meta[meta.BLOCK] for n in chain[:-1] + expand}
    assert set(tagged.values()) == {meta.OUTSIDE}, tagged


def _passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class _DecoratedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    @_passthrough  # as transformers 5 does for LlamaForCausalLM.forward: Dynamo sees self as L['args'][0]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_decorated_forward_container_name() -> None:
    record = _compile_once(_DecoratedForward(), torch.randn(2, 4))
    assert record.blocks.container == "layers"
    assert record.blocks.labels == ("layers.0", "layers.1")


# --------------------------------------------------------------------------- Hugging Face models


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=128, bos_token_id=0, eos_token_id=0, use_cache=False)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=64,
            # GPT-2 defaults to dropout 0.1 and a freshly built model is in train mode: no randomness here.
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        cls_config, cls_model = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[kind]
        config = cls_config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, **common,
        )
        model = cls_model(config)
    model.loss_type = "ForCausalLM"  # avoids a graph break in the loss-type lookup
    return model


@functools.lru_cache(maxsize=None)
def _hf_run(kind: str):
    """One training step of a tiny HF model, compiled (eager codegen) and eager; cached per session."""
    model = _hf_model(kind)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    protrain_fx.reset()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="protrain", options={"codegen": "eager"})
    out = compiled(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    ref_out = ref(input_ids=ids, labels=ids, use_cache=False)
    ref_out.loss.backward()
    records = protrain_fx.captured_graphs()
    protrain_fx.reset()
    torch._dynamo.reset()
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    return records, (out.loss.detach(), ref_out.loss.detach()), grads, ref_grads


_HF = {
    "gpt2": ("transformer.h", "GPT2Block"),
    "llama": ("model.layers", "LlamaDecoderLayer"),
    "mistral": ("model.layers", "MistralDecoderLayer"),
}
@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_hf_single_training_graph_with_blocks(kind: str) -> None:
    records, _, _, _ = _hf_run(kind)
    assert len(records) == 1, [(r.describe(), r.graph_breaks_after) for r in records]
    (record,) = records
    assert record.backward is not None and record.graph_breaks_after == ()
    container, layer_class = _HF[kind]
    assert record.blocks.layer_class == layer_class
    assert len(record.blocks.labels) == 2
    assert record.blocks.labels[0].endswith(container + ".0") and record.blocks.labels[1].endswith(container + ".1")
    allowed = set(record.blocks.labels) | {meta.OUTSIDE}
    for phase, gm in (("forward", record.forward), ("backward", record.backward)):
        by_block = _by_block(gm)
        for n in _compute(gm):
            assert n.meta.get(meta.PHASE) == phase and n.meta.get(meta.BLOCK) in allowed, (phase, n.name)
        for lab in record.blocks.labels:
            assert len(by_block.get(lab, ())) > 20, (phase, lab)  # each block owns a whole layer's ops


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_hf_container_and_labels(kind: str) -> None:
    (record,) = _hf_run(kind)[0]
    container, layer_class = _HF[kind]
    assert record.blocks.container == container
    assert record.blocks.labels == (f"{container}.0", f"{container}.1")
    assert record.blocks.layer_class == layer_class


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_hf_loss_and_grads_equal_eager(kind: str) -> None:
    _, (loss, ref_loss), grads, ref_grads = _hf_run(kind)
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert grads[name] is not None and ref_grads[name] is not None, name
        assert torch.equal(grads[name], ref_grads[name]), (name, (grads[name] - ref_grads[name]).abs().max().item())
