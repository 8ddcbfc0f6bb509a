#!/usr/bin/env python3
"""The FP8 cast kernels on the 12B shapes under a sweep of launch configurations, each checked bit for bit first.

The code is ``nvfp4_train.bench.fp8_casts``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or through ``scripts/gpu_env.sh``: ``python3 scripts/bench_fp8_casts.py``.
"""

from nvfp4_train.bench.fp8_casts import main

if __name__ == "__main__":
    raise SystemExit(main())
