"""The user's calls that join the layers: :func:`offload` puts a model's parameters into chunks
(the runtime's :class:`~protrain_fx.runtime.offload.handle.OffloadHandle`) and adapts the model to being
compiled by the backend with what the integrations know of its library (its own initialisation,
a library's activation checkpointing turned off, a Hugging Face loss lookup named). The runtime
imports no integration: this module is where the two meet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

from protrain_fx.capture import captured_graphs, watch_break_lines
from protrain_fx.integrations.checkpointing import library_checkpointing_off
from protrain_fx.integrations.loss_type import name_default_loss_type
from protrain_fx.integrations.model_init import model_init
from protrain_fx.runtime.offload.handle import OffloadHandle, own_forward_code
from protrain_fx.runtime.offload.options import OffloadOptions
from protrain_fx.state import STATE

__all__ = ["OffloadOptions", "offload"]

#: The keywords :func:`offload` takes: the fields of :class:`OffloadOptions`.
KEYWORDS = tuple(f.name for f in dataclasses.fields(OffloadOptions))


def offload(model: nn.Module, optimizer: torch.optim.Optimizer, options: OffloadOptions | None = None,
            **keywords: Any) -> OffloadHandle:
    """Put ``model``'s parameters into chunks (:mod:`protrain_fx.runtime.offload.handle`); call before
    ``torch.compile``. The settings are keywords, or one :class:`OffloadOptions` (keywords given
    beside it replace its fields); each is checked before anything moves.

    ``n_persist``, ``n_buffer`` and ``n_gpu_optim`` left out (``"auto"``): the backend chooses them,
    with the activation plan, when it compiles the model's first training graph: the fastest counts
    whose predicted peak fits the ``memory_budget`` option (or, on a CUDA device without one, what
    the process can reach there; ``planner/offload.py``). Until then every parameter is a
    device tensor without bytes and its values wait in host memory (or on ``meta``, for ``init``).
    Given by hand: ``n_persist`` and ``n_buffer`` together (``n_gpu_optim`` then defaults to 0).

    A model built on the ``meta`` device is materialised straight into the chunks: ``init(name,
    tensor)`` fills each parameter (first of its names when tied) in place, in the host chunk for
    offloaded ones, on ``device`` for persistent ones. Host memory then peaks at the chunk store,
    never at a whole second copy of the model. ``init="model"``: the model's own initialisation
    (a Hugging Face model's ``_init_weights``, else each module's ``reset_parameters()``), its
    ``meta`` buffers (rotary ``inv_freq``) recomputed on ``device``
    (:mod:`protrain_fx.integrations.model_init`).

    ``n_gpu_optim``: the first that many offloaded chunks (the last of backward, the first of the
    next forward) are stepped on the device instead of the CPU, their fp32 states streamed through
    it (``runtime/optim/device_adam.py``): the CPU steps fewer chunks and forward waits less.

    ``n_lean``: the last that many offloaded chunks keep no compute-dtype copy on the host (12
    instead of 14 bytes per parameter; the device fetches their fp32 master, twice the bytes) and
    land their gradients in ``grad_pool`` shared host buffers. ``"auto"`` (default): none when the
    store fits the host with 8 GiB to spare, else the fewest that fit (``handle.n_lean`` says how
    many).

    ``n_spill``: that many offloaded chunks (before the lean ones) keep their fp32 master and Adam
    moments in a file in ``spill_dir`` (else ``$PROTRAIN_SPILL_DIR``, else the system's temporary
    folder, or ``/var/tmp`` where that is in memory) instead of host memory, read back ahead of their CPU step and written after it: exact,
    and priced by the planner at the disk's rates (``runtime/store/spill.py``). ``"auto"`` (default):
    none while host memory holds the store, else the fewest that fit (``handle.n_spill``). A host too
    small even then, or a folder too small, is refused before training with the bytes needed.

    ``grad_clipping``: whether the training loop calls ``torch.nn.utils.clip_grad_norm_`` (which
    then clips over every chunk: :meth:`OffloadHandle.clip_grad_norm_`). The offloaded chunks'
    steps then wait for the end of backward instead of overlapping it. ``None`` (default): learned
    at the first optimizer step, which waits; ``True``: always wait (a loop that starts clipping
    later); ``False``: never wait, and a clip raises.

    The model and each of its modules get a ``forward`` of their own (:func:`own_forward_code`): a
    second model of the same class offloaded in the process (a notebook cell run again) is compiled
    for its own chunks, and so is each block whose ``forward`` Dynamo compiles as a frame of its own
    (a graph break inside the blocks): a graph laid out for one block's chunks never runs another's."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"offload() got unexpected keyword(s) {', '.join(map(repr, unknown))}; it takes "
                        f"{', '.join(KEYWORDS)}")
    options = OffloadOptions(**keywords) if options is None else options.replace(**keywords)
    # init="model": the model's own initialisation, its meta buffers recomputed on the device
    handle = OffloadHandle(model, optimizer, options, model_init, _last_graph_break)
    library_checkpointing_off(model, "offload")  # before Dynamo traces it: the backend plans recompute
    name_default_loss_type(model)  # a Hugging Face loss lookup that warns would break the graph
    for module in model.modules():  # each its own compiled graphs (own_forward_code)
        own_forward_code(module)
    watch_break_lines()  # a refusal of a module run eagerly names the break's line (_last_graph_break)
    return handle


def _last_graph_break() -> str:
    """For the refusal of a module an offloaded model ran outside the compiled graphs: the last graph
    break the backend's graphs ended at, with the user's line; else the frame Dynamo last skipped for a
    graph break in its loop, as Dynamo's counters name it (no graph of ours is compiled then); else ``""``."""
    breaks = [b for record in captured_graphs() for b in record.breaks]
    if breaks:
        return f"; the last graph break: {breaks[-1].line()}"
    skipped = [reason for reason in counters["unimplemented"] if "frame skipped: " in reason]
    if not skipped:
        return ""
    frame = skipped[-1].split("frame skipped: ", 1)[1].split("\n", 1)[0]
    reason = skipped[-1].splitlines()[0]
    where = f" at {STATE.break_lines[reason]}" if STATE.break_lines.get(reason) else ""
    return f"; Dynamo ran {frame} eagerly for a graph break in its loop ({reason}{where})"
