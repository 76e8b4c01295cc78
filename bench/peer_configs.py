"""The peers' configurations for ``bench/peers.py``: DeepSpeed's config dict for each of its modes,
which peers update exactly (the same loss as AdamW), the host bytes each needs, and the arithmetic
of a data-parallel run's results (its ranks merged, the collective time no kernel overlaps).

Plain data and arithmetic: nothing here imports torch or deepspeed, so ``tests/bench`` builds and
checks every config without either. The keys are DeepSpeed 0.19.8's (``deepspeed/runtime/zero/offload_config.py``,
``deepspeed/compile/config.py``, ``deepspeed/runtime/zenflow/zenflow_config.py`` in its wheel):

- ``deepspeed``: ZeRO-3, parameters and optimizer offloaded to pinned CPU memory, DeepSpeed's CPU Adam
  after backward.
- ``superoffload``: the same with ``offload_optimizer.super_offload`` (CPU Adam in a process of its
  own, overlapped with backward; a speculative step rolled back on clipping or a non-finite
  gradient). ``ratio`` is the share of the optimizer state stepped on the CPU (the rest stays on the
  GPU; 1.0, DeepSpeed's default, keeps none there, the only value that leaves the 24 GiB cap to the
  model) and ``cpuadam_cores_perc`` the share of the cores CPU Adam takes (0.8, its default).
- ``deepcompile``: ZeRO-3 with both offloads and ``"compile": {"deepcompile": true}``, then
  ``engine.compile()``: ZeRO-3 as FX graph passes (the engine turns ``compile.offload_parameters``
  on when both offloads go to the CPU).
- ``zenflow``: ZeRO-2 with the optimizer offloaded and ``zero_optimization.zenflow`` as its tutorial
  sets it (``docs/_tutorials/zenflow.md``): the top 5% of gradient columns updated each step, the
  others every ``update_interval`` steps. Not exact by design; the engine sets its
  ``gradient_accumulation_steps`` to ``update_interval``, so it takes no accumulation of ours.
"""

from __future__ import annotations

import statistics
from typing import Any

#: The DeepSpeed modes ``bench/peers.py`` runs, each in its own process.
DEEPSPEED_SYSTEMS = ("deepspeed", "superoffload", "deepcompile", "zenflow")
#: Systems that train data-parallel under ``--dp`` (the others would train one model per rank).
DATA_PARALLEL_SYSTEMS = ("protrain_offload", "fsdp2", *DEEPSPEED_SYSTEMS)

#: Systems whose update is not AdamW's, and why (every other system's loss is AdamW's, up to rounding).
INEXACT = {
    "zenflow": "delays the updates of the unimportant gradient columns (topk_ratio, update_interval) by design",
}

#: ``zero_optimization.zenflow`` as ZenFlow's tutorial sets it.
ZENFLOW = {
    "topk_ratio": 0.05,
    "select_strategy": "auto",
    "select_interval": "auto",
    "update_interval": 4,
    "full_warm_up_rounds": 0,
    "overlap_step": True,
}
#: SuperOffload's ``ratio`` and ``cpuadam_cores_perc`` (DeepSpeed's defaults; see the module docstring).
SUPEROFFLOAD_RATIO = 1.0
SUPEROFFLOAD_CORES_PERC = 0.8

#: Host bytes per parameter, for the node (every rank's shards together): estimates, not measurements.
#: fsdp2: ``CPUOffloadPolicy(pin_memory=True)`` keeps the fp32 parameters (4 B, pinned) and the fp32
#:   gradients (4 B, pinned: the target of the non-blocking D2H copy) on the CPU, AdamW's exp_avg and
#:   exp_avg_sq are fp32 (8 B), and ``foreach=True`` AdamW materialises one more state-sized
#:   temporary (sqrt(exp_avg_sq), 4 B) during its step: 20 B.
#: ZeRO-3 modes: DeepSpeed's own estimate with parameters and optimizer on the CPU under ``zero.Init``
#:   (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, 0.19.8): 18 B (bf16
#:   parameter 2 + fp32 master 4 + fp32 gradient 4 + Adam states 8) times its
#:   ``additional_buffer_factor`` 1.5: 27 B.
#: zenflow (ZeRO-2, optimizer offloaded): ``estimate_zero2_model_states_mem_needs``:
#:   ``max(4 * gpus, 16)`` B times 1.5: 24 B up to 4 GPUs (:func:`host_bytes_per_param`).
HOST_BYTES_PER_PARAM = {"fsdp2": 20, "deepspeed": 27, "superoffload": 27, "deepcompile": 27, "zenflow": 24}


