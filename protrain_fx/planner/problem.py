"""The one extractor from a captured, analysed step to the search's plain ``Problem``.

:func:`problem_from_record` (a :class:`~protrain_fx.search.problem.Problem`) reads the forward and backward graphs, the memory analysis' per-block
table and the chunk layout, and prices each block (roofline node times, with the matrix,
convolution and attention ops measured on CUDA: :func:`device_op_times`). Its result holds no FX
and no torch, so the cost model and search stay free of both and a dumped problem replays in a
unit test. This module never rewrites a graph; it reads what the analyses left in ``node.meta``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from protrain_fx import chunks as chunks_mod
from protrain_fx import meta
from protrain_fx.analysis.estimate import fused_node_times, node_time
from protrain_fx.analysis.memory import default_granule, output_args
from protrain_fx.analysis.params import parameter_infos
from protrain_fx.analysis.swappable import swap_candidates
from protrain_fx.capture import CapturedGraph
from protrain_fx.machine import Machine, machine_for
from protrain_fx.profile.ops import measure_op_times, op_signature
from protrain_fx.runtime.parallel import distributed
from protrain_fx.runtime.optim.device_adam import DEVICE_SLICE_ELEMS, N_SETS
from protrain_fx.search import problem

#: Adam-family optimizers keep two fp32 moments per parameter (the cost model's Adam state); the
#: others as the analysis counts them (``config.OPTIMIZER_STATES_PER_PARAM``), 4 bytes each.
_STATE_BYTES = 4


def problem_from_record(
    record: CapturedGraph,
    machine: problem.MachineProfile,
    *,
    block_times: Mapping[str, Any] | None = None,
    chunk_bytes: int | None = None,
    estimate_machine: Machine | None = None,
    min_swap_bytes: int | None = None,
    layout: chunks_mod.ChunkLayout | None = None,
    buffer_bytes_per_byte: float = 1.0,
    persistent_param_bytes: int = 0,
    op_times: Mapping[str, float] | None = None,
    compute_scale: float = 1.0,
    collective_s: tuple[float, float] = (0.0, 0.0),
) -> problem.Problem:
    """The search's :class:`~protrain_fx.search.problem.Problem` for a captured training step.

    ``record`` must have a backward graph and its memory analysis (the backend fills both). Blocks are
    the labels of the forward graph's nodes other than ``"outside"``, in order of first appearance
    (forward order). The steps, each documented where it is done: :func:`_step_times` (the blocks'
    and outside's forward, backward and recompute seconds), :func:`_swap_placement` (what the swap
    rewrite moves and the timeline it places copies by; ``min_swap_bytes`` defaults to
    ``Machine``'s, the GPU rule even on the CPU), :func:`_chunk_profiles`, :func:`_block_profiles`.

    Outside the blocks: ``outside_peak_bytes`` = the outside row's transient peak plus its saved
    bytes (embedding and head activations count as working memory at the end of forward);
    ``fixed_bytes`` = the step's inputs. ``master_bytes_per_param`` is 0 for fp32 parameters (the
    working copy is the master), else 4; ``adam_state_bytes_per_param`` is 4 bytes per state the
    optimizer keeps; ``device_step_bytes`` is the device staging of chunks stepped on the GPU;
    ``accumulation`` is the option ``accumulation_steps`` (micro-batches per optimizer step).

    Data-parallel: ``world_size`` is the default process group's (``runtime/parallel/distributed.current``)
    and ``collective_s`` the all-gather and reduce-scatter seconds of one chunk measured on it
    (``profile/collectives.collective_times``; ignored with one rank).
    """
    group = distributed.current()
    world_size = group.world_size if group is not None else 1
    all_gather_s, reduce_scatter_s = collective_s if world_size > 1 else (0.0, 0.0)
    fw_nodes, bw_nodes, labels = _step_nodes(record)
    analysis = record.memory
    device = torch.device(analysis.device)
    est = estimate_machine or machine_for(device, record.config.machine)
    times, estimated, rerun = _step_times(
        record, fw_nodes, bw_nodes, est, block_times=block_times, op_times=op_times, compute_scale=compute_scale
    )
    if min_swap_bytes is None:
        min_swap_bytes = Machine.__dataclass_fields__["min_swap_bytes"].default
    place, outside_place_bwd, parts = _swap_placement(
        record, labels, fw_nodes, bw_nodes, est, min_swap_bytes, default_granule(device)
    )
    chunk_profiles, chunks_of, elem = _chunk_profiles(record, labels, layout, chunk_bytes, buffer_bytes_per_byte)
    rows = {b.block: b for b in analysis.blocks}
    blocks = _block_profiles(
        labels, rows, times, estimated, rerun, _crossing_bytes(fw_nodes, record.step.state_inputs),
        parts, place, chunks_of,
    )
    outside = rows.get(meta.OUTSIDE)
    out_fwd, out_bwd = times.get(meta.OUTSIDE, (0.0, 0.0))
    step = problem.Problem(
        blocks=tuple(blocks),
        chunks=tuple(chunk_profiles),
        machine=machine,
        outside_fwd_s=out_fwd,
        outside_bwd_s=out_bwd,
        outside_peak_bytes=(outside.transient_peak_bytes + outside.saved_activation_bytes) if outside else 0,
        outside_chunk_ids=tuple(sorted(set(chunks_of.get(meta.OUTSIDE, ())))),
        fixed_bytes=analysis.input_bytes,
        master_bytes_per_param=0 if elem >= 4 else 4,
        adam_state_bytes_per_param=_STATE_BYTES * record.config.optimizer_states_per_param,
        device_step_bytes=_device_step_staging_bytes(round(elem * buffer_bytes_per_byte)),
        persistent_param_bytes=persistent_param_bytes,
        outside_place_bwd_s=outside_place_bwd,
        place_d2h_bytes_per_s=est.d2h_bytes,
        place_h2d_bytes_per_s=est.h2d_bytes,
        copy_margin=est.copy_margin,
        accumulation=record.config.accumulation_steps,
        world_size=world_size,
        chunk_all_gather_s=all_gather_s,
        chunk_reduce_scatter_s=reduce_scatter_s,
    )
    # Data-parallel: every rank prices rank 0's problem, so every rank decides alike: its measured
    # inputs are rank 0's, and sums over the graph's nodes may differ in their last bits between
    # processes (hash-ordered sets).
    return distributed.from_rank0(step)


def _step_nodes(record: CapturedGraph) -> tuple[list[fx.Node], list[fx.Node], list[str]]:
    """The forward's and backward's compute nodes and the block labels in forward order; refuses a
    record with no backward graph, no memory analysis or no transformer block."""
    if record.forward is None or record.backward is None or record.step is None:
        raise ValueError(f"graph {record.index} has no backward graph: nothing to train")
    if record.memory is None:
        raise ValueError(f"graph {record.index} has no memory analysis")
    fw_nodes = [n for n in record.forward.graph.nodes if n.op not in ("placeholder", "output")]
    bw_nodes = [n for n in record.backward.graph.nodes if n.op not in ("placeholder", "output")]
    labels = list(dict.fromkeys(_label(n) for n in fw_nodes if _label(n) != meta.OUTSIDE))
    if not labels:
        raise ValueError(f"graph {record.index}: no transformer blocks were found")
    return fw_nodes, bw_nodes, labels


def _step_times(
    record: CapturedGraph,
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    est: Machine,
    *,
    block_times: Mapping[str, Any] | None,
    op_times: Mapping[str, float] | None,
    compute_scale: float,
) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """``(times, estimated, rerun)`` per label: ``(fwd_s, bwd_s)`` as the Problem gets them, the
    same as estimated (unscaled, without ``block_times``), and :func:`_recompute_times`.

    ``fwd_s``, ``bwd_s``: from ``block_times`` when given, else a roofline estimate
    (``analysis.estimate.node_time`` summed over the block's forward / backward nodes with ``est``).
    ``block_times`` maps a label to ``(fwd_s, bwd_s)``, or to one number (fwd + bwd, as
    ``inspect.block_times.profile_block_times`` returns), split 1 : 2 between forward and backward
    (backward computes two products per forward product). A block missing from ``block_times``
    falls back to the roofline. With Inductor codegen the roofline fuses memory-bound nodes as
    Inductor does (``analysis.estimate.fused_node_times``); with eager codegen every node is its own
    kernel. ``op_times`` (``profile.ops.op_signature`` -> seconds, as ``profile.ops.measure_op_times``
    returns) replaces the roofline of the nodes it has a time for: the matrix products, convolutions
    and attention ops measured on the device; the other nodes keep the roofline. ``compute_scale``
    multiplies the times so estimated (not ``block_times``): what a step takes beyond the sum of its
    nodes (:data:`IN_STEP_SCALE`, with op times taken as :func:`device_op_times` takes them).

    ``rerun``: what a checkpointed block reruns in backward when the next block is not / is
    checkpointed too, in the unscaled estimate's seconds; :func:`_block_profiles` applies it to
    ``fwd_s`` as a fraction of the estimated forward."""
    fused = record.config.codegen == "inductor"
    fw_times = node_times(fw_nodes, est, fused=fused, op_times=op_times)
    times = _label_times(fw_times, node_times(bw_nodes, est, fused=fused, op_times=op_times))
    rerun = _recompute_times(fw_nodes, fw_times, output_args(record.forward)[record.step.num_user_outputs :])
    estimated = dict(times)
    if compute_scale != 1.0:  # the recompute fractions stay those of the unscaled estimate
        times = {label: (f * compute_scale, b * compute_scale) for label, (f, b) in times.items()}
    if block_times:
        for label, value in block_times.items():
            times[label] = _split(value)
    return times, estimated, rerun


def _swap_placement(
    record: CapturedGraph,
    labels: list[str],
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    est: Machine,
    min_swap_bytes: int,
    granule: int,
) -> tuple[dict[str, tuple[float, float]], float, dict[str, list[tuple[float, float, int]]]]:
    """``(place, outside_place_bwd_s, parts)``: the timeline the swap rewrite places its waits and
    reloads by, and what it moves.

    ``place``: per label, ``(place_fwd_s, place_bwd_s)``, the block's forward and backward at
    ``analysis.estimate.node_time`` per node, unfused, with ``est``; ``outside_place_bwd_s``: the
    outside backward nodes before the first block's. ``parts``: per block, :func:`_swap_parts`, what
    ``passes/swap.py`` moves when it swaps the block (``analysis.swappable.swap_candidates``: the
    storages its own selection takes, each rounded up to the allocator's ``granule``). What a swap leaves on the device is not counted:
    values under ``min_swap_bytes``, values computed from the model state alone (the compute-dtype
    casts of weights under autocast), storages no contiguous value covers (rotary q / k saved as
    views)."""
    place_fw = {n: node_time(n, est) for n in fw_nodes}
    place_bw = {n: node_time(n, est) for n in bw_nodes}
    place = _label_times(place_fw, place_bw)
    first_block = next((i for i, n in enumerate(bw_nodes) if _label(n) != meta.OUTSIDE), len(bw_nodes))
    outside_place_bwd = sum(place_bw[n] for n in bw_nodes[:first_block])
    parts = _swap_parts(record, labels, fw_nodes, bw_nodes, place_fw, place_bw, min_swap_bytes, granule)
    return place, outside_place_bwd, parts


def _chunk_profiles(
    record: CapturedGraph,
    labels: list[str],
    layout: chunks_mod.ChunkLayout | None,
    chunk_bytes: int | None,
    buffer_bytes_per_byte: float,
) -> tuple[list[problem.ChunkProfile], dict[str, list[int]], float]:
    """``(chunk profiles, chunk ids per label, mean parameter element size)``.

    The parameters (``analysis.params.parameter_infos``, tied ones once, buffers included) packed by
    ``chunks.choose_layout`` (or ``chunks.pack`` with ``chunk_bytes``), or ``layout`` when given (an
    offload handle's, whose chunks are the ones the runtime will move). A chunk's ``bytes`` is the
    chunk size (padding included) times ``buffer_bytes_per_byte`` (the chunk buffers' element size
    over the parameters': 0.5 for fp32 parameters fetched as bf16), ``n_params`` its used bytes over
    the parameters' mean element size. Chunks holding ``"outside"`` parameters (or of a block the
    forward graph does not show) are listed under ``"outside"``."""
    if layout is None:
        params = parameter_infos(record.step, record.dynamo_graph)
        layout = chunks_mod.pack(params, chunk_bytes) if chunk_bytes else chunks_mod.choose_layout(params)
    elem = _mean_param_element_size(record)
    buffer_bytes = round(layout.chunk_bytes * buffer_bytes_per_byte)
    chunk_profiles = [
        problem.ChunkProfile(bytes=buffer_bytes, n_params=round(c.used_bytes / elem)) for c in layout.chunks
    ]
    chunks_of: dict[str, list[int]] = defaultdict(list)
    for c in layout.chunks:
        for block in dict.fromkeys(s.param.block for s in c.slots):
            chunks_of[block if block in labels else meta.OUTSIDE].append(c.index)
    return chunk_profiles, chunks_of, elem


def _block_profiles(
    labels: list[str],
    rows: Mapping[str, Any],
    times: Mapping[str, tuple[float, float]],
    estimated: Mapping[str, tuple[float, float]],
    rerun: Mapping[str, tuple[float, float]],
    crossing: Mapping[str, int],
    parts: Mapping[str, list[tuple[float, float, int]]],
    place: Mapping[str, tuple[float, float]],
    chunks_of: Mapping[str, list[int]],
) -> list[problem.BlockProfile]:
    """One ``BlockProfile`` per label, from the steps before.

    * ``saved_bytes`` / ``transient_bytes``: the analysis' per-block table (``rows``:
      ``saved_activation_bytes``, ``transient_peak_bytes``). With Inductor codegen that table is the
      one of Inductor's plans once the backward has been compiled.
    * ``checkpoint_saved_bytes``: ``crossing``, the bytes of the values that cross into the block
      (:func:`_crossing_bytes`). That is what a checkpointed block must keep to rerun its forward;
      the min-cut partitioner may keep a little more (e.g. a cheap-to-save statistic), which this
      ignores.
    * ``swap_bytes`` / ``swap_parts``: the block's ``parts`` capped at ``saved_bytes``; each part is
      where the rewrite issues its copy out (after its last forward use) and where backward first
      reads it, on the placement timeline.
    * ``recompute_s`` / ``recompute_chained_s``: ``rerun`` as a fraction of the estimated forward,
      applied to ``fwd_s`` (at most ``fwd_s``).
    * ``chunk_ids``: the chunks holding the block's parameters."""
    blocks = []
    for label in labels:
        row = rows.get(label)
        saved = row.saved_activation_bytes if row else 0
        fwd_s, bwd_s = times.get(label, (0.0, 0.0))
        est_fwd = estimated.get(label, (0.0, 0.0))[0]
        alone, chained = rerun.get(label, (est_fwd, est_fwd))
        scale = fwd_s / est_fwd if est_fwd > 0 else 0.0  # the estimate's fractions of a given forward time
        mine = _cap_parts(parts.get(label, []), saved)
        blocks.append(
            problem.BlockProfile(
                name=label,
                fwd_s=fwd_s,
                bwd_s=bwd_s,
                recompute_s=min(fwd_s, alone * scale),
                recompute_chained_s=min(fwd_s, chained * scale),
                saved_bytes=saved,
                checkpoint_saved_bytes=crossing.get(label, 0),
                swap_bytes=sum(x for *_, x in mine),
                swap_parts=tuple(mine),
                transient_bytes=row.transient_peak_bytes if row else 0,
                chunk_ids=tuple(sorted(set(chunks_of.get(label, ())))),
                place_fwd_s=place.get(label, (0.0, 0.0))[0],
                place_bwd_s=place.get(label, (0.0, 0.0))[1],
            )
        )
    return blocks


#: A training step's forward and backward over the sum of their nodes as :func:`problem_from_record`
#: prices them with :func:`device_op_times` (matrix and attention ops timed with the device kept busy,
#: the roofline for the rest). It stands for the device's idle time, at each phase's start and
#: between kernels, less what the timed products read above their in-step kernel time; fitted over
#: on-device runs whose products were timed again right after training
#: (``docs/results.md#the-compute-estimate``).
IN_STEP_SCALE = 1.058


def device_op_times(record: CapturedGraph) -> dict[str, float] | None:
    """Measured seconds of the matrix, convolution and attention nodes of ``record``'s forward and
    backward graphs (``profile.ops.measure_op_times`` with the device kept busy while each op's calls
    are queued: once per distinct call, device and torch version, cached), for
    :func:`problem_from_record`'s ``op_times``, with ``compute_scale`` :data:`IN_STEP_SCALE`;
    ``None`` off CUDA (the CPU "device" plans with relative numbers, and its tests stay
    deterministic)."""
    device = torch.device(record.memory.device) if record.memory is not None else None
    if device is None or device.type != "cuda" or record.forward is None or record.backward is None:
        return None
    nodes = [*record.forward.graph.nodes, *record.backward.graph.nodes]
    return measure_op_times(nodes, device, prefill=True)


def _device_step_staging_bytes(itemsize: int) -> int:
    """Device staging of chunks stepped on the GPU (``DeviceAdamW.staging_bytes`` for this working-copy
    element size): what a config with ``n_gpu_optim > 0`` adds besides its gradients in flight."""
    return N_SETS * DEVICE_SLICE_ELEMS * (4 * 4 + itemsize)


def _label(node: fx.Node) -> str:
    return node.meta.get(meta.BLOCK, meta.OUTSIDE)


def _split(value: Any) -> tuple[float, float]:
    """``(fwd_s, bwd_s)`` from a pair, or from a total split 1 : 2."""
    if isinstance(value, (tuple, list)):
        fwd, bwd = value
        return float(fwd), float(bwd)
    total = float(value)
    return total / 3, 2 * total / 3


def node_times(
    nodes: list[fx.Node],
    machine: Machine,
    *,
    fused: bool = False,
    op_times: Mapping[str, float] | None = None,
) -> dict[fx.Node, float]:
    """Seconds per node of one graph: the roofline (``analysis.estimate.node_time``, or with ``fused``
    ``analysis.estimate.fused_node_times``: memory-bound nodes fused as Inductor fuses them), except
    for nodes whose ``profile.ops.op_signature`` has a measured time in ``op_times``."""
    times = fused_node_times(nodes, machine) if fused else {n: node_time(n, machine) for n in nodes}
    if op_times:
        for n in nodes:
            sig = op_signature(n)
            if sig is not None and sig in op_times:
                times[n] = op_times[sig]
    return times


def _phase_times(
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    machine: Machine,
    *,
    fused: bool = False,
    op_times: Mapping[str, float] | None = None,
) -> dict[str, tuple[float, float]]:
    """Seconds per label and phase: :func:`node_times` of each graph, summed per label."""
    return _label_times(node_times(fw_nodes, machine, fused=fused, op_times=op_times),
                        node_times(bw_nodes, machine, fused=fused, op_times=op_times))


def _label_times(
    fw_times: Mapping[fx.Node, float], bw_times: Mapping[fx.Node, float]
) -> dict[str, tuple[float, float]]:
    """Seconds per label and phase: node times summed per label."""
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    for times, out in ((fw_times, fwd), (bw_times, bwd)):
        for n, t in times.items():
            out[_label(n)] += t
    return {label: (fwd[label], bwd[label]) for label in {*fwd, *bwd}}


def _recompute_times(
    fw_nodes: list[fx.Node], fw_times: Mapping[fx.Node, float], saved: Sequence[Any]
) -> dict[str, tuple[float, float]]:
    """Per block, the seconds of the forward a checkpointed block reruns in backward:
    ``(alone, chained)``.

    A checkpointed block's nodes are all tagged ``MUST_RECOMPUTE`` (``passes/annotate.py``), and the
    min-cut partitioner reruns those the backward reads, with what they need. Which values that is
    comes from the graph analysed without a plan: those its forward saves for backward (``saved``:
    the forward graph's outputs after the user's), produced by the block. What is rerun is the
    block's nodes they depend on inside the block (walking inputs until the block's input).

    * ``chained``: when the next block is checkpointed too, the partitioner saves the values of this
      block that the next one's tagged nodes read (``cleanup_recompute_tags`` in torch's
      partitioner: a tagged value read by a tagged node of a later checkpoint region is saved),
      so values read outside the block are not targets. In a GPT block, the MLP's second matrix
      product (and the residual add after it) is then not rerun: about a third of its matrix work.
    * ``alone``: otherwise its output is rerun as well: values read outside the block are targets.

    A block whose saved values are all read outside it too (so none tells what its own backward
    reads: a graph captured with a plan already checkpointing it) is priced at its whole forward,
    both ways."""
    label_of = {n: _label(n) for n in fw_nodes}
    saved_nodes: set[fx.Node] = {a for a in saved if isinstance(a, fx.Node) and a in label_of}
    out_read = {n for n in fw_nodes if any(u in label_of and label_of[u] != label_of[n] for u in n.users)}
    by_label: dict[str, list[fx.Node]] = defaultdict(list)
    for n in fw_nodes:
        by_label[label_of[n]].append(n)

    def rerun(targets: set[fx.Node], label: str) -> float:
        seen: set[fx.Node] = set()
        stack = list(targets)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(s for s in n.all_input_nodes if label_of.get(s) == label and s not in seen)
        return sum(fw_times.get(n, 0.0) for n in seen)

    out: dict[str, tuple[float, float]] = {}
    for label, nodes in by_label.items():
        own = {n for n in nodes if n in saved_nodes}
        whole = sum(fw_times.get(n, 0.0) for n in nodes)
        inner = own - out_read
        if not inner:
            out[label] = (whole, whole)
            continue
        out[label] = (rerun(own | {n for n in nodes if n in out_read}, label), rerun(inner, label))
    return out


def _swap_parts(
    record: CapturedGraph,
    labels: list[str],
    fw_nodes: list[fx.Node],
    bw_nodes: list[fx.Node],
    place_fw: Mapping[fx.Node, float],
    place_bw: Mapping[fx.Node, float],
    min_bytes: int,
    granule: int,
) -> dict[str, list[tuple[float, float, int]]]:
    """Per block, ``BlockProfile.swap_parts``: what ``passes/swap.py`` moves when it swaps the
    block (``analysis.swappable.swap_candidates``), each storage as ``(issue_s, use_s, bytes)`` on the
    rewrite's own timeline (``place_fw`` / ``place_bw``: the roofline per node it places by): its
    copy out issued when its last forward use ends, from the start of the block's forward; its
    first backward use, from the start of the block's backward."""
    start_fw, start_bw = _starts(fw_nodes, place_fw), _starts(bw_nodes, place_bw)
    block_fw: dict[str, float] = {}
    for n in fw_nodes:
        block_fw.setdefault(_label(n), start_fw[n])
    block_bw: dict[str, float] = {}
    for n in bw_nodes:
        block_bw.setdefault(_label(n), start_bw[n])
    parts: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for c in swap_candidates(record.forward, record.backward, labels, record.step.num_user_outputs,
                             state_inputs=record.step.state_inputs, min_bytes=min_bytes, granule=granule):
        if c.block not in block_fw or c.issued_after not in start_fw:
            continue
        issued = start_fw[c.issued_after] + place_fw[c.issued_after] - block_fw[c.block]
        used = start_bw.get(c.first_use, 0.0) - block_bw.get(c.block, 0.0)
        parts[c.block].append((max(0.0, issued), used, c.nbytes))
    return parts


def _starts(nodes: list[fx.Node], times: Mapping[fx.Node, float]) -> dict[fx.Node, float]:
    """When each of ``nodes`` starts when they run back to back from 0 (``analysis.estimate.start_times``)."""
    out, t = {}, 0.0
    for n in nodes:
        out[n] = t
        t += times[n]
    return out


def _cap_parts(parts: list[tuple[float, float, int]], cap: int) -> list[tuple[float, float, int]]:
    """``parts`` (in order of issue) adding up to at most ``cap`` bytes (the block's saved bytes, which
    the analysis attributes a little differently), the earliest kept."""
    out = []
    for issued, used, nbytes in sorted(parts):
        x = min(nbytes, cap)
        cap -= x
        if x:
            out.append((issued, used, x))
    return out


def _crossing_bytes(fw_nodes: list[fx.Node], state_inputs: frozenset[str]) -> dict[str, int]:
    """Per block: bytes of the storages its forward nodes read from outside it (parameters excluded)."""
    seen: dict[str, dict[int, int]] = defaultdict(dict)
    for node in fw_nodes:
        label = _label(node)
        for src in node.all_input_nodes:
            if _label(src) == label or (src.op == "placeholder" and src.name in state_inputs):
                continue
            for t in meta.tensor_values(src):
                seen[label][meta.storage_key(t)] = meta.storage_nbytes(t)
    return {label: sum(by_key.values()) for label, by_key in seen.items()}


def _mean_param_element_size(record: CapturedGraph) -> float:
    """Bytes per element over the model-state inputs (1 storage once): to turn chunk bytes into params."""
    nbytes = numel = 0
    seen: set[int] = set()
    for node in record.forward.graph.nodes:
        if node.op != "placeholder" or node.name not in record.step.state_inputs:
            continue
        for t in meta.tensor_values(node):
            key = meta.storage_key(t)
            if key not in seen:
                seen.add(key)
                nbytes += meta.storage_nbytes(t)
                numel += meta.storage_nbytes(t) // t.element_size()
    return nbytes / numel if numel else 4.0
