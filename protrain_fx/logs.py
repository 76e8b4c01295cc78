"""protrain_fx's log under torch's logging controls.

The package logs to the logger ``"protrain_fx"`` (one line per planned graph, its plan table, first
steps, warnings). torch reads ``TORCH_LOGS`` once, when it is imported, and accepts there its own
components and the names of importable modules: ``TORCH_LOGS="protrain_fx"`` shows the backend's
INFO lines, ``"+protrain_fx"`` its DEBUG lines. From Python, :func:`register` (run when the package is
imported) adds the short name through torch's registration API, so that
``torch._logging.set_logs(modules={"protrain": logging.DEBUG})`` works as for torch's components.
(``TORCH_LOGS="protrain"`` itself cannot be accepted: torch rejects an unknown name while it is being
imported, before any package of ours can register it.) With nothing set, nothing changes.

The registration uses torch's private ``torch._logging._internal.register_log`` of the pinned torch
(it is how ``torch/_logging/_registrations.py`` registers torch's own components), isolated here;
``tests/inspect/test_logs.py`` fails if it moves.
"""

from __future__ import annotations

#: The name ``torch._logging.set_logs(modules={...})`` takes for this package's log.
ALIAS = "protrain"

#: The package's logger.
LOGGER = "protrain_fx"


def register() -> None:
    """Register :data:`ALIAS` for :data:`LOGGER` with torch's log registry (once; idempotent)."""
    from torch._logging import _internal

    if not _internal.log_registry.is_log(ALIAS):
        _internal.register_log(ALIAS, LOGGER)