def jit_arch_list(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19.8's JIT op builder can read it: its
    ``compute_capability_args`` parses every part of an entry as an integer, so an architecture with a
    letter suffix (``9.0a``, which a Hopper image may set) stops the build of DeepCompile's native op
    with ``ValueError: invalid literal for int()``. The suffix is dropped (the op builds for the base
    architecture, ``9.0``), duplicates once, and ``+PTX`` is kept."""
    out: list[str] = []
    for entry in arch_list.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        cc, plus, ptx = entry.partition("+")
        major, _, minor = cc.partition(".")
        cc = f"{major}.{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}" if minor else major
        entry = cc + plus + ptx
        if entry not in out:
            out.append(entry)
    return ";".join(out)


def host_bytes_per_param(system: str, world_size: int = 1) -> int | None:
    """Host bytes per parameter of an offloading peer on a node of ``world_size`` ranks (None for the others)."""
    if system == "zenflow":
        return max(4 * world_size, 16) * 3 // 2
    return HOST_BYTES_PER_PARAM.get(system)


def exact(system: str) -> bool:
    """Whether ``system`` updates exactly: the same loss as AdamW on the same batches."""
    return system not in INEXACT


def deepspeed_config(
    system: str,
    *,
    micro_batch: int,
    accumulation: int = 1,
    world_size: int = 1,
    lr: float = 1e-4,
    superoffload_ratio: float = SUPEROFFLOAD_RATIO,
    superoffload_cores_perc: float = SUPEROFFLOAD_CORES_PERC,
    clip: float = 0.0,
) -> dict[str, Any]:
    """The DeepSpeed config dict of ``system`` (one of :data:`DEEPSPEED_SYSTEMS`): bf16, AdamW at
    ``lr``, ``micro_batch`` sequences per rank per micro-batch, ``accumulation`` micro-batches per
    optimizer step (``gradient_accumulation_steps``) over ``world_size`` ranks; ``clip`` > 0: the
    gradients' global norm clipped to it before each step (``gradient_clipping``). ``ValueError`` for an
    unknown system, and for ZenFlow with accumulation (it sets its own: the module docstring)."""
    if system not in DEEPSPEED_SYSTEMS:
        raise ValueError(f"deepspeed_config: {system!r} is not one of {DEEPSPEED_SYSTEMS}")
    if accumulation < 1 or world_size < 1 or micro_batch < 1:
        raise ValueError("deepspeed_config: micro_batch, accumulation and world_size must be at least 1")
    if system == "zenflow" and accumulation > 1:
        raise ValueError("zenflow sets gradient_accumulation_steps to its update_interval "
                         "(deepspeed/runtime/zenflow/engine.py): it takes no accumulation of ours")
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {"stage": 3, "offload_param": dict(pinned_cpu), "offload_optimizer": dict(pinned_cpu)}
    config: dict[str, Any] = {
        "train_batch_size": micro_batch * accumulation * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "activation_checkpointing": {"partition_activations": False},
    }
    if clip > 0:
        config["gradient_clipping"] = clip
    if system == "superoffload":
        zero["offload_optimizer"].update(ratio=superoffload_ratio, super_offload=True,
                                         cpuadam_cores_perc=superoffload_cores_perc)
    elif system == "deepcompile":
        config["compile"] = {"deepcompile": True}
    elif system == "zenflow":
        config["zero_optimization"] = {"stage": 2, "offload_optimizer": dict(pinned_cpu), "zenflow": dict(ZENFLOW)}
    return config


# ------------------------------------------------------------------------------------- data-parallel runs


#: Fields each rank's result keeps in a data-parallel run's ``ranks`` list.
RANK_FIELDS = ("rank", "status", "reason", "step_s", "loss", "peak_allocated_bytes", "peak_reserved_bytes",
               "host_peak_bytes", "collective_s", "exposed_collective_s")


def merge_ranks(ranks: list[dict]) -> dict:
    """One result from every rank's (rank order): rank 0's, with ``ranks`` (each rank's
    :data:`RANK_FIELDS`), the first failure of any rank, the step of the slowest rank, the mean of
    the ranks' losses, the highest peaks and, per rank, the exposed collective seconds."""
    ranks = sorted(ranks, key=lambda r: r.get("rank") or 0)
    merged = dict(ranks[0])
    merged["world_size"] = len(ranks)
    merged["ranks"] = [{k: r[k] for k in RANK_FIELDS if k in r} for r in ranks]
    failed = next((r for r in ranks if r.get("status") != "ok"), None)
    if failed is not None:
        merged.update(status=failed["status"], reason=f"rank {failed.get('rank')}: {failed.get('reason', '')}")
        return merged
    merged["step_s"] = max(r["step_s"] for r in ranks)
    merged["loss"] = statistics.fmean(r["loss"] for r in ranks)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "host_peak_bytes", "exposed_collective_s",
                "collective_s"):
        if all(key in r for r in ranks):
            merged[key] = max(r[key] for r in ranks)
    return merged


def collective_times(kernels: list[tuple[str, float, float]]) -> dict:
    """From ``(name, start_s, end_s)`` device kernels: ``collective_s``, the time some collective
    (NCCL) kernel runs, and ``exposed_collective_s``, the part of it when no other kernel runs (the
    collectives compute waits for, or that nothing overlaps)."""
    coll = _union([(a, b) for name, a, b in kernels if "nccl" in name.lower()])
    other = _union([(a, b) for name, a, b in kernels if "nccl" not in name.lower()])
    exposed, j = 0.0, 0
    for a, b in coll:
        t = a
        while j < len(other) and other[j][1] <= t:
            j += 1
        k = j
        while t < b:  # walk the other kernels' intervals over [t, b)
            if k < len(other) and other[k][0] < b:
                start, end = other[k]
                if start > t:
                    exposed += start - t
                t = max(t, end)
                k += 1
            else:
                exposed += b - t
                t = b
    return {"collective_s": sum(b - a for a, b in coll), "exposed_collective_s": exposed}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
