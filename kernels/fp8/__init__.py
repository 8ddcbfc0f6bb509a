"""FP8 E4M3 with fp32 scales: per-tensor current scaling, and the paper's blockwise baseline (1x128 blocks
for activations and gradients, 128x128 tiles for weights).

Public API (quantizers run the Triton kernels on CUDA tensors and on CPU under ``TRITON_INTERPRET=1``, the
pure-PyTorch reference otherwise; both give the same bits):

    q = quantize_fp8(x, block=None, amax=None, amax_group=None)  # None (per tensor), (1, 128), (128, 128)
    q.data       # float8_e4m3fn [M, K]
    q.scale_inv  # float32 decode scale: 0-d, [M, K/128] or [M/128, K/128]
    q.block
    quantize_fp8_tensorwise(x); quantize_fp8_blockwise(x, block=(1, 128))
    fp8_amax(x)                                        # raw tensor amax (non-finite -> +Inf), all-reducible
    row, col = quantize_fp8_rowcol(x, block=(1, 128))  # x and x^T (blocks along M), one pass
    dequantize_fp8(q)                                  # float32 [M, K]
    transpose_fp8(q)                                   # per-tensor / 128x128 only: the same values, transposed
    fp8_gemm(a, b, out_dtype=torch.bfloat16)           # C[M, N] = A[M, K] . B[N, K]^T
    fp8_gemm_backend(a, b)                             # which implementation fp8_gemm takes, by name
    fp8_gemm_accumulate(a, b, c)                       # c += A . B^T in the GEMM's epilogue (fp32 c, CUDA)

Tensor parallelism (per-tensor scaling only; block scales are local): ``amax_group`` all-reduces the raw
amax with MAX over that process group before quantizing, so the scale does not depend on the TP size.

See ``reference.py`` for the exact arithmetic and the non-finite policy, ``gemm.py`` for the GEMM paths.
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fp8.gemm import BACKENDS, blockwise_supported, fp8_gemm, fp8_gemm_accumulate, fp8_gemm_backend
from nvfp4_train.kernels.fp8.reference import (
    BLOCK,
    FP8Tensor,
    check_amax_block,
    check_col_input,
    check_input,
    dequantize_fp8_ref,
    fp8_amax_ref,
    fp8_gemm_ref,
    quantize_fp8_blockwise_ref,
    quantize_fp8_ref,
    quantize_fp8_rowcol_ref,
    quantize_fp8_tensorwise_ref,
    transpose_fp8_ref,
)

__all__ = [
    "BACKENDS",
    "BLOCK",
    "FP8Tensor",
    "quantize_fp8",
    "quantize_fp8_tensorwise",
    "quantize_fp8_blockwise",
    "quantize_fp8_rowcol",
    "fp8_amax",
    "dequantize_fp8",
    "transpose_fp8",
    "fp8_gemm",
    "fp8_gemm_backend",
    "fp8_gemm_accumulate",
    "blockwise_supported",
    "quantize_fp8_ref",
    "quantize_fp8_tensorwise_ref",
    "quantize_fp8_blockwise_ref",
    "quantize_fp8_rowcol_ref",
    "dequantize_fp8_ref",
    "transpose_fp8_ref",
    "fp8_gemm_ref",
    "fp8_amax_ref",
]

_E4M3 = torch.float8_e4m3fn


def _wrap(data_u8: torch.Tensor, scale_inv: torch.Tensor, block) -> FP8Tensor:
    return FP8Tensor(data=data_u8.view(_E4M3), scale_inv=scale_inv, block=block)


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """The raw tensor amax, float32 0-d: max |x| with NaN/Inf counted as +Inf (MAX-all-reducible)."""
    if not use_triton(x):
        return fp8_amax_ref(x)
    from nvfp4_train.kernels.fp8.quantize import fp8_amax_triton

    return fp8_amax_triton(x).reshape(())


def _tensor_amax(x: torch.Tensor, amax: torch.Tensor | None, amax_group) -> torch.Tensor | None:
    """The amax per-tensor scaling uses: the given or computed raw amax, MAX-all-reduced over
    ``amax_group`` when one is given; None (compute inside the quantizer) when neither is given."""
    if amax_group is None:
        return amax
    import torch.distributed as dist

    amax = (fp8_amax(x) if amax is None else amax.to(torch.float32).reshape(())).clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
    return amax


def quantize_fp8_tensorwise(x: torch.Tensor, amax: torch.Tensor | None = None, amax_group=None) -> FP8Tensor:
    """Per-tensor current scaling of a 2-D bf16/fp32 tensor (``amax``: optional precomputed raw amax;
    ``amax_group``: a process group over which the amax is MAX-all-reduced first)."""
    check_input(x, None)
    check_amax_block(None, amax)
    amax = _tensor_amax(x, amax, amax_group)
    if not use_triton(x):
        return quantize_fp8_tensorwise_ref(x, amax)
    from nvfp4_train.kernels.fp8.quantize import quantize_fp8_tensorwise_triton

    data, _, sinv = quantize_fp8_tensorwise_triton(x, amax=amax)
    return _wrap(data, sinv, None)


def quantize_fp8_blockwise(x: torch.Tensor, block=(1, BLOCK)) -> FP8Tensor:
    """Blockwise current scaling: 1x128 blocks along the last dim, or 128x128 tiles."""
    block = check_input(x, block)
    if block is None:
        return quantize_fp8_tensorwise(x)
    if not use_triton(x):
        return quantize_fp8_blockwise_ref(x, block)
    from nvfp4_train.kernels.fp8.quantize import quantize_fp8_blockwise_triton

    data, sinv, _, _ = quantize_fp8_blockwise_triton(x, block)
    return _wrap(data, sinv, block)


def quantize_fp8(x: torch.Tensor, block=None, amax: torch.Tensor | None = None, amax_group=None) -> FP8Tensor:
    """Per tensor (``block=None``), 1x128 blocks or 128x128 tiles. ``amax`` / ``amax_group`` apply to
    per-tensor scaling (a given ``amax`` with a block shape is a ValueError; ``amax_group`` is not needed
    by block scales, which are local, and is ignored for them)."""
    block = check_input(x, block)
    check_amax_block(block, amax)
    if block is None:
        return quantize_fp8_tensorwise(x, amax, amax_group)
    return quantize_fp8_blockwise(x, block)


def quantize_fp8_rowcol(
    x: torch.Tensor, block=(1, BLOCK), amax: torch.Tensor | None = None, amax_group=None
) -> tuple[FP8Tensor, FP8Tensor]:
    """Both copies of x [M, K] a linear layer needs, from one read of x: the rowwise copy and the
    columnwise copy of x^T [K, M] (1x128: blocks along M; 128x128 and per tensor: the same values
    transposed). ``amax`` / ``amax_group`` as in ``quantize_fp8``."""
    block = check_input(x, block)
    check_col_input(x, block)
    check_amax_block(block, amax)
    if block is None:
        amax = _tensor_amax(x, amax, amax_group)
    if not use_triton(x):
        return quantize_fp8_rowcol_ref(x, block, amax)
    if block is None:
        from nvfp4_train.kernels.fp8.quantize import quantize_fp8_tensorwise_triton

        data, data_t, sinv = quantize_fp8_tensorwise_triton(x, write_col=True, amax=amax)
        return _wrap(data, sinv, None), _wrap(data_t, sinv, None)
    from nvfp4_train.kernels.fp8.quantize import quantize_fp8_blockwise_triton

    rd, rs, cd, cs = quantize_fp8_blockwise_triton(x, block, write_row=True, write_col=True)
    return _wrap(rd, rs, block), _wrap(cd, cs, block)


def dequantize_fp8(q: FP8Tensor) -> torch.Tensor:
    """``q * scale_inv`` as float32 [M, K] (torch ops on any device)."""
    return dequantize_fp8_ref(q)


def transpose_fp8(q: FP8Tensor) -> FP8Tensor:
    """The same quantized values transposed (per-tensor and 128x128 scaling only)."""
    return transpose_fp8_ref(q)
