"""NVFP4: E2M1 values, 16-element blocks with E4M3 decode scales, an fp32 tensor scale.

Public API (the same call runs the Triton kernels on CUDA tensors and on CPU under ``TRITON_INTERPRET=1``,
the pure-PyTorch reference otherwise; both give the same bits):

    q = quantize_nvfp4(x, block_2d=False, rht=False, stochastic=False, seed=0)   # blocks along the LAST dim
    q.codes, q.scales, q.amax
    dequantize_nvfp4(q)                                    # float32 [M, K]
    row, col = quantize_nvfp4_rowcol(x, ...)               # both copies a linear layer needs, one pass
    row, col = quantize_nvfp4_rowcol(x, row_values=True, values_dtype=nvfp4_values_dtype("cublas"))
                                                           # row as NVFP4Values: q * sdec_b in bf16, amax
    nvfp4_gemm(a, b, out_dtype=torch.bfloat16, engine="cublas")   # C[M, N] = A[M, K] . B[N, K]^T

``engine`` (the run's ``precision.gemm_engine``, ``kernels/gemm_engine.py``): "cublas" or "triton" (the two
Hopper engines of ``kernels/fp4_gemm.py``), "native" (the FP4 tensor-core GEMM of sm_100+,
``kernels/nvfp4/native.py``) or "auto" (native where the device supports it, else "cublas"). On the reference
path (CPU without ``TRITON_INTERPRET=1``) every engine gives the reference's result.

An operand that one Hopper GEMM reads once can be quantized straight to its block-scaled values
(``NVFP4Values``: the values that GEMM's dequantize launch would write from the packed copy, the same bits):
``nvfp4_gemm`` takes it as A, dequantizes only B and forms alpha from both amaxes. The native engine reads packed
codes and refuses it.

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
    NVFP4Values,
    check_amax,
    check_input,
    check_rowcol_input,
    check_values_args,
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
    "NVFP4Values",
    "nvfp4_values_dtype",
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


def _wrap(codes, scales_u8, amax, block_2d, swizzled=False) -> NVFP4Tensor | NVFP4Values:
    if scales_u8 is None:  # a copy written as its values
        return NVFP4Values(values=codes, amax=amax, block_2d=block_2d)
    return NVFP4Tensor(codes=codes, scales=scales_u8.view(torch.float8_e4m3fn), amax=amax, block_2d=block_2d,
                       swizzled=swizzled)


# The dtype each Hopper engine reads dequantized NVFP4 operands in (``predequant_fp4_gemm``'s default dot dtype:
# bf16 for cuBLASLt, fp16 for the Triton GEMM), i.e. the dtype an ``NVFP4Values`` A operand must have for it
_VALUES_DTYPES = {"cublas": torch.bfloat16, "triton": torch.float16}


def nvfp4_values_dtype(engine: str) -> torch.dtype | None:
    """The dtype of an ``NVFP4Values`` operand for ``engine`` once resolved on its device (``resolve_gemm_engine``):
    bf16 for "cublas", fp16 for "triton"; None for "native", which reads packed codes."""
    if engine not in _VALUES_DTYPES and engine != "native":
        check_gemm_engine(engine)
        raise ValueError(f"nvfp4_values_dtype takes a resolved engine ('cublas', 'triton' or 'native'), got {engine!r}")
    return _VALUES_DTYPES.get(engine)


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
    row_values: bool = False,
    col_values: bool = False,
    values_dtype: torch.dtype = torch.bfloat16,
) -> tuple[NVFP4Tensor | NVFP4Values, NVFP4Tensor | NVFP4Values]:
    """Both copies of a [M, K] tensor in one pass: rowwise (blocks along K) and columnwise (x^T [K, M],
    blocks along M, Hadamard-mixed when ``col_rht``, with its own amax). With ``block_2d`` the columnwise
    copy is the rowwise copy transposed (the same values). ``swizzled``: both copies' scales in the native
    GEMM's layout. ``row_seed`` / ``col_seed``: as ``quantize_nvfp4``'s ``seed``. ``row_values`` /
    ``col_values``: that copy as ``NVFP4Values`` in ``values_dtype`` (bf16 or fp16: ``nvfp4_values_dtype(engine)``)
    instead of packed codes and scales: for an operand a Hopper GEMM reads once (not with ``swizzled``)."""
    if not use_triton(x):
        return quantize_nvfp4_rowcol_ref(
            x, block_2d=block_2d, col_rht=col_rht, row_stochastic=row_stochastic,
            col_stochastic=col_stochastic, row_seed=row_seed, col_seed=col_seed,
            row_amax=row_amax, col_amax=col_amax, swizzled=swizzled,
            row_values=row_values, col_values=col_values, values_dtype=values_dtype,
        )
    check_rowcol_input(x, block_2d, col_rht, row_stochastic, col_stochastic)
    check_amax(row_amax, "row_amax")
    check_amax(col_amax, "col_amax")
    check_values_args(row_values, col_values, values_dtype, swizzled)
    for seed in (row_seed, col_seed):
        if not isinstance(seed, int):  # a seed tensor (an int is checked by kernel_key)
            check_seed(seed, x.device)
    rc, rs, cc, cs, am = _triton().quantize.quantize_nvfp4_rowcol_triton(
        x, write_row=True, write_col=True, block_2d=block_2d, col_rht=col_rht,
        row_stochastic=row_stochastic, col_stochastic=col_stochastic,
        row_key=kernel_key(row_seed), col_key=kernel_key(col_seed), row_amax=row_amax, col_amax=col_amax,
        swizzled=swizzled, row_values=row_values, col_values=col_values, values_dtype=values_dtype,
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


def dequantize_nvfp4(q: NVFP4Tensor | NVFP4Values) -> torch.Tensor:
    """``q * fp32(sdec_b) * (amax / (6*448))`` as float32 [M, K] (torch ops on any device)."""
    return dequantize_nvfp4_ref(q)


def nvfp4_gemm(a: NVFP4Tensor | NVFP4Values, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16,
               engine: str = DEFAULT_GEMM_ENGINE) -> torch.Tensor:
    """C[M, N] = alpha * A[M, K] . B[N, K]^T with both operands NVFP4 blocked along K, by ``engine`` (one of
    ``GEMM_ENGINES``, checked on every call, on the reference path too, where it does not change the result).
    A may be given as its values (``NVFP4Values``, in ``nvfp4_values_dtype(engine)``; not for the native engine)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"NVFP4 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    if engine not in GEMM_ENGINES:
        check_gemm_engine(engine)
    if isinstance(b, NVFP4Values):
        raise TypeError("NVFP4 GEMM: B must be packed (an NVFP4Tensor); only A may be given as NVFP4Values")
    if not use_triton(b.codes):
        return nvfp4_gemm_ref(a, b, out_dtype=out_dtype)
    if engine == "auto" or engine == "native":
        engine = resolve_gemm_engine(engine, b.codes.device)
    if engine == "native":
        if isinstance(a, NVFP4Values):
            raise ValueError("NVFP4 GEMM: the native engine reads packed codes and scales; A is NVFP4Values: quantize "
                             "it without row_values / col_values for gemm_engine native")
        from nvfp4_train.kernels.nvfp4.native import nvfp4_gemm_native

        return nvfp4_gemm_native(a, b, out_dtype=out_dtype)
    if a.swizzled or b.swizzled:
        raise ValueError(f"NVFP4 GEMM: swizzled scales are the native engine's layout; engine {engine!r} takes "
                         f"row-major scales (quantize with swizzled=False)")
    return _triton().gemm.nvfp4_gemm_predequant(a, b, out_dtype=out_dtype, engine=engine)
