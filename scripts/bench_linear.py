#!/usr/bin/env python3
"""One quantized linear layer's forward + backward per 12B shape, against BF16, in one run.

The code is ``nvfp4_train.bench.linear``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/bench_linear.py`` or ``python3 -m scripts.bench_linear``.
"""

from nvfp4_train.bench.linear import main

if __name__ == "__main__":
    raise SystemExit(main())
