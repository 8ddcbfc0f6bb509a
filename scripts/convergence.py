#!/usr/bin/env python3
"""Convergence runs: several train.py processes at once that differ only in precision, then their summary.

The code is ``nvfp4_train.experiments.convergence``; ``--help`` lists the options. Run from the repository root
with the project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there):
``python3 scripts/convergence.py`` or ``python3 -m scripts.convergence``.
"""

from nvfp4_train.experiments.convergence import main

if __name__ == "__main__":
    raise SystemExit(main())
