#!/usr/bin/env python3
"""The BF16 linear layer's three GEMMs by torch and by our cuBLASLt binding on a model's shapes, the Wgrad GEMM with
its fp32 main_grad accumulation unfused and fused, and grouped-query attention with repeated K/V vs SDPA's
enable_gqa; every result checked first.

The code is ``nvfp4_train.bench.bf16_gemm``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or through ``scripts/gpu_env.sh``: ``python3 scripts/bench_bf16_gemm.py``.
"""

from nvfp4_train.bench.bf16_gemm import main

if __name__ == "__main__":
    raise SystemExit(main())
