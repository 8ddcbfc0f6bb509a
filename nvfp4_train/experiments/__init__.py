"""Tools over whole training runs: the convergence launcher and its summary (``convergence``), the plots of
runs' metrics (``plots``), and the check that parallel layouts follow one GPU's losses (``layout_check``).
Each has a ``main()``; ``scripts/`` holds their command lines (``docs/experiments.md``, ``docs/benchmarks.md``).
"""
