"""Inductor's lowering of a step's graphs, as the compile runs it and as the planner's trials run it.

Every lowering of a training graph (the compile's, at the partitioner's return and at the first
``backward()``; a trial's, which judges a plan by Inductor's allocation plan: ``verify="inductor"``)
goes through :func:`lower` with the same settings (:func:`lowering_patches`) and the same keyword
arguments AOTAutograd gives Inductor, so that Inductor's FX graph cache keys them alike: the trial of
the plan the planner chooses is the compile's lowering too (a cache hit: no second codegen), and a
later launch's compile of the same plan hits the cache as a plain ``torch.compile`` does.

A cache hit generates no code, so Inductor's allocation plan (:class:`GraphPlan`, read off the
generated wrapper) cannot be read then: each one read is kept under the graph it came from
(:func:`plan_key`: the graph's structure, phase, static inputs and Inductor's settings), in this
process and as a JSON file under ``$PROTRAIN_CACHE_DIR/lowered/``, and a hit reads it back from there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.fx._lazy_graph_module import _LazyGraphModule

from protrain_fx.analysis.inductor_memory import GraphPlan, PlanRow, analyze_inductor_memory, read_inductor_plan
from protrain_fx.analysis.memory import MemoryAnalysis, output_args
from protrain_fx.capture import CapturedGraph
from protrain_fx.planner.plan_cache import graph_digest
from protrain_fx.profile.cache import cache_dir

log = logging.getLogger("protrain_fx")

#: A hash of the package's sources: the token Inductor's cache keys see for our hooks and partitioner,
#: so that code built by another version of them is not reused.
SOURCE_HASH = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.rglob("*.py")))
).hexdigest()

#: Allocation plans kept in files (:func:`keep_plan`): the newest this many.
MAX_PLAN_FILES = 256

_PLANS: dict[str, GraphPlan] = {}


class Picklable:
    """Wraps an Inductor config hook so that its cache-key pickling sees a stable token."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __reduce__(self):
        return (str, (f"protrain_fx:{SOURCE_HASH}",))


def lowering_patches(record: CapturedGraph, lowered: dict[str, Any]) -> dict[str, Any]:
    """Inductor settings of every lowering of ``record``'s graphs: ``lowered["graph"]`` gets the graph
    being lowered, to read its allocation plan once compiled (not on a cache hit, which lowers
    nothing), and chunk buffers are never reused."""

    def remember_graph(nodes: list[Any]) -> list[Any]:
        from torch._inductor.virtualized import V

        lowered["graph"] = V.graph
        keep_chunk_buffers(nodes, V.graph)
        return nodes

    patches: dict[str, Any] = {"_post_fusion_custom_pass": Picklable(remember_graph)}
    if record.config.keep_node_order:
        patches["reorder_for_peak_memory"] = False
    return patches


class PartitionerToken(CustomPartitionerFn):
    """What Inductor's cache key sees of our partitioner (``backend._Partitioner``): a token of our
    sources. A process that lowers graphs partitioned elsewhere (``codegen_child.py``) sets this in its
    place, so that its lowerings are keyed as the compile's."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("protrain_fx: the partitioner's token partitions nothing")

    def uuid(self) -> Any:
        return SOURCE_HASH

    def __reduce__(self):
        # Inductor pickles its config into cache keys; the uuid stands for this partitioner.
        return (str, (self.uuid(),))


def copy_graph_module(gm: fx.GraphModule, *, lazy: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes (and node meta dicts, shallowly) are its own. ``lazy``: its code is
    written when first read or run (a trial's joint graph is partitioned, never run)."""
    with warnings.catch_warnings():
        # Copying a graph whose nodes hold pytree specs (a model called with keyword arguments)
        # rebuilds each LeafSpec through torch's deprecated isinstance check: torch's warning, not
        # the user's to act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        graph = copy.deepcopy(gm.graph)
    copied = _LazyGraphModule(gm, graph) if lazy else fx.GraphModule(gm, graph)
    copied.meta = dict(getattr(gm, "meta", {}))
    return copied


