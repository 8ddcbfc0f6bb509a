#!/usr/bin/env python3
"""Check that parallel layouts (TP, PP, DP) resuming one GPU's checkpoint follow its losses.

The code is ``nvfp4_train.experiments.layout_check``; ``--help`` lists the options. Run from the repository root
with the project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there):
``python3 scripts/layout_check.py`` or ``python3 -m scripts.layout_check``.
"""

from nvfp4_train.experiments.layout_check import main

if __name__ == "__main__":
    raise SystemExit(main())
