"""Example models and scripts for protrain_fx."""
