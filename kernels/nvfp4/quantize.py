"""Fused NVFP4 quantization in Triton: one pass over a [M, K] tensor writes the rowwise copy and, when
asked, the columnwise copy (x^T, blocks along M, optionally Hadamard-mixed, its own amax).

Layout (same as ``kernels/nvfp4/reference.py``):
    row codes  uint8 [M, K/2]   row scales  e4m3 [M, K/16]    (blocks of 16 along K)
    col codes  uint8 [K, M/2]   col scales  e4m3 [K, M/16]    (blocks of 16 along M, i.e. rows of x^T)

Two launches, because the per-tensor amax must be known before any block can be scaled:
  1. ``_amax_kernel`` reads x once and reduces max|x| (and max|RHT(x^T)| for a mixed columnwise copy) with
     atomic max into a 2-float buffer. Non-finite elements count as +Inf, which the quantize kernel turns
     into the NaN amax of the non-finite policy.
  2. ``_quantize_kernel`` reads x once more and writes both copies. It walks the tiles in the reverse
     order of the amax kernel, so its first reads hit what the amax pass left in L2.
A caller that already knows the amax (e.g. from the op that produced x) passes it and skips launch 1.

Each program owns a [BM, BK] tile. Every output depends only on its 16-element block (and the amax), so
the tile shape is a pure performance choice. Arithmetic per block follows RECIPE §2 in fp32 with
correctly-rounded divisions (``div_rn``); rounding is done with bit arithmetic (``kernels/fp4_triton.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp4_triton import (
    e2m1_round_nearest,
    e2m1_round_stochastic,
    as_kernel_input,
    e4m3_rne_pos,
    hadamard16,
    load_tile,
    pack_pairs,
    random_bits8,
    round_to_bf16,
)
from kernels.nvfp4.reference import RHT_SIGNS

# bit i set <=> RHT sign i is -1
_RHT_NEG_MASK = tl.constexpr(sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0))
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _rht_cols(xt, BK: tl.constexpr, BM: tl.constexpr, ROUND_BF16: tl.constexpr):
    """x^T tile [BK, BM] -> Hadamard-mixed along M in groups of 16, rounded like the input dtype."""
    R: tl.constexpr = BK * BM // 16
    g = tl.reshape(xt, [R, 16])
    j = tl.arange(0, 16)
    neg = (tl.full([16], _RHT_NEG_MASK, tl.int32) >> j) & 1
    sgn = tl.where(neg == 1, -0.25, 0.25)
    g = hadamard16(g * sgn[None, :], R)
    if ROUND_BF16:
        g = round_to_bf16(g)
    return tl.reshape(g, [BK, BM])


@triton.jit
def _tile_coords(pid, M, K, BM: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    n_k = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(M, BM) * n_k
    if REVERSE:
        pid = n_tiles - 1 - pid
    return (pid // n_k) * BM, (pid % n_k) * BK


@triton.jit
def _amax_kernel(
    x_ptr, amax_ptr, M, K, stride_m, stride_k,
    DO_COL_RHT: tl.constexpr, ROUND_BF16: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """Persistent: each program reduces tiles pid, pid + nprog, ... in registers and issues ONE atomic max
    per amax (one atomic per tile serialises thousands of atomics on one address)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(K, BK)
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    acc_t = tl.zeros([BK, BM], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        m0, k0 = _tile_coords(tile, M, K, BM, BK, False)
        x, rm, rk, mask = load_tile(x_ptr, m0, k0, M, K, stride_m, stride_k, BM, BK, ROUND_BF16)
        a = tl.abs(x)
        acc = tl.maximum(acc, tl.where(a == a, a, float("inf")))
        if DO_COL_RHT:
            xt = tl.abs(_rht_cols(tl.trans(x), BK, BM, ROUND_BF16))
            acc_t = tl.maximum(acc_t, tl.where(xt == xt, xt, float("inf")))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))
    if DO_COL_RHT:
        tl.atomic_max(amax_ptr + 1, tl.max(tl.max(acc_t, axis=1), axis=0))


@triton.jit
def _tensor_scales(amax):
    """(S_enc, S_dec, c, amax') from a loaded amax; +Inf (non-finite input) becomes NaN."""
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    s_enc = tl.math.div_rn(2688.0, amax)
    s_enc = tl.where(s_enc > FLT_MAX, FLT_MAX, s_enc)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = tl.math.div_rn(1.0, s_enc)
    c = s_enc * 0.16666667163372040  # fp32(1/6), one product
    return s_enc, s_dec, c, amax


@triton.jit
def _quantize_blocks(v, blk_amax, s_dec, c, rbits, STOCHASTIC: tl.constexpr):
    """v [R, NB, 16] fp32, blk_amax [R, NB] -> (codes [R, NB, 16] int32, scale bytes [R, NB] int32)."""
    s = blk_amax * c
    s = tl.where(s > 448.0, 448.0, s)
    sbyte, sval = e4m3_rne_pos(s)
    enc = tl.math.div_rn(tl.full(sval.shape, 1.0, tl.float32), sval * s_dec)
    enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
    y = v * enc[:, :, None]
    if STOCHASTIC:
        codes = e2m1_round_stochastic(y, rbits)
    else:
        codes = e2m1_round_nearest(y)
    return codes, sbyte


