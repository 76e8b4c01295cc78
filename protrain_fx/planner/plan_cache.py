"""The plan cache: a plan chosen once is applied again at a later launch, without planning again.

Planning a graph costs the ops' profiles, the search and the trial rewrites (and Inductor lowerings)
that verify the plans: minutes on a large model. :func:`reuse_or_choose` wraps the planner's choice
(``planner.activations.choose_plan``, ``planner.offload.choose_offload``):

* **Key** (:class:`PlanKey`): a hash of the joint forward+backward graph's structure (every node's
  op, target, arguments and output shapes, strides, dtypes and devices: the input shapes and dtypes
  are those of its placeholders; AOTAutograd names nodes the same way at every launch, Dynamo's
  graph does not always), the memory budget and where it came from, the devices' names, the torch
  and protrain_fx versions (and a hash of the package's sources), the options that change planning
  (``codegen``, ``optimizer``, ``keep_node_order``, ``machine``, ``verify``) and, for a model
  offloaded without counts, its chunk layout and dtypes; for a later input shape of such a model
  (its counts chosen by the first graph: ``planner.offload.choose_for_placed``), the counts as
  placed too, so its activation plan is applied for the same placement only.
* **File**: one JSON file per device beside its machine profile
  (``profile.cache.plan_cache_path``, under ``$PROTRAIN_CACHE_DIR``), ``{"version", "plans": {digest:
  entry}}``. An entry holds what the planner hands back (:class:`~protrain_fx.planner.result.AutoPlan`:
  the activation plan, the counts, the cost model's problem, the cap and reserve it was chosen
  under), the graph-level analysed peak of the plan applied, and the key's parts in clear. At most
  :data:`MAX_ENTRIES` are kept, the newest.
* **A hit**: the chunks are placed with the counts (an offload), the step is partitioned once with
  the plan and analysed: no search, no other trial, no Inductor lowering to verify. The plan is
  refused (and the entry dropped, the planner runs) when that analysis is above both the peak
  stored and the cap, and skipped when this process measured more room for the code around the
  graph than the entry kept and the plan's judged peak no longer fits under the cap that leaves (a
  reserve grown by a few percent keeps a plan that still fits). A plan taken keeps the measured
  reserve, not its own: its first step plans again only after a miss, not for a faster plan that a
  reserve measured smaller than the one it kept would allow (that plan is worth a lowering at the
  launch that measured it, not at every launch after).
* **Judgments** (``planner/judged.py``): every trial's judged peak of the graph, under a key without
  the budget, beside the plans (``"judged"``). A planner that runs (a miss, a refused entry, another
  budget) answers the trials judged before from them: it lowers only configs never judged. The first step's peak is measured as for any plan
  (``planner/first_step.py``): a miss there (or a faster plan found from the measured reserve)
  drops the entry, and the graph compiled again is planned and stored anew.
* **Replaced**: the plan chosen when that graph is compiled again is kept under the dropped entry
  too (an offloaded model's graph compiled again has its counts placed, a key of its own): the next
  launch applies it without planning.
* **Measured reserve** (``"outside"``): what the code around a graph held at a first step, by the
  graph's structure (:func:`keep_outside`). A later launch plans with it from the start
  (:func:`seed_outside`), as a later compile of the same process does, and is not planned again
  after its first step because an estimate of it was off.
* **Compiled steps** (``"compiled"``): by launch key (``aot_cache.py``: torch's key of the compile
  and :func:`launch_parts`), the entry whose plan the step was compiled with, the plan's digest and
  the figures of the step's analysis (:func:`keep_compiled`): a relaunch keyed alike loads that step
  from AOTAutograd's cache, its plan taken from the entry without a trial (:func:`reuse_compiled`).
  A row goes with its entry (:func:`drop`).
* **Data-parallel**: the key holds the ranks (world size, ranks per node, backend); rank 0's entry
  is every rank's, and one rank's refusal every rank's, so the ranks apply a plan, or search, alike.
* ``PROTRAIN_PLAN_CACHE=0`` turns it off (nothing read or written). A file that cannot be read or
  parsed, or an entry that does not parse, is ignored with a warning and written over.

What is not in the key: the host memory free now (which chunks an offload makes lean), the
machine's measured rates (a plan is still valid when they change, only perhaps not the fastest;
delete the file to plan again) and the room measured for the code around the graph (the entry
keeps the reserve it was chosen with, and is refused when more is measured and it no longer fits).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import unset_fake_temporarily

from protrain_fx import progress, settings
from protrain_fx.capture import Budget, CapturedGraph
from protrain_fx.config import ProtrainConfig
from protrain_fx.handoffs import ChunkFacts, Placement
from protrain_fx.plan import Plan
from protrain_fx.planner import verify
from protrain_fx.planner.judged import Judgment, judge_key, kept_for
from protrain_fx.planner.reserve import ReturnedOutput, returned_outputs, returned_seconds
from protrain_fx.planner.result import AutoPlan
from protrain_fx.profile.cache import (
    device_name,
    plan_cache_path,
    read_json,
    write_json,
)
from protrain_fx.runtime.parallel import distributed
from protrain_fx.search.cost import CostModel
from protrain_fx.search.problem import Counts, Problem, block_plan
from protrain_fx.search.spread import expected_estimate
from protrain_fx.state import STATE
from protrain_fx.version import __version__

log = logging.getLogger("protrain_fx")

#: Version of the plan cache file; a file of another version is ignored (and written over).
PLAN_CACHE_VERSION = 2

#: The environment variable that turns the cache off when ``"0"`` (``docs/options.md``).
ENV = settings.PLAN_CACHE

#: Entries kept per file (the newest): one per graph, budget and shape planned on this machine.
MAX_ENTRIES = 64


def enabled() -> bool:
    """Whether the plan cache is on: unless ``PROTRAIN_PLAN_CACHE`` is ``0`` (or ``false``, ``off``, ``no``)."""
    return settings.plan_cache()


@dataclass(frozen=True)
class PlanKey:
    """Where a plan is cached: ``path`` (the file) and ``digest`` (the entry), and the key's parts."""

    path: Path
    digest: str
    parts: dict[str, Any]
    #: The device the step is planned for (``"cuda:0"``), whose file ``path`` is.
    device: str = "cpu"


