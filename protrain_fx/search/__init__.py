"""The cost model and the search over plans, on plain data (``search/problem.py``).

Nothing here imports torch or FX: a problem can be dumped to JSON and searched again in a test.
"""
