"""What the rewritten graphs call at run time, in rooms by subsystem: ``offload/`` (one offloaded
model's handle, options, chunk ops, shells, landing, state dicts), ``store/`` (the host chunk store
and device buffers), ``optim/`` (the chunks' optimizers and clipping), ``parallel/`` (data
parallelism), and beside them ``swap`` (activation swap ops) and ``allocator`` (CUDA's caching
allocator). Imports nothing from ``passes``, ``planner``, ``search``, ``profile`` or ``integrations``.
"""