def reuse_or_choose(
    record: CapturedGraph,
    key: PlanKey,
    trial: verify.TrialFn,
    choose: Callable[[], AutoPlan | None],
    placer: verify.Placer | None = None,
) -> AutoPlan | None:
    """The plan of ``record`` from the cache (module docstring), else ``choose()``'s, stored for
    the next launch with the judgments of the graph (``planner/judged.py``). ``key``:
    :func:`plan_key` of the graph; ``trial``: the partitioner's (partitions and analyses with a
    plan); ``placer``: places the chunks of the offload whose counts are chosen (the counts
    returned are left placed, for the backend to make final)."""
    if not enabled():
        return choose()
    seed_outside(record.index, key)
    auto = reuse(record, key, trial, placer)
    if auto is not None:
        return auto
    auto = choose()
    if auto is not None:
        store(record, key, auto)
    return auto


def seed_outside(index: int, key: PlanKey) -> int | None:
    """What the code around ``key``'s graph (graph ``index``) held at a first step of an earlier launch (kept by
    :func:`keep_outside`), made this process' measured reserve on the device unless a first step
    of this process measured one: the plan is chosen with it from the start, not chosen again after
    a first step (rank 0's file on every rank). The bytes seeded, or ``None``."""
    if key.device in STATE.measured_outside:
        return None
    kept = distributed.from_rank0(_outside(key.path).get(key.parts["graph"]))
    if not isinstance(kept, int) or isinstance(kept, bool) or kept < 0:
        return None
    STATE.measured_outside[key.device] = kept
    log.info("protrain_fx: graph %d: the code around this graph held %d bytes at a first step of an earlier "
             "launch (%s): kept under the cap for it", index, kept, key.path)
    return kept


