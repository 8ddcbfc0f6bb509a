"""The MXFP4 GEMM on Blackwell's FP4 tensor cores (``gemm_engine=native``, experimental: not yet run on a
B200). The same operands as ``nvfp4_train.kernels.mxfp4.mxfp4_gemm`` (``MXFP4Tensor``, blocked along K), the same product:

    C[M, N] = sum_k (qa[m, k] * 2^(sa[m, k // 32] - 127)) * (qb[n, k] * 2^(sb[n, k // 32] - 127))

One call of torch's block-scaled matmul, the MX form (no tensor scale, so no alpha: the fp32 accumulator is
rounded once to ``output_dtype``):

    torch.nn.functional.scaled_mm(
        a.codes.view(float4_e2m1fn_x2), b.codes.view(float4_e2m1fn_x2).t(),
        sa_blocked.view(float8_e8m0fnu), ScalingType.BlockWise1x32,
        sb_blocked.view(float8_e8m0fnu), ScalingType.BlockWise1x32,
        swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4, output_dtype=torch.bfloat16)

* Codes: our packing is ``float4_e2m1fn_x2`` (a view). Scales: our uint8 E8M0 bytes are ``float8_e8m0fnu``
  (2^(byte - 127), 0xFF NaN; byte 0 is 2^-127 in both), in the 128x4-tile layout of ``kernels/fp4_layout.py``.
* torch 2.13's meta function for this recipe counts the scale blocks over the PACKED K (K/2/32 per row) and so
  rejects the correct buffers on meta tensors; its CUDA check counts them over K. This call is therefore not
  checked on CPU beyond the layout; it is exactly the call torchao 0.18 makes for MXFP4 (``mx_tensor.py``).
* Shapes: K a multiple of 32 and N of 16, as for NVFP4.

``mxfp4_native_args`` builds the arguments, ``emulate_mxfp4_scaled_mm`` evaluates them on CPU (un-swizzle,
dequantize, fp32 matmul), ``mxfp4_gemm_native`` runs the call (sm_100+ only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvfp4_train.kernels.fp4_layout import as_float4_x2, to_blocked
from nvfp4_train.kernels.fp4_native import check_native_fp4
from nvfp4_train.kernels.mxfp4.reference import BLOCK, MXFP4Tensor, e8m0_to_float32
from nvfp4_train.kernels.nvfp4.native import _OUT_DTYPES, _decode_operand, check_native_shapes

__all__ = ["mxfp4_gemm_native", "mxfp4_native_args", "emulate_mxfp4_scaled_mm"]


def _blocked(q: MXFP4Tensor) -> torch.Tensor:
    s = q.scales if q.swizzled else to_blocked(q.scales)
    return s.view(torch.float8_e8m0fnu)


def mxfp4_native_args(a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The keyword arguments of ``torch.nn.functional.scaled_mm`` that compute ``mxfp4_gemm(a, b)`` on FP4
    tensor cores (see the module docstring)."""
    (m, k), (n, k2) = a.shape, b.shape
    check_native_shapes("MXFP4", m, n, k, k2)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return dict(
        mat_a=as_float4_x2(a.codes),
        mat_b=as_float4_x2(b.codes).t(),
        scale_a=_blocked(a),
        scale_recipe_a=F.ScalingType.BlockWise1x32,
        scale_b=_blocked(b),
        scale_recipe_b=F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


def mxfp4_gemm_native(a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C[M, N] = A[M, K] . B[N, K]^T on FP4 tensor cores; ValueError below sm_100."""
    check_native_fp4(a.codes.device)
    return F.scaled_mm(**mxfp4_native_args(a, b, out_dtype))


def emulate_mxfp4_scaled_mm(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_recipe_a, scale_b: torch.Tensor,
    scale_recipe_b, swizzle_a, swizzle_b, output_dtype: torch.dtype,
) -> torch.Tensor:
    """What ``scaled_mm`` computes for ``mxfp4_native_args``, on CPU: un-swizzle, dequantize exactly in fp32,
    ``A @ B`` in fp32, one rounding to ``output_dtype``."""
    assert scale_recipe_a == scale_recipe_b == F.ScalingType.BlockWise1x32
    assert swizzle_a == swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
    m, k = mat_a.shape[0], mat_a.shape[1] * 2
    n = mat_b.shape[1]
    e8m0 = lambda s: e8m0_to_float32(s.view(torch.uint8))  # noqa: E731
    da = _decode_operand(mat_a, scale_a, m, k, BLOCK, e8m0)
    db = _decode_operand(mat_b.t(), scale_b, n, k, BLOCK, e8m0)
    return (da @ db.t()).to(output_dtype)
