"""Run a function on N gloo ranks (spawned processes), with a timeout so a hang fails the test.

Each rank initialises the default process group over a file store (as ``torchrun`` would have it
initialised), runs ``fn(rank, world_size, *args)`` and reports what it returned, or the error it
raised (type and message), through a queue. The children import ``fn`` by its module path: it must
be a top-level function of an importable module.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

#: Seconds a whole spawned run may take (process start, compiles, steps) before it counts as hung.
RUN_TIMEOUT_S = 240
#: The process group's own timeout: a rank left alone in a collective fails within it.
PG_TIMEOUT_S = 60


def _child(fn: Callable[..., Any], rank: int, world: int, store: str, results: Any, args: tuple) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), RANK=str(rank), WORLD_SIZE=str(world))
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(RUN_TIMEOUT_S - 30)  # a hung rank prints where its threads are
    torch.set_num_threads(1)  # two ranks on a 2-core CI machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        buffer = io.BytesIO()  # tensors as bytes: no shared memory that dies with this process
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 -- reported to the parent, which decides
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def _errors(out: dict[int, tuple[str, Any]]) -> str:
    """What the ranks that raised reported (with their tracebacks), one after another."""
    return "\n".join(f"rank {r} raised {value[0]}: {value[1]}\n{value[2]}"
                     for r, (status, value) in sorted(out.items()) if status == "error")


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout_s: float = RUN_TIMEOUT_S) -> list[Any]:
    """``fn``'s return value on each rank, in rank order; a rank's error is raised here (with its
    traceback), and a run past ``timeout_s`` kills the ranks and fails."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, store, results, args)) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < world:
                try:
                    rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"the ranks did not finish within {timeout_s} s (a hang); "
                                         f"finished: {sorted(out)}\n{_errors(out)}") from None
                out[rank] = (status, value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    errors = _errors(out)
    if errors:
        raise AssertionError(errors)
    import torch

    return [torch.load(io.BytesIO(out[r][1]), weights_only=False) for r in range(world)]
