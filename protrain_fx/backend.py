"""The ``protrain`` torch.compile backend: capture the train step through AOTAutograd and analyse it.

``torch.compile(model, backend="protrain", options={...})`` resolves to :func:`protrain` through the
``torch_dynamo_backends`` entry point (pyproject.toml), so no import of ours is needed. For each Dynamo
graph the backend runs AOTAutograd with a partitioner of ours (PyTorch's min-cut partitioner, wrapped):
it is the one place that sees the joint forward+backward graph and both partitioned graphs, so the
pass pipeline runs there. Code generation is Inductor (with our partitioner installed through
``custom_partitioner_fn``, keeping our node order) or plain FX code (``codegen="eager"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.nn.parallel import DistributedDataParallel

from protrain_fx import beside, codegen_child, heap, progress
from protrain_fx.aot_cache import Hit, Relaunch, aot_cache_for, open_relaunch
from protrain_fx.analysis.blocks import block_at_end
from protrain_fx.analysis.memory import StepGraphs
from protrain_fx.capture import Budget, CapturedGraph, new_record
from protrain_fx.config import parse_options
from protrain_fx.errors import UnsupportedError, surfaced
from protrain_fx.handoffs import Placement, StepReadings
from protrain_fx.passes.pipeline import (
    JOINT_PASSES,
    LOWERED_PASSES,
    STEP_PASSES,
    PassContext,
    RewrittenStep,
    run_passes,
)
from protrain_fx.plan import Plan
from protrain_fx.planner.activations import choose_plan, specialize_shapes, warn_at_recompile_limit
from protrain_fx.planner.budget import (
    check_budget,
    reads_hand_offloaded,
    resolve_budget,
    wants_auto_plan,
)
from protrain_fx.planner.first_step import peaks_at_compile_start, watch_first_step
from protrain_fx.planner.fit import answer, answer_offload, planning_budget
from protrain_fx.planner.offload import choose_for_placed, choose_offload
from protrain_fx.inspect import structured
from protrain_fx.lowering import PartitionerToken, lower, probe_inductor
from protrain_fx.lowering import copy_graph_module as _copy_graph_module  # (a name the tests count copies by)
from protrain_fx.planner.plan_cache import judgments, plan_key, reuse_or_choose
from protrain_fx.planner.verify import Rewrite
from protrain_fx.profile.machine_profile import card_machine
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.offload.step_window import StepWindow
from protrain_fx.runtime.parallel import distributed
from protrain_fx.runtime.allocator import expandable_segments
from protrain_fx.runtime.store.spill import spill_dir
from protrain_fx.search.problem import Counts
from protrain_fx.state import STATE

if TYPE_CHECKING:
    from protrain_fx.runtime.offload.handle import OffloadHandle

log = logging.getLogger("protrain_fx")

def protrain(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None, **kwargs: Any) -> Callable:
    """Dynamo backend entry point (``backend="protrain"``); ``options`` is parsed by ``parse_options``."""
    try:
        return _protrain(gm, example_inputs, options, **kwargs)
    except Exception as e:  # ours reach the user as themselves, not wrapped by Dynamo (errors.py)
        error = surfaced(e, inspect.currentframe())
        if error is e:
            raise
        tb = e.__traceback__
        if tb is not None and not torch._dynamo.config.verbose:
            # A user error's message says what to change: the frames below this one (AOTAutograd's,
            # the planner's) go too, so that it comes under a few lines (TORCHDYNAMO_VERBOSE=1 keeps them).
            tb.tb_next = None
        raise error.with_traceback(tb) from e.__cause__


def _protrain(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None, **kwargs: Any) -> Callable:
    if kwargs.get("mode") is not None:
        raise ValueError(f"backend 'protrain' takes no mode= (got {kwargs['mode']!r}); use options=")
    started = _frame_compile_started()
    config = parse_options(options)
    expandable_segments(next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), None))
    peaks_before = None if beside.compiling_beside() else peaks_at_compile_start()  # (beside: the switch resets)
    record = new_record(config, gm, example_inputs, inside_block=block_at_end(gm) or _frame_is_a_block())
    if any(chunk_ops.orphaned(t) for t in record.real_inputs()):
        raise UnsupportedError(
            "protrain_fx: the model's offloaded parameters are empty shells whose offload handle is closed or was "
            "garbage-collected (with the optimizer given to protrain_fx.offload(...), which holds it): their values "
            "and optimizer state went with it. Keep that optimizer (it steps the offloaded chunks) for the whole "
            "training, or save handle.state_dict(model) before handle.close() and load it into a new model"
        )
    if _float16_on_offloaded(gm, record):
        raise UnsupportedError(
            "protrain_fx: an offloaded model computes in float16 (torch.autocast(..., dtype=torch.float16)): "
            "float16 needs loss scaling (GradScaler), whose unscaling and skipped steps do not reach the offloaded "
            "chunks' gradients (they are stepped from the chunk store, not from .grad); use "
            "torch.autocast(..., dtype=torch.bfloat16)"
        )
    for brk in record.breaks:  # Dynamo counts a break before compiling the graph that the break ends
        log.warning("protrain_fx: graph %d ends at a graph break: %s%s%s", record.index, brk.line(),
                    "; the blocks after it are not planned with the ones before (remove the break: a print, "
                    ".item(), data-dependent control flow)" if brk.inside_block else "",
                    _break_hint(brk.line()))
    if config.verbose:
        _log_to_stderr()
    _warn_if_not_averaged(record)
    distributed.agree({  # data-parallel: every rank compiles this graph with the same options and shapes
        "options (memory_budget_bytes, codegen, optimizer, plan, machine, auto_plan, verify)": (
            config.memory_budget_bytes, config.codegen, config.optimizer, repr(config.plan),
            None if config.machine is None else sorted(config.machine.items()), config.auto_plan, config.verify),
        "input shapes and dtypes": _input_signature(example_inputs),
    }, f"the compile of graph {record.index}")
    # The phases' seconds go to record.phases, and to a progress line on a terminal (progress.py).
    with progress.recording(record.phases, title=f"protrain_fx: graph {record.index}", since=started) as shown:
        cuda = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
        if cuda is not None:  # every plan and rewrite of this process prices the card at its own rates
            with progress.phase("machine", "measuring the machine"), unset_fake_temporarily():
                card_machine(cuda)
        shown.begin("capture", "capture (Dynamo, AOTAutograd)", since=started)  # ended by the partitioner
        if config.codegen == "eager":
            compiled = _compile_eager(gm, example_inputs, record)
        else:
            compiled = _compile_inductor(gm, example_inputs, record)
        # The chunk store filled beside the compile (runtime.offload's finalize); done before the first
        # step, whose peak is measured, and before anything of the user's runs beside an init function.
        if chunk_ops.filling():
            with progress.phase("store", "filling the chunk store"):
                chunk_ops.wait_filled()
        chunk_ops.wait_filled()  # a fill's error, if it raised
    # measured against predicted when a plan was chosen; an offload's rates over the timed calls
    again = beside.CompileAgain(record, gm, example_inputs, lambda g, inputs: _protrain(g, inputs, record.config))
    return again.switch(watch_first_step(record, compiled, peaks_before, lambda: _RunningHandle.open(record),
                                         example_inputs, again))


#: The partitioner's settings for a random op a plan recomputes (an attention on CUDA, whose kernels
#: are tagged random for their dropout, or a dropout): its forward's RNG state is saved and restored
#: for the recompute either way; the graph-safe form, made for CUDA graphs (which the backend does not
#: use), is a higher-order op that Inductor's FX graph cache of torch 2.11 refuses, so that every plan
#: that checkpoints a block on CUDA was lowered from scratch at every compile and launch
#: (``docs/results.md#time-to-the-first-steps``); the other form is cached.
RNG_PARTITION = {"graphsafe_rng_functionalization": False}


#: Graph breaks users meet in common models, by a phrase of Dynamo's reason, and the usual fix.
_BREAK_HINTS = {
    # Hugging Face's loss lookup warns that loss_type is unset (GPT-2): the loss leaves the graph.
    "in loss_function": (
        "; Hugging Face warns there that the model's loss_type is unset and uses ForCausalLM: set "
        "model.loss_type = 'ForCausalLM' before torch.compile (the same loss; protrain_fx.offload and "
        "ProTrainTrainer set it), so that the loss is computed inside the graph instead of on its returned logits"
    ),
    # A logging call inside the model; what it logs usually names the setting to change.
    "logging.Logger": (
        "; the model logs a warning there, which usually names the setting to change (Hugging Face gradient "
        "checkpointing: pass use_cache=False or set model.config.use_cache = False); or add the logger's method "
        "to torch._dynamo.config.ignore_logging_functions"
    ),
    # torch.utils.checkpoint around a function with side effects: Hugging Face's activation checkpointing.
    "HOP: Unsafe side effect": (
        "; a checkpointed function Dynamo cannot trace (Hugging Face activation checkpointing: call "
        "model.gradient_checkpointing_disable(); the backend checkpoints blocks itself when the budget needs it)"
    ),
}


def _break_hint(reason: str) -> str:
    return next((hint for phrase, hint in _BREAK_HINTS.items() if phrase in reason), "")


def _warn_if_not_averaged(record: CapturedGraph) -> None:
    """Once per process: a graph training parameters on one of several ranks that nothing averages
    (no offload, no DDP) trains a separate model on each rank; say so and name the two ways."""
    group = distributed.active()
    if group is None or STATE.warned_not_averaged:
        return
    params = [t for t in record.real_inputs() if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    if not params or DistributedDataParallel._get_active_ddp_module() is not None or chunk_ops.any_live_handle():
        return
    STATE.warned_not_averaged = True
    log.warning(
        "protrain_fx: a process group of %d ranks is initialised, but graph %d trains parameters that are neither "
        "offloaded (protrain_fx.offload) nor in a DistributedDataParallel: each rank trains its own copy and no "
        "gradient is averaged. Offload the model (its gradients are then averaged over the ranks: "
        "docs/distributed.md), or wrap it in DistributedDataParallel before torch.compile", group.world_size,
        record.index,
    )


def _float16_on_offloaded(gm: fx.GraphModule, record: CapturedGraph) -> bool:
    """Whether a training graph reading an offloaded model's parameters computes in float16."""
    if not torch.is_grad_enabled() or not any(
        chunk_ops.offloaded(t) is not None or chunk_ops.deferred(t) is not None for t in record.real_inputs()
    ):
        return False
    return any(getattr(n.meta.get("example_value"), "dtype", None) == torch.float16
               for n in gm.graph.nodes if n.op == "call_function")


