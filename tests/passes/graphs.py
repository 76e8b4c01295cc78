"""Small hand-built graphs for the unit tests of each pass, and the record they run on.

The step is a 5-line function of two "blocks" (a matrix product and a relu each) traced by
AOTAutograd into its joint graph and the partitioned forward and backward graphs, the same kinds of
graph the backend hands the passes. One 512x512 fp32 value is exactly 1 MiB, so the memory asserts
are in whole MiB. The module metadata Dynamo would record (``nn_module_stack``) is written by hand
on the forward nodes: ``mm`` and ``relu`` run in ``blocks.0``, ``mm_1`` and ``relu_1`` in
``blocks.1``, the final ``sum`` outside every block. The passes that act on offloaded parameters
read them from a real offload handle of the tiniest model with blocks (:func:`offloaded_mlp`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import protrain_fx
from protrain_fx import meta
from protrain_fx.analysis.memory import StepGraphs
from protrain_fx.capture import Captured, CapturedGraph
from protrain_fx.passes.pipeline import RewrittenStep
from protrain_fx.config import ProtrainConfig

MiB = 2**20
N = 512  # N x N fp32: 1 MiB
#: Forward node -> the block Dynamo would have recorded it in.
BLOCK_OF = {"mm": "blocks.0", "relu": "blocks.0", "mm_1": "blocks.1", "relu_1": "blocks.1",
            "view": "blocks.0", "view_1": "blocks.0"}  # (the views of two_blocks_viewed)


def two_blocks(w0: torch.Tensor, w1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w0)
    y = torch.relu(h @ w1)
    return y.sum()


def two_blocks_viewed(w0: torch.Tensor, w1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`two_blocks` whose first block hands its output on as a view (``view``, ``view_1``)."""
    h = torch.relu(x @ w0).view(N * N).view(N, N)
    y = torch.relu(h @ w1)
    return y.sum()


def module_stack(block: str) -> dict[str, tuple[str, str]]:
    """``nn_module_stack`` as Dynamo records it for a node inside ``block`` (``"blocks.0"``)."""
    key = "L__self___" + block.replace(".", "_")
    return {key: (f"L['self'].{block}", "Block")}


def _with_blocks(gm: fx.GraphModule) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.name in BLOCK_OF and node.meta.get("partitioner_tag") != "is_backward":
            node.meta["nn_module_stack"] = module_stack(BLOCK_OF[node.name])
    return gm


def trace(fn=two_blocks, inputs: tuple[torch.Tensor, ...] | None = None, *, on_joint=None):
    """``fn`` traced by AOTAutograd: ``(joint, forward, backward)`` graph modules, each with the
    blocks written on its forward nodes. ``on_joint(joint)`` runs on the joint graph before the
    min-cut partitioner (where the backend runs its joint passes)."""
    if inputs is None:
        inputs = (torch.randn(N, N, requires_grad=True), torch.randn(N, N, requires_grad=True), torch.randn(N, N))
    graphs: dict[str, fx.GraphModule] = {}

    def keep(name):
        def compiler(gm, _example_inputs):
            graphs[name] = _with_blocks(gm)
            return make_boxed_func(gm)
        return compiler

    def partition(joint, joint_inputs, **kwargs):
        graphs["joint"] = _with_blocks(joint)
        if on_joint is not None:
            on_joint(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition)(
        *inputs).backward()
    return graphs["joint"], graphs["forward"], graphs["backward"]


def record_for(
    forward: fx.GraphModule | None = None,
    backward: fx.GraphModule | None = None,
    *,
    joint: fx.GraphModule | None = None,
    inference: fx.GraphModule | None = None,
    state_inputs: frozenset[str] = frozenset({"primals_1", "primals_2"}),
    example_inputs: tuple = (),
    config: ProtrainConfig | None = None,
    inductor_plans: dict | None = None,
) -> CapturedGraph:
    """The smallest record the passes read: its graphs and, when there is a forward graph, the
    step's description (one user output: the loss). A test stores what the passes return in
    ``record.rewritten``, as the backend does."""
    graph = forward if forward is not None else inference if inference is not None else joint
    step_forward = forward if forward is not None else inference
    step = None
    if step_forward is not None:
        trainable = state_inputs if backward is not None else frozenset()
        step = StepGraphs(step_forward, backward, 1, state_inputs, trainable)
    return CapturedGraph(
        Captured(index=0, config=config or ProtrainConfig(), dynamo_graph=graph, example_inputs=example_inputs),
        RewrittenStep(joint=joint, forward=forward, backward=backward, inference=inference, step=step,
                      inductor_plans=inductor_plans or {}))


def nodes_made_by(gm: fx.GraphModule, made_by: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(meta.MADE_BY) == made_by]


def outputs(gm: fx.GraphModule) -> list:
    """The graph's output values (nodes, or ``None``)."""
    return list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class TwoBlockMLP(nn.Module):
    """The tiniest model with repeated blocks: two bias-free linear layers with a relu each."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def offloaded_mlp(width: int = 64):
    """A :class:`TwoBlockMLP` whose parameters an offload handle holds on the CPU, one chunk per
    block, two chunk buffers: ``(model, handle, [weight of block 0, weight of block 1])``. Keep
    the handle referenced while its parameters are in use."""
    model = TwoBlockMLP(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = protrain_fx.offload(model, optimizer, device="cpu", n_persist=0, n_buffer=2,
                                 chunk_bytes=width * width * 4)
    return model, handle, [block.fc.weight for block in model.blocks]


def graph_text(*graphs: fx.GraphModule | None) -> list[str]:
    """The graphs as text, to check that a pass left them as they were."""
    return [str(g.graph) if g is not None else "" for g in graphs]