def keep_outside(auto: AutoPlan, outside: int) -> None:
    """Keep ``outside`` (bytes the code around ``auto``'s graph held at its first step) in the plan
    cache file under the graph's structure, the most measured (a file that cannot be written: a
    debug line). Nothing when the cache is off or the plan is not kept there."""
    if not enabled() or not auto.cache_file or not auto.graph_key:
        return
    path = Path(auto.cache_file)
    table = _outside(path)
    if table.get(auto.graph_key, -1) >= outside:
        return
    _put_newest(path, "outside", table, auto.graph_key, outside, "the measured reserve")


def judgments(key: PlanKey) -> dict[str, Judgment]:
    """The judgments of the graph of ``key`` kept in this process (``planner.judged.kept_for``), with
    those the plan cache file keeps for it added when the cache is on (rank 0's file on every rank)."""
    kept = kept_for(judge_key(key.parts))
    if not enabled():
        return kept
    raw = distributed.from_rank0(_judged(key.path).get(judge_key(key.parts)))
    if isinstance(raw, dict):
        for trial, value in raw.items():
            try:
                kept.setdefault(trial, Judgment.from_list(value))
            except (TypeError, ValueError, KeyError):
                continue  # an entry that does not parse is left out (and written over at the next store)
    return kept


def plan_key(
    record: CapturedGraph, joint: fx.GraphModule, facts: ChunkFacts | None = None,
    placed: ChunkFacts | None = None,
) -> PlanKey:
    """The key of ``record``'s plan (module docstring). ``facts``: the offload whose counts are
    chosen; ``placed``: the offload whose counts an earlier graph chose (``ChunkFacts.placed``)."""
    offload = facts or placed
    devices = sorted({device_str(t.device) for t in _tensors_of(joint)} | ({device_str(offload.device)} if offload else set()))
    parts: dict[str, Any] = {
        "graph": graph_digest(joint),
        **launch_parts(record.config, record.budget, devices),
        "offload": _offload_key(facts) if facts is not None else None,
    }
    if placed is not None:  # the counts an earlier graph chose: this plan holds for them only
        assert placed.placed is not None
        counts = placed.placed
        parts["placed"] = {**_offload_key(placed), "counts": [counts.n_persist, counts.n_buffer, counts.n_gpu_optim]}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    device = step_device(devices)
    return PlanKey(plan_cache_path(device), digest, parts, device)


def launch_parts(config: ProtrainConfig, budget: Budget | None, devices: list[str]) -> dict[str, Any]:
    """The parts of a plan's key besides the graph and the offload (module docstring): the budget and
    where it came from, the names of ``devices`` (``device_str`` names, sorted), the versions and
    sources, and the options that change planning."""
    return {
        "budget_bytes": budget.bytes if budget is not None else None,
        "budget_source": budget.source if budget is not None else "user",
        "devices": [device_name(d) for d in devices],
        "torch": torch.__version__,
        "protrain_fx": __version__,
        "sources": source_digest(),
        "options": {
            "codegen": config.codegen,
            "optimizer": config.optimizer,
            "keep_node_order": config.keep_node_order,
            "machine": dict(config.machine) if config.machine else None,
            "verify": config.verify,
            "accumulation_steps": config.accumulation_steps,
        },
    }


def step_device(devices: list[str]) -> str:
    """The device a step on ``devices`` (``device_str`` names) is planned for, whose plan cache file
    holds its plans: the first CUDA device, else the first, else the CPU."""
    return next((d for d in devices if d.startswith("cuda")), devices[0] if devices else "cpu")


