"""Rewrites of the captured graphs, one function per pass.

The order in which they run, and the only list of them, is ``passes/pipeline.py``.
"""