@triton.jit
def _quantize_kernel(
    x_ptr, amax_ptr,
    row_codes_ptr, row_scales_ptr, col_codes_ptr, col_scales_ptr, amax_out_ptr,
    M, K, stride_m, stride_k, row_key, col_key,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, BLOCK_2D: tl.constexpr,
    COL_RHT: tl.constexpr, ROW_SR: tl.constexpr, COL_SR: tl.constexpr, ROUND_BF16: tl.constexpr,
    REVERSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    m0, k0 = _tile_coords(pid, M, K, BM, BK, REVERSE)
    x, rm, rk, mask = load_tile(x_ptr, m0, k0, M, K, stride_m, stride_k, BM, BK, ROUND_BF16)

    row_s_enc, row_s_dec, row_c, row_amax = _tensor_scales(tl.load(amax_ptr))
    if pid == 0:
        tl.store(amax_out_ptr, row_amax)

    if WRITE_ROW or BLOCK_2D:
        v = tl.reshape(x, [BM, BK // 16, 16])
        if BLOCK_2D:
            t4 = tl.reshape(tl.abs(x), [BM // 16, 16, BK // 16, 16])
            tmax = tl.max(tl.max(t4, axis=3), axis=1)  # [BM/16, BK/16]
            blk = tl.reshape(tl.broadcast_to(tmax[:, None, :], [BM // 16, 16, BK // 16]), [BM, BK // 16])
        else:
            blk = tl.max(tl.abs(v), axis=2)
        if ROW_SR:
            idx = rm[:, None].to(tl.int64) * K + rk[None, :]
            rbits = tl.reshape(random_bits8(idx, row_key), [BM, BK // 16, 16])
        else:
            rbits = 0
        codes, sbyte = _quantize_blocks(v, blk, row_s_dec, row_c, rbits, ROW_SR)
        codes = tl.reshape(codes, [BM, BK])
        if WRITE_ROW:
            rkh = k0 // 2 + tl.arange(0, BK // 2)
            cmask = (rm[:, None] < M) & (rkh[None, :] < K // 2)
            tl.store(row_codes_ptr + rm[:, None] * (K // 2) + rkh[None, :], pack_pairs(codes, BM, BK), mask=cmask)
            rks = k0 // 16 + tl.arange(0, BK // 16)
            smask = (rm[:, None] < M) & (rks[None, :] < K // 16)
            tl.store(row_scales_ptr + rm[:, None] * (K // 16) + rks[None, :], sbyte.to(tl.uint8), mask=smask)

    if WRITE_COL:
        if BLOCK_2D:
            # the same values transposed: tile scales serve both orientations
            ccodes = tl.trans(codes)  # [BK, BM]
            t2 = tl.reshape(sbyte, [BM // 16, 16, BK // 16])
            tsc = tl.max(t2, axis=1)  # identical over the 16 rows of a tile: [BM/16, BK/16]
            csbyte = tl.reshape(tl.broadcast_to(tl.trans(tsc)[:, None, :], [BK // 16, 16, BM // 16]), [BK, BM // 16])
        else:
            col_s_enc, col_s_dec, col_c, col_amax = _tensor_scales(tl.load(amax_ptr + 1))
            if pid == 0:
                tl.store(amax_out_ptr + 1, col_amax)
            xt = tl.trans(x)  # [BK, BM]
            if COL_RHT:
                xt = _rht_cols(xt, BK, BM, ROUND_BF16)
            vt = tl.reshape(xt, [BK, BM // 16, 16])
            blkt = tl.max(tl.abs(vt), axis=2)
            if COL_SR:
                idx = rk[:, None].to(tl.int64) * M + rm[None, :]
                rbits_t = tl.reshape(random_bits8(idx, col_key), [BK, BM // 16, 16])
            else:
                rbits_t = 0
            ccodes, csbyte = _quantize_blocks(vt, blkt, col_s_dec, col_c, rbits_t, COL_SR)
            ccodes = tl.reshape(ccodes, [BK, BM])
        rmh = m0 // 2 + tl.arange(0, BM // 2)
        cmask = (rk[:, None] < K) & (rmh[None, :] < M // 2)
        tl.store(col_codes_ptr + rk[:, None] * (M // 2) + rmh[None, :], pack_pairs(ccodes, BK, BM), mask=cmask)
        rms = m0 // 16 + tl.arange(0, BM // 16)
        smask = (rk[:, None] < K) & (rms[None, :] < M // 16)
        tl.store(col_scales_ptr + rk[:, None] * (M // 16) + rms[None, :], csbyte.to(tl.uint8), mask=smask)


def _grid(M: int, K: int, BM: int, BK: int) -> tuple[int]:
    return (triton.cdiv(M, BM) * triton.cdiv(K, BK),)


_NUM_SMS: dict = {}


def _persistent_grid(x: torch.Tensor, M: int, K: int, BM: int, BK: int) -> tuple[int]:
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(K, BK)
    if x.is_cuda:
        dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if dev not in _NUM_SMS:
            _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        return (min(n_tiles, 4 * _NUM_SMS[dev]),)
    return (min(n_tiles, 4),)


def amax_triton(x: torch.Tensor, col_rht: bool, block_m: int = 64, block_k: int = 64) -> torch.Tensor:
    """float32 [2]: raw amax of x (non-finite as +Inf) and of RHT(x^T) (or x^T)."""
    M, K = x.shape
    is_bf16 = x.dtype == torch.bfloat16
    out = torch.zeros(2, dtype=torch.float32, device=x.device)
    _amax_kernel[_persistent_grid(x, M, K, block_m, block_k)](
        as_kernel_input(x), out, M, K, x.stride(0), x.stride(1),
        DO_COL_RHT=col_rht, ROUND_BF16=is_bf16, BM=block_m, BK=block_k, num_warps=4, enable_fp_fusion=False,
    )
    if not col_rht:
        out[1] = out[0]
    return out


def quantize_nvfp4_rowcol_triton(
    x: torch.Tensor,
    *,
    write_row: bool = True,
    write_col: bool = False,
    block_2d: bool = False,
    col_rht: bool = False,
    row_stochastic: bool = False,
    col_stochastic: bool = False,
    row_key: int = 0,
    col_key: int = 0,
    row_amax: torch.Tensor | None = None,
    col_amax: torch.Tensor | None = None,
    block_m: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
):
    """Launch the fused kernels. Inputs are validated by the caller (``kernels.nvfp4``).

    Returns (row_codes, row_scales_u8, col_codes, col_scales_u8, amax[2]) where absent copies are None and
    ``amax`` holds the (policy-adjusted) row and column amax.
    """
    M, K = x.shape
    dev = x.device
    is_bf16 = x.dtype == torch.bfloat16
    x = as_kernel_input(x)
    need_col_amax = write_col and not block_2d
    amax_in = torch.zeros(2, dtype=torch.float32, device=dev)
    have_row = row_amax is not None
    have_col = col_amax is not None or not need_col_amax
    if have_row:
        amax_in[0] = row_amax.to(torch.float32).reshape(())
    if need_col_amax and col_amax is not None:
        amax_in[1] = col_amax.to(torch.float32).reshape(())
    launch_opts = dict(num_warps=num_warps, enable_fp_fusion=False)
    if not (have_row and have_col):
        if have_row or have_col:
            # one of the two is given: compute into a scratch buffer and keep the given one
            scratch = torch.zeros(2, dtype=torch.float32, device=dev)
            _amax_kernel[_persistent_grid(x, M, K, block_m, block_k)](
                x, scratch, M, K, x.stride(0), x.stride(1),
                DO_COL_RHT=need_col_amax and col_rht, ROUND_BF16=is_bf16,
                BM=block_m, BK=block_k, **launch_opts,
            )
            if not have_row:
                amax_in[0] = scratch[0]
            if not have_col:
                amax_in[1] = scratch[1]
        else:
            _amax_kernel[_persistent_grid(x, M, K, block_m, block_k)](
                x, amax_in, M, K, x.stride(0), x.stride(1),
                DO_COL_RHT=need_col_amax and col_rht, ROUND_BF16=is_bf16,
                BM=block_m, BK=block_k, **launch_opts,
            )
        if need_col_amax and not col_rht and col_amax is None:
            amax_in[1] = amax_in[0]  # x^T has the same amax as x
    row_codes = torch.empty((M, K // 2), dtype=torch.uint8, device=dev) if write_row else None
    row_scales = torch.empty((M, K // 16), dtype=torch.uint8, device=dev) if write_row else None
    col_codes = torch.empty((K, M // 2), dtype=torch.uint8, device=dev) if write_col else None
    col_scales = torch.empty((K, M // 16), dtype=torch.uint8, device=dev) if write_col else None
    amax_out = torch.empty(2, dtype=torch.float32, device=dev)
    dummy = amax_out
    _quantize_kernel[_grid(M, K, block_m, block_k)](
        x, amax_in,
        row_codes if write_row else dummy, row_scales if write_row else dummy,
        col_codes if write_col else dummy, col_scales if write_col else dummy, amax_out,
        M, K, x.stride(0), x.stride(1), row_key, col_key,
        WRITE_ROW=write_row, WRITE_COL=write_col, BLOCK_2D=block_2d, COL_RHT=col_rht,
        ROW_SR=row_stochastic, COL_SR=col_stochastic, ROUND_BF16=is_bf16,
        REVERSE=True, BM=block_m, BK=block_k, **launch_opts,
    )
    if write_col and block_2d:
        amax_out[1] = amax_out[0]
    return row_codes, row_scales, col_codes, col_scales, amax_out
