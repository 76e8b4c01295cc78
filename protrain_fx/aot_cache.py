"""A relaunch's training step loaded whole from AOTAutograd's cache, when the plan cache holds its plan.

Plain ``torch.compile`` starts a relaunch from AOTAutograd's cache (``AOTAutogradCache``): the
compiled forward and backward of a Dynamo graph, found under a key of the graph, its inputs and the
compile's settings, with no tracing, partitioning or lowering. The backend plans inside its
partitioner, which a hit skips, so it keeps that cache off (``backend._compile_inductor``) except for
a compile :func:`open_relaunch` finds eligible: Inductor codegen, one process, grad on with an input
that needs it, an automatic plan for a budget known when the compile starts, the plan cache on
(``planner/plan_cache.py``), no offloaded input, and AOTAutograd's local cache on in torch's settings.
There it uses the cache under keys of its own, so that a step compiled for one plan is loaded for
that plan only:

* **Launch key**: torch's key of the compile (``autograd_cache_key``: the Dynamo graph, its inputs,
  AOTAutograd's and Inductor's settings, and the partitioner's token, a hash of the package's
  sources) hashed with what else decides the plan (``plan_cache.launch_parts``: the budget and its
  source, the options, the devices, the versions).
* **Step key**: the launch key hashed with the digest of the plan cache entry the plan is kept under
  and the plan's own (:func:`plan_digest`): the one key a compiled step is saved under. torch's key
  is looked up only when no plan is kept for the launch, and nothing is ever saved under it.
* **The row** (the plan cache file's ``"compiled"`` table, ``plan_cache.keep_compiled``): launch key
  -> the entry, the plan's digest, the memory analysis' figures of the step as compiled (its peak,
  what is live at the start, per block) and the outputs it hands back to the user's code. Written
  when the backward is lowered (Inductor's analysis is then known); dropped with its entry
  (``plan_cache.drop``: a plan refused, a first step's miss), so that the next compile plans again.

A compile wraps AOTAutograd's lookup (:meth:`Relaunch.lookups`). With a row whose entry still holds
that plan, and which the reserve measured for the code around the graph does not refuse
(``plan_cache.reuse_compiled``), the step key is looked up; a hit returns the compiled step, and the
backend stores the plan, its budget and the figures kept in the record (:class:`Hit`) and watches
the first step as for any plan. Otherwise (no row, nothing under the step key) the graph compiles as
without this cache, with AOTAutograd's save held back until the partitioner arms it with the step key
of the plan it applied (:meth:`Relaunch.arm`): only a plan the plan cache keeps, for the budget the
launch key holds. Every other compile leaves AOTAutograd's cache off, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._functorch._aot_autograd import autograd_cache
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache, should_use_local_autograd_cache

from protrain_fx import progress
from protrain_fx.analysis.memory import BlockMemory, MemoryAnalysis
from protrain_fx.analysis.timeline import Timeline
from protrain_fx.capture import Budget, CapturedGraph
from protrain_fx.planner.budget import budget_on, tensors_device, wants_auto_plan
from protrain_fx.planner.plan_cache import (
    compiled_row,
    device_str,
    enabled,
    keep_compiled,
    launch_parts,
    reuse_compiled,
    step_device,
)
from protrain_fx.planner.reserve import ReturnedOutput
from protrain_fx.planner.result import AutoPlan
from protrain_fx.profile.cache import plan_cache_path
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.parallel import distributed

log = logging.getLogger("protrain_fx")


@dataclass(frozen=True)
class Hit:
    """A step loaded from AOTAutograd's cache: the plan it was compiled with (from the plan cache),
    the figures of its memory analysis kept with it, and the budget it was planned for."""

    auto: AutoPlan
    memory: MemoryAnalysis
    budget: Budget


def open_relaunch(record: CapturedGraph) -> Relaunch | None:
    """The use of AOTAutograd's cache by the compile of ``record`` (module docstring), ``None`` where
    the compile keeps it off (as every compile did before)."""
    tensors = [t for t in record.real_inputs() if isinstance(t, torch.Tensor)]
    if not _served(record, tensors):
        return None
    budget = budget_on(record, tensors_device(tensors), warn=False)  # the partitioner warns
    if budget is None:
        return None
    devices = sorted({device_str(t.device) for t in tensors})
    return Relaunch(record.index, step_device(devices), budget, launch_parts(record.config, budget, devices))


def _served(record: CapturedGraph, tensors: list[torch.Tensor]) -> bool:
    """Whether the compile of ``record`` (its input ``tensors``) may use AOTAutograd's cache: a
    training step of one process that the backend plans with Inductor for one shape, the plan cache
    on, no input offloaded, and AOTAutograd's local cache on in torch's settings."""
    config = record.config
    return (config.codegen == "inductor" and not config.dry_run and enabled() and should_use_local_autograd_cache()
            and distributed.active() is None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and wants_auto_plan(record, budget_needed=False) and not _dynamic(record)
            and not any(chunk_ops.offloaded(t) or chunk_ops.deferred(t) for t in tensors))


def _dynamic(record: CapturedGraph) -> bool:
    """Whether the Dynamo graph has a symbolic size (``dynamic=True``, or a size Dynamo marked dynamic
    after a recompile): its plan is sized for one shape (``planner.activations.specialize_shapes``)."""
    for node in record.dynamo_graph.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))):
            return True
    return False


class Relaunch:
    """One compile's use of AOTAutograd's cache (module docstring): :meth:`lookups` around the
    compile, :meth:`arm` from the partitioner, :meth:`keep` when the backward is lowered; ``hit``:
    the step loaded, if it was."""

    def __init__(self, index: int, device: str, budget: Budget, parts: dict[str, Any]) -> None:
        self.index, self.device, self.budget, self.parts = index, device, budget, parts
        self.path = plan_cache_path(device)
        #: The launch key, once torch's key of the compile is known (``None``: AOTAutograd bypassed its cache).
        self.launch: str | None = None
        self.hit: Hit | None = None
        self._candidate: Hit | None = None
        self._looked_up = False
        self._aot_config: Any = None
        self._info: Any = None  # AOTAutograd's save, held back until armed
        self._armed: tuple[AutoPlan, str] | None = None

    @contextlib.contextmanager
    def lookups(self) -> Iterator[None]:
        """AOTAutograd's cache on for the compile, its lookup keyed as the module docstring says."""
        static = AOTAutogradCache.__dict__["try_load"]  # restored as it was, staticmethod and all
        AOTAutogradCache.try_load = staticmethod(self._try_load(AOTAutogradCache.try_load))
        try:
            with torch._functorch.config.patch(enable_autograd_cache=True):
                yield
        finally:
            AOTAutogradCache.try_load = static

    def _try_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def try_load(mod: Any, args: Any, aot_config: Any, *rest: Any, **kwargs: Any) -> Any:
            if self._looked_up:  # another graph compiled inside this compile: its cache stays off
                return None
            self._looked_up = True
            with progress.phase("aot cache", "AOTAutograd's cache"), self._keyed():
                compiled = original(mod, args, aot_config, *rest, **kwargs)
            if compiled is not None and self._candidate is not None:
                self.hit = self._candidate
                return compiled
            if compiled is None and aot_config.cache_info is not None:
                # a miss: nothing is saved unless the partitioner arms the save with the step key
                self._aot_config, self._info = aot_config, aot_config.cache_info
                aot_config.cache_info = None
            # (an entry under torch's key is none of ours: the graph compiles, and nothing is saved)
            return None

        return try_load

    @contextlib.contextmanager
    def _keyed(self) -> Iterator[None]:
        """``autograd_cache_key`` answering with the step key of the plan kept for the launch, else torch's key."""
        original = autograd_cache.autograd_cache_key

        def key(*args: Any, **kwargs: Any) -> tuple[str, list[str]]:
            torch_key, lines = original(*args, **kwargs)
            self.launch = _digest(torch_key, self.parts)
            step = self._kept_step()
            return (step if step is not None else torch_key), lines

        autograd_cache.autograd_cache_key = key
        try:
            yield
        finally:
            autograd_cache.autograd_cache_key = original

    def _kept_step(self) -> str | None:
        """The step key of the plan kept for this launch, with the :class:`Hit` it makes as the
        candidate; ``None`` when none is kept, or it is refused."""
        assert self.launch is not None
        row = compiled_row(self.path, self.launch)
        if row is None:
            return None
        try:
            memory, returned = memory_from_dict(row["memory"]), returned_from_list(row["returned"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.debug("protrain_fx: graph %d: the compiled step's row in %s does not parse (%s)", self.index,
                      self.path, e)
            return None
        auto = reuse_compiled(self.index, self.path, row["entry"], self.device, returned)
        if auto is None or plan_digest(auto) != row.get("plan"):
            return None
        auto.from_aot_cache = True
        self._candidate = Hit(auto, memory, self.budget)
        return step_key(self.launch, auto)

    def arm(self, auto: AutoPlan | None, budget: Budget | None) -> bool:
        """The partitioner applied ``auto`` under ``budget``: AOTAutograd saves the step under its step
        key when the plan cache keeps that plan for the launch's budget (``True``); otherwise it saves
        nothing (``False``)."""
        if self._info is None or self.launch is None or auto is None or budget != self.budget:
            return False
        if auto.offload or not auto.cache_key:
            return False
        key = step_key(self.launch, auto)
        self._aot_config.cache_info = dataclasses.replace(self._info, cache_key=key)
        self._armed = (auto, key)
        return True

    def keep(self, memory: MemoryAnalysis | None) -> None:
        """The backward is lowered and ``memory`` is the step's analysis: keep the row that a later
        launch loads the step by (nothing when the save was not armed)."""
        if self._armed is None or memory is None:
            return
        auto, key = self._armed
        keep_compiled(auto, self.launch, {
            "plan": plan_digest(auto),
            "memory": memory_to_dict(memory),
            "returned": [dataclasses.astuple(r) for r in auto.returned],
        })
        log.info("protrain_fx: graph %d: the compiled step is kept in AOTAutograd's cache under %s, for a "
                 "relaunch with this plan", self.index, key)


@contextlib.contextmanager
def aot_cache_for(relaunch: Relaunch | None) -> Iterator[None]:
    """The compile's AOTAutograd cache: keyed by ``relaunch`` (:meth:`Relaunch.lookups`), or off
    without one (a hit would skip the partitioner, and with it the plan and the passes)."""
    if relaunch is None:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
        return
    with relaunch.lookups():
        yield


def plan_digest(auto: AutoPlan) -> str:
    """A hash of the plan ``auto`` applies: its per-block policies and its counts."""
    return _digest(auto.plan.to_dict(), auto.config.to_dict())


def step_key(launch: str, auto: AutoPlan) -> str:
    """The key the step compiled with ``auto``'s plan for the launch ``launch`` is saved under
    (module docstring); ``a`` first, as AOTAutograd's own keys."""
    return "a" + _digest(launch, auto.cache_key, plan_digest(auto))


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def memory_to_dict(memory: MemoryAnalysis) -> dict[str, Any]:
    """The figures of ``memory`` kept with a compiled step: its totals, the timeline's start and the
    per-block rows (not the per-node timeline)."""
    return {
        "device": memory.device,
        "peak_bytes": memory.peak_bytes,
        "baseline_bytes": dict(memory.timeline.baseline_bytes),
        "totals": [memory.parameter_bytes, memory.gradient_bytes, memory.optimizer_state_bytes,
                   memory.input_bytes, memory.saved_activation_bytes],
        "blocks": [dataclasses.astuple(b) for b in memory.blocks],
    }


def memory_from_dict(raw: dict[str, Any]) -> MemoryAnalysis:
    """The :class:`MemoryAnalysis` of :func:`memory_to_dict`'s figures: a timeline with its start and
    peak and no events."""
    device, peak = str(raw["device"]), int(raw["peak_bytes"])
    baseline = {str(k): int(v) for k, v in raw["baseline_bytes"].items()}
    timeline = Timeline(kind="predicted", device=device, events=(), baseline_bytes=baseline, peak_bytes=peak,
                        label="the compiled step's analysis, kept with it (no per-node timeline)")
    params, grads, optimizer, inputs, saved = (int(v) for v in raw["totals"])
    return MemoryAnalysis(device, timeline, peak, None, params, grads, optimizer, inputs, saved,
                          tuple(BlockMemory(*b) for b in raw["blocks"]))


def returned_from_list(raw: list[Any]) -> tuple[ReturnedOutput, ...]:
    """The outputs returned to the user's code as kept with a compiled step (``dataclasses.astuple`` of each)."""
    return tuple(ReturnedOutput(int(i), tuple(int(d) for d in shape), str(dtype), int(nbytes))
                 for i, shape, dtype, nbytes in raw)
