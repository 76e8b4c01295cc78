"""Machine constants the rewrites plan with: compute rate, memory bandwidth, host<->device copy speed.

On a CUDA device they are the card's own, measured once per card and cached
(``profile/machine_profile.card_machine``, which hands them here: :func:`remember_card`), with the
efficiencies below; before that (or where they cannot be measured) known numbers for the GPUs
measured (``docs/results.md#the-gpu-machine``) and conservative defaults elsewhere.
``options={"machine": {...}}`` overrides any of them. The rates the cost model prices an offloaded
plan with (the copy link, the optimizer steps) are measured on each host too
(``profile/machine_profile.py``).

They price what is not measured (the roofline of memory-bound nodes, ``analysis/estimate.py``) and
*place* work (when to wait for an offload, how early to prefetch); a wrong number costs time (a copy
waited on too early), never correctness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class Machine:
    """Rates in units per second: ``flops`` for matrix products (bf16 on GPUs), ``hbm_bytes`` for the
    device's memory (reads plus writes), ``h2d_bytes`` / ``d2h_bytes`` for pinned copies one way,
    ``duplex_bytes`` for both directions at once (total). ``*_efficiency`` is the fraction of the peak
    a typical kernel of the captured graphs reaches."""

    name: str
    flops: float
    hbm_bytes: float
    h2d_bytes: float
    d2h_bytes: float
    duplex_bytes: float
    flops_efficiency: float = 0.6
    hbm_efficiency: float = 0.7
    #: Swap copies are placed as if they took this many times their bytes / bandwidth: placed near
    #: their link time the waits come early and about half the copy time shows in the step, at three
    #: times or more a tenth or less (``docs/results.md#activation-swap``). The estimate of compute
    #: time it is laid against is a roofline that Inductor's fused kernels beat.
    copy_margin: float = 3.0
    #: A block swap leaves saved values smaller than this on the device: their copy saves next to no
    #: memory and its two ops cost more host time than the copy (layer-norm statistics, masks).
    min_swap_bytes: int = 1 << 20
    #: Whether host memory, where a swap copies saved values, is apart from the device's memory. On a
    #: CUDA card it is, and a swap frees card memory the budget counts; on the CPU "device" the copy
    #: lands in the memory the budget counts, so a swap frees nothing and the automatic plans never
    #: swap there (a plan by hand still may: it exercises the rewrite).
    host_memory_apart: bool = True

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> Machine:
        if not overrides:
            return self
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"option 'machine': unknown key(s) {unknown}; accepted: {sorted(fields - {'name'})}"
            )
        for key, value in overrides.items():
            if isinstance(getattr(self, key), bool):
                if not isinstance(value, bool):
                    raise ValueError(f"option 'machine': {key}={value!r} must be True or False")
            elif key != "name" and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value < 0
                or (value == 0 and key != "min_swap_bytes")
            ):
                raise ValueError(
                    f"option 'machine': {key}={value!r} must be a positive number"
                )
        return dataclasses.replace(self, **dict(overrides))


#: The GPU machine's readings (``docs/results.md#the-gpu-machine``): bf16 8192^3 matrix products,
#: pinned copies one way and both at once; HBM3e bandwidth from the datasheet.
H200 = Machine(
    "NVIDIA H200",
    flops=786e12,
    hbm_bytes=4.8e12,
    h2d_bytes=55.3e9,
    d2h_bytes=55.2e9,
    duplex_bytes=97e9,
)
#: Any other GPU until measured: an RTX 4090-class card on PCIe Gen4 (ProTrain's own setting).
GENERIC_GPU = Machine(
    "generic GPU",
    flops=165e12,
    hbm_bytes=1.0e12,
    h2d_bytes=22e9,
    d2h_bytes=22e9,
    duplex_bytes=40e9,
)
#: CPU "device": swaps are synchronous copies there, so only relative numbers matter, and their copies
#: stay in the one memory (``host_memory_apart``).
CPU = Machine(
    "CPU", flops=1e12, hbm_bytes=50e9, h2d_bytes=20e9, d2h_bytes=20e9, duplex_bytes=20e9, min_swap_bytes=0,
    host_memory_apart=False,
)


#: The fraction of a measured device-to-device copy's rate (``Machine.hbm_bytes`` of a measured card)
#: a typical fused kernel reaches: the H200's datasheet bandwidth at 70% (the estimate's fit,
#: ``docs/results.md#the-compute-estimate``) is 78% of the 4.3 TB/s its copy reads
#: (``docs/results.md#the-estimate-on-each-card``).
MEASURED_HBM_EFFICIENCY = 0.78

#: The cards measured in this process: device name -> :class:`Machine` (:func:`remember_card`).
_CARDS: dict[str, Machine] = {}


def remember_card(name: str, rates: Mapping[str, float]) -> Machine:
    """Plan on the card named ``name`` with its measured ``rates`` (``flops``, ``hbm_bytes``,
    ``h2d_bytes``, ``d2h_bytes``, ``duplex_bytes``) from now on (``profile/machine_profile.card_machine``
    measures and caches them); returns its :class:`Machine`."""
    machine = Machine(name, **{k: float(rates[k]) for k in ("flops", "hbm_bytes", "h2d_bytes", "d2h_bytes",
                                                            "duplex_bytes")}, hbm_efficiency=MEASURED_HBM_EFFICIENCY)
    _CARDS[name] = machine
    return machine


def machine_for(
    device: torch.device, overrides: Mapping[str, Any] | None = None
) -> Machine:
    """The constants for ``device``, with the user's overrides applied: a CUDA card's measured ones
    (:func:`remember_card`), else the table's."""
    if device.type != "cuda":
        base = CPU
    else:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else ""
        base = _CARDS.get(name) or (H200 if "H200" in name else GENERIC_GPU)
    return base.with_overrides(overrides)
