#!/usr/bin/env python3
"""Time the optimizer step's passes (AdamW foreach against fused, the clipping, megatron's found-inf check and
bf16 copy-back) on FP32 shards of a model's parameter shapes, as ms and a share of the H200's copy rate.

The code is ``nvfp4_train.bench.optimizer``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/bench_optimizer.py`` (one GPU; ``--quick``: a CPU smoke test).
"""

from nvfp4_train.bench.optimizer import main

if __name__ == "__main__":
    raise SystemExit(main())