def plan_key(gm: fx.GraphModule, phase: str, static_input_idxs: Any) -> str:
    """What an allocation plan is kept under: ``gm``'s structure (before Inductor rewrites it), the
    phase, the static inputs, Inductor's settings, torch and our sources."""
    from torch._inductor import config as inductor_config

    try:
        settings = hashlib.sha256(pickle.dumps(inductor_config.save_config_portable(ignore_private_configs=False))
                                  ).hexdigest()
    except Exception:  # noqa: BLE001 -- an unpicklable setting: plans are then kept per process only
        settings = f"process-{os.getpid()}"
    parts = [graph_digest(gm), phase, repr(list(static_input_idxs or ())), settings, torch.__version__, SOURCE_HASH]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def keep_plan(key: str, plan: GraphPlan) -> None:
    """Keep ``plan`` under ``key`` in this process and in its file (a file that cannot be written is
    left, with a debug line: the plan is kept in the process)."""
    _PLANS[key] = plan
    folder = cache_dir() / "lowered"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(_plan_to_dict(plan)), encoding="utf-8")
        tmp.replace(folder / f"{key}.json")
        files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in files[:-MAX_PLAN_FILES]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.debug("protrain_fx: the allocation plan %s could not be kept in %s: %s", key, folder, e)


def kept_plan(key: str) -> GraphPlan | None:
    """The allocation plan kept under ``key`` (this process, else its file), or ``None``."""
    if key in _PLANS:
        return _PLANS[key]
    try:
        raw = json.loads((cache_dir() / "lowered" / f"{key}.json").read_text(encoding="utf-8"))
        plan = _plan_from_dict(raw)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _PLANS[key] = plan
    return plan


def lower(
    record: CapturedGraph,
    gm: fx.GraphModule,
    inputs: list[Any],
    phase: str,
    compile_fn: Callable[..., Any],
    copy_graph: Callable[[fx.GraphModule], fx.GraphModule],
    **kwargs: Any,
) -> tuple[Any, GraphPlan | None]:
    """``compile_fn(gm, inputs, **kwargs)`` (Inductor's ``compile_fx_inner``) under
    :func:`lowering_patches`, and the allocation plan of what it compiled: read off the code it
    generated, or on a cache hit the one kept for the same graph; a hit with none kept lowers a copy
    of ``gm`` (``copy_graph``, taken before) again past the cache to read it. ``None`` only when
    Inductor generated nothing to read it from."""
    from torch._inductor import config as inductor_config

    key = plan_key(gm, phase, kwargs.get("static_input_idxs"))  # before Inductor rewrites gm
    lowered: dict[str, Any] = {}
    # what a lowering again needs, should the cache hit without a plan kept (a copy of a large graph
    # takes a second: only when none is kept)
    pristine = copy_graph(gm) if kept_plan(key) is None else None
    fx_keys: list[str] = []
    with inductor_config.patch(lowering_patches(record, lowered)), _no_shape_env(gm), _fx_graph_keys(fx_keys), \
            _in_this_process():
        compiled = compile_fn(gm, inputs, **kwargs)
    graph = lowered.pop("graph", None)
    if graph is None:
        # a hit: the plan kept under Inductor's own key of the entry it hit (equal exactly when the
        # entry is the same), else under ours
        plan = next((p for k in fx_keys[-1:] if (p := kept_plan(k)) is not None), None) or kept_plan(key)
        if plan is not None or pristine is None:
            return compiled, plan
        # A hit on code some other run cached (its plan was not kept, or deleted): lowered again, uncached.
        log.info("protrain_fx: graph %d: Inductor's cache held the %s graph without the allocation plan kept for "
                 "it; lowered again to read it", record.index, phase)
        context = torch._guards.TracingContext.try_get()
        if context is not None and context.output_strides is not None:
            context.output_strides.clear()  # the hit handed them back; the lowering again hands them back anew
        with inductor_config.patch({**lowering_patches(record, lowered), "fx_graph_cache": False}), \
                _no_shape_env(pristine), _in_this_process():
            compiled = compile_fn(pristine, inputs, **kwargs)
        graph = lowered.pop("graph", None)
        if graph is None:
            return compiled, None
    plan = read_inductor_plan(graph, phase)
    for k in (key, *fx_keys[-1:]):
        keep_plan(k, plan)
    return compiled, plan


