#!/usr/bin/env python3
"""RMSNorm forward + backward and backward alone: torch's fused rms_norm, ours (the backward as one Triton kernel,
``fusion.rms_norm``) and Liger-Kernel's when it imports, each checked against the bound first.

The code is ``nvfp4_train.bench.rms_norm``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or through ``scripts/gpu_env.sh``: ``python3 scripts/bench_rms_norm.py``
(one GPU; ``TRITON_INTERPRET=1 ... --quick``: a CPU smoke test).
"""

from nvfp4_train.bench.rms_norm import main

if __name__ == "__main__":
    raise SystemExit(main())