def _frame_compile_started() -> float:
    """When Dynamo began compiling the frame whose graph the backend gets now, as a
    ``time.perf_counter()`` reading (from Dynamo's metrics context, which times each frame's
    compile); now when the backend is called outside Dynamo."""
    now = time.perf_counter()
    try:
        from torch._dynamo.utils import get_metrics_context

        context = get_metrics_context()
        start_ns = getattr(context, "_start_time_ns", 0) if context.in_progress() else 0
    except Exception:  # noqa: BLE001 -- a private clock of Dynamo's: without it, capture starts here
        return now
    return now - max(0.0, (time.time_ns() - start_ns) / 1e9) if start_ns else now


def _input_signature(example_inputs: Sequence[Any]) -> list[str]:
    """Shape and dtype of each tensor input (the value's type otherwise), as plain strings."""
    return [f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__ for x in example_inputs]


def _frame_is_a_block() -> str:
    """The module path of the block (a child of a ``ModuleList`` / ``Sequential``: ``blocks.0``)
    whose ``forward`` is the frame Dynamo compiles now, when the module calling it runs eagerly:
    Dynamo gave up on the caller's frame at a graph break inside its loop over blocks and compiles
    each block's frame on its own, so nothing around the blocks is captured and the blocks are not
    planned together. ``""`` otherwise (or when the frames cannot be read)."""
    import sys

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        module = InstructionTranslator.current_tx().f_locals.get("self")
        if not isinstance(module, torch.nn.Module):
            return ""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and owner is not module:
                name = next((n for n, m in owner.named_modules() if m is module), None)
                if name is not None:
                    return name if re.match(r"^(.*)\.(\d+)$", name) else ""
            frame = frame.f_back
    except Exception:  # noqa: BLE001 -- a diagnostic: never fails the compile
        return ""
    return ""


