"""NVFP4: E2M1 values, 16-element blocks with E4M3 decode scales, an fp32 tensor scale.

Public API (the same call runs the Triton kernels on CUDA tensors and on CPU under ``TRITON_INTERPRET=1``,
the pure-PyTorch reference otherwise; both give the same bits):

    q = quantize_nvfp4(x, block_2d=False, rht=False, stochastic=False, seed=0)   # blocks along the LAST dim
    q.codes, q.scales, q.amax
    dequantize_nvfp4(q)                                    # float32 [M, K]
    row, col = quantize_nvfp4_rowcol(x, ...)               # both copies a linear layer needs, one pass
    nvfp4_gemm(a, b, out_dtype=torch.bfloat16, engine="cublas")   # C[M, N] = A[M, K] . B[N, K]^T

``engine`` (the run's ``precision.gemm_engine``, ``kernels/gemm_engine.py``): "cublas" or "triton" (the two
Hopper engines of ``kernels/fp4_gemm.py``), "native" (the FP4 tensor-core GEMM of sm_100+,
``kernels/nvfp4/native.py``) or "auto" (native where the device supports it, else "cublas"). On the reference
path (CPU without ``TRITON_INTERPRET=1``) every engine gives the reference's result.

See ``reference.py`` for the exact arithmetic and the non-finite policy.
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, GEMM_ENGINES, check_gemm_engine, resolve_gemm_engine
from nvfp4_train.kernels.fp4_reference import check_seed, kernel_key
from nvfp4_train.kernels.nvfp4.reference import (
    BLOCK,
    NVFP4Tensor,
    check_amax,
    check_input,
    check_rowcol_input,
    dequantize_nvfp4_ref,
    hadamard16_ref,
    nvfp4_alpha,
    nvfp4_amax_ref,
    nvfp4_gemm_ref,
    quantize_nvfp4_ref,
    quantize_nvfp4_rowcol_ref,
    transpose_nvfp4_ref,
)

__all__ = [
    "NVFP4Tensor",
    "quantize_nvfp4",
    "quantize_nvfp4_rowcol",
    "dequantize_nvfp4",
    "nvfp4_gemm",
    "hadamard16_ref",
    "quantize_nvfp4_ref",
    "quantize_nvfp4_rowcol_ref",
    "dequantize_nvfp4_ref",
    "nvfp4_gemm_ref",
    "nvfp4_alpha",
    "nvfp4_amax",
    "nvfp4_amax_ref",
    "transpose_nvfp4_ref",
]


_TRITON_MODULES = None


def _triton():
    """The Triton launchers' modules ``nvfp4_train.kernels.nvfp4.quantize`` and ``nvfp4_train.kernels.nvfp4.gemm`` as one namespace,
    imported on first use (the reference path runs without Triton): one global lookup per call on the hot path
    instead of an import statement."""
    global _TRITON_MODULES
    if _TRITON_MODULES is None:
        import types

        from nvfp4_train.kernels.nvfp4 import gemm, quantize

        _TRITON_MODULES = types.SimpleNamespace(quantize=quantize, gemm=gemm)
    return _TRITON_MODULES


def _wrap(codes, scales_u8, amax, block_2d, swizzled=False) -> NVFP4Tensor:
    return NVFP4Tensor(codes=codes, scales=scales_u8.view(torch.float8_e4m3fn), amax=amax, block_2d=block_2d,
                       swizzled=swizzled)


def quantize_nvfp4(
    x: torch.Tensor,
    block_2d: bool = False,
    rht: bool = False,
    stochastic: bool = False,
    seed: int | torch.Tensor = 0,
    amax: torch.Tensor | None = None,
    swizzled: bool = False,
) -> NVFP4Tensor:
    """Quantize a 2-D bf16/fp32 tensor to NVFP4, blocks of 16 along the last dim (16x16 tiles when
    ``block_2d``). ``rht`` mixes each 16 consecutive elements of the last dim with the Random Hadamard
    Transform first (pass x^T for a columnwise copy); ``stochastic`` rounds with 8 random bits per
    element from a counter-based hash keyed by ``seed`` (an int, or a 0-d int64 tensor holding one on x's
    device: the same bits, ``nvfp4_train.kernels.fp4_reference.check_seed``). ``amax`` optionally supplies the tensor amax.
    ``swizzled``: the scales are written in the native GEMM's 128x4-tile layout (``kernels/fp4_layout.py``)."""
    check_input(x, block_2d)
    check_amax(amax)
    if not use_triton(x):
        return quantize_nvfp4_ref(x, block_2d=block_2d, rht=rht, stochastic=stochastic, seed=seed, amax=amax,
                                  swizzled=swizzled)
    from nvfp4_train.kernels.nvfp4.quantize import quantize_nvfp4_rowcol_triton

    if not isinstance(seed, int):  # a seed tensor (an int is checked by kernel_key)
        check_seed(seed, x.device)
    key = kernel_key(seed)
    if rht and block_2d:
        # an ablation only (RHT on the weight of every GEMM): mix with torch ops, then 2-D tiles
        x = hadamard16_ref(x).to(x.dtype)
        rht = False
    if rht:
        # the columnwise path of the fused kernel mixes along the first dim: feed it x^T (a view)
        _, _, codes, scales, am = quantize_nvfp4_rowcol_triton(
            x.t(), write_row=False, write_col=True, col_rht=True, col_stochastic=stochastic, col_key=key,
            col_amax=amax, swizzled=swizzled,
        )
        return _wrap(codes, scales, am[1], False, swizzled)
    codes, scales, _, _, am = quantize_nvfp4_rowcol_triton(
        x, block_2d=block_2d, row_stochastic=stochastic, row_key=key, row_amax=amax, swizzled=swizzled
    )
    return _wrap(codes, scales, am[0], block_2d, swizzled)


