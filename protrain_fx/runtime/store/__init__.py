"""Host memory of offloaded chunks: the pinned chunk store and its slots, the device buffers chunks
are gathered into, accumulated gradient adds, and what the host can hold."""
