"""Decisions: budget arithmetic, the activation plan, offload counts, first-step feedback, what fits.

The planner decides; it never rewrites a graph (``passes/`` does).
"""