def reuse(
    record: CapturedGraph, key: PlanKey, trial: verify.TrialFn, placer: verify.Placer | None = None
) -> AutoPlan | None:
    """Apply the entry of ``key`` to ``record`` (module docstring, "a hit") and return its
    :class:`AutoPlan`; ``None`` when there is none or it is refused (the planner chooses then).
    ``placer``: an offload's chunks are placed with the entry's counts (``None``: not an offload
    whose counts are chosen), and left placed when the entry is taken (the backend makes them final)."""
    # data-parallel: rank 0's file decides for every rank (each rank must search, or apply, alike)
    raw = distributed.from_rank0(_entries(key.path).get(key.digest))
    if raw is None:
        return None
    started = time.perf_counter()
    entry = _parsed(raw, record.index, key.path)
    if entry is None:
        return None
    config = entry["config"]
    if placer is not None:  # timed apart from the rest of the hit (the rewrite and its analysis)
        with unset_fake_temporarily(), progress.phase("place", "placing the chunks"):  # (out of the compile's fake mode)
            placer.place(Placement(config.n_persist, config.n_buffer, config.n_gpu_optim))
    trial(entry["plan"])
    assert record.memory is not None
    peak = record.memory.peak_bytes
    refusal = ""
    if peak > max(entry["graph_peak_bytes"], entry["allocated_cap_bytes"]):
        refusal = (f"the plan analyses at {peak} bytes, above the {entry['graph_peak_bytes']} stored and the cap "
                   f"of {entry['allocated_cap_bytes']}")
        drop(key.path, key.digest)
    else:
        refusal = _reserve_refusal(entry, STATE.measured_outside.get(record.memory.device, 0))
    refusal = next((r for r in distributed.gather(refusal) if r), "")  # one rank's refusal is every rank's
    if refusal:
        log.warning("protrain_fx: graph %d: the plan cache's plan (%s) is not used: %s; the plan is chosen again",
                    record.index, key.path, refusal)
        if placer is not None:
            with unset_fake_temporarily():
                placer.undo()
        return None
    auto = _taken(entry, key, record.memory.device, tuple(returned_outputs(record)), started)
    log.info("protrain_fx: graph %d: plan from the plan cache (%s): n_persist=%d, n_buffer=%d, n_gpu_optim=%d, "
             "n_swap=%d, n_checkpoint=%d; no search, no trial lowerings", record.index, key.path, config.n_persist,
             config.n_buffer, config.n_gpu_optim, config.n_swap, config.n_checkpoint)
    return auto


def reuse_compiled(index: int, path: Path, digest: str, device: str, returned: tuple[ReturnedOutput, ...]
                   ) -> AutoPlan | None:
    """The :class:`AutoPlan` of the entry ``digest`` of ``path`` for graph ``index``, whose step
    compiled with that plan is loaded whole (``aot_cache.py``: no graph to rewrite or analyse here);
    ``returned``: the outputs the step hands back to the user's code, as kept with it. ``None``
    when the cache is off, the entry is gone or does not parse, or the reserve measured on
    ``device`` (this process, or seeded from the file: :func:`seed_outside`) refuses it as
    :func:`reuse` does. One process only: the ranks of a data-parallel step plan through :func:`reuse`."""
    raw = _entries(path, warn=False).get(digest) if enabled() else None
    if raw is None:
        return None
    started = time.perf_counter()
    entry = _parsed(raw, index, path, warn=False)  # (the compile that follows reads it again, and warns)
    if entry is None or not isinstance(entry.get("key"), dict):
        return None
    key = PlanKey(path, digest, entry["key"], device)
    seed_outside(index, key)
    refusal = _reserve_refusal(entry, STATE.measured_outside.get(device, 0))
    if refusal:
        log.info("protrain_fx: graph %d: the step compiled with the plan cache's plan (%s) is not loaded: %s",
                 index, path, refusal)
        return None
    return _taken(entry, key, device, returned, started)


