#!/usr/bin/env python3
"""Training-step benchmark on one GPU: step time, tokens/s, MFU, memory, profile, under several recipes.

The code is ``nvfp4_train.bench.train``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/bench_train.py`` or ``python3 -m scripts.bench_train``.
"""

from nvfp4_train.bench.train import main

if __name__ == "__main__":
    raise SystemExit(main())
