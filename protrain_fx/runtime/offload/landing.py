"""Gradients of an offloaded model's chunks landing on the host, the part of ``OffloadHandle`` that
the rewritten backward calls (``chunk_ops``' gradient op, once per chunk).

A chunk's gradients are held (the loop may clip, or accumulate micro-batches), stepped on the CPU
optimizer's worker as they land, or streamed through the device (``n_gpu_optim`` chunks).
Data-parallel, a chunk's gradient is first reduce-scattered to the ranks' mean, each rank landing
its own piece. A chunk may land once per optimizer step unless accumulating: a second landing after
its step ran says why and names the fix. A loop seen landing a chunk twice while its step is held,
or setting the optimizer's settings between backward and ``optimizer.step()``, gets every chunk's step
held until ``optimizer.step()`` from then on (exact, without the overlap with backward).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from protrain_fx.errors import UnsupportedError
from protrain_fx.runtime.parallel import shard

log = logging.getLogger("protrain_fx")

#: The param-group settings a chunk's optimizer step reads when it is queued (``ChunkAdamW.kernel``).
HYPER_KEYS = ("lr", "betas", "weight_decay", "eps", "maximize")


class Landing:
    """Gradient landing for ``OffloadHandle`` (which holds ``store``, ``worker``, ``device_adam``,
    ``group``, the counts, the step state of ``_init_step_state`` and ``_param_of_slot``)."""

    def land_grads(self, chunk: int, names: list[str], grads: list[torch.Tensor]) -> None:
        if any(not self._param_of_slot[n].requires_grad for n in names):
            # frozen since the graph was compiled (Dynamo does not recompile for it): autograd
            # would drop these gradients, and the optimizer would skip the parameters
            kept = [(n, g) for n, g in zip(names, grads) if self._param_of_slot[n].requires_grad]
            if not kept:
                return
            names, grads = [n for n, _ in kept], [g for _, g in kept]
        if self.group is None:
            return self._land_local(chunk, names, grads)
        # the ranks' mean, this rank's piece of each parameter only; the whole gradient is laid out
        # on the current stream (the graph may reuse its gradients' buffers as soon as this returns)
        whole = shard.whole_gradient(self.store, chunk, names, grads, self.store.compute_dtype)
        with self._reducing(whole):
            part = shard.reduce_scatter_mean(self.store, whole)
            local = shard.local_grads(self.store, part, names)
            self._land_local(chunk, list(local), list(local.values()))

    @contextlib.contextmanager
    def _reducing(self, whole: torch.Tensor) -> Iterator[None]:
        """On CUDA, the reduce-scatter of ``whole`` and what uses its result (the copy to the host, a
        device step, the clip's norms) are issued on the handle's reduction stream, after the
        gradient's making on the current stream, so compute goes on beside the collective (as a
        fetch's all-gather runs on the pool's copy stream); ``whole`` stays allocated until the
        stream is past the collective (``record_stream``), and :meth:`wait_reductions` orders a
        later reader. Elsewhere (gloo on CPU) everything runs where it is called."""
        if self.device.type != "cuda":
            yield
            return
        if self._reduce_stream is None:
            self._reduce_stream = torch.cuda.Stream(self.device)
        stream = self._reduce_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradient is made there
        whole.record_stream(stream)
        with torch.cuda.stream(stream):
            yield
        self._reduced = torch.cuda.Event()
        self._reduced.record(stream)

    def wait_reductions(self) -> None:
        """The current stream waits for the gradient reductions issued so far (a reader of their
        results on another stream: the clip's norms)."""
        if self._reduced is not None:
            torch.cuda.current_stream(self.device).wait_event(self._reduced)

    def _land_local(self, chunk: int, names: list[str], grads: list[torch.Tensor]) -> None:
        """Land this rank's gradients of ``chunk`` (the whole chunk's with one rank): held, stepped on
        the CPU worker or streamed through the device."""
        landed = self._landed.setdefault(chunk, set())
        if chunk in self._submitted:
            raise UnsupportedError(self._second_landing(chunk, landed, names))
        if self._hyper_landed is None:
            self._hyper_landed = self._hyper_now()
        fresh = not self.store.holds_grad(chunk)
        if not self._accumulating:
            plain = self._landed_plain.setdefault(chunk, set())
            if plain.intersection(names):
                self._hold_from_now("the same parameters got gradients twice before optimizer.step() (two backward "
                                    "passes, or one through two calls of the model) outside handle.accumulate()")
            plain.update(names)
        if not fresh and not landed.intersection(names) and not self._accumulating:
            # another part of the chunk's parameters (two graphs around a graph break, or a module run
            # eagerly): its step waits for optimizer.step() from now on (this step is held: the first
            # one holds every chunk's, or it would have been stepped at its first part)
            self._split_chunks = True
        if (self.grad_clipping is None and not self._accumulating and not self._released_early
                and self.store.is_lean(chunk) and fresh and self.store.landing_full()):
            self._release_early()  # learning: held lean gradients may not take host memory beyond the pool
        hold = (self._accumulating or self._split_chunks or self._hold_always or self.grad_clipping is True
                or (self.grad_clipping is None and not self._released_early))
        on_device = chunk < self.n_gpu_optim and not hold and fresh
        if on_device:
            self.device_adam.make_room()  # bounds the device steps in flight, so their gradients' memory
        if self.device.type == "cuda" and self.group is None:  # (sharded: the reduced part is a fresh buffer)
            grads = _staged(grads, self.store.compute_dtype)
        landed.update(names)
        if on_device:
            self.device_adam.step_chunk(chunk, dict(zip(names, grads)))  # its states stream through the GPU
            self._submitted.add(chunk)
            self._stepped = True
            return
        if hold and self.grad_clipping is not False and not self._released_early:  # a clip may follow: its norms
            self._norms.note(self.store, chunk, names, grads, fresh=fresh)
        if self.store.is_lean(chunk) and fresh:
            self._wait_for_landing_buffer()
        self.store.write_grads(dict(zip(names, grads)), accumulate=True)
        if hold:
            self._pending.add(chunk)
        else:
            self._submit(chunk)

    def _init_holding(self) -> None:
        #: Every chunk's step waits for optimizer.step(): the loop lands a chunk twice or sets the
        #: optimizer's settings after backward (:meth:`_hold_from_now`).
        self._hold_always = False
        self._next_step_landing()

    def _next_step_landing(self) -> None:
        """Forget the step's landings that :meth:`_hold_from_now` is decided on."""
        self._hyper_landed: tuple | None = None  # the settings at the step's first landing
        #: Per chunk, the parameter names landed outside ``accumulate()`` in this step.
        self._landed_plain: dict[int, set[str]] = {}

    def _hyper_now(self) -> tuple[tuple[Any, ...], ...]:
        """The optimizer's settings a chunk step reads (:data:`HYPER_KEYS` of each param group); a
        tensor setting by identity and version (read without a device sync)."""
        def value(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return id(v), v._version
            if isinstance(v, (tuple, list)):  # betas
                return tuple(map(value, v))
            return v

        return tuple(tuple(value(group.get(k)) for k in HYPER_KEYS) for group in self.optimizer.param_groups)

    def check_hyper(self) -> None:
        """At ``optimizer.step()``: the loop set the optimizer's settings (a learning rate) after this
        step's first gradient landed. Chunk steps queued as gradients land read the settings then, so
        from now on every chunk's step waits for ``optimizer.step()`` (exact, without the overlap with
        backward). Where this step's chunks were already stepped with the settings before, a warning
        says so (the first step holds every chunk's, and is exact)."""
        before, self._hyper_landed = self._hyper_landed, None
        if before is None or self._hold_always or before == self._hyper_now():
            return
        stepped = sorted(self._submitted)
        if stepped:
            warnings.warn(
                f"protrain_fx: the optimizer's settings ({', '.join(HYPER_KEYS)}) changed between this step's "
                f"backward and optimizer.step(); offloaded chunks {stepped[:4]}{' ...' if len(stepped) > 4 else ''} "
                "were already stepped with the settings before, as their gradients landed. Set them before "
                "backward, or pass grad_clipping=True to protrain_fx.offload(...)", stacklevel=3)
        self._hold_from_now("the optimizer's settings (a learning rate) are set between backward and "
                            "optimizer.step()")

    def _hold_from_now(self, why: str) -> None:
        """Every chunk's step waits for ``optimizer.step()`` from now on (once said, with ``why``)."""
        if self._hold_always:
            return
        self._hold_always = True
        if self.grad_clipping is not True and not self._split_chunks:
            log.warning("protrain_fx: %s: every offloaded chunk's step waits for optimizer.step() from now on, "
                        "exact but without its overlap with backward (handle.accumulate() around all but the last "
                        "micro-batch's backward, and settings changed before backward, keep the overlap)", why)

    def _release_early(self) -> None:
        """The first step, learning whether the loop clips, cannot hold every chunk's gradient: a lean
        chunk's would take a landing buffer beyond the pool (host memory the store was not sized
        for). The held chunks are stepped now and the rest of this step's as they land; a clip in
        this step is then refused (:meth:`_check_clip`)."""
        self._released_early = True
        for chunk in sorted(self._pending):
            self._submit(chunk)

    def _submit(self, chunk: int, **kwargs: Any) -> None:
        """Queue the chunk's CPU step (``kwargs`` to ``ChunkAdamW.step_chunk``)."""
        self._pending.discard(chunk)
        self._submitted.add(chunk)
        self._stepped = True
        self.worker.submit(chunk, **kwargs)
        if self.store.is_lean(chunk):
            self._landed_lean.append(chunk)

    def _second_landing(self, chunk: int, landed: set[str], names: list[str]) -> str:
        """Why a chunk already stepped in this step got gradients again, and what to do."""
        if landed.intersection(names):
            return (
                f"protrain_fx: the parameters of offloaded chunk {chunk} got a second gradient before "
                "optimizer.step(), but their optimizer step already ran as the first one landed (a second "
                "backward per step: micro-batches; or one backward through two calls of the model). Wrap the "
                "backward passes of all but the last micro-batch in `with handle.accumulate():` (handle = "
                "protrain_fx.offload(...)'s return value), or pass grad_clipping=True to offload(...), which "
                "holds every chunk's step until optimizer.step()"
            )
        return (
            f"protrain_fx: offloaded chunk {chunk} got gradients from two graphs in one step (a graph break "
            "inside the parameters of one chunk, after its first part was stepped); remove the graph break "
            "(protrain_fx.step_report() names it), or pass grad_clipping=True to offload(...), which holds "
            "every chunk's step until the gradients are complete"
        )

    def _wait_for_landing_buffer(self) -> None:
        """While the lean chunks' landing pool is full, wait for the oldest queued CPU step to give
        its buffer back. With none queued (accumulated gradients hold the buffers until
        ``optimizer.step()``) the store makes one more, checking the host memory."""
        start = time.perf_counter()
        while self.store.landing_full() and self._landed_lean:
            self.worker.wait(self._landed_lean.pop(0))
        self.landing_wait_s += time.perf_counter() - start


def _staged(grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients copied, in ``dtype``, into one fresh device buffer on the current stream.

    The copies to the host read this buffer after the graph has gone on; the graph's own gradient
    buffers are free as soon as this returns (Inductor may reuse them at once, which it could not
    if the host copies read them), and the staging buffer is the caching allocator's, held until
    the copy stream is done with it (``record_stream``)."""
    flat = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device)
    views, start = [], 0
    for g in grads:
        view = flat[start : start + g.numel()].view(g.shape)
        view.copy_(g)
        views.append(view)
        start += g.numel()
    return views
