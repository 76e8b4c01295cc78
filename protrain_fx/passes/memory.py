"""Memory analysis: tensor liveness over a whole training step, predicted from the captured graphs.

The step is: forward graph, backward graph, optimizer step. Model states (parameters, optimizer state)
and the user's inputs are live throughout; gradients appear as the backward graph produces them and
stay live through the optimizer step; activations saved by the forward graph live until their last use
in the backward graph; every other value lives from the node that allocates it to its last use.
Aliasing is handled by storage: a view, ``detach`` or in-place op adds no bytes, and a storage dies
only when the last value on it is no longer used.

Pure analysis: graphs are read, never changed (``meta.BLOCK`` must have been written before, for the
per-block numbers).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.timeline import BufferEvent, Timeline, TimelineEntry

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes, and
#: ``torch.cuda.memory_allocated`` counts the rounded sizes.
CUDA_ALLOCATION_GRANULE = 512


@dataclass(frozen=True)
class StepGraphs:
    """The partitioned graphs of one captured training step and what the analysis must know about them.

    Attributes:
        forward: the forward graph (or the only graph, for inference).
        backward: the backward graph, ``None`` for a graph with no backward.
        num_user_outputs: leading outputs of ``forward`` returned to the user (loss, logits, mutated
            inputs); the rest are values saved for the backward graph.
        state_inputs: names of ``forward`` placeholders that are model state (parameters, buffers).
        trainable_inputs: the subset of ``state_inputs`` that get a gradient (and optimizer state).
    """

    forward: fx.GraphModule
    backward: fx.GraphModule | None
    num_user_outputs: int
    state_inputs: frozenset[str]
    trainable_inputs: frozenset[str]


@dataclass(frozen=True)
class BlockMemory:
    """Per-block numbers of the inspection table (bytes on the analysed device)."""

    block: str
    parameter_bytes: int
    saved_activation_bytes: int
    transient_peak_bytes: int
    forward_nodes: int
    backward_nodes: int


@dataclass(frozen=True)
class MemoryAnalysis:
    """Result of :func:`analyze_memory`.

    ``peak_bytes`` is the largest ``peak_bytes`` over the timeline's entries: model states and inputs,
    plus every live graph value, while the peak node runs.
    """

    device: str
    timeline: Timeline
    peak_bytes: int
    peak_entry: TimelineEntry | None
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    input_bytes: int
    saved_activation_bytes: int
    blocks: tuple[BlockMemory, ...] = field(default=())


@dataclass
class _Buffer:
    key: int
    nbytes: int
    category: str
    name: str
    source: str
    alloc: int  # entry index (baseline: 0)
    last_use: int
    persistent: bool = False  # lives through the whole step (model state, inputs)
    block: str = meta.OUTSIDE


def _round(n: int, granule: int) -> int:
    return -(-n // granule) * granule if granule > 1 else n


def _compute_nodes(gm: fx.GraphModule | None) -> list[fx.Node]:
    if gm is None:
        return []
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _output_args(gm: fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def analysis_device(step: StepGraphs) -> torch.device:
    """The device whose memory is analysed: where most model-state bytes are (else the first input's)."""
    weight: dict[torch.device, int] = defaultdict(int)
    first = None
    for node in step.forward.graph.nodes:
        if node.op != "placeholder":
            continue
        for t in meta.tensor_values(node):
            first = first or t.device
            if node.name in step.state_inputs:
                weight[t.device] += meta.tensor_nbytes(t)
    if weight:
        return max(weight, key=weight.get)
    return first or torch.device("cpu")


def analyze_memory(
    step: StepGraphs,
    *,
    optimizer_states_per_param: int = 2,
    device: torch.device | None = None,
    granule: int | None = None,
    label: str = "",
) -> MemoryAnalysis:
    """Predict the memory timeline and peak of one training step on ``device``.

    ``granule`` rounds every buffer up (defaults to the CUDA allocator's 512 bytes on CUDA, 1 elsewhere).
    """
    device = device or analysis_device(step)
    if granule is None:
        granule = CUDA_ALLOCATION_GRANULE if device.type == "cuda" else 1
    fw_nodes = _compute_nodes(step.forward)
    bw_nodes = _compute_nodes(step.backward)
    n_fw, n_bw = len(fw_nodes), len(bw_nodes)
    has_optimizer = step.backward is not None and bool(step.trainable_inputs)
    end = n_fw + n_bw + (1 if has_optimizer else 0)  # index of the step's last entry + 1

    buffers: dict[int, _Buffer] = {}

    def keys_of(node: fx.Node) -> list[tuple[int, torch.Tensor]]:
        return [
            (meta.storage_key(t), t)
            for t in meta.tensor_values(node)
            if t.device == device
        ]

    def new_buffer(key: int, t: torch.Tensor, category: str, node: fx.Node | None, at: int, **kw) -> _Buffer:
        buf = _Buffer(
            key=key,
            nbytes=_round(meta.storage_nbytes(t), granule),
            category=category,
            name=node.name if node is not None else category,
            source=meta.source_line(node) if node is not None else "",
            alloc=at,
            last_use=at,
            block=node.meta.get(meta.BLOCK, meta.OUTSIDE) if node is not None else meta.OUTSIDE,
            **kw,
        )
        buffers[key] = buf
        return buf

    # Model state and inputs: live before the first node, through the whole step.
    state_bufs: list[_Buffer] = []
    for node in step.forward.graph.nodes:
        if node.op != "placeholder":
            continue
        category = "parameter" if node.name in step.state_inputs else "input"
        for key, t in keys_of(node):
            if key not in buffers:
                buf = new_buffer(key, t, category, node, 0, persistent=True)
                buf.last_use = end
                if category == "parameter":
                    state_bufs.append(buf)
    optimizer_bufs: list[_Buffer] = []
    if has_optimizer and optimizer_states_per_param:
        trainable_keys = {
            key
            for node in step.forward.graph.nodes
            if node.op == "placeholder" and node.name in step.trainable_inputs
            for key, _ in keys_of(node)
        }
        for buf in state_bufs:
            if buf.key in trainable_keys:
                for i in range(optimizer_states_per_param):
                    optimizer_bufs.append(
                        _Buffer(
                            key=-(len(optimizer_bufs) + 1),
                            nbytes=buf.nbytes,
                            category="optimizer_state",
                            name=f"{buf.name}.state{i}",
                            source="",
                            alloc=0,
                            last_use=end,
                            persistent=True,
                            block=buf.block,
                        )
                    )

    def walk(nodes: list[fx.Node], offset: int) -> None:
        for i, node in enumerate(nodes):
            at = offset + i
            for key, t in keys_of(node):
                if key not in buffers:
                    new_buffer(key, t, "transient", node, at)
            for producer in (node, *node.all_input_nodes):
                for key, _ in keys_of(producer):
                    buf = buffers.get(key)
                    if buf is not None and not buf.persistent:
                        buf.last_use = max(buf.last_use, at)

    walk(fw_nodes, 0)

    # Forward outputs: the user's outputs live to the end of the step; saved values are activations.
    fw_outputs = _output_args(step.forward)
    for j, arg in enumerate(fw_outputs):
        if not isinstance(arg, fx.Node):
            continue
        for key, _ in keys_of(arg):
            buf = buffers.get(key)
            if buf is None or buf.persistent:
                continue
            if j < step.num_user_outputs:
                buf.category, buf.last_use = "output", end
            else:
                if buf.category == "transient":
                    buf.category = "activation"
                buf.last_use = max(buf.last_use, n_fw)  # held until the backward graph takes it

    if step.backward is not None:
        # Tangents (the loss's grad) arrive with the backward call.
        for node in step.backward.graph.nodes:
            if node.op == "placeholder":
                for key, t in keys_of(node):
                    if key not in buffers:
                        new_buffer(key, t, "transient", node, n_fw)
        walk(bw_nodes, n_fw)
        for arg in _output_args(step.backward):
            if isinstance(arg, fx.Node):
                for key, _ in keys_of(arg):
                    buf = buffers.get(key)
                    if buf is not None and not buf.persistent and buf.alloc >= n_fw:
                        buf.category, buf.last_use = "gradient", end - 1

    timeline_entries, events = _replay(
        list(buffers.values()) + optimizer_bufs, fw_nodes, bw_nodes, has_optimizer, step
    )
    by_category: dict[str, int] = defaultdict(int)
    for buf in list(buffers.values()) + optimizer_bufs:
        by_category[buf.category] += buf.nbytes
    peak_entry = max(timeline_entries, key=lambda e: e.peak_bytes, default=None)
    baseline = {
        c: sum(b.nbytes for b in list(buffers.values()) + optimizer_bufs if b.persistent and b.category == c)
        for c in ("parameter", "optimizer_state", "input")
    }
    phase_bounds = {"forward": (0, n_fw)}
    if step.backward is not None:
        phase_bounds["backward"] = (n_fw, n_fw + n_bw)
    if has_optimizer:
        phase_bounds["optimizer"] = (n_fw + n_bw, end)
    timeline = Timeline(
        kind="predicted",
        device=str(device),
        events=tuple(events),
        entries=tuple(timeline_entries),
        phase_bounds=phase_bounds,
        baseline_bytes=baseline,
        peak_bytes=peak_entry.peak_bytes if peak_entry else sum(baseline.values()),
        label=label,
    )
    return MemoryAnalysis(
        device=str(device),
        timeline=timeline,
        peak_bytes=timeline.peak_bytes,
        peak_entry=peak_entry,
        parameter_bytes=by_category["parameter"],
        gradient_bytes=by_category["gradient"],
        optimizer_state_bytes=by_category["optimizer_state"],
        input_bytes=by_category["input"],
        saved_activation_bytes=by_category["activation"],
        blocks=_block_table(list(buffers.values()), timeline_entries, fw_nodes, bw_nodes, step),
    )


def _replay(
    buffers: list[_Buffer],
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    has_optimizer: bool,
    step: StepGraphs,
) -> tuple[list[TimelineEntry], list[BufferEvent]]:
    """Turn buffer lifetimes into per-node entries and alloc/free events."""
    allocs: dict[int, list[_Buffer]] = defaultdict(list)
    frees: dict[int, list[_Buffer]] = defaultdict(list)
    events: list[BufferEvent] = []
    for i, buf in enumerate(buffers):
        allocs[buf.alloc].append(buf)
        if not buf.persistent:
            frees[buf.last_use].append(buf)
    ids = {id(b): i for i, b in enumerate(buffers)}
    rows: list[tuple[str, int, fx.Node | None]] = [("forward", 0, n) for n in fw_nodes]
    rows += [("backward", 1, n) for n in bw_nodes]
    if has_optimizer:
        rows.append(("optimizer", 2, None))
    # Persistent buffers (model state, inputs) are live before the first node.
    live = sum(b.nbytes for b in buffers if b.persistent)
    entries: list[TimelineEntry] = []
    for index, (phase, graph, node) in enumerate(rows):
        alloc = sum(b.nbytes for b in allocs[index] if not b.persistent)
        freed = sum(b.nbytes for b in frees[index])
        for b in allocs[index]:
            events.append(BufferEvent(index, "alloc", ids[id(b)], b.nbytes, b.category, b.name, b.source))
        for b in frees[index]:
            events.append(BufferEvent(index, "free", ids[id(b)], b.nbytes, b.category, b.name, b.source))
        peak = live + alloc
        live = peak - freed
        entries.append(
            TimelineEntry(
                index=index,
                phase=phase,  # type: ignore[arg-type]
                graph=graph,
                name=node.name if node is not None else "optimizer.step",
                op=meta.op_name(node) if node is not None else "optimizer.step",
                block=node.meta.get(meta.BLOCK, meta.OUTSIDE) if node is not None else meta.OUTSIDE,
                source=meta.source_line(node) if node is not None else "",
                peak_bytes=peak,
                live_bytes=live,
                alloc_bytes=alloc,
                freed_bytes=freed,
            )
        )
    return entries, events


def _block_table(
    buffers: list[_Buffer],
    entries: list[TimelineEntry],
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    step: StepGraphs,
) -> tuple[BlockMemory, ...]:
    params: dict[str, int] = defaultdict(int)
    saved: dict[str, int] = defaultdict(int)
    for buf in buffers:
        if buf.category == "parameter":
            params[buf.block] += buf.nbytes
        elif buf.category == "activation":
            saved[buf.block] += buf.nbytes
    # Transient bytes live at each entry: allocated, not persistent, not saved/grad/output.
    transient_live: list[int] = [0] * len(entries)
    for buf in buffers:
        if buf.category == "transient":
            for i in range(buf.alloc, min(buf.last_use, len(entries) - 1) + 1):
                transient_live[i] += buf.nbytes
    transient_peak: dict[str, int] = defaultdict(int)
    for entry in entries:
        transient_peak[entry.block] = max(transient_peak[entry.block], transient_live[entry.index])
    fw_count: dict[str, int] = defaultdict(int)
    bw_count: dict[str, int] = defaultdict(int)
    for n in fw_nodes:
        fw_count[n.meta.get(meta.BLOCK, meta.OUTSIDE)] += 1
    for n in bw_nodes:
        bw_count[n.meta.get(meta.BLOCK, meta.OUTSIDE)] += 1
    labels: list[str] = []
    for n in fw_nodes + bw_nodes:
        label = n.meta.get(meta.BLOCK, meta.OUTSIDE)
        if label not in labels:
            labels.append(label)
    for label in list(params):
        if label not in labels:
            labels.append(label)
    if meta.OUTSIDE in labels:  # outside blocks last
        labels.remove(meta.OUTSIDE)
        labels.append(meta.OUTSIDE)
    return tuple(
        BlockMemory(
            block=label,
            parameter_bytes=params[label],
            saved_activation_bytes=saved[label],
            transient_peak_bytes=transient_peak[label],
            forward_nodes=fw_count[label],
            backward_nodes=bw_count[label],
        )
        for label in labels
    )