def _parsed(raw: Any, index: int, path: Path, *, warn: bool = True) -> dict[str, Any] | None:
    """The entry ``raw`` of the plan cache ``path`` parsed (:func:`_parse`), ``None`` when it does not
    parse (with a warning when ``warn``)."""
    try:
        return _parse(raw)
    except (KeyError, TypeError, ValueError) as e:
        if warn:
            log.warning("protrain_fx: graph %d: the plan cache's entry in %s does not parse (%s: %s); it is ignored "
                        "and the plan is chosen again", index, path, type(e).__name__, e)
        return None


def _reserve_refusal(entry: dict[str, Any], measured: int) -> str:
    """Why the plan of ``entry`` is refused under ``measured`` bytes kept for the code around the
    graph (module docstring, "a hit"); ``""``: taken."""
    room = entry["allocated_cap_bytes"] + entry["reserve_bytes"] - measured  # the cap under the measured reserve
    if measured > entry["reserve_bytes"] and entry["analysed_peak_bytes"] > room:
        return (f"this process measured {measured} bytes for the code around the graph, more than the "
                f"{entry['reserve_bytes']} the plan kept, and with it the plan's judged peak of "
                f"{entry['analysed_peak_bytes']} bytes is over the cap of {room}")
    return ""


def _taken(entry: dict[str, Any], key: PlanKey, device: str, returned: tuple[ReturnedOutput, ...],
           started: float) -> AutoPlan:
    """The :class:`AutoPlan` of ``entry`` (parsed), kept under ``key``, taken for a step on ``device``
    handing ``returned`` back to the user's code; ``started``: when taking it began."""
    config, problem, spread = entry["config"], entry["problem"], entry["rate_spread"]
    measured = STATE.measured_outside.get(device, 0)
    # A reserve measured in this process or an earlier launch (seed_outside) replaces the one the plan
    # kept: the cap is the one under it, and the first step does not plan again because an estimate
    # of it was off (taking the kept plan is that decision, made without a lowering).
    known = device in STATE.measured_outside
    return AutoPlan(
        plan=entry["plan"],
        config=config,
        estimate=expected_estimate(problem, config, spread) if spread else CostModel(problem).estimate(config),
        problem=problem,
        budget_bytes=entry["budget_bytes"],
        allocated_cap_bytes=(entry["allocated_cap_bytes"] + entry["reserve_bytes"] - measured if known
                             else entry["allocated_cap_bytes"]),
        predicted_peak_bytes=entry["predicted_peak_bytes"],
        analysed_peak_bytes=entry["analysed_peak_bytes"],
        empty_peak_bytes=entry["empty_peak_bytes"],
        empty_step_s=entry["empty_step_s"],
        how=entry["how"],
        budget_source=entry["budget_source"],
        reserve_bytes=measured if known else entry["reserve_bytes"],
        reserve_source="measured" if known else entry["reserve_source"],
        returned=returned,
        around_estimate_s=returned_seconds(returned, device, key.parts.get("machine")),  # the option's overrides
        rate_spread=spread,
        offload=entry["offload"],
        choose_s=time.perf_counter() - started,
        judged_by=entry["judged_by"],
        empty_by_inductor=entry["empty_by_inductor"],
        cache_file=str(key.path),
        cache_key=key.digest,
        graph_key=key.parts["graph"],
        from_cache=True,
    )


