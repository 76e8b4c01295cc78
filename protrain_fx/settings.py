"""Every environment variable the package reads, read here only, each when it is used (a launcher or
a test may set one between two compiles, and the processes a test starts inherit it).

============================  =====================  ==============================================
variable                      read by                effect (``docs/options.md``)
============================  =====================  ==============================================
``PROTRAIN_CACHE_DIR``        :func:`cache_dir`      where machine profiles and plans are kept
``PROTRAIN_PROGRESS``         :func:`progress`       the compile's progress line on or off
``PROTRAIN_PLAN_CACHE``       :func:`plan_cache`     ``0``: every compile plans, nothing is kept
``PROTRAIN_DISABLE_PASSES``   :func:`disabled_passes`  rewrites skipped (debugging)
``PROTRAIN_DUMP_DIR``         :func:`dump_dir`       every graph written after each pass
``PROTRAIN_SPILL_DIR``        :func:`spill_dir`      where the chunk store spills optimizer state
``PROTRAIN_COMPILE_BESIDE``   :func:`compile_beside`  ``1`` / ``0``: a faster plan found at the first
                                                     step compiles beside training, or before the next call
``PROTRAIN_CODEGEN_CHILD``    :func:`codegen_child`  ``1`` / ``0``: a child process lowers the backward
                                                     beside the forward (``codegen_child.py``)
``PYTORCH_CUDA_ALLOC_CONF``,  :func:`allocator_conf`  the user's allocator settings (expandable
``PYTORCH_ALLOC_CONF``                               segments are left as set there)
``LOCAL_WORLD_SIZE``,         :func:`local_ranks`    torchrun's ranks on this node
``LOCAL_RANK``
``KINETO_LOG_LEVEL`` (set)    :func:`quiet_kineto`   torch's profiler quiet about a missing GPU
============================  =====================  ==============================================

Tests change a setting with :func:`patch` (a context manager that sets and restores the variable),
or ``monkeypatch.setenv`` with the names this module exports. This module imports nothing of the
package: every layer may read it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_DIR = "PROTRAIN_CACHE_DIR"
PROGRESS = "PROTRAIN_PROGRESS"
PLAN_CACHE = "PROTRAIN_PLAN_CACHE"
DISABLE_PASSES = "PROTRAIN_DISABLE_PASSES"
DUMP_DIR = "PROTRAIN_DUMP_DIR"
SPILL_DIR = "PROTRAIN_SPILL_DIR"
COMPILE_BESIDE = "PROTRAIN_COMPILE_BESIDE"
CODEGEN_CHILD = "PROTRAIN_CODEGEN_CHILD"
#: The variables through which PyTorch reads the caching allocator's configuration.
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: :func:`patch`'s keywords -> the variable each sets.
VARIABLES = {"cache_dir": CACHE_DIR, "progress": PROGRESS, "plan_cache": PLAN_CACHE,
             "disable_passes": DISABLE_PASSES, "dump_dir": DUMP_DIR, "spill_dir": SPILL_DIR,
             "compile_beside": COMPILE_BESIDE, "codegen_child": CODEGEN_CHILD}

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def cache_dir() -> Path:
    """``$PROTRAIN_CACHE_DIR``, else ``~/.cache/protrain_fx``."""
    value = os.environ.get(CACHE_DIR)
    return Path(value) if value else Path.home() / ".cache" / "protrain_fx"


def progress() -> bool | None:
    """``PROTRAIN_PROGRESS``: ``True`` for ``1`` (``true``, ``on``, ``yes``), ``False`` for ``0``
    (``false``, ``off``, ``no``), ``None`` when unset or anything else (the stream decides)."""
    value = os.environ.get(PROGRESS, "").strip().lower()
    return False if value in _OFF else True if value in _ON else None


def compile_beside() -> bool | None:
    """``PROTRAIN_COMPILE_BESIDE``: ``True`` for ``1`` (``true``, ``on``, ``yes``), ``False`` for ``0``
    (``false``, ``off``, ``no``), ``None`` when unset or anything else (``beside.py`` decides)."""
    value = os.environ.get(COMPILE_BESIDE, "").strip().lower()
    return False if value in _OFF else True if value in _ON else None


def codegen_child() -> bool | None:
    """``PROTRAIN_CODEGEN_CHILD``: ``True`` for ``1`` (``true``, ``on``, ``yes``), ``False`` for ``0``
    (``false``, ``off``, ``no``), ``None`` when unset or anything else (``codegen_child.py`` decides)."""
    value = os.environ.get(CODEGEN_CHILD, "").strip().lower()
    return False if value in _OFF else True if value in _ON else None


#: The variables that say where the caches are (Inductor's, Triton's, ours): a child process that
#: lowers a graph (``codegen_child.py``) must write where this process reads.
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", CACHE_DIR)


def cache_env() -> dict[str, str]:
    """The :data:`CACHE_VARIABLES` set now, for another process (:func:`adopt`)."""
    return {name: os.environ[name] for name in CACHE_VARIABLES if name in os.environ}


def adopt(env: dict[str, str]) -> None:
    """In a child process: the variables another process read (:func:`cache_env`)."""
    os.environ.update(env)


def plan_cache() -> bool:
    """Whether the plan cache is on: unless ``PROTRAIN_PLAN_CACHE`` is ``0`` (``false``, ``off``, ``no``)."""
    return os.environ.get(PLAN_CACHE, "1").strip().lower() not in _OFF


def disabled_passes() -> frozenset[str]:
    """The names ``PROTRAIN_DISABLE_PASSES`` lists (comma-separated; the pipeline checks them)."""
    return frozenset(n.strip() for n in os.environ.get(DISABLE_PASSES, "").split(",") if n.strip())


def dump_dir() -> str | None:
    """``PROTRAIN_DUMP_DIR``, or ``None`` when unset or empty."""
    return os.environ.get(DUMP_DIR) or None


def spill_dir() -> Path | None:
    """``PROTRAIN_SPILL_DIR``, or ``None`` when unset or empty (the system's temporary folder)."""
    value = os.environ.get(SPILL_DIR)
    return Path(value) if value else None


def allocator_conf() -> str:
    """The user's allocator settings, both variables together."""
    return ",".join(os.environ.get(name, "") for name in ALLOC_CONF)


def local_ranks(world: int, rank: int) -> tuple[int, int]:
    """``(local world size, local rank)`` as torchrun sets them, else one node of ``world`` ranks."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local_world, int(os.environ.get("LOCAL_RANK", rank % max(local_world, 1)))


def quiet_kineto() -> None:
    """Kineto's log level at errors only, unless the user set it (``KINETO_LOG_LEVEL``): on a
    machine without a GPU, a CUDA build's profiler logs an error line about the GPU count."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


@contextlib.contextmanager
def patch(**values: str | os.PathLike[str] | bool | None) -> Iterator[None]:
    """Set the variables behind these settings (:data:`VARIABLES`; ``None``: unset, a bool: ``1``/``0``)
    for the ``with`` block, then put them back as they were."""
    unknown = sorted(set(values) - set(VARIABLES))
    if unknown:
        raise TypeError(f"settings.patch: unknown setting(s) {', '.join(unknown)}; known: {', '.join(VARIABLES)}")
    saved = {VARIABLES[k]: os.environ.get(VARIABLES[k]) for k in values}
    try:
        for key, value in values.items():
            _set(VARIABLES[key], None if value is None else ("1" if value else "0") if isinstance(value, bool)
                 else str(value))
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
