"""Where measured machine profiles live on disk, and the rates training reached kept beside them.

One JSON file per (device name, torch version) under :func:`cache_dir` holds the profile
:mod:`protrain_fx.profile.machine_profile` measured and, under ``"in_training"``, the newest rates
the backend timed in training (``planner/rates.py``). Kept apart from the measurements so the
planner's first-step feedback reads and updates the file without the code that measures (this
module never measures). Rates are parameters or bytes per second; files are written whole and atomically, and a
file of another :data:`CACHE_VERSION` is ignored (measured again).

A profile **pinned** by :func:`pin_machine_profile` is never measured nor learned from: every rate
comes from it (the CPU step of any chunk size, the device steps of any layout), training's rates are
not kept beside it, and the plans chosen from it are the same on every host. For tests, for a fleet
of hosts that must plan alike, and to replay a plan from someone else's numbers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import statistics
from pathlib import Path

import torch

from protrain_fx import settings
from protrain_fx.search import problem

MiB = 2**20


#: Version of the machine cache file; a file of another version is measured again.
CACHE_VERSION = 8


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where measured machine profiles are kept: ``path``, else ``$PROTRAIN_CACHE_DIR``, else
    ``~/.cache/protrain_fx``."""
    if path is not None:
        return Path(path)
    return settings.cache_dir()


def device_name(device: torch.device | str) -> str:
    """The name a machine profile is cached under: the GPU's name, or ``cpu-<processor>``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.processor() or platform.machine() or 'unknown'}"


def _slug(device: torch.device | str) -> str:
    """Device name and torch version as a file name part."""
    key = f"{device_name(device)}-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", key).strip("_")


def cache_path(device: torch.device | str, cache: str | os.PathLike[str] | None = None) -> Path:
    """The JSON file of ``device``'s profile: keyed by device name and torch version."""
    return cache_dir(cache) / f"machine-{_slug(device)}.json"


def card_path(device: torch.device | str, cache: str | os.PathLike[str] | None = None) -> Path:
    """The JSON file of the card's own rates (``machine_profile.card_machine``), beside its machine profile."""
    return cache_dir(cache) / f"card-{_slug(device)}.json"


def plan_cache_path(device: torch.device | str, cache: str | os.PathLike[str] | None = None) -> Path:
    """The JSON file of the plans chosen on ``device`` (``planner/plan_cache.py``), beside its machine
    profile and named like it: a plan rests on that machine's rates."""
    return cache_dir(cache) / f"plans-{_slug(device)}.json"


def pin_machine_profile(
    device: torch.device | str,
    profile: problem.MachineProfile | dict,
    *,
    cache: str | os.PathLike[str] | None = None,
) -> Path:
    """Pin ``device``'s machine profile to ``profile`` (a :class:`~protrain_fx.search.problem.MachineProfile`
    or its ``to_dict()``): written as the profile file of :func:`cache_path`, marked ``"pinned"``, it
    replaces whatever was measured there. Returns the file. A rate that is not a positive number
    raises ``ValueError`` naming it (``MachineProfile``'s check); delete the file to measure again."""
    if isinstance(profile, dict):
        profile = problem.MachineProfile.from_dict(profile)
    path = cache_path(device, cache)
    write_json(path, {
        "version": CACHE_VERSION,
        "device": device_name(device),
        "torch": torch.__version__,
        "pinned": True,
        "profile": profile.to_dict(),
    })
    return path


