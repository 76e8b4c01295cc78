"""Modules of an offloaded model that run outside the compiled graphs.

A graph break Dynamo cannot resume (one inside the loop over the blocks: a ``.item()`` branch, a
``print``) makes it run the frame around it as plain Python inside the compiled call: the embedding,
the final norm and the head then run eagerly, while each block's ``forward`` is still compiled as a
frame of its own. An offloaded parameter is a shell of 0 bytes there. :class:`EagerModules` gives
such a module, for the call, device copies of its offloaded parameters read from the chunk store
(once a step each: a tied weight is one copy), and lands their gradients in the store when autograd
has accumulated them, as a compiled graph's gradient op does. A chunk whose gradients then land in
parts (two graphs, or a graph and a module run eagerly) has its step held until ``optimizer.step()``
(``Landing``: learned at the first step, which holds every chunk's step anyway).

The copies live until the step's backward has used them: memory outside every graph's plan, named
in a warning once; so only modules outside the blocks get them (the embedding, norms and head
around the loop). Refused, naming the graph break: a module inside a block (the frame around the
blocks ran eagerly whole: the plan's memory would not hold), before the chunk counts are chosen
(an automatic offload whose first training graph is not compiled yet), and data-parallel, where
each rank holds a part of every chunk.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.offload import chunk_ops
from protrain_fx.runtime.offload.shells import hollow

#: A module inside a block (a numbered entry of a module list: ``blocks.3.attn``, ``model.layers.0``).
_IN_BLOCK = re.compile(r"(^|\.)\d+(\.|$)")

log = logging.getLogger("protrain_fx")


def _refusal(name: str, module: nn.Module, shell: str, why: str, explain: Callable[[], str]) -> UnsupportedError:
    return UnsupportedError(
        f"protrain_fx: {name} ({type(module).__name__}) of an offloaded model ran outside the compiled graphs, "
        f"where its offloaded parameter {shell!r} holds no values: Dynamo gave up on a frame around it and ran "
        "that frame eagerly, for a graph break it cannot resume (one inside a loop; Hugging Face activation "
        "checkpointing is one, model.gradient_checkpointing_disable(), and the backend checkpoints blocks itself "
        "when the budget needs it) or for a new input shape past torch._dynamo.config.recompile_limit (pad the "
        f"inputs to a few fixed lengths, or raise the limit); {why}; TORCH_LOGS=graph_breaks,recompiles names "
        "which" + explain()
    )


class EagerModules:
    """Device copies of an offloaded model's parameters for its modules that run eagerly (module
    docstring). ``handle``: the offload (held weakly); ``explain()``: what is known of the graph
    breaks so far."""

    def __init__(self, handle: Any, explain: Callable[[], str] = str) -> None:
        # weakly: the model's hooks hold this, and a handle nothing else keeps is collected (its
        # optimizer dropped) as it would be without them
        self._handle = weakref.ref(handle) if handle is not None else lambda: None
        self.explain = explain
        self._values: dict[int, torch.Tensor] = {}  # id(shell) -> its copy, for this step
        self._swapped: dict[int, list[tuple[str, nn.Parameter]]] = {}  # id(module) -> what its call replaced
        self.warned = False
        #: Parameters copied so far (a test reads it).
        self.copies = 0

    def hooks(self, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        """The forward pre-hook and (always called) forward hook of module ``name``."""

        def before(module: nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return None
            shells = []  # a loop, not a comprehension: its frame would be one Dynamo compiles
            for n, p in module._parameters.items():
                if p is not None and hollow(p):
                    shells.append((n, p))
            if not shells:
                return None
            why = self._unservable(name)
            if why:
                raise _refusal(name, module, shells[0][0], why, self.explain)
            self._warn(name)
            for n, p in shells:
                module._parameters[n] = self.value(p)  # the module reads the copy for this call
            self._swapped[id(module)] = shells
            return None

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():  # (inlined into a traced graph: folds away, no guard on the module)
                return None
            for n, p in self._swapped.pop(id(module), ()):
                module._parameters[n] = p  # the shell again, whatever the call did

        return before, after

    def _unservable(self, name: str) -> str:
        """Why module ``name`` gets no copies now (``""``: it does)."""
        h = self._handle()
        if h is None:
            return "its offload handle is gone (keep the optimizer given to offload(...))"
        if _IN_BLOCK.search(name):
            return ("it is inside a block, which the plan's graphs run: the frame around the blocks ran eagerly "
                    "whole (a break in it before the blocks' loop, or a shape past the recompile limit)")
        if not h.placed:
            return ("the chunk counts are not chosen before the first training graph is compiled, so the store "
                    "holds nothing to copy yet: remove the break, or give the counts to offload(...) by hand")
        if h.group is not None:
            return "data-parallel, each rank holds a part of every chunk: remove the break"
        return ""

    def _warn(self, name: str) -> None:
        if self.warned:
            return
        self.warned = True
        log.warning(
            "protrain_fx: %s and the modules around it ran outside the compiled graphs (a graph break Dynamo cannot "
            "resume: TORCH_LOGS=graph_breaks names it): their offloaded parameters are copied to the device for the "
            "call and kept to the end of the step's backward, outside the memory plan; the chunks whose gradients "
            "land in parts hold their steps to optimizer.step()%s", name, self.explain())

    def value(self, shell: torch.Tensor) -> torch.Tensor:
        """The device copy of ``shell``'s values for this step (made at its first use): read from its
        chunk's working copy once the chunk's last step has written it, or from the fp32 master
        (rounded to the compute dtype, as the working copy is) where the chunk has none or holds a
        gradient in it; in the parameter's own dtype; its gradient lands in the store."""
        got = self._values.get(id(shell))
        if got is not None:
            return got
        h = self._handle()
        store = h.store
        _, chunk, _, name = chunk_ops.offloaded(shell)
        store.wait_filled()
        if h.worker is not None:
            h.worker.wait(chunk)  # its CPU step of the last optimizer step has written the host copy
        store.wait_writes(chunk)  # so has a device step
        slot = store.slot(name)
        if store.is_lean(chunk) or store.holds_grad(chunk):
            with store.state_held(chunk, write=False):
                source = store.view("master", slot).to(store.compute_dtype)
        else:
            source = store.view("working", slot)
        # its own memory (on a CPU device ``to`` would alias the host buffer, which the gradient lands in)
        copy = source.to(device=h.device, dtype=slot.dtype, copy=True).detach()
        if shell.requires_grad:
            copy.requires_grad_(True)
            copy.register_post_accumulate_grad_hook(
                lambda t, chunk=chunk, name=name: self._land(t, chunk, name))
        self._values[id(shell)] = copy
        self.copies += 1
        return copy

    def _land(self, copy: torch.Tensor, chunk: int, name: str) -> None:
        grad, copy.grad = copy.grad, None
        h = self._handle()
        if grad is not None and h is not None:
            h.land_grads(chunk, [name], [grad])

    def after_step(self) -> None:
        """``optimizer.step()`` ran (or ``zero_grad()`` dropped the step): the next use copies anew."""
        self._values.clear()


# Called from eager code (a frame Dynamo gave up on), the hooks must run as Python: compiled as a
# frame of its own, ``is_compiling()`` would read true and pass.
for _hook in EagerModules(None).hooks(""):  # type: ignore[arg-type]
    torch._dynamo.eval_frame.skip_code(_hook.__code__)
torch._dynamo.eval_frame.skip_code(EagerModules.value.__code__)
torch._dynamo.eval_frame.skip_code(EagerModules._unservable.__code__)
torch._dynamo.eval_frame.skip_code(EagerModules._land.__code__)
