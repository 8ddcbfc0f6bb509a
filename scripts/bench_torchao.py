#!/usr/bin/env python3
"""Our FP8 linear layer (blockwise and tensorwise) against torchao's FP8 training layers, per 12B shape, in one run.

The code is ``nvfp4_train.bench.torchao_fp8``; ``--help`` lists the options. torchao is optional: without it its
variants are reported unavailable. Run from the repository root with the project installed (``make install``) or
on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3 scripts/bench_torchao.py``.
"""

from nvfp4_train.bench.torchao_fp8 import main

if __name__ == "__main__":
    raise SystemExit(main())