def store(record: CapturedGraph, key: PlanKey, auto: AutoPlan) -> None:
    """Keep ``auto`` (just chosen for ``record``, whose graphs are as of it) under ``key``; a file
    that cannot be written is left with a warning."""
    assert record.memory is not None
    entry = {
        "key": key.parts,
        "plan": auto.plan.to_dict(),
        "config": auto.config.to_dict(),
        "problem": auto.problem.to_dict(),
        "graph_peak_bytes": record.memory.peak_bytes,
        "budget_bytes": auto.budget_bytes,
        "allocated_cap_bytes": auto.allocated_cap_bytes,
        "predicted_peak_bytes": auto.predicted_peak_bytes,
        "analysed_peak_bytes": auto.analysed_peak_bytes,
        "empty_peak_bytes": auto.empty_peak_bytes,
        "empty_step_s": auto.empty_step_s,
        "how": auto.how,
        "budget_source": auto.budget_source,
        "reserve_bytes": auto.reserve_bytes,
        "reserve_source": auto.reserve_source,
        "rate_spread": auto.rate_spread,
        "offload": auto.offload,
        "judged_by": auto.judged_by,
        "empty_by_inductor": auto.empty_by_inductor,
    }
    plans = _entries(key.path, warn=False)
    keys = [key]
    replaced = _REPLACED.pop(key.parts["graph"], None)
    if replaced is not None and replaced.path == key.path and replaced.digest != key.digest:
        keys.append(replaced)  # the entry a first step dropped (module docstring, "replaced")
    for k in keys:
        plans.pop(k.digest, None)
        plans[k.digest] = {**entry, "key": k.parts}  # the newest last
    while len(plans) > MAX_ENTRIES:
        plans.pop(next(iter(plans)))
    judged = _judged(key.path)
    graph = judge_key(key.parts)
    judged.pop(graph, None)
    judged[graph] = {trial: j.to_list() for trial, j in kept_for(graph).items()}  # the newest last
    while len(judged) > MAX_ENTRIES:
        judged.pop(next(iter(judged)))
    try:
        _write(key.path, plans=plans, judged=judged)
    except OSError as e:
        log.warning("protrain_fx: graph %d: the plan could not be kept in the plan cache %s (%s)",
                    record.index, key.path, e)
        return
    auto.cache_file, auto.cache_key, auto.graph_key = str(key.path), key.digest, key.parts["graph"]
    log.info("protrain_fx: graph %d: plan kept in the plan cache (%s)%s", record.index, key.path,
             "; also under the entry its first compile's plan had" if len(keys) > 1 else "")


#: Entries a first step dropped, by their graph's structure: the plan chosen when that graph is
#: compiled again is kept under them too (module docstring, "replaced"). ``protrain_fx.reset()`` forgets them.
_REPLACED: dict[str, PlanKey] = {}
STATE.on_reset(_REPLACED.clear)


def _write(path: Path, *, plans: dict[str, Any] | None = None, judged: dict[str, Any] | None = None,
           outside: dict[str, Any] | None = None, compiled: dict[str, Any] | None = None) -> None:
    """Write the plan cache ``path`` with the tables given, the others as the file has them."""
    write_json(path, {"version": PLAN_CACHE_VERSION,
                      "plans": _entries(path, warn=False) if plans is None else plans,
                      "judged": _judged(path) if judged is None else judged,
                      "outside": _outside(path) if outside is None else outside,
                      "compiled": _compiled(path) if compiled is None else compiled})


def keep_compiled(auto: AutoPlan, launch: str, row: dict[str, Any]) -> None:
    """Keep ``row`` (what ``aot_cache.py`` keeps of the step compiled with ``auto``'s plan) under
    ``launch`` (its launch key) in the plan cache file of ``auto``'s entry, with that entry's digest
    (module docstring, "compiled steps"); a file that cannot be written: a debug line. Nothing when
    the cache is off or the plan is not kept there."""
    if not enabled() or not auto.cache_file or not auto.cache_key:
        return
    path = Path(auto.cache_file)
    table = _compiled(path)
    _put_newest(path, "compiled", table, launch, {**row, "entry": auto.cache_key}, "the compiled step's row")


def _put_newest(path: Path, name: str, table: dict[str, Any], key: str, value: Any, what: str) -> None:
    """``table`` (the file's table ``name``) with ``key`` set to ``value`` as its newest item, the
    oldest dropped past :data:`MAX_ENTRIES`, written back; a write that fails only loses ``what``."""
    table.pop(key, None)
    table[key] = value  # the newest last
    while len(table) > MAX_ENTRIES:
        table.pop(next(iter(table)))
    try:
        _write(path, **{name: table})
    except OSError as e:
        log.debug("protrain_fx: %s could not be kept in the plan cache %s (%s)", what, path, e)


