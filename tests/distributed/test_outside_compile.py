"""The collectives the planner issues while a compile runs see real tensors and no Python dispatcher.

AOTAutograd runs the partitioner (and so the planner) with the Python dispatcher on and under its
fake mode. With the dispatcher on, a thread queueing a gloo collective keeps the GIL, which the
group's worker thread needs to free the tensors of the collective before: two ranks planning
together stalled in about a third of runs (``runtime/parallel/distributed.outside_compile``). One process
here: the process group is stood in for, and each collective records the modes it was called in.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from protrain_fx.runtime.parallel import distributed, shard


@pytest.fixture
def calls(monkeypatch):
    seen: list[tuple[str, bool, bool]] = []

    def recorder(name):
        def call(*args, **kwargs):
            dispatcher = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
            fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
            seen.append((name, dispatcher, fake))
        return call

    monkeypatch.setattr(distributed, "active", lambda: distributed.Group(2, 0, 0, 2, "gloo"))
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    for name in ("broadcast_object_list", "all_gather_object", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, recorder(name))
    return seen


def test_the_planners_exchanges_leave_the_compiles_modes(calls):
    store = SimpleNamespace(shard=(0, 2), chunk_numel=2, full_numel=4)
    whole = torch.zeros(4)
    with enable_python_dispatcher():
        shard.all_gather(store, whole)
        shard.reduce_scatter_mean(store, whole)
        with FakeTensorMode():
            distributed.from_rank0(1)
            distributed.gather(1)
            shard._all_objects(1)
    assert [c[0] for c in calls] == ["all_gather_into_tensor", "reduce_scatter_tensor", "broadcast_object_list",
                                     "all_gather_object", "all_gather_object"]
    assert not any(dispatcher or fake for _, dispatcher, fake in calls), calls