def _log_to_stderr() -> None:
    """``verbose=True``: one line per pass on stderr (once per process; logging config is the user's
    otherwise)."""
    if not any(getattr(h, "_protrain", False) for h in log.handlers):
        handler = _NoteHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        handler._protrain = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)


class _NoteHandler(logging.Handler):
    """Log records as lines on stderr, under the progress line when one is shown (``progress.note``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            progress.note(self.format(record))
        except Exception:  # noqa: BLE001 -- as logging.StreamHandler: a failed write never fails the caller
            self.handleError(record)


class _Partitioner(PartitionerToken):
    """Min-cut partition, then record the graphs and run our passes on them. ``relaunch``: the
    compile's use of AOTAutograd's cache (``aot_cache.py``), armed with the plan applied."""

    def __init__(self, record: CapturedGraph, relaunch: Relaunch | None = None) -> None:
        self.record = record
        self.relaunch = relaunch
        self.handed: tuple[fx.GraphModule, fx.GraphModule] | None = None  # the graphs AOTAutograd lowers

    def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        progress.end("capture")  # AOTAutograd has traced the joint graph
        with progress.phase("planning"):
            graphs = self._partition(joint, joint_inputs, **kwargs)
        self.handed = graphs
        record = self.record
        if record.auto_plan is not None:  # after the phase: its table has the planning's seconds
            log.info("protrain_fx: %s", record.auto_plan.table(record.index))
        # TORCH_TRACE (tlparse): the plan beside Dynamo's and AOTAutograd's artifacts of this compile
        structured.write_plan(record)
        if record.config.codegen == "eager":
            structured.write_timeline(record)
        return graphs

    def _partition(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        kwargs.setdefault("compiler", "inductor")
        static = kwargs.get("static_lifetime_input_indices") or []
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        record = self.record
        primals = [n.name for n in joint.graph.nodes if n.op == "placeholder"]
        parameters = {primals[i] for i in static if i < len(primals)}

        def partition(graph: fx.GraphModule, plan: Plan | None, *, check: bool = True
                      ) -> tuple[fx.GraphModule, fx.GraphModule]:
            names = frozenset(parameters)
            tagged = run_passes(JOINT_PASSES, PassContext(  # the tags the partitioner acts on
                record, plan, names, num_fwd_outputs, RewrittenStep(joint=graph, plan=plan)))
            with torch._functorch.config.patch(RNG_PARTITION):
                forward, backward = min_cut_rematerialization_partition(graph, joint_inputs, **kwargs)
            if isinstance(forward, _LazyGraphModule):  # the backward as well: its code is written once, when read
                backward = _LazyGraphModule.from_graphmodule(backward)
            partitioned = dataclasses.replace(tagged, forward=forward, backward=backward,
                                              step=_step_graphs(forward, backward, num_fwd_outputs, set(static)))
            # the record shows this rewrite from here on: the planner reads it after each trial
            record.rewritten = run_passes(STEP_PASSES, PassContext(record, plan, names, num_fwd_outputs, partitioned))
            if check and record.config.codegen == "eager":
                check_budget(record)  # with Inductor: once its allocation plan is known
            return forward, backward

        if record.config.dry_run and reads_hand_offloaded(record):  # stop before anything can run
            raise ValueError(
                "protrain_fx.what_fits: the model is offloaded with n_persist / n_buffer given by hand; what_fits "
                "answers for a model whose parameters stay on the device, or one offloaded without counts"
            )
        record.budget = resolve_budget(record, joint)  # the user's memory_budget, or what the CUDA device has
        handle = deferred_handle(record)  # offload(...) without counts: chosen here (planner/offload.py)
        placed = placed_handle(record) if handle is None else None  # ... or at an earlier compile
        if handle is not None or placed is not None:
            _check_automatic_offload(record, answering=handle is not None)
        dry_run = record.config.dry_run and wants_auto_plan(record, budget_needed=False)  # protrain_fx.what_fits
        if handle is None and not dry_run and not wants_auto_plan(record):
            return partition(joint, record.config.plan)
        # The backend chooses the plan: each trial partitions its own copy of the joint graph (the
        # partitioner rewrites the graph it is given, and the tags of one plan must not reach the next).
        specialize_shapes(joint)  # the plan is sized for these shapes: a new shape compiles (and plans) again
        warn_at_recompile_limit(record)
        user_config = record.config
        graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = []

        def trial(plan: Plan | None) -> Rewrite:
            applied = plan if plan is not None and plan.rewrites() else None
            with heap.young_only():  # no full collection walks the whole process mid-trial
                graphs[:] = [partition(_copy_graph_module(joint, lazy=True), applied, check=False)]
            assert record.memory is not None
            return Rewrite(applied, record.memory)

        # The planner's trials, timed as one phase (planner/judged.py counts the trials judged); a plan
        # from the plan cache is applied with the plain trial (no trial lowering: its time is the planning's).
        tried = progress.timed("trial lowerings")(trial)
        # The planner gets the offload as data and places chunks only through the placer (handoffs.py).
        facts = handle.facts() if handle is not None else None
        placed_facts = placed.facts() if placed is not None else None
        placer = _HandlePlacer(handle) if handle is not None else None
        # The judgments of this graph kept by earlier compiles, and in the plan cache by earlier launches:
        # only configs never judged are rewritten and lowered (planner/judged.py).
        key = plan_key(record, joint, facts, placed_facts)
        kept = judgments(key)
        if user_config.verify != "graph":  # "inductor" (options refuse it with another codegen) or "auto"
            # Judged on the device the step's memory is analysed for (an offloaded model's inputs
            # can sit on the host): "auto" lowers with Inductor only for a CUDA step.
            record.probe_inductor = progress.timed("trial lowerings")(lambda: (
                probe_inductor(record, _compile_patches(), _copy_graph_module, codegen_child.start)
                if user_config.verify_for(record.memory.device) == "inductor" else None
            ))

        if dry_run:
            # what the compile's Inductor code peaks at, where the plan is judged without lowering it
            lower = progress.timed("trial lowerings")(lambda: probe_inductor(record, _compile_patches(),
                                                                               _copy_graph_module, codegen_child.start))
            given = record.budget
            record.budget = planning_budget(given)  # planned as if unbounded when none
            if facts is not None and placer is not None:
                answer_offload(record, given, facts, placer, tried, kept, lower)  # placed, checked and removed
            answer(record, given, tried, kept, lower)  # stops the compile with the report: nothing runs
        # A plan kept from an earlier launch of this graph and budget is applied without planning
        # (planner/plan_cache.py); otherwise the planner chooses, and the choice is kept.
        if facts is not None and placer is not None:
            record.auto_plan = reuse_or_choose(
                record, key, trial, lambda: choose_offload(record, facts, placer, tried, kept=kept), placer)
            assert record.auto_plan is not None  # (choose_offload refuses a graph without blocks)
            placer.keep(record.auto_plan.config)  # the counts chosen (and left placed) are final
        elif placed_facts is not None:
            record.auto_plan = reuse_or_choose(record, key, trial,
                                               lambda: choose_for_placed(record, placed_facts, tried, kept=kept))
        else:
            record.auto_plan = reuse_or_choose(record, key, trial, lambda: choose_plan(record, tried, kept))
        if record.auto_plan is None:
            log.info("protrain_fx: graph %d has no transformer blocks: no activation plan to choose", record.index)
        else:
            record.auto_plan.phases = record.phases  # the compile's phases, as they are timed
        if record.auto_plan is not None:  # each rank chose from rank 0's measurements: the same choice
            distributed.agree({"the chosen plan and counts": (repr(record.auto_plan.config), repr(record.auto_plan.plan))},
                              f"the plan of graph {record.index}")
        record.probe_inductor = None
        if record.config.codegen == "eager":
            check_budget(record)  # with Inductor: once its allocation plan is known
        forward, backward = graphs[0]
        if self.relaunch is not None and self.relaunch.arm(record.auto_plan, record.budget):
            # the step compiled with this plan is saved for a relaunch; the save empties the node meta
            # of the backward graph it is handed, so it gets a copy and the record keeps its own
            return forward, _copy_graph_module(backward)
        return forward, backward


def deferred_handle(record: CapturedGraph) -> OffloadHandle | None:
    """The offload handle whose counts this graph's first compile chooses, if its inputs hold one."""
    found = {}
    for t in record.real_inputs():
        h = chunk_ops.deferred(t)
        if h is not None:
            found[id(h)] = h
    if len(found) > 1:
        raise ValueError(
            f"protrain_fx: graph {record.index} reads the parameters of {len(found)} offloaded models with "
            "automatic counts; one budget cannot be split among them: give n_persist / n_buffer by hand"
        )
    return next(iter(found.values()), None)