def compiled_row(path: Path, launch: str) -> dict[str, Any] | None:
    """The row :func:`keep_compiled` kept under ``launch`` in the plan cache ``path`` whose entry is
    still there; ``None`` when the cache is off or there is none."""
    if not enabled():
        return None
    row = _compiled(path).get(launch)
    if not isinstance(row, dict) or row.get("entry") not in _entries(path, warn=False):
        return None
    return row


def drop(path: str | Path, digest: str) -> dict[str, Any] | None:
    """Remove the entry ``digest`` from the plan cache ``path``, with the compiled steps' rows that
    point at it (a launch keyed as one of them plans again, and loads no step compiled with the plan
    dropped); the entry removed, ``None`` when none was there or the file could not be written."""
    path = Path(path)
    plans = _entries(path, warn=False)
    entry = plans.pop(digest, None)
    if entry is None:
        return None
    compiled = {launch: row for launch, row in _compiled(path).items()
                if not (isinstance(row, dict) and row.get("entry") == digest)}
    try:
        _write(path, plans=plans, compiled=compiled)
    except OSError as e:
        log.warning("protrain_fx: the plan cache %s could not be written (%s)", path, e)
        return None
    return entry


def drop_after_miss(auto: AutoPlan, index: int, why: str) -> None:
    """After the first step of ``auto`` made its graph compile again (``planner/first_step.py``): its
    cached entry is dropped, and the plan chosen when the graph is compiled again is kept under it
    (module docstring, "replaced")."""
    if not (auto.cache_key and auto.cache_file):
        return
    entry = drop(auto.cache_file, auto.cache_key)
    if entry is None:
        return
    parts = entry.get("key")
    if isinstance(parts, dict) and isinstance(parts.get("graph"), str):
        _REPLACED[parts["graph"]] = PlanKey(Path(auto.cache_file), auto.cache_key, parts)
    log.info("protrain_fx: graph %d: the plan's entry in the plan cache (%s) is dropped: %s; the plan chosen "
             "again takes its place", index, auto.cache_file, why)


def graph_digest(gm: fx.GraphModule) -> str:
    """A hash of ``gm``'s structure: per node its op, name, target, arguments (nodes by name) and the
    shapes, strides, dtypes and devices of what it computes. Addresses printed in a ``repr`` are left out."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
        line = f"{node.op}|{node.name}|{_target_name(node.target)}|{_no_addresses(repr(args))}|{_value(node.meta.get('val'))}"
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


@functools.cache
def source_digest() -> str:
    """A hash of the package's sources: a plan chosen by other code is not reused."""
    root = Path(__file__).resolve().parents[1]
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))).hexdigest()


def _entries(path: Path, *, warn: bool = True) -> dict[str, Any]:
    """The entries of the plan cache ``path`` (empty: no file, another version, or one that does not
    read, with a warning when ``warn``)."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        if warn:
            log.warning("protrain_fx: the plan cache %s cannot be read (%s: %s); it is ignored and written over",
                        path, type(e).__name__, e)
        return {}
    if data is None or data.get("version") != PLAN_CACHE_VERSION:
        return {}
    plans = data.get("plans")
    if not isinstance(plans, dict):
        if warn:
            log.warning("protrain_fx: the plan cache %s has no plans table; it is ignored and written over", path)
        return {}
    return plans


def _judged(path: Path) -> dict[str, Any]:
    """The judgments table of the plan cache ``path`` (judge key -> trial key -> judgment as a list;
    empty: no file, another version, or none there). Errors are :func:`_entries`'s to report."""
    return _table(path, "judged")


def _outside(path: Path) -> dict[str, Any]:
    """The measured-reserve table of the plan cache ``path`` (graph structure -> bytes the code
    around it held at a first step; empty: no file, another version, or none there)."""
    return _table(path, "outside")


