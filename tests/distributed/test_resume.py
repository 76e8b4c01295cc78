"""Checkpoints across world sizes: saved at 2 ranks (gathered whole on every rank), resumed at 1,
saved there and resumed at 2 again (with the loop's own ``load_state_dict`` calls: each rank loads
its pieces); the next step gives the same bits on every path. At 2 ranks ``model.state_dict()`` and
``optimizer.state_dict()`` are refused naming the handle's collectives.

One rank stands for two by halving each micro-batch's loss and accumulating: 0.5 * g0 + 0.5 * g1 is
exactly (g0 + g1) / 2 (halving is exact), the mean two ranks reduce."""

from __future__ import annotations

import os

import pytest
import torch

import protrain_fx
from protrain_fx.errors import UnsupportedError
from tests.distributed import common
from tests.distributed.ranks import run_ranks


def _offloaded():
    model, _, opt, _ = common.models()
    handle = protrain_fx.offload(model, opt, n_persist=1, n_buffer=2, device="cpu", chunk_bytes=common.CHUNK)
    return model, opt, handle, torch.compile(model, backend="protrain", options={"codegen": "eager"})


def _step(rank: int, world: int, compiled, opt, handle, step: int) -> None:
    if world == 2:
        compiled(*common.batch(step, rank)).backward()
    else:  # both ranks' micro-batches, each loss halved
        with handle.accumulate():
            (0.5 * compiled(*common.batch(step, 0))).backward()
        (0.5 * compiled(*common.batch(step, 1))).backward()
    opt.step(), opt.zero_grad()


def _run(rank: int, world: int, load: str | None, save: str | None, steps_before_save: int) -> dict:
    model, opt, handle, compiled = _offloaded()
    if load is not None:
        checkpoint = torch.load(load, weights_only=False)
        if world == 2:  # the loop's own calls: each rank loads its pieces, no collective
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        else:
            handle.load_state_dict(model, checkpoint["model"], checkpoint["optimizer"])
    for step in range(steps_before_save):
        _step(rank, world, compiled, opt, handle, step)
    if world == 2:  # saving gathers every rank's pieces: the loop's own calls name the handle's
        for call in (model.state_dict, opt.state_dict):
            with pytest.raises(UnsupportedError, match="on every rank"):
                call()
    state, optimizer = handle.state_dict(model), handle.optimizer_state_dict()  # every rank: collectives
    if save is not None and rank == 0:
        torch.save({"model": state, "optimizer": optimizer}, save)
    _step(rank, world, compiled, opt, handle, 7)
    final = handle.state_dict(model)
    handle.close()
    return final


def test_a_checkpoint_saved_at_two_ranks_resumes_at_one_and_back_at_two_exactly(tmp_path):
    a, b = os.path.join(tmp_path, "two.pt"), os.path.join(tmp_path, "one.pt")
    at_two = run_ranks(_run, None, a, 2)  # two steps at 2 ranks, saved, then step 7
    (at_one,) = run_ranks(_run, a, b, 0, world=1)  # loaded at 1 rank, saved again, step 7
    back_at_two = run_ranks(_run, b, None, 0)  # loaded at 2 ranks, step 7
    for final in (*at_two[1:], at_one, *back_at_two):
        assert final.keys() == at_two[0].keys()
        for name, value in at_two[0].items():
            assert torch.equal(final[name], value), name