def placed_handle(record: CapturedGraph) -> OffloadHandle | None:
    """The offload handle whose counts the backend chose at an earlier compile, if this graph reads it."""
    for t in record.real_inputs():
        found = chunk_ops.offloaded(t)
        if found is not None and chunk_ops.handle(found[0]).counts_chosen:
            return chunk_ops.handle(found[0])
    return None


class _HandlePlacer:
    """The planner's :class:`~protrain_fx.planner.verify.Placer` made on an offload handle
    (``runtime/offload/handle.py``), and the backend's side of the decision it hands back: the counts
    chosen made final (:meth:`keep`). The planner holds this, never the handle."""

    def __init__(self, handle: OffloadHandle) -> None:
        self._handle = handle

    def place(self, placement: Placement) -> None:
        self._handle.configure(placement.n_persist, placement.n_buffer, placement.n_gpu_optim, fill=False)

    def set_gpu_optim(self, n_gpu_optim: int) -> None:
        self._handle.set_gpu_optim(n_gpu_optim)

    def undo(self) -> None:
        self._handle.unplace()

    def keep(self, config: Counts) -> None:
        """``config`` (the planner's choice, whose chunks it left placed) is final: the placement's
        store gets its values and the handle forgets the values it kept to place again."""
        handle = self._handle
        assert (handle.n_persist, handle.n_buffer) == (config.n_persist, config.n_buffer), "not the counts placed"
        with unset_fake_temporarily():  # (the partitioner runs under the compile's fake mode: real tensors here)
            handle.finalize()