def quantize_nvfp4_rowcol(
    x: torch.Tensor,
    block_2d: bool = False,
    col_rht: bool = False,
    row_stochastic: bool = False,
    col_stochastic: bool = False,
    row_seed: int | torch.Tensor = 0,
    col_seed: int | torch.Tensor = 0,
    row_amax: torch.Tensor | None = None,
    col_amax: torch.Tensor | None = None,
    swizzled: bool = False,
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Both copies of a [M, K] tensor in one pass: rowwise (blocks along K) and columnwise (x^T [K, M],
    blocks along M, Hadamard-mixed when ``col_rht``, with its own amax). With ``block_2d`` the columnwise
    copy is the rowwise copy transposed (the same values). ``swizzled``: both copies' scales in the native
    GEMM's layout. ``row_seed`` / ``col_seed``: as ``quantize_nvfp4``'s ``seed``."""
    if not use_triton(x):
        return quantize_nvfp4_rowcol_ref(
            x, block_2d=block_2d, col_rht=col_rht, row_stochastic=row_stochastic,
            col_stochastic=col_stochastic, row_seed=row_seed, col_seed=col_seed,
            row_amax=row_amax, col_amax=col_amax, swizzled=swizzled,
        )
    check_rowcol_input(x, block_2d, col_rht, row_stochastic, col_stochastic)
    check_amax(row_amax, "row_amax")
    check_amax(col_amax, "col_amax")
    for seed in (row_seed, col_seed):
        if not isinstance(seed, int):  # a seed tensor (an int is checked by kernel_key)
            check_seed(seed, x.device)
    rc, rs, cc, cs, am = _triton().quantize.quantize_nvfp4_rowcol_triton(
        x, write_row=True, write_col=True, block_2d=block_2d, col_rht=col_rht,
        row_stochastic=row_stochastic, col_stochastic=col_stochastic,
        row_key=kernel_key(row_seed), col_key=kernel_key(col_seed), row_amax=row_amax, col_amax=col_amax,
        swizzled=swizzled,
    )
    row_am, col_am = am.unbind()  # the views am[0], am[1] in one op
    return _wrap(rc, rs, row_am, block_2d, swizzled), _wrap(cc, cs, col_am, block_2d, swizzled)


def nvfp4_amax(x: torch.Tensor, col_rht: bool = False) -> torch.Tensor:
    """float32 [2] on x's device: the raw amax of x and of its columnwise copy (of RHT(x^T) when
    ``col_rht``), non-finite elements counted as +Inf. All-reduce it with MAX over a tensor-parallel group
    and pass the entries as ``row_amax`` / ``col_amax`` so quantization does not depend on the TP size."""
    check_input(x, False)
    if col_rht and x.shape[0] % BLOCK != 0:
        raise ValueError(f"the Hadamard transform mixes {BLOCK} rows; x has {x.shape[0]}")
    if not use_triton(x):
        return nvfp4_amax_ref(x, col_rht)
    from nvfp4_train.kernels.nvfp4.quantize import amax_triton

    return amax_triton(x, col_rht)


def dequantize_nvfp4(q: NVFP4Tensor) -> torch.Tensor:
    """``q * fp32(sdec_b) * (amax / (6*448))`` as float32 [M, K] (torch ops on any device)."""
    return dequantize_nvfp4_ref(q)


def nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16,
               engine: str = DEFAULT_GEMM_ENGINE) -> torch.Tensor:
    """C[M, N] = alpha * A[M, K] . B[N, K]^T with both operands NVFP4 blocked along K, by ``engine`` (one of
    ``GEMM_ENGINES``, checked on every call, on the reference path too, where it does not change the result)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"NVFP4 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    if engine not in GEMM_ENGINES:
        check_gemm_engine(engine)
    if not use_triton(a.codes):
        return nvfp4_gemm_ref(a, b, out_dtype=out_dtype)
    if engine == "auto" or engine == "native":
        engine = resolve_gemm_engine(engine, a.codes.device)
    if engine == "native":
        from nvfp4_train.kernels.nvfp4.native import nvfp4_gemm_native

        return nvfp4_gemm_native(a, b, out_dtype=out_dtype)
    if a.swizzled or b.swizzled:
        raise ValueError(f"NVFP4 GEMM: swizzled scales are the native engine's layout; engine {engine!r} takes "
                         f"row-major scales (quantize with swizzled=False)")
    return _triton().gemm.nvfp4_gemm_predequant(a, b, out_dtype=out_dtype, engine=engine)
