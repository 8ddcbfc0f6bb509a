#!/usr/bin/env python3
"""What one linear layer's forward + backward launches on the GPU code path, counted on CPU.

Runs ``quantized_linear`` (the autograd Function of every quantized layer) under ``TRITON_INTERPRET=1`` with CPU
tensors, i.e. through the same Python code as on CUDA, and counts

* the Triton kernel launches, by kernel;
* the torch operators it calls (views and allocations listed apart: they launch no kernel).

The weight is quantized in a first call and cached, as in training with the weight cache on (one quantization per
optimizer step), so the counts are those of every further micro-batch. Under the interpreter a few torch operators
stand in for GPU-only ones (the "cublas" GEMM engine's ``a.float() @ b.float().t()`` instead of ``torch.mm(...,
out_dtype=float32)``; an fp32 staging copy when dequantizing to bf16): they are marked "interpreter only". Host
cost on the GPU grows with every launch (docs/benchmarks.md, "One linear layer"); this is the count to keep small.
Only ``nvfp4`` (and its ablations) and ``bf16`` take the same path here as on CUDA: FP8's GEMM is an emulation on
CPU (``torch._scaled_mm`` is CUDA-only) and MXFP4's GEMM design differs under the interpreter, so their counts are
not their GPU counts.

    TRITON_INTERPRET=1 python3 scripts/launch_inventory.py --recipe nvfp4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("launch_inventory: run with TRITON_INTERPRET=1 (the flag is read when triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kernels.nvfp4 import GEMM_ENGINE_ENV, GEMM_ENGINES  # noqa: E402
from scripts._aten_ops import launches_kernel  # noqa: E402

# CPU stand-ins of GPU-only operators (see the module docstring)
INTERPRETER_ONLY = {"_to_copy", "copy_"}


def inventory(recipe_name: str, M: int = 128, K: int = 256, N: int = 128) -> dict:
    from nvfp4_train.precision.linear import LinearContext, quantized_linear
    from nvfp4_train.precision.recipe import named_recipe

    ops: collections.Counter = collections.Counter()
    launches: collections.Counter = collections.Counter()
    inside = [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:  # the interpreter's own tensor traffic is not the program's
                ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(N, K, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(torch.bfloat16)
    lctx = LinearContext(recipe=named_recipe(recipe_name))
    interpreter.InterpretedFunction.run = counted_run
    try:
        quantized_linear(x, w, None, lctx).backward(dy)  # quantizes and caches the weight
        x.grad = w.grad = None  # the counted backward writes the gradients, it does not accumulate them
        ops.clear()
        launches.clear()
        with Count():
            quantized_linear(x, w, None, lctx).backward(dy)
    finally:
        interpreter.InterpretedFunction.run = run
    kernels = {k: v for k, v in ops.items() if launches_kernel(k) and k not in INTERPRETER_ONLY}
    return dict(recipe=recipe_name, triton=dict(launches), torch_kernels=kernels,
                interpreter_only={k: v for k, v in ops.items() if k in INTERPRETER_ONLY},
                no_kernel={k: v for k, v in ops.items() if not launches_kernel(k)},
                total_launches=sum(launches.values()) + sum(kernels.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", nargs="+", default=["nvfp4"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gemm-engine", choices=GEMM_ENGINES, help=f"{GEMM_ENGINE_ENV} for this count")
    a = ap.parse_args()
    if a.gemm_engine:
        os.environ[GEMM_ENGINE_ENV] = a.gemm_engine
    rows = [inventory(r) for r in a.recipe]
    for r in rows:
        note = "" if r["recipe"].startswith("nvfp4") or r["recipe"] == "bf16" else "  (CPU path: not the GPU count)"
        print(f"{r['recipe']}: {r['total_launches']} kernel launches per fwd+bwd (weight cached){note}")
        print(f"  triton:           {r['triton']}")
        print(f"  torch kernels:    {r['torch_kernels']}")
        print(f"  interpreter only: {r['interpreter_only']}")
        print(f"  no kernel:        {r['no_kernel']}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