def _compiled(path: Path) -> dict[str, Any]:
    """The compiled steps' table of the plan cache ``path`` (launch key -> row: :func:`keep_compiled`;
    empty: no file, another version, or none there)."""
    return _table(path, "compiled")


def _table(path: Path, name: str) -> dict[str, Any]:
    """The table ``name`` of the plan cache ``path``; empty when the file is missing, unreadable, of
    another version, or has no such table."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    if data is None or data.get("version") != PLAN_CACHE_VERSION or not isinstance(data.get(name), dict):
        return {}
    return data[name]


def _parse(raw: Any) -> dict[str, Any]:
    """An entry as read, with its plan, counts and problem made objects and its numbers checked."""
    if not isinstance(raw, dict):
        raise TypeError(f"an entry is a {type(raw).__name__}, not an object")
    entry = dict(raw)
    entry["plan"] = Plan.from_dict(raw["plan"])
    entry["config"] = Counts.from_dict(raw["config"])
    entry["problem"] = Problem.from_dict(raw["problem"])
    for name in ("graph_peak_bytes", "budget_bytes", "allocated_cap_bytes", "predicted_peak_bytes",
                 "analysed_peak_bytes", "empty_peak_bytes", "reserve_bytes"):
        if not isinstance(raw[name], int) or isinstance(raw[name], bool):
            raise TypeError(f"{name} is not an integer: {raw[name]!r}")
    if not isinstance(raw["empty_step_s"], (int, float)):
        raise TypeError(f"empty_step_s is not a number: {raw['empty_step_s']!r}")
    for name in ("how", "budget_source", "reserve_source", "judged_by"):
        if not isinstance(raw[name], str):
            raise TypeError(f"{name} is not a string: {raw[name]!r}")
    spread = raw["rate_spread"]
    if spread is not None and not (isinstance(spread, dict) and all(isinstance(v, (int, float)) for v in spread.values())):
        raise TypeError(f"rate_spread is not a table of numbers: {spread!r}")
    entry["offload"], entry["empty_by_inductor"] = bool(raw["offload"]), bool(raw["empty_by_inductor"])
    if entry["plan"] != block_plan(entry["problem"], entry["config"]):
        raise ValueError("the plan is not the counts' plan of its problem")
    return entry


def _offload_key(facts: ChunkFacts) -> dict[str, Any]:
    layout = facts.layout
    key = {
        "chunk_bytes": layout.chunk_bytes,
        "chunks": [[c.used_bytes, len(c.slots)] for c in layout.chunks],
        "param_dtype": str(facts.param_dtype),
        "compute_dtype": str(facts.compute_dtype),
        "device": str(facts.device),
    }
    if facts.ranks is not None:  # data-parallel: the plan rests on the ranks' shards and collectives
        key["ranks"] = list(facts.ranks)
    return key


def device_str(device: torch.device | str) -> str:
    """``device`` as the memory analysis names it (``"cuda:0"``, not ``"cuda"``: an offload made with
    ``device="cuda"``), so that the key's device is the one ``STATE.measured_outside`` is kept under."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def _tensors_of(gm: fx.GraphModule) -> list[torch.Tensor]:
    return [v for n in gm.graph.nodes if n.op == "placeholder"
            for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _size(s: Any) -> Any:
    try:
        return int(s)
    except Exception:  # noqa: BLE001 -- an unbacked size: by its name
        return str(s)


def _value(val: Any) -> str:
    out = []
    for v in pytree.tree_leaves(val):
        if isinstance(v, torch.Tensor):
            out.append(f"T{[_size(s) for s in v.shape]}{[_size(s) for s in v.stride()]}{v.dtype}{v.device}")
        elif isinstance(v, torch.SymInt):
            out.append(f"S{_size(v)}")
        else:
            out.append(_no_addresses(repr(v)))
    return ";".join(out)
