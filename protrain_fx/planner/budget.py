"""Budget arithmetic: where a step's memory budget comes from and what allocated peak it allows.

The budget is the user's ``memory_budget`` or, with none and a CUDA device, what this process can
still reach there when the step is compiled (:func:`resolve_budget`). It caps what the caching
allocator *reserves*, which runs above what tensors hold, so every comparison is against
:func:`allocated_cap_bytes`: the budget less :data:`ALLOCATOR_HEADROOM`, in exact fractions. The
same rule says "fits" in the plan table, the report and the refusal's minimum budget
(:func:`budget_for_peak`). CUDA is read only here and only at compile time; tests replace
:func:`device_budget_bytes` to plan a CPU step for a budget of their own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from fractions import Fraction

import torch
import torch.fx as fx

from protrain_fx import meta
from protrain_fx.analysis.readable import human_bytes
from protrain_fx.capture import Budget, CapturedGraph
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.search.search import NoPlanFits

log = logging.getLogger("protrain_fx")


def reads_hand_offloaded(record: CapturedGraph) -> bool:
    """Whether the graph reads parameters offloaded with counts given by hand (the backend plans
    the activations of a model whose counts it chose itself: ``planner.offload.choose_for_placed``)."""
    return any(map(chunk_ops.counts_by_hand, record.real_inputs()))


def wants_auto_plan(record: CapturedGraph, *, budget_needed: bool = True) -> bool:
    """A memory budget (the user's or, after :func:`resolve_budget`, the device's), ``auto_plan`` on,
    no plan by hand and no parameter offloaded with counts by hand (those models keep the path they
    had; an offload whose counts the backend chose gets an activation plan for its chunks,
    ``planner.offload.choose_for_placed``): the backend chooses the activation plan
    (``planner/activations.py``). Asked before partitioning a train graph. ``budget_needed=False``: the
    same without the budget (``protrain_fx.what_fits`` also answers without one)."""
    config = record.config
    return (
        (record.budget is not None or config.memory_budget_bytes is not None or not budget_needed)
        and config.auto_plan
        and config.plan is None
        and not reads_hand_offloaded(record)
    )


def reachable_bytes(total_bytes: int, fraction: float, free_bytes: int, reserved_bytes: int) -> int:
    """What a process can still hold on a GPU: its per-process cap (``fraction`` of ``total_bytes``,
    which bounds what its caching allocator reserves), but no more than is physically there: the
    device's free bytes plus what this allocator already reserves (its cached blocks are free to it,
    not to ``cudaMemGetInfo``)."""
    return min(int(total_bytes * fraction), free_bytes + reserved_bytes)


def device_budget_bytes(device: str | torch.device) -> int | None:
    """The budget a step on ``device`` gets when the user gives none: :func:`reachable_bytes` from the
    CUDA runtime, read when the step is compiled; ``None`` for a device that is not CUDA (no budget:
    nothing is planned). Tests replace this function to plan a CPU step for a budget of their own."""
    limit = device_limit_bytes(device)
    if limit is None:
        return None
    index = _cuda_index(device)
    free, _total = torch.cuda.mem_get_info(index)
    return reachable_bytes(limit, 1.0, free, torch.cuda.memory_reserved(index))


def graph_device(gm: fx.GraphModule) -> torch.device:
    """The device holding most of the bytes of ``gm``'s inputs (parameters, batch); CPU if none."""
    return tensors_device(t for node in gm.graph.nodes if node.op == "placeholder" for t in meta.tensor_values(node))


