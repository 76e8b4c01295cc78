"""What the rewritten graphs call at run time: activation swap ops (copy streams, pinned pool), the
chunk store, the device buffer pool and the optimizers of offloaded chunks. Imports nothing from
``passes``, ``planner``, ``search`` or ``profile``.
"""
