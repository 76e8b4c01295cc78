"""Graph passes. Analyses (``blocks``, ``memory``) only read graphs and write ``protrain_fx.meta`` keys;
the order in which passes run lives in ``protrain_fx.pipeline``."""