def tensors_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device holding most of the bytes of ``tensors``; CPU if none."""
    weight: dict[torch.device, int] = {}
    for t in tensors:
        weight[t.device] = weight.get(t.device, 0) + meta.tensor_nbytes(t)
    return max(weight, key=weight.get) if weight else torch.device("cpu")


def resolve_budget(record: CapturedGraph, joint: fx.GraphModule) -> Budget | None:
    """The step's budget and where it comes from, before partitioning; the backend stores it as
    ``record.budget`` (the user's option stays in ``record.config``): the user's ``memory_budget``
    (``"user"``), else, when the backend would choose the plan (``auto_plan`` on, no plan by hand,
    nothing offloaded), :func:`device_budget_bytes` of the device the step runs on (``"device"``),
    else ``None``. A ``memory_budget`` above what the process can reach on a CUDA device is lowered
    to that, with a warning: a plan that fits the larger number would run out of memory there."""
    return budget_on(record, graph_device(joint))


def budget_on(record: CapturedGraph, device: torch.device, *, warn: bool = True) -> Budget | None:
    """:func:`resolve_budget` for a step whose inputs are mostly on ``device`` (``warn``: the warning
    of a ``memory_budget`` lowered to what the device can reach)."""
    config = record.config
    if config.memory_budget_bytes is not None:
        if not config.auto_plan or config.plan is not None:  # a budget only checked: as given
            return Budget(config.memory_budget_bytes, "user")
        reachable = device_budget_bytes(device)
        if reachable is None or config.memory_budget_bytes <= reachable:
            return Budget(config.memory_budget_bytes, "user")
        if warn:
            log.warning(
                "protrain_fx: memory_budget %d bytes (%.4g GiB) is more than this process can reach on %s (%d bytes, "
                "%.2f GiB: its per-process cap, free memory and what it already holds); graph %d is planned for that",
                config.memory_budget_bytes, config.memory_budget_bytes / 2**30, device, reachable, reachable / 2**30,
                record.index,
            )
        return Budget(reachable, "user")
    if not config.auto_plan or config.plan is not None or reads_hand_offloaded(record):
        return None
    budget = device_budget_bytes(device)
    return Budget(budget, "device") if budget is not None else None


#: The caching allocator reserves more than the tensors it holds (block rounding, fragmentation);
#: a budget (a memory cap) limits what it reserves. Reserved ran up to 7% above allocated with every
#: chunk on the device, and plans predicted 4-5% under their cap ran out of memory
#: (``docs/results.md#allocator-headroom``).
ALLOCATOR_HEADROOM = 0.08


def _with_headroom(peak_bytes: int) -> Fraction:
    """``peak_bytes`` with :data:`ALLOCATOR_HEADROOM` on top, exactly (no float rounding at any size)."""
    return Fraction(peak_bytes) * (1 + Fraction(ALLOCATOR_HEADROOM).limit_denominator(10**6))


def budget_verdict(peak_bytes: int, budget_bytes: int) -> str:
    """``"fits"``, ``"tight"`` (the allocated peak fits, the allocator's usual headroom does not)
    or ``"over"``."""
    if _with_headroom(peak_bytes) <= budget_bytes:
        return "fits"
    return "tight" if peak_bytes <= budget_bytes else "over"


def allocated_cap_bytes(budget_bytes: int) -> int:
    """The largest allocated peak that :func:`budget_verdict` calls ``"fits"`` under ``budget_bytes``:
    the budget caps what the allocator reserves, and reserved runs up to ``ALLOCATOR_HEADROOM`` above
    allocated."""
    return math.floor(Fraction(budget_bytes) / _with_headroom(1))


def budget_for_peak(peak_bytes: int) -> int:
    """The smallest budget under which an allocated peak of ``peak_bytes`` ``"fits"`` (the inverse of
    :func:`allocated_cap_bytes`)."""
    return max(1, math.ceil(_with_headroom(peak_bytes)))


def device_limit_bytes(device: str | torch.device) -> int | None:
    """Bytes this process may allocate on a CUDA ``device``: its memory times the per-process
    fraction (``torch.cuda.set_per_process_memory_fraction``); None for other devices."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    index = _cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(index))


def _cuda_index(device: str | torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def check_budget(record: CapturedGraph) -> None:
    """Warn when the predicted peak, with the allocator's headroom, exceeds the memory budget, or,
    without one, the memory this process may use on the GPU (a run that will run out of memory).

    Where the backend was asked to fit the budget (:func:`wants_auto_plan`: an automatic plan, or a
    graph without blocks to plan) and the step as compiled is over it, past the headroom, it raises
    :class:`~protrain_fx.search.search.NoPlanFits` naming the smallest budget for it instead: a plan
    said to fit that does not is refused before it runs (Inductor's allocation plan can peak above
    the graph-level analysis that judged it, ``verify="graph"``)."""
    budget, memory = record.budget_bytes, record.memory
    if memory is None:
        return
    what = "its memory budget"
    if record.budget is not None and record.budget.source == "device":
        what = f"the memory this process can reach on {memory.device}"
    if budget is None:
        budget = device_limit_bytes(memory.device)
        what = f"the memory this process may use on {memory.device}"
        if budget is None:
            return
    verdict = budget_verdict(memory.peak_bytes, budget)
    if verdict == "fits":
        return
    auto = getattr(record, "auto_plan", None)
    if verdict == "over" and record.budget is not None and wants_auto_plan(record):
        reserve = auto.reserve_bytes if auto is not None else 0
        minimum = budget_for_peak(memory.peak_bytes + reserve)
        judged = ("; the plan was judged by the graph-level analysis, under it: options={'verify': 'inductor'} judges "
                  "plans by the code Inductor compiles" if auto is not None and auto.judged_by != "inductor" else "")
        what_to_do = ("raise memory_budget" + judged if auto is not None else
                      "no repeated layers in this graph to checkpoint or swap: raise memory_budget, use a smaller "
                      "batch, or offload the parameters with protrain_fx.offload(...)")
        raise NoPlanFits(
            f"protrain_fx: graph {record.index} as compiled peaks at {memory.peak_bytes} bytes "
            f"({human_bytes(memory.peak_bytes)}){f' beside {human_bytes(reserve)} kept for the code around it' if reserve else ''}, "
            f"over {what} of {budget} bytes ({human_bytes(budget)}) with the allocator's headroom; the budget must be at "
            f"least {minimum} bytes ({human_bytes(minimum)}); {what_to_do}",
            min_budget_bytes=minimum,
        )
    if auto is not None:
        advice = "the automatic plan was chosen from the graph-level prediction, which said it fits"
    elif record.blocks is None or not record.blocks.labels:
        advice = ("no repeated layers found in this graph to checkpoint or swap: offload the parameters with "
                  "protrain_fx.offload(...), use a smaller batch, or raise the budget")
    elif reads_hand_offloaded(record):  # counts by hand: the budget is checked, nothing is chosen
        advice = ("fewer persistent chunks or buffers (offload(..., n_persist=, n_buffer=)), or leave the counts "
                  "out so that the backend chooses them and the activation plan for the budget")
    else:
        advice = "choose a plan by hand with options={'plan': ...}"
    log.warning(
        "protrain_fx: graph %d is predicted to need %s (%s with %.0f%% allocator headroom), %s %s of %s (%s)",
        record.index,
        human_bytes(memory.peak_bytes),
        human_bytes(math.ceil(memory.peak_bytes * (1 + ALLOCATOR_HEADROOM))),
        100 * ALLOCATOR_HEADROOM,
        "over" if verdict == "over" else "at the edge of",
        what,
        human_bytes(budget),
        advice,
    )
