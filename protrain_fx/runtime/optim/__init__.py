"""The optimizers of offloaded chunks (CPU AdamW, the device's streamed AdamW) and exact gradient
clipping over every chunk."""
