"""What one linear layer's forward + backward launches on the GPU code path, counted on CPU.

Runs ``quantized_linear`` (the autograd Function of every quantized layer) under ``TRITON_INTERPRET=1`` with CPU
tensors, i.e. through the same Python code as on CUDA, and counts (with ``nvfp4_train.bench.host``'s counters, which
also time that host path)

* the Triton kernel launches, by kernel;
* the torch operators it calls (views and allocations listed apart: they launch no kernel).

The weight is quantized in a first call and cached, as in training with the weight cache on (one quantization per
optimizer step), so the counts are those of every further micro-batch. Under the interpreter a few torch operators
stand in for GPU-only ones (the "cublas" GEMM engine's ``a.float() @ b.float().t()`` and Triton alpha pass instead
of one cuBLASLt GEMM with alpha in its epilogue; an fp32 staging copy when dequantizing to bf16; see
``bench_host``'s docstring): they are marked "interpreter only". Host
cost on the GPU grows with every launch (docs/benchmarks.md, "One linear layer"); this is the count to keep small.
Only ``nvfp4`` (and its ablations) and ``bf16`` take the same path here as on CUDA: FP8's GEMM is an emulation on
CPU (``torch._scaled_mm`` is CUDA-only) and MXFP4's GEMM runs on fp32 operands under the interpreter (bf16 on the
GPU), so their counts are not their GPU counts.

    TRITON_INTERPRET=1 python3 scripts/launch_inventory.py --recipe nvfp4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("launch_inventory: run with TRITON_INTERPRET=1 (the flag is read when triton is imported)")
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, GEMM_ENGINES
from nvfp4_train.bench.host import measure, print_op_counts


def inventory(recipe_name: str, M: int = 128, K: int = 256, N: int = 128,
              gemm_engine: str = DEFAULT_GEMM_ENGINE) -> dict:
    """The launches of one ``quantized_linear`` fwd+bwd with the weight cached, counted by ``bench_host.measure``
    (the Triton launches stubbed and counted; the aten ops classified by ``bench_host``'s call-site rules: those
    that launch a kernel, those that launch none, and those only the interpreter issues)."""
    r = measure(recipe_name, "function", M, K, N, iters=1, warmup=1, gemm_engine=gemm_engine)
    return dict(recipe=recipe_name, triton=r["triton"], torch_kernels=r["torch_kernels"],
                interpreter_only=r["interpreter_only"], no_kernel=r["no_kernel"], total_launches=r["launches"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", nargs="+", default=["nvfp4"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gemm-engine", choices=GEMM_ENGINES, default=DEFAULT_GEMM_ENGINE,
                    help="precision.gemm_engine for this count")
    a = ap.parse_args()
    rows = [inventory(r, gemm_engine=a.gemm_engine) for r in a.recipe]
    for r in rows:
        note = "" if r["recipe"].startswith("nvfp4") or r["recipe"] == "bf16" else "  (CPU path: not the GPU count)"
        print(f"{r['recipe']}: {r['total_launches']} kernel launches per fwd+bwd (weight cached){note}")
        print_op_counts(r)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
