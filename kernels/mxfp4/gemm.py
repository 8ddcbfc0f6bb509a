"""MXFP4 x MXFP4 GEMM in Triton (Hopper: no FP4 tensor cores): the NVFP4 GEMM with E8M0 scales.

    C[M, N] = sum_k (qa[m, k] * 2^(sa[m, k // 32] - 127)) * (qb[n, k] * 2^(sb[n, k // 32] - 127))

Layout (both operands blocked along K, as ``MXFP4Tensor``): codes uint8 [., K/2] (element 2j in the low
nibble), scales uint8 E8M0 [., K/32]; 0xFF is NaN. No tensor scale, so no alpha.

The GEMM is ``kernels/fp4_gemm.py``'s ``predequant_fp4_gemm`` (see its docstring for the E2M1 bit decoding)
with E8M0 scales: one pass writes each operand's ``e2m1 * 2^(s-127)`` in the dot dtype (the scale byte s
becomes the bf16 (or fp32) bit pattern ``s << 7`` (``s << 23``) = 2^(s-127), byte 0 the subnormal 2^-127,
0xFF NaN), then the Triton 16-bit GEMM with fp32 accumulation. That product is exact in bf16 and fp32 (a
2-bit significand times a power of two in [2^-127, 2^127]; bf16 and fp32 share the exponent range, and
0.5 * 2^-127 = 2^-128 is still a subnormal of both) except where it overflows (|e2m1| >= 2 with s = 254 gives
Inf, as the fp32 reference does). fp16 cannot hold that range, so the dot dtype is bf16 on the GPU and fp32
under ``TRITON_INTERPRET=1`` (whose bf16 dot multiplies raw bits).

Exactness for scales <= 2^-126 (bytes 0, 1 with small codes) relies on bf16 subnormals surviving the
multiply and the tensor cores on the GPU; checked by ``tests/kernels/test_mxfp4_gemm.py`` on the GPU.
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels._dispatch import interpret_mode
from nvfp4_train.kernels.fp4_gemm import GemmConfig, predequant_fp4_gemm

MX_BLOCK = 32


def mxfp4_gemm_triton(
    a,
    b,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    dot_dtype: str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """C[M, N] = A[M, K] . B[N, K]^T for MXFP4 operands (objects with ``codes`` uint8 [., K/2] and
    ``scales`` uint8 [., K/32], e.g. ``MXFP4Tensor``). ``out_dtype``: torch.bfloat16 or torch.float32.
    ``dot_dtype``: None picks 'bf16' on the GPU and 'fp32' under the interpreter; 'fp16' is refused (not
    exact for E8M0 scales). Products are exact and accumulate in fp32."""
    if dot_dtype is None:
        dot_dtype = "fp32" if interpret_mode() else "bf16"
    if dot_dtype == "fp16":
        raise ValueError("MXFP4 GEMM: E2M1 * 2^(s-127) is not representable in fp16 for most scales; "
                         "use dot_dtype='bf16' (GPU) or 'fp32'")
    if a.scales.dtype != torch.uint8 or b.scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 scales must be uint8 E8M0, got {a.scales.dtype} and {b.scales.dtype}")
    return predequant_fp4_gemm(a.codes, a.scales, b.codes, b.scales, block=MX_BLOCK, scale_format="e8m0",
                               alpha=None, out_dtype=out_dtype, dot_dtype=dot_dtype, config=config,
                               fmt_name="MXFP4")
