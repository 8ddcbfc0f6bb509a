"""The NVFP4 GEMM on Blackwell's FP4 tensor cores (``gemm_engine=native``, experimental: not yet run on a
B200). The same operands as ``nvfp4_train.kernels.nvfp4.nvfp4_gemm`` (``NVFP4Tensor``, blocked along K), the same product:

    C[M, N] = alpha * sum_k (qa[m, k] * sa[m, k // 16]) * (qb[n, k] * sb[n, k // 16])
    alpha   = (amax_A / 2688) * (amax_B / 2688)                       (``nvfp4_alpha``)

One call of torch's block-scaled matmul (written for torch 2.13 and checked against its own argument checks on
meta tensors; torch 2.11, the H200's, has ``scaled_mm`` too, but its FP4 forms were not tried there):

    torch.nn.functional.scaled_mm(
        a.codes.view(float4_e2m1fn_x2),            [M, K/2]  row-major: the codes as they are
        b.codes.view(float4_e2m1fn_x2).t(),        [K/2, N]  column-major: B's codes as they are
        [sa_blocked, amax_A / 2688], [ScalingType.BlockWise1x16, ScalingType.TensorWise],
        [sb_blocked, amax_B / 2688], [ScalingType.BlockWise1x16, ScalingType.TensorWise],
        swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4,
        output_dtype=torch.bfloat16)

* Codes: our packing (element 2j in the low nibble) IS ``float4_e2m1fn_x2``: a view, no pass.
* Block scales: E4M3 in the 128x4-tile layout (``kernels/fp4_layout.py``), written so by the quantizer when it
  is asked for ``swizzled=True``; row-major scales are rearranged here (``to_blocked``, one small pass).
* Alpha: the two-level form (a ``TensorWise`` fp32 scale after each ``BlockWise1x16`` one) is the only form of
  torch's API that applies the tensor scale to the fp32 accumulator: torch (``_scaled_nvfp4_nvfp4`` in
  ATen's ScaledBlas.cpp) multiplies the two global scales on the device, ``alpha = scale_a[1] * scale_b[1]``
  (one fp32 multiply of our two ``decode_scale`` values: exactly ``nvfp4_alpha``'s bits), and hands that
  device tensor to cuBLASLt as the GEMM's alpha, which computes ``D = alpha * acc`` in its fp32 scale type
  and rounds D once to ``output_dtype``: the same two roundings as our Hopper GEMM's epilogue, with no host
  sync. The alternatives are not exact: the single-level call returns a bf16 product that would then be
  scaled (a second rounding), ``torch._scaled_mm``'s ``scale_result`` applies only to fp8 outputs, and an
  fp32 output followed by a multiply is exact but costs a pass over an fp32 [M, N] tensor.

What differs from the Hopper engines: the fp32 summation order, and how the tensor cores accumulate inside a
block-scaled MMA (not measured yet). Shapes: K a multiple of 32 and N a multiple of 16 (torch's checks on the
packed operands); M is free; the scale tiles are zero-padded to 128 rows x 4 blocks.

``nvfp4_native_args`` builds the exact arguments (CPU-testable: ``scaled_mm`` accepts them on meta tensors),
``emulate_nvfp4_scaled_mm`` evaluates them on CPU from the swizzled buffers (un-swizzle, dequantize, fp32
matmul, alpha), and ``nvfp4_gemm_native`` runs the call (sm_100+ only: ``check_native_fp4``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvfp4_train.kernels.fp4_layout import as_float4_x2, from_blocked, to_blocked
from nvfp4_train.kernels.fp4_native import check_native_fp4, native_fp4_supported  # noqa: F401 (nvfp4_train.kernels.gemm_engine reads it here)
from nvfp4_train.kernels.fp4_reference import e2m1_decode, unpack_nibbles
from nvfp4_train.kernels.nvfp4.reference import BLOCK, NVFP4Tensor, decode_scale

__all__ = ["nvfp4_gemm_native", "nvfp4_native_args", "emulate_nvfp4_scaled_mm", "check_native_shapes"]

_OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_native_shapes(fmt: str, m: int, n: int, k: int, k2: int) -> None:
    """The native FP4 GEMM's shape limits: equal K, K a multiple of 32, N a multiple of 16 (torch checks the
    packed [M, K/2] and [K/2, N] operands for multiples of 16)."""
    if k != k2:
        raise ValueError(f"{fmt} GEMM: reduction dims differ (A is [{m}, {k}], B is [{n}, {k2}])")
    if k % 32 != 0 or n % 16 != 0:
        raise ValueError(f"gemm_engine=native: {fmt} GEMM [{m}, {k}] x [{n}, {k}]^T needs K % 32 == 0 and "
                         f"N % 16 == 0 (torch's FP4 scaled_mm); pad the layer's dims")


def _blocked(q: NVFP4Tensor) -> torch.Tensor:
    """q's E4M3 scales in the 128x4-tile layout (as they are when the quantizer wrote them so)."""
    return q.scales if q.swizzled else to_blocked(q.scales)


