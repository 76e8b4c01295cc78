"""Memory of a training step as Inductor's generated code allocates it.

Inductor fuses ops into kernels (values inside a kernel never exist in memory), reuses dead buffers
for new ones, writes outputs in place of dying inputs, and may run a fused kernel earlier than the FX
order of its last op. Its wrapper code generator records all of that as memory-planning lines
(allocate, free, reuse) between ``LineContext`` markers that name the FX node being lowered. This
module reads those lines after compilation into a :class:`GraphPlan` per graph (plain data), and
replays the plans of the forward and backward graphs, with the model state around them, into the
same :class:`~protrain_fx.analysis.memory.MemoryAnalysis` the FX-level analysis produces.

Not seen here (as for the FX-level analysis): memory an extern kernel allocates inside itself
(cuBLAS workspaces, attention scratch) and the allocator's block rounding beyond 512 bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.analysis.memory import (
    MemoryAnalysis,
    StepGraphs,
    _Buffer,
    _compute_nodes,
    _mark_forward_output,
    _node_buffer,
    output_args,
    _round,
    analysis_device,
    default_granule,
    finish_analysis,
    model_state,
    step_rows,
)


@dataclass
class PlanRow:
    """What the generated code does while lowering one FX node (``context``): allocations
    ``(buffer name, bytes)``, names it releases, and reuses ``(old name, new name)`` in order."""

    context: str
    # ("alloc", name, (bytes, device type)) | ("free", name, None) | ("alias", old name, new name)
    actions: list[tuple[str, str, Any]] = field(default_factory=list)


@dataclass
class GraphPlan:
    """Inductor's allocation plan of one graph: its input and output names and the rows in order."""

    phase: str
    inputs: tuple[str, ...]
    outputs: tuple[str | None, ...]
    rows: list[PlanRow]


def read_inductor_plan(graph: Any, phase: str) -> GraphPlan:
    """Read the memory-planning lines of a compiled ``GraphLowering`` (after its code was generated)."""
    from torch._inductor.codegen import wrapper as w
    from torch._inductor.ir import MultiOutputLayout, NoneLayout
    from torch._inductor.utils import LineContext

    def nbytes(node: Any) -> tuple[int, str]:
        size = graph.sizevars.size_hint(graph.get_allocation_storage_size(node), fallback=0)
        device = node.get_device()
        return int(size) * node.get_dtype().itemsize, device.type if device is not None else "cpu"

    rows = [PlanRow("<start>")]
    for line in graph.wrapper_code.lines:
        if isinstance(line, LineContext):
            context = getattr(line.context, "name", str(line.context))
            if context != rows[-1].context:
                rows.append(PlanRow(context))
            continue
        if _allocates(line, MultiOutputLayout, w) and any(a[0] == "free" for a in rows[-1].actions):
            # Frees before this allocation happen first: a new row keeps that order in the replay
            # (which counts a row's allocations before its frees).
            rows.append(PlanRow(rows[-1].context))
        actions = rows[-1].actions
        if isinstance(line, w.AllocateLine):
            actions.append(("alloc", line.node.get_name(), nbytes(line.node)))
        elif isinstance(line, w.ReuseLine):
            actions.append(("alias", line.node.get_name(), line.reused_as.get_name()))
            if line.delete_old:
                actions.append(("free", line.node.get_name(), None))
        elif isinstance(line, w.FreeIfNotReusedLine):
            if not line.is_reused:
                actions.append(("free", line.node.get_name(), None))
        elif isinstance(line, w.FreeLine):
            actions.append(("free", line.node.get_name(), None))
        elif isinstance(line, w.ExternKernelAllocLine):
            # NoneLayout: an op that returns nothing (our copy waits, which only mutate an input).
            if not isinstance(line.node.layout, (MultiOutputLayout, NoneLayout)):
                actions.append(("alloc", line.node.get_name(), nbytes(line.node)))
        elif isinstance(line, w.MultiOutputLine):
            actions.append(("alloc", line.result_name, nbytes(graph.get_buffer(line.result_name))))
    outputs = tuple(graph.get_output_names())
    return GraphPlan(phase=phase, inputs=tuple(graph.graph_inputs.keys()), outputs=outputs, rows=rows)


def _allocates(line: Any, multi_output_layout: type, w: Any) -> bool:
    if isinstance(line, (w.AllocateLine, w.MultiOutputLine)):
        return True
    return isinstance(line, w.ExternKernelAllocLine) and not isinstance(line.node.layout, multi_output_layout)


