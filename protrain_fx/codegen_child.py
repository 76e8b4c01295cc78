"""The backward graph's Inductor codegen in a child process, beside the forward's in this one.

AOTAutograd hands Inductor a training step's forward graph, then its backward graph, and each
lowering is Python that holds this process's GIL for tens of seconds at a billion parameters
(``docs/results.md#time-to-the-first-steps``). Here a child process (Inductor's own ``SubprocPool``:
a fresh interpreter, not a fork, so the user's script is never imported again) lowers the backward
graph as the compile will (:func:`protrain_fx.lowering.lower`, with AOTAutograd's arguments) while
this process lowers the forward. The child's code lands in Inductor's FX graph cache and its
allocation plan in ours (``lowering.keep_plan``, a file), so the compile's own lowering of the
backward is a cache hit that reads the plan back.

Never wrong, at worst not faster: where the child's lowering is keyed apart from the compile's (the
forward's output strides restride the backward's inputs, a setting the child cannot see), or fails,
or the FX graph cache is off, the compile lowers the backward itself as it would without the child.

Where: a step on a CUDA device (Triton's codegen is the Python this saves; a CPU step's C++ compile
already keeps the cores busy), and not in a compile beside training, whose child would hold a CUDA
context's device memory beside the running plan. The child goes when the compile that started it has
lowered its backward: a CUDA context it made to load the kernels goes with it.
``PROTRAIN_CODEGEN_CHILD=1`` / ``0`` turns it on everywhere / off (``protrain_fx.settings``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import threading
import time
from concurrent.futures import Future, TimeoutError
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx_inner, count_tangents
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from protrain_fx import settings, state
from protrain_fx.analysis.memory import output_args
from protrain_fx.lowering import PartitionerToken, aot_kwargs, copy_graph_module, lower, unmark_static
from protrain_fx.runtime import swap  # noqa: F401 -- the swap ops, registered on import, for the child's graphs
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.store.host_memory import available_host_bytes

log = logging.getLogger("protrain_fx")

#: Inductor settings the child sets itself: our hooks, which do not pickle as themselves (their
#: ``__reduce__`` is a token for Inductor's cache key).
_OWN_SETTINGS = ("custom_partitioner_fn", "_post_fusion_custom_pass")

#: Host memory that must stay available beside a chunk store still filling for a child to be started:
#: its interpreter, its Triton compile workers and the graph it lowers. A margin, not a measurement
#: (a model whose store nearly fills the host, as 10B on a 128 GiB host, lowers without the child).
HOST_MARGIN_BYTES = 16 * 2**30

#: The compile waits for the child's backward at most this long, or this many times as long as the
#: forward's lowering took beside it, whichever is longer; then it lowers the backward itself (a child
#: that hangs must not hang the compile). The backward's lowering takes up to about three times the
#: forward's (``docs/results.md#time-to-the-first-steps``).
WAIT_MIN_S = 120.0
WAIT_FACTOR = 4.0

#: How long stopping the child may take before it is killed (its own workers then end themselves).
SHUT_WAIT_S = 10.0

_lock = threading.Lock()
_pool: Any = None


@dataclass
class Pending:
    """A backward lowering sent to the child, and when."""

    future: Future
    sent_at: float


def enabled(device: torch.device | None) -> bool:
    """Whether a child lowers the backward of a step on ``device`` (module docstring): and Inductor's
    FX graph cache is on, as the child's code reaches this process only through it."""
    wanted = settings.codegen_child()
    if wanted is False or state.compiling_beside() is not None:
        return False
    if not inductor_config.fx_graph_cache or inductor_config.force_disable_caches:
        return False
    return wanted is True or (device is not None and device.type == "cuda")


def warm(device: torch.device | None) -> None:
    """Start the child now, so that its imports (torch, Inductor, this package) overlap the capture
    that comes before any lowering."""
    if enabled(device):
        try:
            _get_pool()
        except Exception as e:  # noqa: BLE001 -- no child: the compile lowers everything itself
            log.debug("protrain_fx: no codegen child: %s", e)


def start(index: int, gm: fx.GraphModule, bw_donated_idxs: Any, keep_node_order: bool,
          device: torch.device | None) -> Callable[[], None]:
    """Where :func:`enabled`, send the backward graph ``gm`` to the child (:func:`send_backward`);
    what to call before this process lowers it: waits for the child (a no-op where none was sent)."""
    sent = send_backward(index, gm, bw_donated_idxs, keep_node_order) if enabled(device) else None
    return (lambda: None) if sent is None else (lambda: wait(sent, index))


