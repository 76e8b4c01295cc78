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

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.analysis.timeline import BufferEvent, Timeline, TimelineEntry

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes, and
#: ``torch.cuda.memory_allocated`` counts the rounded sizes.
CUDA_ALLOCATION_GRANULE = 512


@dataclass(frozen=True)
class OffloadFacts:
    """What the analysis counts of one offload handle whose chunks the step reads, handed over as
    data (the passes read it from the runtime: ``passes/pipeline.py``): its device chunk buffers
    (``n_buffer`` of ``chunk_numel`` elements of ``compute_itemsize`` bytes), the fp32 fetch staging
    of lean chunks, the device optimizer steps' staging, how many chunks those steps take
    (``n_gpu_optim``) and how many run at once at most."""

    compute_itemsize: int
    chunk_numel: int
    n_buffer: int
    fetch_staging_bytes: int = 0
    device_step_staging_bytes: int = 0
    n_gpu_optim: int = 0
    device_steps_in_flight: int = 2

    @property
    def pool_bytes(self) -> int:
        return self.n_buffer * self.chunk_numel * self.compute_itemsize


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
    #: Per offload handle id whose chunks the graphs gather: what the analysis counts of it.
    offload: Mapping[int, OffloadFacts] = dataclasses.field(default_factory=dict)
    #: The device-resident trainable parameters' gradients are held from one step to the next
    #: (gradient accumulation: every micro-batch after an optimizer step's first adds into them), so
    #: they are live through the whole step, beside the new ones the backward graph returns.
    held_gradients: bool = False


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
    key: object
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


def output_args(gm: fx.GraphModule) -> list:
    """The values ``gm``'s output node returns, in order (nodes, or constants such as ``None``)."""
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
    """Predict the memory timeline and peak of one training step on ``device``, counting every
    value of the graphs (what eager codegen allocates; ``inductor_memory`` reads Inductor's own plan).

    ``granule`` rounds every buffer up (defaults to the CUDA allocator's 512 bytes on CUDA, 1 elsewhere).
    """
    device = device or analysis_device(step)
    granule = granule if granule is not None else default_granule(device)
    fw_nodes = _compute_nodes(step.forward)
    bw_nodes = _compute_nodes(step.backward)
    n_fw = len(fw_nodes)
    rows = step_rows(step, fw_nodes, bw_nodes)
    end = len(rows)

    host = host_copies(step) | pool_buffers(step)

    # Recomputed nodes in the backward graph carry copies of their forward nodes' fake values,
    # so their storages look like the forward's: a backward node that allocates (none of its
    # storages is an input's) under a forward storage gets a storage of its own.
    renamed: dict[int, object] = {}
    # A node's storages, read once: every reader of a node asks again, and the graphs do not change here.
    known: dict[fx.Node, list[tuple[int, torch.Tensor]]] = {}

    def raw_keys(node: fx.Node) -> list[tuple[int, torch.Tensor]]:
        got = known.get(node)
        if got is None:
            got = known[node] = storages(node)
        return got

    def storages(node: fx.Node) -> list[tuple[int, torch.Tensor]]:
        if meta.is_view(node) and isinstance(node.args[0], fx.Node):
            # A view aliases its input, whatever storage its recorded value has: a rewrite that
            # re-points a reader (a parameter's transpose now reading a chunk buffer) keeps the
            # value recorded before, whose storage the analysis would count as a new buffer.
            return raw_keys(node.args[0])
        keys = [(meta.storage_key(t), t) for t in meta.tensor_values(node) if t.device == device]
        return [(k, t) for k, t in keys if k not in host]

    def keys_of(node: fx.Node) -> list[tuple[object, torch.Tensor]]:
        return [(renamed.get(k, k), t) for k, t in raw_keys(node)]

    def rename_recomputed(node: fx.Node) -> None:
        inputs = {k for i in node.all_input_nodes for k, _ in raw_keys(i)}
        for k, _ in raw_keys(node):
            if k not in inputs and k in buffers and buffers[k].alloc < n_fw:
                renamed[k] = ("backward", node.name, k)

    state = model_state(step, device, granule, end, optimizer_states_per_param)
    buffers: dict[int, _Buffer] = {key: buf for key, buf in state.by_storage.items()}

    def new_buffer(key: int, t: torch.Tensor, node: fx.Node, at: int) -> None:
        buffers[key] = _node_buffer(key, _round(meta.storage_nbytes(t), granule), "transient", node, at)

    def walk(nodes: list[fx.Node], offset: int) -> None:
        for i, node in enumerate(nodes):
            at = offset + i
            if offset:
                rename_recomputed(node)
            for key, t in keys_of(node):
                if key not in buffers:
                    new_buffer(key, t, node, at)
            for producer in (node, *node.all_input_nodes):
                for key, _ in keys_of(producer):
                    buf = buffers.get(key)
                    if buf is not None and not buf.persistent:
                        buf.last_use = max(buf.last_use, at)

    walk(fw_nodes, 0)
    # Forward outputs: the user's outputs live to the end of the step; saved values are activations.
    for j, arg in enumerate(output_args(step.forward)):
        if isinstance(arg, fx.Node):
            for key, _ in keys_of(arg):
                if key in buffers:
                    _mark_forward_output(buffers[key], j < step.num_user_outputs, n_fw, end)
    if step.backward is not None:
        # Tangents (the loss's grad) arrive with the backward call.
        for node in step.backward.graph.nodes:
            if node.op == "placeholder" and not node.meta.get(meta.OFFLOADED):
                for key, t in keys_of(node):
                    if key not in buffers:
                        new_buffer(key, t, node, n_fw)
        walk(bw_nodes, n_fw)
        for arg in output_args(step.backward):
            if isinstance(arg, fx.Node):
                for key, _ in keys_of(arg):
                    buf = buffers.get(key)
                    if buf is not None and not buf.persistent and buf.alloc >= n_fw:
                        buf.category, buf.last_use = "gradient", end - 1
    return finish_analysis(
        step, device, list(buffers.values()) + state.optimizer, rows, fw_nodes, bw_nodes, label
    )