@contextlib.contextmanager
def _in_this_process() -> Iterator[None]:
    """Inductor's codegen in this process, whatever ``TORCHINDUCTOR_FX_COMPILE_MODE`` says: in a child
    process (``subprocess``, ``async+``, ``progressive+``) the hooks of :func:`lowering_patches` do not
    run (Inductor does not send its private settings there), so chunk buffers could be reused and no
    allocation plan is read. Inductor reads the mode from module globals at each codegen."""
    from torch._inductor import compile_fx

    wanted = {"fx_compile_mode": compile_fx.FxCompileMode.NORMAL, "fx_compile_async": False,
              "fx_compile_progressive": False}
    saved = {name: getattr(compile_fx, name) for name in wanted}
    if saved != wanted:
        log.debug("protrain_fx: TORCHINDUCTOR_FX_COMPILE_MODE is not followed for the graphs protrain_fx lowers: "
                  "they are lowered in this process")
    for name, value in wanted.items():
        setattr(compile_fx, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(compile_fx, name, value)


@contextlib.contextmanager
def _fx_graph_keys(found: list[str]) -> Iterator[None]:
    """``found`` gets the FX graph cache key of each graph Inductor looks up meanwhile. A plan is kept
    under that key too: our own key (:func:`plan_key`) hashes the graph as we see it, and where it
    tells apart two graphs that Inductor's key does not (the trial's and the compile's), a hit would
    find no plan kept and lower the graph again."""
    from torch._inductor import codecache

    original = codecache.compiled_fx_graph_hash

    def spy(*args: Any, **kwargs: Any) -> tuple[str, list[str]]:
        key, lines = original(*args, **kwargs)
        found.append(key)
        return key, lines

    codecache.compiled_fx_graph_hash = spy
    try:
        yield
    finally:
        codecache.compiled_fx_graph_hash = original


@contextlib.contextmanager
def _no_shape_env(gm: fx.GraphModule) -> Iterator[None]:
    """``gm`` without the ``shape_env`` AOTAutograd sets on it, for one lowering: Inductor pickles the
    graph module into its cache key, shape env and all, and a trial lowers during the partition, when
    the shape env holds less than at the compile's lowering of the same graph; without it, Inductor
    takes the same shape env from the inputs' fake mode, and both lowerings are keyed alike."""
    saved = getattr(gm, "shape_env", None)
    gm.shape_env = None
    try:
        yield
    finally:
        gm.shape_env = saved


def _attributes_ordered_as(copied: fx.GraphModule, original: fx.GraphModule) -> fx.GraphModule:
    """``copied`` with its attributes in ``original``'s order: Inductor's cache key pickles a graph
    module's attribute dict, whose order the pickle keeps."""
    attributes = dict(copied.__dict__)
    copied.__dict__.clear()
    copied.__dict__.update({k: attributes[k] for k in original.__dict__ if k in attributes})
    copied.__dict__.update({k: v for k, v in attributes.items() if k not in copied.__dict__})
    return copied


def unmark_static(inputs: Sequence[Any]) -> None:
    """Drop the mark Inductor leaves on the GPU inputs of a lowering it was told are static
    (``_is_inductor_static``, set on the tensor object itself): its cache key then records their
    storage sizes. A trial lowers the graph's placeholder values, the same objects in every trial, so a
    mark left by one trial would key the next one apart from the compile, whose inputs are fresh."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and hasattr(t, "_is_inductor_static"):
            del t._is_inductor_static

def aot_kwargs(phase: str, static_input_idxs: list[int]) -> dict[str, Any]:
    """The keyword arguments AOTAutograd gives Inductor's ``compile_fx_inner`` for a training graph's
    ``phase`` (``compile_fx_forward`` / ``compile_fx_backward``, cudagraphs off), less the graph id
    Inductor's cache leaves out of its key: a trial lowered with them is cached under the key the
    compile of the same graph looks up."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool

    kwargs: dict[str, Any] = {"static_input_idxs": static_input_idxs,
                              "cudagraphs": BoxedBool(inductor_config.triton.cudagraphs),
                              "boxed_forward_device_index": BoxedDeviceIndex(None)}
    if phase == "backward":
        kwargs["is_backward"] = True
    else:
        kwargs["is_inference"] = False
    return kwargs


def probe_inductor(record: CapturedGraph, extra_patches: dict[str, Any], copy_graph: Callable[[fx.GraphModule], fx.GraphModule],
                   lower_beside: Callable[..., Callable[[], None]] | None = None) -> MemoryAnalysis | None:
    """The memory analysis of Inductor's allocation plans for the step now in ``record`` (one plan
    the backend tries, ``verify="inductor"``), lowered as the compile lowers it (:func:`lower`, with
    ``extra_patches``: the compile's other settings, so that the cache keys match): copies of both
    graphs (``copy_graph``) through ``compile_fx_inner`` with AOTAutograd's arguments (static inputs:
    the model state in forward, the tangents in backward; the saved values AOTAutograd donates to
    backward, whose storage Inductor reuses; chunk buffers never reused). ``lower_beside``
    (``codegen_child.start``): sends the backward to be lowered elsewhere while the forward lowers
    here, and returns what waits for it. ``None`` (with a warning) when it cannot be done: the
    graph-level analysis judges then."""
    from torch._functorch._aot_autograd.graph_compile import collect_bw_donated_buffer_idxs
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner, count_tangents

    step = record.step
    if step is None or step.backward is None:
        return None
    try:
        # Inductor rewrites the graphs it lowers: copies (node values shared, so storages match)
        forward, backward = (_attributes_ordered_as(copy_graph(g), g) for g in (step.forward, step.backward))
        probe_step = dataclasses.replace(step, forward=forward, backward=backward,
                                         held_gradients=record.config.accumulation_steps > 1)
        outputs = output_args(forward)
        saved = outputs[step.num_user_outputs:]  # AOTAutograd's order: saved tensors, then saved sizes

        def kind(v: Any) -> type | None:
            val = v.meta.get("val") if isinstance(v, fx.Node) else v
            return torch.Tensor if isinstance(val, torch.Tensor) else torch.SymInt if isinstance(val, (int, torch.SymInt)) else None

        n_tensors = sum(kind(v) is torch.Tensor for v in saved)
        if [kind(v) for v in saved] != [torch.Tensor] * n_tensors + [torch.SymInt] * (len(saved) - n_tensors):
            log.warning("protrain_fx: graph %d saves values of an unexpected kind for its backward: its plans are "
                        "judged by the graph-level analysis, not Inductor's plan", record.index)
            return None
        donated = collect_bw_donated_buffer_idxs(forward, backward, SimpleNamespace(
            num_forward=step.num_user_outputs,
            tensors_saved_for_backwards_slice=slice(step.num_user_outputs, step.num_user_outputs + n_tensors),
            num_symints_saved_for_bw=len(saved) - n_tensors))  # backward takes the sizes first
        placeholders = [n.name for n in forward.graph.nodes if n.op == "placeholder"]
        device = next((v.device for n in forward.graph.nodes if n.op == "placeholder"
                       and isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"), None)
        # the backward lowered elsewhere beside this process's forward (codegen_child.start)
        wait_for_backward = lower_beside(record.index, backward, donated, record.config.keep_node_order, device) \
            if lower_beside is not None else None
        plans = {}
        for phase, gm in (("forward", forward), ("backward", backward)):
            inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
            out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
            if phase == "forward":  # as compile_fx_forward / compile_fx_backward mark them
                static = [i for i, name in enumerate(placeholders) if name in step.state_inputs]
                out.meta["user_visible_output_idxs"] = [i for i in range(step.num_user_outputs)
                                                        if isinstance(outputs[i], fx.Node)]
            else:
                static = list(range(count_tangents(gm)))
                out.meta["user_visible_output_idxs"] = [
                    i for i, v in enumerate(output_args(gm)) if isinstance(v, fx.Node)
                ] if inductor_config.bw_outputs_user_visible else []
            context = TracingContext(detect_fake_mode(inputs))
            context.fw_metadata = SimpleNamespace(bw_donated_idxs=donated, static_input_indices=static)
            unmark_static(inputs)  # as the compile's own inputs: marked static by this lowering only
            if phase == "backward" and wait_for_backward is not None:
                wait_for_backward()  # its code then hits Inductor's cache
            try:
                with tracing(context), inductor_config.patch(extra_patches):
                    _, plan = lower(record, gm, inputs, phase, compile_fx_inner, copy_graph,
                                    **aot_kwargs(phase, static))
            finally:
                unmark_static(inputs)
            if plan is None:
                raise RuntimeError(f"Inductor generated no code to read the {phase} graph's allocation plan from")
            plans[phase] = plan
        return analyze_inductor_memory(probe_step, plans,
                                       optimizer_states_per_param=record.config.optimizer_states_per_param,
                                       label=f"graph {record.index} (Inductor, a plan tried)")
    except Exception as e:  # noqa: BLE001 -- a failed check must not fail the compile
        log.warning("protrain_fx: lowering a plan with Inductor to check its memory failed (%s: %s); the "
                    "graph-level analysis judges it", type(e).__name__, e)
        return None


def keep_chunk_buffers(nodes: list[Any], graph: Any) -> None:
    """A chunk buffer ``chunk_gather`` returns belongs to the pool: Inductor must never reuse its
    memory for another buffer nor write a kernel's output into it in place.

    (Gradients handed to ``chunk_grads`` are not listed: Inductor never frees a buffer it may not
    reuse, so they stayed allocated to the end of backward -- every offloaded chunk's gradient at
    once. The op copies them into a staging buffer of its own before returning instead.)"""
    gather = getattr(torch.ops.protrain, "chunk_gather", None)
    if gather is None:
        return
    from torch._inductor.ir import MultiOutput

    for node in nodes:
        for snode in node.get_nodes():
            op = snode.node
            if isinstance(op, MultiOutput) and op.inputs:  # the tensor a single-output fallback returns
                op = op.inputs[0]
            if getattr(op, "op_overload", None) is gather.default:
                for out in snode.get_outputs():
                    graph.never_reuse_buffers.add(out.get_name())


def _plan_to_dict(plan: GraphPlan) -> dict[str, Any]:
    return {"phase": plan.phase, "inputs": list(plan.inputs), "outputs": list(plan.outputs),
            "rows": [[row.context, [list(a) for a in row.actions]] for row in plan.rows]}


def _plan_from_dict(raw: dict[str, Any]) -> GraphPlan:
    def action(a: list[Any]) -> tuple[str, str, Any]:
        kind, name, extra = a
        return (kind, name, tuple(extra) if kind == "alloc" else extra)

    return GraphPlan(phase=raw["phase"], inputs=tuple(raw["inputs"]), outputs=tuple(raw["outputs"]),
                     rows=[PlanRow(context, [action(a) for a in actions]) for context, actions in raw["rows"]])
