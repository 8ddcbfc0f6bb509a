#!/usr/bin/env python3
"""The FP4 GEMM's dequantize launch on the `1.2b` and 12B operand pairs under a sweep of launch configurations, each
checked bit for bit first.

The code is ``nvfp4_train.bench.fp4_dequant``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or through ``scripts/gpu_env.sh``: ``python3 scripts/bench_fp4_dequant.py``.
"""

from nvfp4_train.bench.fp4_dequant import main

if __name__ == "__main__":
    raise SystemExit(main())
