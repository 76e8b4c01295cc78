"""Analyses of captured graphs: blocks, liveness and peak memory, Inductor's allocation plan, estimates.

Analyses read graphs and return data; they never rewrite a graph (``passes/`` does).
"""