def host_copies(step: StepGraphs) -> set[int]:
    """Storage keys of the host copies swapped activations are offloaded to (never device memory,
    even when the "device" is the CPU)."""
    offload = torch.ops.protrain.offload.default if hasattr(torch.ops.protrain, "offload") else None
    nodes = step.forward.graph.nodes if step.forward is not None else ()
    return {meta.storage_key(t) for n in nodes if n.target is offload for t in meta.tensor_values(n)}


def _gather_nodes(step: StepGraphs) -> list[fx.Node]:
    gather = getattr(torch.ops.protrain, "chunk_gather", None)
    if gather is None:
        return []
    graphs = [g for g in (step.forward, step.backward) if g is not None]
    return [n for g in graphs for n in g.graph.nodes if n.target is gather.default]


def pool_buffers(step: StepGraphs) -> set[int]:
    """Storage keys of the chunk buffers ``chunk_gather`` hands out: the pool's, counted once as
    model state (:func:`model_state`), not as values of the graph."""
    return {meta.storage_key(t) for n in _gather_nodes(step) for t in meta.tensor_values(n)}


def chunk_pool_bytes(step: StepGraphs) -> dict[int, int]:
    """Bytes of the device chunk buffers of every offload handle the step reads parameters from
    (the buffers, the lean chunks' fetch staging and the device steps' staging slices)."""
    out = {}
    granule = default_granule(analysis_device(step))
    for hid in sorted({n.args[0] for n in _gather_nodes(step)}):
        facts = step.offload[hid]
        out[hid] = facts.pool_bytes
        if facts.fetch_staging_bytes:  # lean chunks' fp32 fetches (runtime/store/buffer_pool.py)
            out[hid] += _round(facts.fetch_staging_bytes, granule)
        if facts.device_step_staging_bytes:  # the device steps' staging slices (runtime/optim/device_adam.py)
            out[hid] += _round(facts.device_step_staging_bytes, granule)
    return out


@dataclass
class ModelState:
    """Buffers live through the whole step: parameters and inputs (by storage key and by placeholder
    name) and the optimizer state of trainable parameters."""

    by_storage: dict[int, "_Buffer"]
    by_placeholder: dict[str, list["_Buffer"]]
    optimizer: list["_Buffer"]


def default_granule(device: torch.device) -> int:
    return CUDA_ALLOCATION_GRANULE if device.type == "cuda" else 1


