"""Runtime: the custom ops rewritten graphs call. Never imports ``protrain_fx.passes``."""
