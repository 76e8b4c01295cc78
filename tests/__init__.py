"""The test suite, in folders that mirror the package's data flow.

``analysis/``, ``search/``, ``profile/``, ``planner/``, ``passes/``, ``runtime/`` and ``inspect/``
test their package folder (``passes/test_<pass>_unit.py``: each pass on hand-built graphs);
``bench/`` the scripts in ``bench/``; ``integration/`` training end to end through the backend
(numerics, training loops, options, the entry point, the package's layering). GPU tests
(``test_gpu_*.py``, ``test_measure_gpu.py``) sit beside their area and skip without CUDA. Every
folder is a package, so test modules import each other as ``tests.<folder>.<module>``.
"""