def pinned_profile(device: torch.device | str, cache: str | os.PathLike[str] | None = None
                   ) -> problem.MachineProfile | None:
    """The profile :func:`pin_machine_profile` pinned for ``device``, else ``None`` (no file, a
    measured one, another :data:`CACHE_VERSION`, or a file that does not read)."""
    try:
        data = json.loads(cache_path(device, cache).read_text(encoding="utf-8"))
        if data.get("version") == CACHE_VERSION and data.get("pinned") is True:
            return problem.MachineProfile.from_dict(data["profile"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; ``None`` when there is no such file. Raises ``OSError`` or
    ``ValueError`` for a file that cannot be read or is not a JSON object (the caller decides how loud)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` whole and atomically (a concurrent reader sees the old file or the
    new one), making its folder when missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, data)


#: How many in-training measurements of each rate a profile file keeps (the newest); the rate used
#: is their median.
TRAINING_KEEP = 5


#: The key under ``"in_training"`` of the device steps' rates (``planner/rates.alone_rate``: without
#: the re-fetches beside them). Entries under ``"device_step_bytes_per_s"`` hold rates with the
#: re-fetches included and are not read: the cost model adds the re-fetches to the rate it is given.
TRAINING_DEVICE_KEY = "device_step_alone_bytes_per_s"


def note_training_rates(
    device: torch.device | str,
    *,
    chunk_params: int | None = None,
    cpu_adam_params_per_s: float = 0.0,
    device_step_bytes_per_s: float = 0.0,
    cache: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Keep rates measured in training (``planner/rates.py``) in ``device``'s profile file
    (``"in_training"``), for :func:`training_rates`: the CPU chunk step's (per chunk size, rounded as
    :func:`chunk_adam_rate` rounds it) and the device steps' (without the re-fetches beside them,
    under :data:`TRAINING_DEVICE_KEY`). A rate of 0 is not kept. Without a profile file (nothing was
    measured on this machine) nothing is written; measuring the profile again (``refresh``, another
    cache version) starts without them, and a pinned profile (:func:`pin_machine_profile`) keeps
    none. Returns the file written, else ``None``."""
    path = cache_path(device, cache)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("version") != CACHE_VERSION or data.get("pinned") is True or (device_step_bytes_per_s <= 0 and not (cpu_adam_params_per_s > 0 and chunk_params)):
        return None
    kept = data.setdefault("in_training", {})
    if device_step_bytes_per_s > 0:
        kept[TRAINING_DEVICE_KEY] = (kept.get(TRAINING_DEVICE_KEY, []) + [device_step_bytes_per_s])[-TRAINING_KEEP:]
    if cpu_adam_params_per_s > 0 and chunk_params:
        n = str(_granule(chunk_params))
        by_chunk = kept.setdefault("cpu_adam_by_chunk", {})
        by_chunk[n] = (by_chunk.get(n, []) + [cpu_adam_params_per_s])[-TRAINING_KEEP:]
    _write_json(path, data)
    return path


def training_rates(
    device: torch.device | str,
    profile: problem.MachineProfile,
    chunk_params: int | None = None,
    *,
    cache: str | os.PathLike[str] | None = None,
) -> tuple[problem.MachineProfile, list[str]]:
    """``profile`` with the rates training reached on this machine (:func:`note_training_rates`) in
    place of the profiled ones, and the names of the fields replaced.

    * ``device_step_bytes_per_s``: the median of those kept.
    * ``cpu_adam_params_per_s`` (the rate of chunks of ``chunk_params``): the median of those kept for
      this chunk size; for a size not trained yet, the median of the trained sizes' rates within
      :data:`NEAR_CHUNK_FACTOR` of it; failing those, ``profile``'s rate scaled by the median ratio
      of training's rate to the profiled one (``"cpu_adam_by_chunk"``) over the sizes trained. Without
      ``chunk_params`` it is left as it is.

    A pinned profile (:func:`pin_machine_profile`) is returned as it is.

    Why a near size's rate and not the scaled profile: the profiled reading of each chunk size
    misses its training rate by a factor that differs between sizes on one host, so scaling the
    profile carries one size's miss onto the other; a near size's training rate predicts a size's
    training rate best (``docs/results.md#cpu-step-rate-within-and-across-hosts``)."""
    try:
        data = json.loads(cache_path(device, cache).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return profile, []
    if data.get("version") != CACHE_VERSION or data.get("pinned") is True:
        return profile, []
    kept = data.get("in_training")
    kept = kept if isinstance(kept, dict) else {}
    changes: dict[str, float] = {}
    if device := _median_rate(kept.get(TRAINING_DEVICE_KEY)):
        changes["device_step_bytes_per_s"] = device
    by_chunk = kept.get("cpu_adam_by_chunk")
    by_chunk = {k: r for k, v in by_chunk.items() if (r := _median_rate(v))} if isinstance(by_chunk, dict) else {}
    if chunk_params and by_chunk:
        n = str(_granule(chunk_params))
        near = [r for k, r in by_chunk.items() if k.isdigit() and _near_size(int(k), int(n))]
        if n in by_chunk:
            changes["cpu_adam_params_per_s"] = by_chunk[n]
        elif near:
            changes["cpu_adam_params_per_s"] = statistics.median(near)
        else:
            profiled = data.get("cpu_adam_by_chunk")
            profiled = profiled if isinstance(profiled, dict) else {}
            ratios = [r / p for k, r in by_chunk.items() if (p := _median_rate([profiled.get(k)]))]
            if ratios:
                changes["cpu_adam_params_per_s"] = profile.cpu_adam_params_per_s * statistics.median(ratios)
    return dataclasses.replace(profile, **changes), sorted(changes)


#: A chunk size not trained yet takes the CPU rate training reached on sizes within this factor of
#: it (:func:`training_rates`): small chunks step much faster than large ones, while sizes within
#: a factor of 4 step at nearly one rate in training (``docs/results.md#cpu-step-rate-within-and-across-hosts``).
NEAR_CHUNK_FACTOR = 4


def _near_size(a: int, b: int) -> bool:
    return a > 0 and b > 0 and max(a, b) <= NEAR_CHUNK_FACTOR * min(a, b)


def _median_rate(values: object) -> float:
    """The median of the positive finite numbers in ``values`` (a list read from a profile file, which
    a person may have edited), else 0: entries that are not rates are left out."""
    if not isinstance(values, list):
        return 0.0
    rates = [float(v) for v in values
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0]
    return statistics.median(rates) if rates else 0.0


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


#: The CPU chunk step is measured per chunk size rounded up to a multiple of this many parameters.
CHUNK_RATE_GRANULE = 16 * 2**20


def _granule(chunk_params: int) -> int:
    """``chunk_params`` rounded up to :data:`CHUNK_RATE_GRANULE` (at least one granule): the chunk
    size a CPU step rate is measured and kept at."""
    return max(1, -(-chunk_params // CHUNK_RATE_GRANULE)) * CHUNK_RATE_GRANULE
