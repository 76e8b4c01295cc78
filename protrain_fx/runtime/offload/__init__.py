"""One offloaded model's handle (``protrain_fx.offload``): its options and checks, the custom ops
the rewritten graphs call on its chunks, the parameter shells, gradient landing and state dicts."""