class _RunningHandle:
    """The planner's :class:`~protrain_fx.planner.rates.RunningOffload` on an offload handle in
    training: a window on its optimizer steps (``runtime/offload/step_window.py``) opened when made,
    what the re-plan reads of the handle (read when asked), and its ``n_gpu_optim`` set."""

    def __init__(self, handle: OffloadHandle) -> None:
        self._handle = handle
        self._window = StepWindow(handle)

    @staticmethod
    def open(record: CapturedGraph) -> _RunningHandle | None:
        """The window on the offload handle whose chunks the backend placed for ``record``, when its
        offloaded chunks have optimizer steps of their own (CPU or device); else ``None``."""
        handle = placed_handle(record)
        return None if handle is None or handle.adam is None else _RunningHandle(handle)

    @property
    def chunk_params(self) -> int:
        return self._handle.chunk_params

    @property
    def spill_dir(self) -> Path:
        return spill_dir(self._handle.options.spill_dir)

    @property
    def grad_clipping(self) -> bool | None:
        return self._handle.grad_clipping

    @property
    def n_gpu_optim(self) -> int:
        return self._handle.n_gpu_optim

    def close(self) -> StepReadings:
        return self._window.close()

    def set_gpu_optim(self, n_gpu_optim: int) -> None:
        self._handle.set_gpu_optim(n_gpu_optim)


