#!/usr/bin/env python3
"""Plot runs' metrics (loss or validation loss vs tokens) with the relative difference to a baseline.

The code is ``nvfp4_train.experiments.plots``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/plot_runs.py`` or ``python3 -m scripts.plot_runs``.
"""

from nvfp4_train.experiments.plots import main

if __name__ == "__main__":
    raise SystemExit(main())
