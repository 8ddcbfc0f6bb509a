"""Fused MXFP4 quantization in Triton: ONE launch reads a [M, K] tensor once and writes the rowwise copy
and, when asked, the columnwise copy (x^T, blocks of 32 along M).

Layout (same as ``kernels/mxfp4/reference.py``):
    row codes  uint8 [M, K/2]   row scales  uint8 E8M0 [M, K/32]    (blocks of 32 along K)
    col codes  uint8 [K, M/2]   col scales  uint8 E8M0 [K, M/32]    (blocks of 32 along M, rows of x^T)

MXFP4 has no tensor scale, so unlike NVFP4 no amax pass is needed: every output depends only on its own
32-element block (or 32x32 tile in 2-D mode, where the columnwise copy is the rowwise one transposed).
Each program owns a [BM, BK] tile (BM, BK multiples of 32), so the tile shape is a pure performance
choice. Per block: the E8M0 code is ``max(e(amax) - 2, 0)`` read from the fp32 exponent bits
of the block amax (0xFF when the block holds NaN/Inf), the elements are multiplied by the normal power of
two ``2^(127 - code)`` built from bits (exact), products below 2^-126 are flushed to zero, and the E2M1
rounding is the shared bit-exact one of ``kernels/fp4_triton.py``. No division, no transcendental, no
narrowing cast: the interpreter and the GPU give the same bits. bf16 input is read through its bits
(``load_as_f32``), exact for subnormals too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_triton import (
    as_kernel_input,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    launch_keys,
    load_key,
    load_tile,
    pack_pairs,
    random_bits8,
    u32,
)
from nvfp4_train.kernels.fp4_layout_triton import scale_buffer, scale_offset

FLT_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2^-126


@triton.jit
def _abs_inf(v):
    """|v| with NaN counted as +Inf (the GPU's max ignores NaN, the interpreter's propagates it)."""
    a = tl.abs(v)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _mx_blocks(v, amax, rbits, STOCHASTIC: tl.constexpr):
    """v [R, NB, 32] fp32, amax [R, NB] (+Inf for non-finite blocks) -> (codes [R, NB, 32] int32,
    E8M0 codes [R, NB] int32)."""
    e = ((u32(amax) >> 23) & 0xFF).to(tl.int32)
    code = tl.maximum(e - 2, 0)
    nonfinite = amax == float("inf")
    inv_bits = (254 - tl.minimum(code, 253)) << 23
    inv = inv_bits.to(tl.float32, bitcast=True)  # 2^(127 - code), a normal power of two
    y = v * inv[:, :, None]
    y = tl.where(tl.abs(y) < FLT_MIN_NORMAL, 0.0, y)
    if STOCHASTIC:
        q = e2m1_round_stochastic(y, rbits)
    else:
        q = e2m1_round_nearest(y)
    q = (q & 7) | ((v < 0).to(tl.int32) << 3)
    q = tl.where(nonfinite[:, :, None], 0, q)
    code = tl.where(nonfinite, 255, code)
    return q, code


@triton.jit(do_not_specialize=["row_key", "col_key"])
def _mxfp4_quantize_kernel(
    x_ptr, row_codes_ptr, row_scales_ptr, col_codes_ptr, col_scales_ptr,
    M, K, stride_m, stride_k, row_key, col_key,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, ROW_SR: tl.constexpr, COL_SR: tl.constexpr,
    BLOCK_2D: tl.constexpr, BF16_BITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    SWIZZLE: tl.constexpr = False, KEY_PTR: tl.constexpr = False,
):
    """``KEY_PTR``: ``row_key`` / ``col_key`` point to int64 seeds (``load_key``), else they are the keys."""
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BK)
    m0 = (pid // n_k) * BM
    k0 = (pid % n_k) * BK
    x, rm, rk, mask = load_tile(x_ptr, m0, k0, M, K, stride_m, stride_k, BM, BK, BF16_BITS)

    if WRITE_ROW or BLOCK_2D:
        v = tl.reshape(x, [BM, BK // 32, 32])
        if BLOCK_2D:
            t4 = tl.reshape(_abs_inf(x), [BM // 32, 32, BK // 32, 32])
            tmax = tl.max(tl.max(t4, axis=3), axis=1)  # [BM/32, BK/32]
            amax = tl.reshape(tl.broadcast_to(tmax[:, None, :], [BM // 32, 32, BK // 32]), [BM, BK // 32])
        else:
            amax = tl.max(_abs_inf(v), axis=2)
        if ROW_SR:
            idx = rm[:, None].to(tl.int64) * K + rk[None, :]
            rbits = tl.reshape(random_bits8(idx, load_key(row_key, KEY_PTR)), [BM, BK // 32, 32])
        else:
            rbits = 0
        q, code = _mx_blocks(v, amax, rbits, ROW_SR)
        q = tl.reshape(q, [BM, BK])
    if WRITE_ROW:
        rkh = k0 // 2 + tl.arange(0, BK // 2)
        cmask = (rm[:, None] < M) & (rkh[None, :] < K // 2)
        tl.store(row_codes_ptr + rm[:, None] * (K // 2) + rkh[None, :], pack_pairs(q, BM, BK), mask=cmask)
        rks = k0 // 32 + tl.arange(0, BK // 32)
        smask = (rm[:, None] < M) & (rks[None, :] < K // 32)
        tl.store(row_scales_ptr + scale_offset(rm[:, None], rks[None, :], K // 32, SWIZZLE), code.to(tl.uint8),
                 mask=smask)

    if WRITE_COL:
        if BLOCK_2D:
            # the same values transposed: each tile's scale serves both orientations
            qt = tl.trans(q)  # [BK, BM]
            tsc = tl.max(tl.reshape(code, [BM // 32, 32, BK // 32]), axis=1)  # equal over a tile's rows
            codet = tl.reshape(tl.broadcast_to(tl.trans(tsc)[:, None, :], [BK // 32, 32, BM // 32]), [BK, BM // 32])
        else:
            xt = tl.trans(x)  # [BK, BM]
            vt = tl.reshape(xt, [BK, BM // 32, 32])
            if COL_SR:
                idx = rk[:, None].to(tl.int64) * M + rm[None, :]
                rbits_t = tl.reshape(random_bits8(idx, load_key(col_key, KEY_PTR)), [BK, BM // 32, 32])
            else:
                rbits_t = 0
            qt, codet = _mx_blocks(vt, tl.max(_abs_inf(vt), axis=2), rbits_t, COL_SR)
            qt = tl.reshape(qt, [BK, BM])
        rmh = m0 // 2 + tl.arange(0, BM // 2)
        cmask = (rk[:, None] < K) & (rmh[None, :] < M // 2)
        tl.store(col_codes_ptr + rk[:, None] * (M // 2) + rmh[None, :], pack_pairs(qt, BK, BM), mask=cmask)
        rms = m0 // 32 + tl.arange(0, BM // 32)
        smask = (rk[:, None] < K) & (rms[None, :] < M // 32)
        tl.store(col_scales_ptr + scale_offset(rk[:, None], rms[None, :], M // 32, SWIZZLE), codet.to(tl.uint8),
                 mask=smask)


def quantize_mxfp4_rowcol_triton(
    x: torch.Tensor,
    *,
    write_row: bool = True,
    write_col: bool = False,
    row_stochastic: bool = False,
    col_stochastic: bool = False,
    row_key=0,
    col_key=0,
    block_2d: bool = False,
    block_m: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    swizzled: bool = False,
):
    """Launch the fused kernel. Inputs are validated by the caller (``nvfp4_train.kernels.mxfp4``). ``swizzled``: both
    copies' scales as the 1-D buffers of the native GEMM's 128x4-tile layout (``kernels/fp4_layout.py``),
    written by the same stores at other addresses; zero padding.

    ``row_key`` / ``col_key``: int keys (``seed_key``) or 0-d int64 seed tensors (``launch_keys``).

    Returns (row_codes, row_scales, col_codes, col_scales); absent copies are None.
    """
    assert block_m % 32 == 0 and block_k % 32 == 0
    M, K = x.shape
    dev = x.device
    row_codes = torch.empty((M, K // 2), dtype=torch.uint8, device=dev) if write_row else None
    row_scales = scale_buffer(M, K // 32, swizzled, dev) if write_row else None
    col_codes = torch.empty((K, M // 2), dtype=torch.uint8, device=dev) if write_col else None
    col_scales = scale_buffer(K, M // 32, swizzled, dev) if write_col else None
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(K, block_k),)
    bf16 = x.dtype == torch.bfloat16
    rkey, ckey, kptr = launch_keys(row_key, col_key, row_stochastic, col_stochastic)
    _mxfp4_quantize_kernel[grid](
        as_kernel_input(x),
        row_codes if write_row else dummy, row_scales if write_row else dummy,
        col_codes if write_col else dummy, col_scales if write_col else dummy,
        M, K, x.stride(0), x.stride(1), rkey, ckey,
        WRITE_ROW=write_row, WRITE_COL=write_col, ROW_SR=row_stochastic, COL_SR=col_stochastic,
        BLOCK_2D=block_2d, BF16_BITS=bf16, BM=block_m, BK=block_k, SWIZZLE=swizzled, KEY_PTR=kptr,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return row_codes, row_scales, col_codes, col_scales
