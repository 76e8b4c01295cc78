"""Under a process group of several ranks, a compiled model that nothing averages (not offloaded, not
in a DistributedDataParallel) trains a separate copy on each rank: the backend warns once, naming
the two ways. One process: the process group is stood in for (``distributed.active``)."""

from __future__ import annotations

import logging

import pytest
import torch

import protrain_fx
from examples.gpt import GPT, gpt_config, random_batch
from protrain_fx.runtime.parallel import distributed

CONFIG = gpt_config("tiny", n_layer=2)


@pytest.fixture
def warnings_logged():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("protrain_fx")
    logger.addHandler(handler)
    torch._dynamo.reset()
    protrain_fx.reset()
    yield lambda: [r.getMessage() for r in records if "no gradient is averaged" in r.getMessage()]
    logger.removeHandler(handler)
    torch._dynamo.reset()
    protrain_fx.reset()


def _two_ranks(monkeypatch):
    monkeypatch.setattr(distributed, "active", lambda: distributed.Group(2, 0, 0, 2, "gloo"))
    monkeypatch.setattr(distributed, "agree", lambda values, where: None)  # no ranks to agree with


def test_a_plain_model_on_several_ranks_is_warned_of_once(warnings_logged, monkeypatch):
    _two_ranks(monkeypatch)
    torch.manual_seed(0)
    compiled = torch.compile(GPT(CONFIG), backend="protrain", options={"codegen": "eager"})
    for seq in (16, 24):  # two compiles, one warning
        compiled(*random_batch(CONFIG, 2, seq)).backward()
    (warned,) = warnings_logged()
    assert "2 ranks" in warned and "protrain_fx.offload" in warned and "DistributedDataParallel" in warned


def test_an_offloaded_model_is_not_warned_of(warnings_logged, monkeypatch):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    protrain_fx.offload(model, opt, device="cpu", n_persist=1, n_buffer=2, chunk_bytes=64 * 1024)  # one rank's store
    _two_ranks(monkeypatch)  # then the compile sees several ranks
    torch.compile(model, backend="protrain", options={"codegen": "eager"})(*random_batch(CONFIG, 2, 16)).backward()
    assert not warnings_logged()
