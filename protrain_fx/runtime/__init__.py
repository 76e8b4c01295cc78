"""Runtime pieces the rewritten graphs call: activation swap ops (copy streams, pinned pool) and the
host side of parameter chunks (chunk store, GPU buffer pool, CPU optimizer worker). Never imports
``protrain_fx.passes``."""