def step_rows(step: StepGraphs, fw_rows: list, bw_rows: list) -> list[tuple[str, int, object]]:
    """(phase, graph, item) per timeline entry: forward items, backward items, then the optimizer."""
    rows: list[tuple[str, int, object]] = [("forward", 0, n) for n in fw_rows]
    rows += [("backward", 1, n) for n in bw_rows]
    if step.backward is not None and step.trainable_inputs:
        rows.append(("optimizer", 2, None))
    return rows


def model_state(
    step: StepGraphs, device: torch.device, granule: int, end: int, optimizer_states_per_param: int
) -> ModelState:
    """Parameters, inputs and optimizer state (and gradients, when held: ``StepGraphs.held_gradients``):
    live before the first node, through the whole step."""
    state = ModelState({}, {}, [])
    params: list[_Buffer] = []
    trainable: set[int] = set()
    for node in step.forward.graph.nodes:
        if node.op != "placeholder":
            continue
        category = "parameter" if node.name in step.state_inputs else "input"
        state.by_placeholder[node.name] = []
        if node.meta.get(meta.OFFLOADED):
            continue  # in the host chunk store: its device bytes are the pool's (below)
        for t in meta.tensor_values(node):
            if t.device != device:
                continue
            key = meta.storage_key(t)
            if key not in state.by_storage:
                buf = _node_buffer(key, _round(meta.storage_nbytes(t), granule), category, node, 0)
                buf.persistent, buf.last_use = True, end
                state.by_storage[key] = buf
                if category == "parameter":
                    params.append(buf)
            state.by_placeholder[node.name].append(state.by_storage[key])
            if node.name in step.trainable_inputs:
                trainable.add(key)
    for hid, nbytes in chunk_pool_bytes(step).items():  # parameters streamed through the pool
        buf = _Buffer(key=("chunk_pool", hid), nbytes=_round(nbytes, granule), category="parameter",
                      name=f"chunk buffers of offload handle {hid}", source="", alloc=0, last_use=end,
                      persistent=True)
        state.by_storage[buf.key] = buf
    if step.backward is None or not step.trainable_inputs:
        return state
    for buf in params:
        if buf.key in trainable and step.held_gradients:
            state.optimizer.append(_Buffer(key=-(len(state.optimizer) + 1), nbytes=buf.nbytes, category="gradient",
                                           name=f"{buf.name}.grad (held)", source="", alloc=0, last_use=end,
                                           persistent=True, block=buf.block))
        if buf.key in trainable:
            for i in range(optimizer_states_per_param):
                state.optimizer.append(
                    _Buffer(
                        key=-(len(state.optimizer) + 1),
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
    return state


def _node_buffer(key: object, nbytes: int, category: str, node: fx.Node | None, at: int) -> "_Buffer":
    return _Buffer(
        key=key,
        nbytes=nbytes,
        category=category,
        name=node.name if node is not None else category,
        source=meta.source_line(node) if node is not None else "",
        alloc=at,
        last_use=at,
        block=node.meta.get(meta.BLOCK, meta.OUTSIDE) if node is not None else meta.OUTSIDE,
    )


def _mark_forward_output(buf: "_Buffer", user_output: bool, n_fw: int, end: int) -> None:
    """A forward output lives to the end of the step (user's) or until the backward frees it (saved)."""
    if buf.persistent:
        return
    if user_output:
        buf.category, buf.last_use = "output", end
    else:
        if buf.category == "transient":
            buf.category = "activation"
        buf.last_use = max(buf.last_use, n_fw)  # held until the backward graph takes it


def finish_analysis(
    step: StepGraphs,
    device: torch.device,
    buffers: list["_Buffer"],
    rows: list[tuple[str, int, object]],
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    label: str,
) -> MemoryAnalysis:
    """Replay buffer lifetimes over the rows into a timeline, and sum them up."""
    buffers = buffers + grad_staging(rows, device, step.offload)
    timeline_entries, events = _replay(buffers, rows)
    by_category: dict[str, int] = defaultdict(int)
    for buf in buffers:
        by_category[buf.category] += buf.nbytes
    peak_entry = max(timeline_entries, key=lambda e: e.peak_bytes, default=None)
    baseline = {
        c: sum(b.nbytes for b in buffers if b.persistent and b.category == c)
        for c in ("parameter", "optimizer_state", "input")
    }
    if held := sum(b.nbytes for b in buffers if b.persistent and b.category == "gradient"):
        baseline["gradient"] = held  # held from the step before (StepGraphs.held_gradients)
    phase_bounds: dict[str, tuple[int, int]] = {}
    for i, (phase, _, _) in enumerate(rows):
        lo, _hi = phase_bounds.get(phase, (i, i))
        phase_bounds[phase] = (lo, i + 1)
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
        blocks=_block_table(buffers, timeline_entries, fw_nodes, bw_nodes),
    )


def grad_staging(rows: list[tuple[str, int, object]], device: torch.device,
                 offload: Mapping[int, OffloadFacts]) -> list["_Buffer"]:
    """The staging buffers ``chunk_grads`` allocates on a GPU (``runtime/offload._staged``): the
    chunk's gradients in the compute dtype, from the op until its copy to the host is done --
    counted as live until the next ``chunk_grads`` (or the end of backward), so two overlap there.
    A chunk stepped on the device (``n_gpu_optim``) holds its buffer until its step has streamed
    through; the runtime lets at most ``device_steps_in_flight`` such steps run at once
    (``DeviceAdamW.make_room``), so the buffer is counted until just before the device step that
    many chunks later makes its own (or the end of backward)."""
    op = getattr(torch.ops.protrain, "chunk_grads", None)
    if op is None or device.type != "cuda":
        return []
    at, seen = [], set()
    for index, (_, _, item) in enumerate(rows):
        node = item[1] if isinstance(item, tuple) else item
        if isinstance(node, fx.Node) and node.target is op.default and node not in seen:
            seen.add(node)  # Inductor may show one op in several rows
            facts = offload[node.args[2]]
            numel = sum(g.meta["val"].numel() for g in node.args[1])
            nbytes = _round(numel * facts.compute_itemsize, CUDA_ALLOCATION_GRANULE)
            on_device = node.args[3] < facts.n_gpu_optim  # read by its device step, not one copy
            at.append((index, nbytes, node.name, on_device, facts.device_steps_in_flight))

    end = max((i for i, (phase, _, _) in enumerate(rows) if phase == "backward"), default=len(rows) - 1)
    device_rows = [index for index, _, _, on_device, _ in at if on_device]

    def last_use(k: int) -> int:
        index, _, _, on_device, in_flight = at[k]
        if on_device:  # freed before the in_flight-th next device step makes its buffer
            later = device_rows[device_rows.index(index) + in_flight :]
            return later[0] - 1 if later else end
        return at[k + 1][0] if k + 1 < len(at) else end

    return [
        _Buffer(key=("grad_staging", name), nbytes=nbytes, category="transient", name=f"{name} (staging)",
                source="", alloc=index, last_use=last_use(k))
        for k, (index, nbytes, name, _, _) in enumerate(at)
    ]


def _replay(
    buffers: list[_Buffer], rows: list[tuple[str, int, object]]
) -> tuple[list[TimelineEntry], list[BufferEvent]]:
    """Turn buffer lifetimes into per-row entries and alloc/free events.

    A row's item is an FX node, a ``(name, fx.Node | None)`` pair (a kernel of generated code and the
    node it came from), or ``None`` (the optimizer step).
    """
    allocs: dict[int, list[_Buffer]] = defaultdict(list)
    frees: dict[int, list[_Buffer]] = defaultdict(list)
    events: list[BufferEvent] = []
    for buf in buffers:
        allocs[buf.alloc].append(buf)
        if not buf.persistent and buf.last_use < len(rows):
            frees[buf.last_use].append(buf)
    ids = {id(b): i for i, b in enumerate(buffers)}
    # Persistent buffers (model state, inputs) are live before the first node.
    live = sum(b.nbytes for b in buffers if b.persistent)
    entries: list[TimelineEntry] = []
    for index, (phase, graph, item) in enumerate(rows):
        name, node = item if isinstance(item, tuple) else (getattr(item, "name", "optimizer.step"), item)
        alloc = sum(b.nbytes for b in allocs[index] if not b.persistent)
        freed = sum(b.nbytes for b in frees[index])
        for b in allocs[index]:
            if not b.persistent:  # live before the step: counted in the timeline's baseline_bytes
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
                name=name,
                op=meta.op_name(node) if node is not None else name,
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
