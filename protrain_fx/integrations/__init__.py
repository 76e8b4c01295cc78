"""Integrations with model libraries, each imported only when the model comes from that library.

:func:`model_init` is ``protrain_fx.offload(..., init="model")``: a model built on the ``meta``
device is materialised with its own initialisation, parameter by parameter, straight into the
chunks, and its ``meta`` buffers are recomputed on the device.
"""

from protrain_fx.integrations.model_init import model_init

__all__ = ["model_init"]
