#!/usr/bin/env python3
"""Time one checkpoint save, verification and load of a model size, by phase.

The code is ``nvfp4_train.bench.checkpoint``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/bench_checkpoint.py`` or ``python3 -m scripts.bench_checkpoint``.
"""

from nvfp4_train.bench.checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