def nvfp4_native_args(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The keyword arguments of ``torch.nn.functional.scaled_mm`` that compute ``nvfp4_gemm(a, b)`` on FP4
    tensor cores (see the module docstring)."""
    (m, k), (n, k2) = a.shape, b.shape
    check_native_shapes("NVFP4", m, n, k, k2)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    two_level = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    return dict(
        mat_a=as_float4_x2(a.codes),
        mat_b=as_float4_x2(b.codes).t(),
        scale_a=[_blocked(a), decode_scale(a.amax)],
        scale_recipe_a=two_level,
        scale_b=[_blocked(b), decode_scale(b.amax)],
        scale_recipe_b=list(two_level),
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


def nvfp4_gemm_native(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C[M, N] = alpha * A[M, K] . B[N, K]^T on FP4 tensor cores; ValueError below sm_100."""
    check_native_fp4(a.codes.device)
    return F.scaled_mm(**nvfp4_native_args(a, b, out_dtype))


def _decode_operand(codes_fp4: torch.Tensor, blocked: torch.Tensor, rows: int, k: int, block: int,
                    scale_to_f32) -> torch.Tensor:
    """fp32 [rows, k] = e2m1(code) * block scale, from the packed codes (a [rows, k/2] fp4x2 tensor) and the
    swizzled scale buffer (exact: <= 6 significant bits per value)."""
    vals = e2m1_decode(unpack_nibbles(codes_fp4.view(torch.uint8))).view(rows, k // block, block)
    scales = scale_to_f32(from_blocked(blocked, rows, k // block))
    return (vals * scales.unsqueeze(-1)).view(rows, k)


def emulate_nvfp4_scaled_mm(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: list, scale_recipe_a: list, scale_b: list,
    scale_recipe_b: list, swizzle_a, swizzle_b, output_dtype: torch.dtype,
) -> torch.Tensor:
    """What ``scaled_mm`` computes for ``nvfp4_native_args``, on CPU: un-swizzle the block scales, dequantize
    each operand exactly in fp32, ``acc = A @ B`` in fp32 (torch's CPU order), ``alpha = scale_a[1] *
    scale_b[1]`` in fp32 (torch's own product), ``(acc * alpha)`` rounded once to ``output_dtype``."""
    assert scale_recipe_a == scale_recipe_b == [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    assert swizzle_a == swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
    m, k = mat_a.shape[0], mat_a.shape[1] * 2
    n = mat_b.shape[1]
    e4m3 = lambda s: s.to(torch.float32)  # noqa: E731
    da = _decode_operand(mat_a, scale_a[0], m, k, BLOCK, e4m3)
    db = _decode_operand(mat_b.t(), scale_b[0], n, k, BLOCK, e4m3)
    acc = da @ db.t()
    alpha = scale_a[1].to(torch.float32) * scale_b[1].to(torch.float32)
    return (acc * alpha).to(output_dtype)