def _check_automatic_offload(record: CapturedGraph, *, answering: bool) -> None:
    """What an offload with automatic counts needs from the options (``planner.offload.choose_offload``).
    ``answering``: ``what_fits`` may ask (the counts are not chosen yet), no budget needed."""
    config = record.config
    fix = "give n_persist / n_buffer to offload(...) by hand"
    if config.dry_run:
        if answering:
            return
        raise ValueError(
            "protrain_fx.what_fits: this offloaded model's chunk counts were chosen at its first training "
            "compile and stay; what_fits answers for an offload whose counts are not chosen yet"
        )
    if not config.auto_plan:
        raise ValueError(f"protrain_fx: auto_plan=False, but offload(...) left its counts to the backend; {fix}")
    if config.plan is not None:
        raise ValueError(
            "protrain_fx: a plan by hand, but offload(...) left its counts to the backend, which chooses them "
            f"with the activation plan; leave the plan out, or {fix}"
        )
    if record.budget is None:
        raise ValueError(
            "protrain_fx: offload(...) without n_persist / n_buffer needs a memory budget to choose them: pass "
            f"options={{'memory_budget': ...}} (a CUDA device gives its own when none is given), or {fix}"
        )


def _step_graphs(forward: fx.GraphModule, backward: fx.GraphModule | None, num_user_outputs: int,
                 static_indices: set[int]) -> StepGraphs:
    """Which forward placeholders are model state (AOT's static-lifetime inputs) and which get grads."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    state = {placeholders[i].name for i in static_indices if i < len(placeholders)}
    trainable: set[str] = set()
    if backward is not None:
        out = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
        grads = list(out.args[0])
        for node, grad in zip(placeholders, grads):
            if grad is not None and node.name in state:
                trainable.add(node.name)
    return StepGraphs(
        forward=forward,
        backward=backward,
        num_user_outputs=num_user_outputs,
        state_inputs=frozenset(state),
        trainable_inputs=frozenset(trainable),
    )


def _compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], record: CapturedGraph) -> Callable:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    relaunch = open_relaunch(record)
    partitioner = _Partitioner(record, relaunch)
    waits: list[Callable[[], None]] = []  # for the backward, sent to a child to lower beside the forward
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    device = next((t.device for t in tensors if t.device.type == "cuda"), tensors[0].device if tensors else None)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):  # a training step: a backward to send
        codegen_child.warm(device)

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        phase = "inference" if kwargs.get("is_inference") else "backward" if kwargs.get("is_backward") else "forward"
        if phase == "inference":  # no backward: our partitioner never ran
            _record_inference(record, graph, inputs)
        auto = record.auto_plan  # a plan a trial lowered is in Inductor's cache: nothing for a child to do
        if phase == "forward" and partitioner.handed is not None and not (auto and auto.judged_by == "inductor"
                                                                           and not auto.from_cache):
            context = torch._guards.TracingContext.try_get()
            donated = getattr(getattr(context, "fw_metadata", None), "bw_donated_idxs", None)
            waits.append(codegen_child.start(record.index, partitioner.handed[1], donated,
                                             record.config.keep_node_order, device))
        with contextlib.ExitStack() as stack:  # (a backward lowered lazily: after the compile's recording closed)
            if progress.current() is None:
                stack.enter_context(progress.recording(record.phases, title=f"protrain_fx: graph {record.index} ({phase})"))
            with progress.phase("codegen", f"Inductor codegen ({phase})"):
                if phase == "backward" and waits:
                    waits.pop()()  # the child's code then hits Inductor's cache
                    codegen_child.shut()  # (a CUDA context it made goes before the first step)
                compiled, plan = lower(record, graph, list(inputs), phase, compile_fx_inner, _copy_graph_module, **kwargs)
        if record.rewritten is not None and record.step is not None:
            if plan is not None:
                record.rewritten = dataclasses.replace(record.rewritten,
                                                       inductor_plans={**record.rewritten.inductor_plans, phase: plan})
            if phase != "forward" or record.backward is None:
                record.rewritten = run_passes(LOWERED_PASSES, PassContext(record, record.plan))
                structured.write_timeline(record)  # (TORCH_TRACE) the analysis of the code Inductor wrote
                check_budget(record)
                if relaunch is not None:  # what a relaunch that loads this step needs of it
                    relaunch.keep(record.memory)
        return compiled

    # AOTAutograd's cache stays off but where a relaunch may load the step planned (aot_cache.py):
    # a hit skips partitioning, and with it our passes. The backward is lowered now, not at the first
    # backward: the chunk store fills beside both lowerings, and the first step waits for neither.
    try:
        with aot_cache_for(relaunch), torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile,
                                  config_patches=_compile_patches(partitioner))
    finally:
        codegen_child.shut()  # (already, where it lowered the backward)
    if relaunch is not None and relaunch.hit is not None:
        _store_hit(record, relaunch.hit)
    return compiled


def _store_hit(record: CapturedGraph, hit: Hit) -> None:
    """The step was loaded from AOTAutograd's cache: the record gets the plan it was compiled with,
    its budget and the figures of its analysis kept with it; no graph of it is here."""
    progress.end("capture")  # no partitioner ran to end it
    record.budget = hit.budget
    record.auto_plan = hit.auto
    record.rewritten = RewrittenStep(plan=hit.auto.plan, memory=hit.memory, from_aot_cache=True)
    hit.auto.phases = record.phases
    structured.write_plan(record)  # (TORCH_TRACE) the plan it runs, as a compile that plans writes it
    log.info("protrain_fx: graph %d: the step compiled with the plan cache's plan at an earlier launch, loaded from "
             "AOTAutograd's cache: no tracing, no partitioning, no lowering\n%s", record.index,
             hit.auto.table(record.index))


def _compile_patches(partitioner: PartitionerToken | None = None) -> dict[str, Any]:
    """Inductor settings of the compile besides those of each lowering (``lowering.lowering_patches``):
    our partitioner (the compile's :class:`_Partitioner`). A trial's lowering runs under them too, with
    the partitioner's token in its place, so that Inductor caches it under the key the compile of the
    same graph looks up (``lowering.py``): the token is the same either way."""
    return {"custom_partitioner_fn": partitioner if partitioner is not None else PartitionerToken()}


def _record_inference(record: CapturedGraph, graph: fx.GraphModule, inputs: Sequence[Any]) -> None:
    """Analyse a graph that needs no backward (inference, a compiled optimizer step); it runs as is."""
    if any(chunk_ops.deferred(t) for t in record.real_inputs()):
        raise UnsupportedError(
            f"protrain_fx: graph {record.index} (no backward: inference or no_grad) reads an offloaded model whose "
            "chunk counts are not chosen yet; they are chosen with the first training graph: run a training "
            "step first, or give n_persist / n_buffer to offload(...) by hand"
        )
    progress.end("capture")  # AOTAutograd has traced the graph
    if record.config.memory_budget_bytes is not None:  # checked as given: nothing is planned
        record.budget = Budget(record.config.memory_budget_bytes, "user")
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    # AOTAutograd hands fake inputs to the compiler; the Dynamo graph's real inputs, in the same
    # order, say which are parameters.
    real = record.real_inputs()
    state = {n.name for n, t in zip(placeholders, real) if isinstance(t, torch.nn.Parameter)}
    step = StepGraphs(graph, None, _num_outputs(graph), frozenset(state), frozenset())
    plan = record.config.plan
    record.rewritten = run_passes(STEP_PASSES, PassContext(
        record, plan, result=RewrittenStep(inference=graph, plan=plan, step=step)))
    check_budget(record)


def _boxed(gm: fx.GraphModule) -> Callable:
    """Run ``gm`` as FX code taking a list it empties, so inputs die at their last use (as in Inductor)."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], record: CapturedGraph) -> Callable:
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(graph: fx.GraphModule, _inputs: Sequence[Any]) -> Callable:
        return _boxed(graph)

    def inference_compiler(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        _record_inference(record, graph, inputs)
        return _boxed(graph)

    compiler = aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=fw_compiler,
        inference_compiler=inference_compiler,
        partition_fn=_Partitioner(record),
        keep_inference_input_mutations=True,
    )
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compiler(gm, example_inputs)


def _num_outputs(gm: fx.GraphModule) -> int:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return len(args) if isinstance(args, (tuple, list)) else 1


def register() -> None:
    """Make ``backend="protrain"`` resolvable when the package is used from a source tree without
    being installed (an installed package registers it through its entry point)."""
    from torch._dynamo.backends import registry

    registry.list_backends()  # loads the installed entry points first
    if "protrain" not in registry._BACKENDS and "protrain" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=protrain, name="protrain")
