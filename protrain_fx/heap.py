"""Python's full garbage collections held off while a trial rewrites the step.

A trial (``backend.py``: the joint graph copied, partitioned, rewritten and analysed) allocates
objects by the hundred thousand: nodes, their meta dicts, fake tensors. Python's collector counts
them, and each time enough have survived it runs a full collection, which walks every object the
process holds: torch's modules, Dynamo's and AOTAutograd's state, the captured graphs. Those walks
are a large share of a trial on a deep model. :func:`young_only` keeps the collector to its young
generations while it lasts: what a trial makes and drops at once is collected as before; a cycle
that lived long enough to be old waits for the first full collection after it, which the collector
runs as it would have (its count of survivors carries over), walking the process once instead of
once per collection the trial would have started.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

#: The oldest generation's threshold while :func:`young_only` lasts: never reached.
NEVER = 1 << 30


@contextlib.contextmanager
def young_only() -> Iterator[None]:
    """Only the young generations collected until the block ends (module docstring); the
    collector's thresholds as they were afterwards, an error or not."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