class _PlanWalker:
    """Replays plans: names refer to storages; a storage dies when no name refers to it any more."""

    def __init__(self, buffers: list[_Buffer]) -> None:
        self.buffers = buffers
        self.storage_of: dict[str, _Buffer] = {}
        self.refs: dict[int, int] = defaultdict(int)

    def bind(self, name: str, buf: _Buffer) -> None:
        self.storage_of[name] = buf
        self.refs[id(buf)] += 1

    def release(self, name: str, at: int) -> None:
        buf = self.storage_of.pop(name, None)
        if buf is None:
            return
        self.refs[id(buf)] -= 1
        if self.refs[id(buf)] == 0 and not buf.persistent:
            buf.last_use = max(buf.last_use, at)

    def walk(self, plan: GraphPlan, offset: int, nodes: dict[str, fx.Node], granule: int, keep: set[str],
             device_type: str) -> int:
        """Apply ``plan``'s rows from entry ``offset``; returns the number of rows. Names in ``keep``
        (the graph's outputs) survive the graph; every other name dies when the graph returns."""
        for i, row in enumerate(plan.rows):
            at = offset + i
            node = nodes.get(row.context)
            pooled = node is not None and node.target is getattr(
                getattr(torch.ops.protrain, "chunk_gather", None), "default", None
            )
            for action, a, b in row.actions:
                if action == "alloc":
                    if b[1] != device_type or pooled:  # a host copy; a chunk buffer (model state)
                        continue
                    buf = _node_buffer(("plan", plan.phase, a), _round(b[0], granule), "transient", node, at)
                    self.buffers.append(buf)
                    self.bind(a, buf)
                elif action == "alias" and a in self.storage_of:
                    self.bind(b, self.storage_of[a])
                elif action == "free" and a not in keep:
                    self.release(a, at)
        last = offset + len(plan.rows) - 1
        for name in list(self.storage_of):
            if name not in keep:
                self.release(name, last)
        return len(plan.rows)


def plan_rows(plan: GraphPlan, nodes: dict[str, fx.Node]) -> list[tuple[str, fx.Node | None]]:
    return [(row.context, nodes.get(row.context)) for row in plan.rows]


def analyze_inductor_memory(
    step: StepGraphs,
    plans: dict[str, GraphPlan],
    *,
    optimizer_states_per_param: int = 2,
    device: torch.device | None = None,
    granule: int | None = None,
    label: str = "",
) -> MemoryAnalysis:
    """The step's memory timeline from Inductor's allocation plans of its forward and backward graphs."""
    device = device or analysis_device(step)
    granule = granule if granule is not None else default_granule(device)
    fw_plan = plans.get("forward") or plans.get("inference")
    bw_plan = plans.get("backward")
    if fw_plan is None or (step.backward is not None and bw_plan is None):
        raise ValueError(f"need Inductor plans for every graph of the step, got {sorted(plans)}")
    fw_nodes_by_name = {n.name: n for n in step.forward.graph.nodes}
    bw_nodes_by_name = {n.name: n for n in step.backward.graph.nodes} if step.backward is not None else {}
    rows = step_rows(
        step,
        plan_rows(fw_plan, fw_nodes_by_name),
        plan_rows(bw_plan, bw_nodes_by_name) if bw_plan is not None else [],
    )
    end = len(rows)
    n_fw = len(fw_plan.rows)
    state = model_state(step, device, granule, end, optimizer_states_per_param)
    buffers: list[_Buffer] = list(state.by_storage.values())
    walker = _PlanWalker(buffers)
    for name in fw_plan.inputs:
        for buf in state.by_placeholder.get(name, [])[:1]:
            walker.bind(name, buf)
    walker.walk(fw_plan, 0, fw_nodes_by_name, granule, keep=set(fw_plan.outputs) | set(fw_plan.inputs),
                device_type=device.type)
    fw_out_nodes = output_args(step.forward)
    if len(fw_out_nodes) != len(fw_plan.outputs):
        raise ValueError(
            f"forward graph has {len(fw_out_nodes)} outputs but Inductor's plan {len(fw_plan.outputs)}"
        )
    saved_by_name: dict[str, _Buffer] = {}
    for j, (arg, out_name) in enumerate(zip(fw_out_nodes, fw_plan.outputs)):
        buf = walker.storage_of.get(out_name) if out_name is not None else None
        if buf is None or not isinstance(arg, fx.Node):
            continue
        _mark_forward_output(buf, j < step.num_user_outputs, n_fw, end)
        saved_by_name[arg.name] = buf
    if bw_plan is not None:
        walker = _PlanWalker(buffers)
        for name in bw_plan.inputs:
            if name in saved_by_name:
                walker.bind(name, saved_by_name[name])
            elif name in state.by_placeholder and state.by_placeholder[name]:
                walker.bind(name, state.by_placeholder[name][0])
            elif getattr(bw_nodes_by_name.get(name), "meta", {}).get(meta.OFFLOADED):
                continue  # a parameter held in a host chunk store: no device bytes
            else:  # a tangent, made by autograd for the backward call
                node = bw_nodes_by_name.get(name)
                val = node.meta.get("val") if node is not None else None
                if isinstance(val, torch.Tensor) and val.device == device:
                    nbytes = _round(meta.storage_nbytes(val), granule)
                    buf = _node_buffer(("tangent", name), nbytes, "transient", node, n_fw)
                    buffers.append(buf)
                    walker.bind(name, buf)
        walker.walk(bw_plan, n_fw, bw_nodes_by_name, granule, keep=set(bw_plan.outputs), device_type=device.type)
        for out_name in bw_plan.outputs:
            buf = walker.storage_of.get(out_name) if out_name is not None else None
            if buf is not None and not buf.persistent and buf.alloc >= n_fw:
                buf.category, buf.last_use = "gradient", end - 1
    return finish_analysis(
        step,
        device,
        buffers + state.optimizer,
        rows,
        _compute_nodes(step.forward),
        _compute_nodes(step.backward),
        label,
    )