def shut() -> None:
    """Stop the child (a later compile starts another): killed where it does not stop within
    :data:`SHUT_WAIT_S` (a job still running)."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is None:
        return

    def stop() -> None:
        try:
            pool.shutdown()
        except Exception as e:  # noqa: BLE001 -- (subprocess.TimeoutExpired among them)
            log.debug("protrain_fx: the codegen child did not shut down cleanly: %s", e)

    stopping = threading.Thread(target=stop, name="protrain_fx codegen child stop", daemon=True)
    stopping.start()
    stopping.join(SHUT_WAIT_S)
    if stopping.is_alive():
        pool.process.kill()


def _get_pool() -> Any:
    global _pool
    with _lock:
        if _pool is None:
            import atexit

            from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

            _pool = SubprocPool(1, kind=SubprocKind.SPAWN)
            atexit.register(_pool.shutdown)
            _pool.submit(_warm_in_child)
        return _pool


def _warm_in_child() -> int:
    return os.getpid()  # (unpickling this function imported this module, Inductor and our ops)


def send_backward(index: int, gm: fx.GraphModule, bw_donated_idxs: Any, keep_node_order: bool) -> Pending | None:
    """Send the backward graph ``gm`` (the one AOTAutograd will hand Inductor, with its placeholders'
    values as inputs) to the child to lower; ``None`` where it is not sent: the host's memory is short
    beside a chunk store still filling (:data:`HOST_MARGIN_BYTES`), or a setting or the graph does not
    pickle (the compile lowers it then)."""
    available = available_host_bytes()
    still_filling = chunk_ops.filling_host_bytes()
    if available is not None and available - still_filling < HOST_MARGIN_BYTES:
        log.info("protrain_fx: graph %d: the backward is lowered in this process: %.1f GiB of host memory are "
                 "available and chunk stores still filling take up to %.1f GiB of them (a child needs %.0f GiB "
                 "beside them)", index, available / 2**30, still_filling / 2**30, HOST_MARGIN_BYTES / 2**30)
        return None
    begin = time.perf_counter()
    try:
        portable = {k: v for k, v in inductor_config.save_config_portable(ignore_private_configs=False).items()
                    if k not in _OWN_SETTINGS}
        pickle.dumps(portable)  # every setting must cross as itself
        inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        unmark_static(inputs)
        gather = getattr(torch.ops.protrain, "chunk_gather", None)
        hids = {n.args[0] for n in gm.graph.nodes if gather is not None and n.target is gather.default}
        job = {"gm": gm, "inputs": inputs, "buffer_shapes": chunk_ops.buffer_shapes(hids), "index": index,
               "settings": portable, "attribute_order": list(gm.__dict__), "bw_donated_idxs": bw_donated_idxs,
               "keep_node_order": keep_node_order, "grad": torch.is_grad_enabled()}
        payload = _Pickler.dumps(job, Options(ops_filter=None, node_metadata_key_filter=_crosses))
    except Exception as e:  # noqa: BLE001
        log.info("protrain_fx: graph %d: the backward is lowered in this process (it could not be sent to a "
                 "child: %s: %s)", index, type(e).__name__, e)
        return None
    future = _submit(_get_pool(), payload)
    send_s = time.perf_counter() - begin
    log.info("protrain_fx: graph %d: the backward sent to a child process to lower beside the forward (%.1f s, "
             "%.1f MB)", index, send_s, len(payload) / 1e6)
    return Pending(future, time.perf_counter())


def _submit(pool: Any, payload: bytes) -> Future:
    """The child's lowering of ``payload``, submitted from a thread of its own: the pool writes the job
    into a pipe that the child reads only once its imports are done, and a payload larger than the
    pipe's buffer would hold this process there instead of lowering the forward."""
    future: Future = Future()

    def chain(done: Future) -> None:
        try:
            future.set_result(done.result())
        except BaseException as e:  # noqa: BLE001 -- (a job cancelled by the pool's shutdown among them)
            future.set_exception(e)

    def send() -> None:
        try:
            pool.submit(_lower_in_child, payload, settings.cache_env()).add_done_callback(chain)
        except Exception as e:  # noqa: BLE001 -- (a pool shut meanwhile) the compile lowers the backward itself
            future.set_exception(e)

    threading.Thread(target=send, name="protrain_fx codegen child send", daemon=True).start()
    return future


