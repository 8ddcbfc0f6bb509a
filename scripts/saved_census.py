#!/usr/bin/env python3
"""What a benchmark case's forward saves for backward, by the autograd node that saved it, on CPU.

The code is ``nvfp4_train.bench.saved_census``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/saved_census.py`` or ``python3 -m scripts.saved_census``.
"""

from nvfp4_train.bench.saved_census import main

if __name__ == "__main__":
    raise SystemExit(main())
