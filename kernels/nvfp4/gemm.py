"""The NVFP4 x NVFP4 GEMM on Hopper: ``kernels/fp4_gemm.py``'s block-scaled FP4 GEMM with E4M3 scales over 16
elements and the tensor scales in ``alpha = (amax_A / 2688) * (amax_B / 2688)`` (see that module for the
exactness argument, the dequantization and the two engines)."""

from __future__ import annotations

import torch

from nvfp4_train.kernels.fp4_gemm import GemmConfig, check_gemm_engine, predequant_fp4_gemm
from nvfp4_train.kernels.nvfp4.reference import BLOCK, NVFP4Tensor, nvfp4_alpha

__all__ = ["nvfp4_gemm_predequant", "nvfp4_gemm_accumulate"]


def _alpha(a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
    """nvfp4_alpha with torch ops on the operands' device (no .item(), no host sync)."""
    dev = a.codes.device
    if a.amax.device != dev or b.amax.device != dev:
        raise ValueError(f"NVFP4 GEMM: amax tensors must be on the codes' device {dev}, got "
                         f"{a.amax.device} and {b.amax.device}")
    return nvfp4_alpha(a.amax, b.amax).reshape(1).contiguous()


def nvfp4_gemm_predequant(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    dot_dtype: str | None = None,
    config: GemmConfig | None = None,
    engine: str = "triton",
) -> torch.Tensor:
    """C[M, N] = alpha * A[M, K] . B[N, K]^T, both NVFP4 blocked along K (1x16 or 2-D scales alike): dequantize
    both operands once to 16-bit [., K] tensors (``q * sdec_b``, exact; one launch), then a 16-bit GEMM with
    fp32 accumulation and the alpha epilogue. ``engine``: "triton" (``gemm_alpha_triton``; ``dot_dtype``
    default "fp16") or "cublas" (``gemm_alpha_cublas``: cuBLAS with fp32 output, then the alpha pass;
    ``dot_dtype`` default "bf16", the dtype of the dequantized operands, "fp16" or "bf16"; no ``config``)."""
    # engine "cublas": alpha formed inside its alpha pass from the two amaxes (the same bits as _alpha)
    cublas = check_gemm_engine(engine) == "cublas"
    return predequant_fp4_gemm(
        a.codes, a.scales, b.codes, b.scales, block=BLOCK, scale_format="e4m3",
        alpha=None if cublas else _alpha(a, b), out_dtype=out_dtype, dot_dtype=dot_dtype, config=config,
        fmt_name="NVFP4", engine=engine, amax=(a.amax, b.amax) if cublas else None,
    )


def nvfp4_gemm_accumulate(a: NVFP4Tensor, b: NVFP4Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[M, N] += alpha * A[M, K] . B[N, K]^T`` on CUDA (engine "cublas"): the two operands dequantized in one
    launch (which forms alpha), then one cuBLASLt GEMM that adds ``fl32(alpha * acc)`` into ``out`` (fp32, or
    bf16/fp16) in its epilogue: the Wgrad GEMM of a quantized layer straight into megatron's ``main_grad``."""
    if not a.codes.is_cuda:
        raise ValueError(f"nvfp4_gemm_accumulate runs on CUDA, got operands on {a.codes.device}")
    return predequant_fp4_gemm(
        a.codes, a.scales, b.codes, b.scales, block=BLOCK, scale_format="e4m3", alpha=None, out_dtype=out.dtype,
        dot_dtype=None, fmt_name="NVFP4", engine="cublas", amax=(a.amax, b.amax), accumulate_into=out,
    )
