"""The garbage collector kept off the objects that outlive a rewrite of the step.

A trial (``backend.py``: the joint graph copied, partitioned, rewritten and analysed) allocates
objects by the hundred thousand: nodes, their meta dicts, fake tensors. Python's collector counts
them, and each time enough have survived it runs a full collection, which walks every object the
process holds: torch's modules, Dynamo's and AOTAutograd's state, the captured graphs. Those walks
are a large share of a trial on a deep model. :func:`frozen` moves the objects alive when it starts
into the collector's permanent generation while it lasts (``gc.freeze``): the objects the trial
makes are collected as before, the older ones are not walked again. Only a cycle of objects alive
when the freeze begins and dropped while it lasts is freed later: at the first full collection
after it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """The objects alive now left out of the collector's walks until the block ends (module
    docstring). Where something else froze objects already (a parent process before a fork, say, or
    an enclosing :func:`frozen`), nothing changes: unfreezing would thaw its objects too."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