def wait(pending: Pending, index: int) -> float | None:
    """Wait for the child's lowering (at most :data:`WAIT_MIN_S` or :data:`WAIT_FACTOR` times the
    seconds since it was sent); its seconds, or ``None`` where it failed or took longer (logged; the
    child is stopped then)."""
    begin = time.perf_counter()
    limit = max(WAIT_MIN_S, WAIT_FACTOR * (begin - pending.sent_at))
    try:
        result = pending.future.result(timeout=limit)
    except TimeoutError:
        log.info("protrain_fx: graph %d: the child had not lowered the backward %.0f s after the forward's lowering "
                 "ended; lowered here", index, limit)
        shut()
        return None
    except Exception as e:  # noqa: BLE001 -- the compile lowers the backward itself
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if "Error" in line.split(":")[0]), lines[-1] if lines else "")
        log.info("protrain_fx: graph %d: the child's lowering of the backward failed (%s); lowered here",
                 index, said or type(e).__name__)
        return None
    log.info("protrain_fx: graph %d: the child lowered the backward in %.1f s (waited %.1f s for it)", index,
             result["seconds"], time.perf_counter() - begin)
    return float(result["seconds"])


def _crosses(key: str) -> bool:
    """Whether a node meta key is sent: not the module and source stacks (their entries hold classes
    made at run time, as Hugging Face models' are; Inductor's lowering does not read them)."""
    return not key.endswith(("module_stack", "source_fn_stack"))


def _bare(desc: Any) -> Any:
    """A tensor description with no fake mode on its base either (the mode does not pickle)."""
    if getattr(desc, "base", None) is None:
        return desc
    return dataclasses.replace(desc, base=_bare(dataclasses.replace(desc.base, fake_mode=None)))


class _Pickler(GraphPickler):
    """torch's ``GraphPickler``, able to send a view's fake value: torch's takes the fake mode off the
    view's description but not off its base's (a chunk's parameters are views of the buffer
    ``chunk_gather`` returns)."""

    def reducer_override(self, obj: object) -> Any:
        reduced = super().reducer_override(obj)
        if isinstance(obj, FakeTensor) and reduced is not NotImplemented:
            data = reduced[1][0]
            data.metadata = _bare(data.metadata)
        return reduced


def _lower_in_child(payload: bytes, env: dict[str, str]) -> dict[str, Any]:
    """In the child: lower the backward ``payload`` holds as the compile will, keeping its code in
    Inductor's FX graph cache and its allocation plan in ours (``env``: where those caches are)."""
    settings.adopt(env)
    begin = time.perf_counter()
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    job = GraphPickler.loads(payload, fake_mode)
    gm: fx.GraphModule = job["gm"]
    attributes = dict(gm.__dict__)  # in the order the compile's graph has them: Inductor's key pickles it
    gm.__dict__.clear()
    gm.__dict__.update({k: attributes[k] for k in job["attribute_order"] if k in attributes})
    gm.__dict__.update({k: v for k, v in attributes.items() if k not in gm.__dict__})
    chunk_ops.adopt_buffer_shapes(job["buffer_shapes"])  # the chunk buffers' fake values, without the handles
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out.meta["user_visible_output_idxs"] = [i for i, v in enumerate(output_args(gm)) if isinstance(v, fx.Node)] \
        if inductor_config.bw_outputs_user_visible else []
    static = list(range(count_tangents(gm)))
    context = TracingContext(fake_mode)
    context.fw_metadata = SimpleNamespace(bw_donated_idxs=job["bw_donated_idxs"], static_input_indices=static)
    record = SimpleNamespace(index=job["index"], config=SimpleNamespace(keep_node_order=job["keep_node_order"]))
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(job["settings"]))
        stack.enter_context(inductor_config.patch({"custom_partitioner_fn": PartitionerToken()}))
        stack.enter_context(tracing(context))
        stack.enter_context(torch.set_grad_enabled(job["grad"]))
        stack.enter_context(torch._C._DisableAutocast())
        _, plan = lower(record, gm, job["inputs"], "backward", compile_fx_inner, copy_graph_module,
                        **aot_kwargs("backward", static))
    return {"seconds": time.perf_counter() - begin, "planned": plan is not None}
