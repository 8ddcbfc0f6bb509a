"""MXFP4 (OCP Microscaling v1.0): E2M1 values, 32-element blocks with E8M0 power-of-two scales, no tensor
scale. The paper's comparison format.

Public API (the same call runs the Triton kernel on CUDA tensors and on CPU under ``TRITON_INTERPRET=1``,
the pure-PyTorch reference otherwise; both give the same bits):

    q = quantize_mxfp4(x, stochastic=False, seed=0, block_2d=False)   # blocks of 32 along the LAST dim
    q.codes    # uint8 [M, K // 2], element 2j in the low nibble
    q.scales   # uint8 [M, K // 32], E8M0: 2^(code - 127); 0xFF = NaN
    row, col = quantize_mxfp4_rowcol(x, ...)           # rowwise and x^T (blocks along M), one launch
    transpose_mxfp4(q)                                 # 2-D (32x32) only: the same values, transposed
    dequantize_mxfp4(q)                                # float32 [M, K]
    mxfp4_gemm(a, b, out_dtype=torch.bfloat16, engine="cublas")   # C[M, N] = A[M, K] . B[N, K]^T

See ``reference.py`` for the exact arithmetic, the zero-block and the non-finite policies.
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, GEMM_ENGINES, check_gemm_engine, resolve_gemm_engine
from nvfp4_train.kernels.fp4_reference import check_seed, kernel_key
from nvfp4_train.kernels.mxfp4.reference import (
    BLOCK,
    MXFP4Tensor,
    check_col_input,
    check_input,
    check_rowcol_modes,
    dequantize_mxfp4_ref,
    e8m0_to_float32,
    mxfp4_gemm_ref,
    quantize_mxfp4_ref,
    quantize_mxfp4_rowcol_ref,
    transpose_mxfp4_ref,
)

__all__ = [
    "BLOCK",
    "MXFP4Tensor",
    "quantize_mxfp4",
    "quantize_mxfp4_rowcol",
    "dequantize_mxfp4",
    "transpose_mxfp4",
    "mxfp4_gemm",
    "quantize_mxfp4_ref",
    "quantize_mxfp4_rowcol_ref",
    "dequantize_mxfp4_ref",
    "mxfp4_gemm_ref",
    "transpose_mxfp4_ref",
    "e8m0_to_float32",
]


def quantize_mxfp4(x: torch.Tensor, stochastic: bool = False, seed: int | torch.Tensor = 0, block_2d: bool = False,
                   swizzled: bool = False) -> MXFP4Tensor:
    """Quantize a 2-D bf16/fp32 tensor to MXFP4, blocks of 32 along the last dim (32x32 tiles when
    ``block_2d``, for weights); ``stochastic`` rounds with 8 random bits per element from a counter-based
    hash keyed by ``seed`` (an int, or a 0-d int64 tensor holding one on x's device: the same bits,
    ``nvfp4_train.kernels.fp4_reference.check_seed``). ``swizzled``: the scales are written in the native GEMM's 128x4-tile
    layout (``kernels/fp4_layout.py``)."""
    check_input(x, block_2d)
    if not use_triton(x):
        return quantize_mxfp4_ref(x, stochastic=stochastic, seed=seed, block_2d=block_2d, swizzled=swizzled)
    from nvfp4_train.kernels.mxfp4.quantize import quantize_mxfp4_rowcol_triton

    if not isinstance(seed, int):  # a seed tensor (an int is checked by kernel_key)
        check_seed(seed, x.device)
    codes, scales, _, _ = quantize_mxfp4_rowcol_triton(
        x, row_stochastic=stochastic, row_key=kernel_key(seed), block_2d=block_2d, swizzled=swizzled
    )
    return MXFP4Tensor(codes=codes, scales=scales, block_2d=block_2d, swizzled=swizzled)


def quantize_mxfp4_rowcol(
    x: torch.Tensor,
    row_stochastic: bool = False,
    col_stochastic: bool = False,
    row_seed: int | torch.Tensor = 0,
    col_seed: int | torch.Tensor = 0,
    block_2d: bool = False,
    swizzled: bool = False,
) -> tuple[MXFP4Tensor, MXFP4Tensor]:
    """Both copies of a [M, K] tensor in one pass: rowwise (blocks along K) and columnwise (x^T [K, M],
    blocks along M). Both dims must be multiples of 32. With ``block_2d`` the columnwise copy is the
    rowwise copy transposed (the same values). ``swizzled``: both copies' scales in the native GEMM's
    layout."""
    check_input(x, block_2d)
    check_col_input(x)
    check_rowcol_modes(block_2d, row_stochastic, col_stochastic)
    if not use_triton(x):
        return quantize_mxfp4_rowcol_ref(
            x, row_stochastic=row_stochastic, col_stochastic=col_stochastic, row_seed=row_seed,
            col_seed=col_seed, block_2d=block_2d, swizzled=swizzled,
        )
    from nvfp4_train.kernels.mxfp4.quantize import quantize_mxfp4_rowcol_triton

    for seed in (row_seed, col_seed):
        if not isinstance(seed, int):  # a seed tensor (an int is checked by kernel_key)
            check_seed(seed, x.device)
    rc, rs, cc, cs = quantize_mxfp4_rowcol_triton(
        x, write_row=True, write_col=True, row_stochastic=row_stochastic, col_stochastic=col_stochastic,
        row_key=kernel_key(row_seed), col_key=kernel_key(col_seed), block_2d=block_2d, swizzled=swizzled,
    )
    return (MXFP4Tensor(codes=rc, scales=rs, block_2d=block_2d, swizzled=swizzled),
            MXFP4Tensor(codes=cc, scales=cs, block_2d=block_2d, swizzled=swizzled))


def transpose_mxfp4(q: MXFP4Tensor) -> MXFP4Tensor:
    """The same quantized values transposed (2-D, 32x32-tiled tensors only)."""
    return transpose_mxfp4_ref(q)


def dequantize_mxfp4(q: MXFP4Tensor) -> torch.Tensor:
    """``e2m1(q) * 2^X`` as float32 [M, K] (torch ops on any device)."""
    return dequantize_mxfp4_ref(q)


def mxfp4_gemm(a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype = torch.bfloat16,
               engine: str = DEFAULT_GEMM_ENGINE) -> torch.Tensor:
    """C[M, N] = A[M, K] . B[N, K]^T with both operands MXFP4 blocked along K (alpha = 1). ``engine`` as for
    ``nvfp4_gemm``: "native" (or "auto" on a device that has it) runs ``kernels/mxfp4/native.py``; both Hopper
    engines run the one Triton MXFP4 GEMM (``kernels/mxfp4/gemm.py``; MXFP4 is the comparison format)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"MXFP4 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    if engine not in GEMM_ENGINES:
        check_gemm_engine(engine)
    if not use_triton(a.codes):
        return mxfp4_gemm_ref(a, b, out_dtype=out_dtype)
    if resolve_gemm_engine(engine, a.codes.device) == "native":
        from nvfp4_train.kernels.mxfp4.native import mxfp4_gemm_native

        return mxfp4_gemm_native(a, b, out_dtype=out_dtype)
    if a.swizzled or b.swizzled:
        raise ValueError(f"MXFP4 GEMM: swizzled scales are the native engine's layout; engine {engine!r} takes "
                         f"row-major scales (quantize with swizzled=False)")
    from nvfp4_train.kernels.mxfp4.gemm import mxfp4_gemm_triton

    return mxfp4_gemm_triton(a, b, out_dtype=out_dtype)
