"""Fused NVFP4 quantization in Triton: one pass over a [M, K] tensor writes the rowwise copy and, when
asked, the columnwise copy (x^T, blocks along M, optionally Hadamard-mixed, its own amax).

Layout (same as ``kernels/nvfp4/reference.py``):
    row codes  uint8 [M, K/2]   row scales  e4m3 [M, K/16]    (blocks of 16 along K)
    col codes  uint8 [K, M/2]   col scales  e4m3 [K, M/16]    (blocks of 16 along M, i.e. rows of x^T)

Two launches, because the per-tensor amax must be known before any block can be scaled:
  1. an amax kernel reads x once and reduces max|x| (and max|RHT(x^T)| for a mixed columnwise copy) with
     one atomic max per persistent program into a 2-float buffer. Non-finite elements count as +Inf, which
     the quantize kernel turns into the NaN amax of the non-finite policy.
  2. a quantize kernel reads x once more and writes both copies, walking the tiles in the reverse order of
     the amax kernel, so its first reads hit what the amax pass left in L2.
A caller that already knows the amax (e.g. from the op that produced x) passes it and skips launch 1.

The quantize kernel (``_quantize_grouped_kernel``) loads each tile as 16 row tensors so that everything
the columnwise copy does along M stays in registers (see the comment above it), and spends as few
instructions per element as it can, which is what bounds the pass (SASS instructions per element, static
count of the unrolled body, 64x128 tile, sm_90: 46 for round-to-nearest, 70 with stochastic rounding,
which does not spill):
  - E2M1 RNE codes with the sign folded into the rounding add, left in the low nibble (8 instructions a
    code instead of ~10; ``e2m1_code_rne_lowbyte``) and packed by byte permutes on the GPU (``_bytes4``);
  - stochastic rounding by one add rounded up (``e2m1_code_sr_lean``: ~11 instead of ~20 a code);
  - encode scales looked up by scale byte in a 128-entry table per copy that each program writes once
    (``_enc_table``) instead of a decode, a multiply and a division in every thread that holds a part of
    a block (for bf16 input; the columnwise copy of fp32 input divides, see the column scale);
  - the bf16 rounding after the Hadamard transform two values per instruction (``round_to_bf16_x2``).
On the GPU the steps Triton cannot express in one instruction are inline PTX (add.rp, cvt.rn.bf16x2, prmt).
Earlier designs (a transposing tile kernel 2-3x slower on the H200, the same kernel without these steps:
docs/benchmarks.md) are in git history.

Every output depends only on its 16-element block (and the amax), so the tile shape is a pure performance
choice. Arithmetic per block follows RECIPE §2 in fp32 with correctly-rounded divisions (``div_rn``);
rounding is done with bit arithmetic (``kernels/fp4_triton.py``), except that on the GPU the kernels let
the hardware do the two conversions whose rounding it has exactly (fp32 -> bf16 RNE after the
Hadamard transform, fp32 -> E4M3 RNE of the block scales); the interpreter runs the bit arithmetic, and
the tests compare both against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_triton import (
    as_kernel_input,
    cdiv,
    e2m1_code_rne_lowbyte,
    e2m1_code_sr_lean,
    e4m3_rne_pos_native,
    launch_keys,
    load_as_f32,
    load_key,
    pack_pairs,
    random_bits8_top,
    round_to_bf16,
    round_to_bf16_x2,
)
from nvfp4_train.kernels._dispatch import persistent_grid
from nvfp4_train.kernels.fp4_layout_triton import scale_buffer, scale_offset

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _tile_coords(pid, M, K, BM: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    n_k = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(M, BM) * n_k
    if REVERSE:
        pid = n_tiles - 1 - pid
    return (pid // n_k) * BM, (pid % n_k) * BK


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


# ----------------------------------------------------------------------------------------------------------
# The quantize kernel: every thread owns the same positions of 16 consecutive rows
# ----------------------------------------------------------------------------------------------------------
#
# A program owns the [BM, BK] tile at (m0, k0) and loads it as 16 tensors x0..x15 of shape [G, KB, 16]
# (G = BM/16, KB = BK/16): x_i[g, kb, j] = x[m0 + 16g + i, k0 + 16kb + j]. Each is a plain coalesced load of
# G rows, and all 16 have the same layout, so everything the columnwise copy does along M (the Hadamard
# butterfly, the block amax over 16 rows, packing 16 codes into one 64-bit word) is elementwise arithmetic
# between the 16 tensors: it stays in registers, with no transpose. The rowwise copy reduces each x_i over
# its last axis (16 consecutive k). The only data movement between threads is that reduction and the
# store of the packed column words (Triton routes it through shared memory to coalesce it).


@triton.jit
def _bfly(a, b):
    return a + b, a - b


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """x_i * (s_i/4) (exact), then the butterfly stages with strides 1, 2, 4, 8 (the reference's order)."""
    x0 = x0 * 0.25
    x1 = x1 * 0.25
    x2 = x2 * 0.25
    x3 = x3 * -0.25
    x4 = x4 * 0.25
    x5 = x5 * -0.25
    x6 = x6 * -0.25
    x7 = x7 * -0.25
    x8 = x8 * -0.25
    x9 = x9 * -0.25
    x10 = x10 * -0.25
    x11 = x11 * 0.25
    x12 = x12 * -0.25
    x13 = x13 * 0.25
    x14 = x14 * -0.25
    x15 = x15 * -0.25
    x0, x1 = _bfly(x0, x1)
    x2, x3 = _bfly(x2, x3)
    x4, x5 = _bfly(x4, x5)
    x6, x7 = _bfly(x6, x7)
    x8, x9 = _bfly(x8, x9)
    x10, x11 = _bfly(x10, x11)
    x12, x13 = _bfly(x12, x13)
    x14, x15 = _bfly(x14, x15)
    x0, x2 = _bfly(x0, x2)
    x1, x3 = _bfly(x1, x3)
    x4, x6 = _bfly(x4, x6)
    x5, x7 = _bfly(x5, x7)
    x8, x10 = _bfly(x8, x10)
    x9, x11 = _bfly(x9, x11)
    x12, x14 = _bfly(x12, x14)
    x13, x15 = _bfly(x13, x15)
    x0, x4 = _bfly(x0, x4)
    x1, x5 = _bfly(x1, x5)
    x2, x6 = _bfly(x2, x6)
    x3, x7 = _bfly(x3, x7)
    x8, x12 = _bfly(x8, x12)
    x9, x13 = _bfly(x9, x13)
    x10, x14 = _bfly(x10, x14)
    x11, x15 = _bfly(x11, x15)
    x0, x8 = _bfly(x0, x8)
    x1, x9 = _bfly(x1, x9)
    x2, x10 = _bfly(x2, x10)
    x3, x11 = _bfly(x3, x11)
    x4, x12 = _bfly(x4, x12)
    x5, x13 = _bfly(x5, x13)
    x6, x14 = _bfly(x6, x14)
    x7, x15 = _bfly(x7, x15)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Elementwise max of |x_i|, NaN if any is NaN (one instruction per max on the GPU)."""
    n: tl.constexpr = tl.PropagateNan.ALL
    a = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1), n), tl.maximum(tl.abs(x2), tl.abs(x3), n), n)
    b = tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5), n), tl.maximum(tl.abs(x6), tl.abs(x7), n), n)
    c = tl.maximum(tl.maximum(tl.abs(x8), tl.abs(x9), n), tl.maximum(tl.abs(x10), tl.abs(x11), n), n)
    d = tl.maximum(tl.maximum(tl.abs(x12), tl.abs(x13), n), tl.maximum(tl.abs(x14), tl.abs(x15), n), n)
    return tl.maximum(tl.maximum(a, b, n), tl.maximum(c, d, n), n)


@triton.jit
def _pack8(c0, c1, c2, c3, c4, c5, c6, c7):
    """8 int32 codes -> one uint32 word, c0 in the low nibble (the byte order of ``pack_pairs``)."""
    w = c0 | (c1 << 4) | (c2 << 8) | (c3 << 12) | (c4 << 16) | (c5 << 20) | (c6 << 24) | (c7 << 28)
    return w.to(tl.uint32, bitcast=True)


@triton.jit
def _bytes4(a, b, c, d, ASM: tl.constexpr):
    """The low bytes of a, b, c, d (int32) as one uint32, a in the lowest byte: two byte permutes (PRMT)
    per pair and one for the halves with ``ASM`` (the compiler's own masks and shifts take ~2x as many)."""
    if ASM:
        ab = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x0040;", "=r,r,r", [a, b], dtype=tl.int32,
                                       is_pure=True, pack=1)
        cd = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x0040;", "=r,r,r", [c, d], dtype=tl.int32,
                                       is_pure=True, pack=1)
        w = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [ab, cd], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        w = (a & 0xFF) | ((b & 0xFF) << 8) | ((c & 0xFF) << 16) | ((d & 0xFF) << 24)
    return w.to(tl.uint32, bitcast=True)


@triton.jit
def _pack8_lowbyte(c0, c1, c2, c3, c4, c5, c6, c7, ASM: tl.constexpr):
    """``_pack8`` of codes that hold the code in their low nibble and junk above bit 22
    (``e2m1_code_rne_lowbyte``): c + (c' << 4) is one shift-add whose low byte is exact (no carry
    reaches bit 8 from below), then the four low bytes are gathered."""
    return _bytes4(c0 + (c1 << 4), c2 + (c3 << 4), c4 + (c5 << 4), c6 + (c7 << 4), ASM)


@triton.jit
def _ld_row(x_ptr, offs, stride_m, i: tl.constexpr, row0, M, kmask, IS_BF16: tl.constexpr, NATIVE: tl.constexpr,
            EVEN: tl.constexpr):
    """x_i: rows row0 + i of the tile's groups, as fp32 [G, KB, 16]. ``EVEN``: the tile is inside x (no
    mask). ``NATIVE``: bf16 through the GPU's own (exact) conversion; else through its bits."""
    p = x_ptr + offs + i * stride_m
    if IS_BF16 and NATIVE:
        pb = p.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        if EVEN:
            return tl.load(pb).to(tl.float32)
        else:
            return tl.load(pb, mask=((row0 + i) < M) & kmask, other=0.0).to(tl.float32)
    else:
        return load_as_f32(p, ((row0 + i) < M) & kmask, IS_BF16)


@triton.jit
def _enc_table(tab_ptr, s_dec):
    """enc_b of every E4M3 scale byte 0..127 (RECIPE §2: min(1 / (fp32(sdec_b) * S_dec), FLT_MAX); byte
    0x7F is NaN) into tab_ptr[0:128]. The kernel looks the encode scale of a block up here by its
    scale byte instead of dividing in every thread that holds a part of the block."""
    j = tl.arange(0, 128)
    normal = (((j >> 3) + 120) << 23) | ((j & 7) << 20)  # 2^((j >> 3) - 7) * (1 + (j & 7) / 8) as bits
    sval = tl.where(j < 8, j.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    sval = tl.where(j == 127, float("nan"), sval)
    enc = tl.math.div_rn(tl.full([128], 1.0, tl.float32), sval * s_dec)
    tl.store(tab_ptr + j, tl.where(enc > FLT_MAX, FLT_MAX, enc))


@triton.jit
def _block_scale(blk_amax, s_dec, c, NATIVE: tl.constexpr, TABLE: tl.constexpr = False, tab_ptr=None):
    """(enc_b, scale byte) of blocks with amax ``blk_amax`` (RECIPE §2). ``TABLE``: enc_b from the table
    ``_enc_table`` wrote at ``tab_ptr`` (one load instead of a decode, a multiply and a division)."""
    s = blk_amax * c
    s = tl.where(s > 448.0, 448.0, s)
    sbyte, sval = e4m3_rne_pos_native(s, NATIVE)
    if TABLE:
        return tl.load(tab_ptr + sbyte), sbyte
    enc = tl.math.div_rn(tl.full(sval.shape, 1.0, tl.float32), sval * s_dec)
    enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
    return enc, sbyte


@triton.jit
def _codes(y, idx, key, SR: tl.constexpr, ASM: tl.constexpr = False):
    """E2M1 codes of y (already scaled), RNE or stochastic with the counter hash of ``idx`` (uint32). RNE
    codes come in the low nibble with junk above bit 22 (``e2m1_code_rne_lowbyte``); the stochastic ones are
    clean (``e2m1_code_sr_lean``)."""
    if SR:
        return e2m1_code_sr_lean(y, random_bits8_top(idx + key), ASM)
    else:
        return e2m1_code_rne_lowbyte(y).to(tl.int32, bitcast=True)


@triton.jit
def _row_quant(v, enc, sbyte, i: tl.constexpr, row0, M, K, k0, rbase, key, zero_codes,
               row_codes_ptr, row_scales_ptr, WRITE_ROW: tl.constexpr, SR: tl.constexpr,
               G: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr = False):
    """Rowwise copy of rows row0 + i (blocks of 16 along k): returns the codes [G, KB, 16] and stores
    the packed codes when WRITE_ROW (the scales of all 16 rows go out together: ``_store_row_scales16``).
    The codes may carry junk above bit 22 (only their low nibble counts) and the non-finite policy zeroes
    the packed bytes (one select per 2 codes) instead of the codes."""
    codes = _codes(v * enc[:, :, None], rbase + i * K.to(tl.uint32), key, SR, ASM)
    if WRITE_ROW:
        m = row0 + i  # [G, 1, 1]
        lo, hi = tl.split(tl.reshape(codes, [G, KB, 8, 2]))
        kh = k0 // 2 + 8 * tl.arange(0, KB)[None, :, None] + tl.arange(0, 8)[None, None, :]
        pk = tl.where(zero_codes, 0, lo + (hi << 4)).to(tl.uint8)  # the low byte is exact
        tl.store(row_codes_ptr + m * (K // 2) + kh, pk, mask=(m < M) & (kh < K // 2))
    return codes


@triton.jit
def _store_row_scales16(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
                        row_scales_ptr, m0, k0, M, K, G: tl.constexpr, KB: tl.constexpr,
                        SWIZZLE: tl.constexpr = False):
    """The row scales of the tile's 16 rows per group in ONE store: the 16 [G, KB] tensors joined into
    [G, KB, 2, 2, 2, 2] (row i = b0 + 2 b1 + 4 b2 + 8 b3), one layout conversion instead of 16."""
    a0 = tl.join(tl.join(tl.join(tl.join(s0, s1), tl.join(s2, s3)), tl.join(tl.join(s4, s5), tl.join(s6, s7))),
                 tl.join(tl.join(tl.join(s8, s9), tl.join(s10, s11)), tl.join(tl.join(s12, s13), tl.join(s14, s15))))
    b0 = tl.arange(0, 2)[None, None, :, None, None, None]
    b1 = tl.arange(0, 2)[None, None, None, :, None, None]
    b2 = tl.arange(0, 2)[None, None, None, None, :, None]
    b3 = tl.arange(0, 2)[None, None, None, None, None, :]
    m = m0 + 16 * tl.arange(0, G)[:, None, None, None, None, None] + b0 + 2 * b1 + 4 * b2 + 8 * b3
    ks = k0 // 16 + tl.arange(0, KB)[None, :, None, None, None, None]
    tl.store(row_scales_ptr + scale_offset(m, ks, K // 16, SWIZZLE), a0.to(tl.uint8), mask=(m < M) & (ks < K // 16))


@triton.jit(do_not_specialize=["row_key", "col_key"])
def _quantize_grouped_kernel(
    x_ptr, amax_ptr,
    row_codes_ptr, row_scales_ptr, col_words_ptr, col_scales_ptr, amax_out_ptr, enc_tab_ptr,
    M, K, stride_m, stride_k, row_key, col_key,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, BLOCK_2D: tl.constexpr,
    COL_RHT: tl.constexpr, ROW_SR: tl.constexpr, COL_SR: tl.constexpr, IS_BF16: tl.constexpr,
    NATIVE_CVT: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ASM: tl.constexpr = False, SWIZZLE: tl.constexpr = False, KEY_PTR: tl.constexpr = False,
):
    """``KEY_PTR``: ``row_key`` / ``col_key`` point to int64 seeds (``load_key``), else they are the keys.
    ``ASM`` (GPU only): the steps that Triton cannot express in one instruction use inline PTX (add.rp,
    cvt.rn.bf16x2, prmt). The rowwise encode scales come from the table ``_enc_table`` writes, the columnwise
    ones too for bf16 input (see the column scale). ``SWIZZLE``: both copies' scales are stored in the native
    GEMM's layout (``scale_offset``)."""
    G: tl.constexpr = BM // 16
    KB: tl.constexpr = BK // 16
    pid = tl.program_id(0)
    m0, k0 = _tile_coords(pid, M, K, BM, BK, True)

    row_s_enc, row_s_dec, row_c, row_amax = _tensor_scales(tl.load(amax_ptr))
    if pid == 0:
        tl.store(amax_out_ptr, row_amax)
    row_nan = row_amax != row_amax  # the non-finite policy: every code 0 (the scales are NaN already)

    row0 = m0 + 16 * tl.arange(0, G)[:, None, None]  # [G, 1, 1]: first row of each group of 16
    k = k0 + 16 * tl.arange(0, KB)[None, :, None] + tl.arange(0, 16)[None, None, :]  # [1, KB, 16]
    kmask = k < K
    offs = row0 * stride_m + k * stride_k
    x0 = _ld_row(x_ptr, offs, stride_m, 0, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x1 = _ld_row(x_ptr, offs, stride_m, 1, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x2 = _ld_row(x_ptr, offs, stride_m, 2, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x3 = _ld_row(x_ptr, offs, stride_m, 3, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x4 = _ld_row(x_ptr, offs, stride_m, 4, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x5 = _ld_row(x_ptr, offs, stride_m, 5, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x6 = _ld_row(x_ptr, offs, stride_m, 6, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x7 = _ld_row(x_ptr, offs, stride_m, 7, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x8 = _ld_row(x_ptr, offs, stride_m, 8, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x9 = _ld_row(x_ptr, offs, stride_m, 9, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x10 = _ld_row(x_ptr, offs, stride_m, 10, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x11 = _ld_row(x_ptr, offs, stride_m, 11, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x12 = _ld_row(x_ptr, offs, stride_m, 12, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x13 = _ld_row(x_ptr, offs, stride_m, 13, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x14 = _ld_row(x_ptr, offs, stride_m, 14, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    x15 = _ld_row(x_ptr, offs, stride_m, 15, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
    row_tab = enc_tab_ptr
    col_tab = enc_tab_ptr + 128
    # every program writes the same tables (a benign race); the barrier makes this program's own
    # writes visible to all its threads before the lookups (after the loads of x, so that their
    # latency overlaps this). The columnwise table only for bf16 input: see the column scale.
    _enc_table(row_tab, row_s_dec)
    if WRITE_COL and not BLOCK_2D and IS_BF16:
        _enc_table(col_tab, _tensor_scales(tl.load(amax_ptr + 1))[1])
    tl.debug_barrier()

    # element counters of the stochastic rounding (mod 2^32, as the reference): row i adds i*K
    rbase = row0.to(tl.uint32) * K.to(tl.uint32) + k.to(tl.uint32)
    rkey = load_key(row_key, KEY_PTR)

    if WRITE_ROW or BLOCK_2D:
        if BLOCK_2D:
            # one scale per 16x16 tile: the max over the 16 rows of the row-block maxima
            t = tl.max(_max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15), axis=2)
            e0, s0 = _block_scale(t, row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e1, s1 = e0, s0
            e2, s2 = e0, s0
            e3, s3 = e0, s0
            e4, s4 = e0, s0
            e5, s5 = e0, s0
            e6, s6 = e0, s0
            e7, s7 = e0, s0
            e8, s8 = e0, s0
            e9, s9 = e0, s0
            e10, s10 = e0, s0
            e11, s11 = e0, s0
            e12, s12 = e0, s0
            e13, s13 = e0, s0
            e14, s14 = e0, s0
            e15, s15 = e0, s0
        else:
            e0, s0 = _block_scale(tl.max(tl.abs(x0), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e1, s1 = _block_scale(tl.max(tl.abs(x1), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e2, s2 = _block_scale(tl.max(tl.abs(x2), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e3, s3 = _block_scale(tl.max(tl.abs(x3), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e4, s4 = _block_scale(tl.max(tl.abs(x4), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e5, s5 = _block_scale(tl.max(tl.abs(x5), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e6, s6 = _block_scale(tl.max(tl.abs(x6), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e7, s7 = _block_scale(tl.max(tl.abs(x7), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e8, s8 = _block_scale(tl.max(tl.abs(x8), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e9, s9 = _block_scale(tl.max(tl.abs(x9), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e10, s10 = _block_scale(tl.max(tl.abs(x10), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e11, s11 = _block_scale(tl.max(tl.abs(x11), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e12, s12 = _block_scale(tl.max(tl.abs(x12), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e13, s13 = _block_scale(tl.max(tl.abs(x13), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e14, s14 = _block_scale(tl.max(tl.abs(x14), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
            e15, s15 = _block_scale(tl.max(tl.abs(x15), axis=2), row_s_dec, row_c, NATIVE_CVT, True, row_tab)
        c0 = _row_quant(x0, e0, s0, 0, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c1 = _row_quant(x1, e1, s1, 1, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c2 = _row_quant(x2, e2, s2, 2, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c3 = _row_quant(x3, e3, s3, 3, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c4 = _row_quant(x4, e4, s4, 4, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c5 = _row_quant(x5, e5, s5, 5, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c6 = _row_quant(x6, e6, s6, 6, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c7 = _row_quant(x7, e7, s7, 7, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c8 = _row_quant(x8, e8, s8, 8, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c9 = _row_quant(x9, e9, s9, 9, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c10 = _row_quant(x10, e10, s10, 10, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c11 = _row_quant(x11, e11, s11, 11, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c12 = _row_quant(x12, e12, s12, 12, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c13 = _row_quant(x13, e13, s13, 13, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c14 = _row_quant(x14, e14, s14, 14, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        c15 = _row_quant(x15, e15, s15, 15, row0, M, K, k0, rbase, rkey, row_nan, row_codes_ptr,
                              row_scales_ptr, WRITE_ROW, ROW_SR, G, KB, ASM)
        if WRITE_ROW:
            _store_row_scales16(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
                                row_scales_ptr, m0, k0, M, K, G, KB, SWIZZLE)

    if WRITE_COL:
        if BLOCK_2D:
            # the same values transposed: the tile scale serves both orientations
            csb = tl.broadcast_to(s0[:, :, None], [G, KB, 16])
        else:
            col_s_enc, col_s_dec, col_c, col_amax = _tensor_scales(tl.load(amax_ptr + 1))
            if pid == 0:
                tl.store(amax_out_ptr + 1, col_amax)
            col_nan = col_amax != col_amax
            if COL_RHT:
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
                    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
                if IS_BF16:
                    x0 = round_to_bf16_x2(x0, ASM, NATIVE_CVT)
                    x1 = round_to_bf16_x2(x1, ASM, NATIVE_CVT)
                    x2 = round_to_bf16_x2(x2, ASM, NATIVE_CVT)
                    x3 = round_to_bf16_x2(x3, ASM, NATIVE_CVT)
                    x4 = round_to_bf16_x2(x4, ASM, NATIVE_CVT)
                    x5 = round_to_bf16_x2(x5, ASM, NATIVE_CVT)
                    x6 = round_to_bf16_x2(x6, ASM, NATIVE_CVT)
                    x7 = round_to_bf16_x2(x7, ASM, NATIVE_CVT)
                    x8 = round_to_bf16_x2(x8, ASM, NATIVE_CVT)
                    x9 = round_to_bf16_x2(x9, ASM, NATIVE_CVT)
                    x10 = round_to_bf16_x2(x10, ASM, NATIVE_CVT)
                    x11 = round_to_bf16_x2(x11, ASM, NATIVE_CVT)
                    x12 = round_to_bf16_x2(x12, ASM, NATIVE_CVT)
                    x13 = round_to_bf16_x2(x13, ASM, NATIVE_CVT)
                    x14 = round_to_bf16_x2(x14, ASM, NATIVE_CVT)
                    x15 = round_to_bf16_x2(x15, ASM, NATIVE_CVT)
            cmax = _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
            if IS_BF16:
                enc, csb = _block_scale(cmax, col_s_dec, col_c, NATIVE_CVT, True, col_tab)
            else:
                # fp32 input: the encode scale by division, not by the table. The lookup is
                # a gather load; Triton 3.6 anchors the rest of the columnwise copy to its layout (4 warps
                # along k) and, for fp32 input only, moves the 16 mixed fp32 tensors there by stmatrix and
                # the lookup pointers through shared memory. That was the one fp32-only construct of the lean
                # kernel when its columnwise codes came out wrong on the H200 for fp32 input (rows k % 4 in
                # {0, 1} = warps 0 and 1 of that layout); bf16 moves its 16-bit values instead and passed.
                # Without the gather the copy stays in the load layout (GPU-verified).
                enc, csb = _block_scale(cmax, col_s_dec, col_c, NATIVE_CVT)
            # counters of x^T [K, M]: k * M + m, row i adds i
            cbase = k.to(tl.uint32) * M.to(tl.uint32) + row0.to(tl.uint32)
            ckey = load_key(col_key, KEY_PTR)
            c0 = _codes(x0 * enc, cbase, ckey, COL_SR, ASM)
            c1 = _codes(x1 * enc, cbase + 1, ckey, COL_SR, ASM)
            c2 = _codes(x2 * enc, cbase + 2, ckey, COL_SR, ASM)
            c3 = _codes(x3 * enc, cbase + 3, ckey, COL_SR, ASM)
            c4 = _codes(x4 * enc, cbase + 4, ckey, COL_SR, ASM)
            c5 = _codes(x5 * enc, cbase + 5, ckey, COL_SR, ASM)
            c6 = _codes(x6 * enc, cbase + 6, ckey, COL_SR, ASM)
            c7 = _codes(x7 * enc, cbase + 7, ckey, COL_SR, ASM)
            c8 = _codes(x8 * enc, cbase + 8, ckey, COL_SR, ASM)
            c9 = _codes(x9 * enc, cbase + 9, ckey, COL_SR, ASM)
            c10 = _codes(x10 * enc, cbase + 10, ckey, COL_SR, ASM)
            c11 = _codes(x11 * enc, cbase + 11, ckey, COL_SR, ASM)
            c12 = _codes(x12 * enc, cbase + 12, ckey, COL_SR, ASM)
            c13 = _codes(x13 * enc, cbase + 13, ckey, COL_SR, ASM)
            c14 = _codes(x14 * enc, cbase + 14, ckey, COL_SR, ASM)
            c15 = _codes(x15 * enc, cbase + 15, ckey, COL_SR, ASM)
        if not (COL_SR and not BLOCK_2D) and not (ROW_SR and BLOCK_2D):
            lo = _pack8_lowbyte(c0, c1, c2, c3, c4, c5, c6, c7, ASM)  # RNE codes: junk above bit 22
            hi = _pack8_lowbyte(c8, c9, c10, c11, c12, c13, c14, c15, ASM)
        else:
            lo = _pack8(c0, c1, c2, c3, c4, c5, c6, c7)
            hi = _pack8(c8, c9, c10, c11, c12, c13, c14, c15)
        w = lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)
        if not BLOCK_2D:
            w = tl.where(col_nan, 0, w)
        else:
            w = tl.where(row_nan, 0, w)  # the lean rowwise path leaves the codes themselves unzeroed
        # x^T row k, 16 codes (8 bytes) of group g: word k * (M/16) + m0/16 + g
        gi = m0 // 16 + tl.arange(0, G)[:, None, None]
        cmask = (gi < M // 16) & kmask
        tl.store(col_words_ptr + k * (M // 16) + gi, w.to(tl.int64, bitcast=True), mask=cmask)
        tl.store(col_scales_ptr + scale_offset(k, gi, M // 16, SWIZZLE), csb.to(tl.uint8), mask=cmask)


@triton.jit
def _amax_grouped_kernel(
    x_ptr, amax_ptr, M, K, stride_m, stride_k,
    DO_COL_RHT: tl.constexpr, IS_BF16: tl.constexpr, NATIVE_CVT: tl.constexpr, EVEN: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """Persistent amax pass in the grouped layout: max|x| (NaN and Inf as +Inf) and, with DO_COL_RHT, the
    max |RHT(x^T)|. Rounding to bf16 and the final scaling are monotonic, so the mixed values are rounded
    once, after the max; a non-finite input makes the mixed amax +Inf too (as in the reference, where it
    mixes into Inf or NaN)."""
    G: tl.constexpr = BM // 16
    KB: tl.constexpr = BK // 16
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(K, BK)
    acc = tl.zeros([G, KB, 16], dtype=tl.float32)
    acc_t = tl.zeros([G, KB, 16], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        m0, k0 = _tile_coords(tile, M, K, BM, BK, False)
        row0 = m0 + 16 * tl.arange(0, G)[:, None, None]
        k = k0 + 16 * tl.arange(0, KB)[None, :, None] + tl.arange(0, 16)[None, None, :]
        kmask = k < K
        offs = row0 * stride_m + k * stride_k
        x0 = _ld_row(x_ptr, offs, stride_m, 0, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x1 = _ld_row(x_ptr, offs, stride_m, 1, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x2 = _ld_row(x_ptr, offs, stride_m, 2, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x3 = _ld_row(x_ptr, offs, stride_m, 3, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x4 = _ld_row(x_ptr, offs, stride_m, 4, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x5 = _ld_row(x_ptr, offs, stride_m, 5, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x6 = _ld_row(x_ptr, offs, stride_m, 6, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x7 = _ld_row(x_ptr, offs, stride_m, 7, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x8 = _ld_row(x_ptr, offs, stride_m, 8, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x9 = _ld_row(x_ptr, offs, stride_m, 9, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x10 = _ld_row(x_ptr, offs, stride_m, 10, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x11 = _ld_row(x_ptr, offs, stride_m, 11, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x12 = _ld_row(x_ptr, offs, stride_m, 12, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x13 = _ld_row(x_ptr, offs, stride_m, 13, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x14 = _ld_row(x_ptr, offs, stride_m, 14, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        x15 = _ld_row(x_ptr, offs, stride_m, 15, row0, M, kmask, IS_BF16, NATIVE_CVT, EVEN)
        nan: tl.constexpr = tl.PropagateNan.ALL
        acc = tl.maximum(acc, _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15), nan)
        if DO_COL_RHT:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
            acc_t = tl.maximum(acc_t, _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
                               nan)
    acc = tl.where(acc == acc, acc, float("inf"))
    amax = tl.max(tl.max(tl.max(acc, axis=2), axis=1), axis=0)
    amax_t = amax
    if DO_COL_RHT:
        acc_t = tl.where(acc_t == acc_t, acc_t, float("inf"))
        amax_t = tl.max(tl.max(tl.max(acc_t, axis=2), axis=1), axis=0)
    publish_amax_pair(amax_ptr, amax, amax_t, DO_COL_RHT, IS_BF16)


@triton.jit
def publish_amax_pair(amax_ptr, amax, amax_t, COL_RHT: tl.constexpr, IS_BF16: tl.constexpr):
    """The end of a program of an amax pass (``_amax_grouped_kernel``, and the squared ReLU's, whose amax must be
    this one's bit for bit): one atomic max of its max|x| into amax[0] and, with COL_RHT, of its max|RHT(x^T)| into
    amax[1], both reduced from tiles whose NaN were made +Inf (the GPU's max skips NaN). The mixed amax is rounded to
    bf16 once, after the max, for bf16 input (rounding is monotonic) and made +Inf wherever the plain one is: a mix
    that overflows makes Inf - Inf = NaN in other outputs, non-finite all the same."""
    tl.atomic_max(amax_ptr, amax)
    if COL_RHT:
        if IS_BF16:
            amax_t = round_to_bf16(amax_t)
        amax_t = tl.where(amax == float("inf"), float("inf"), amax_t)
        tl.atomic_max(amax_ptr + 1, amax_t)


def _grid(M: int, K: int, BM: int, BK: int) -> tuple[int]:
    return (cdiv(M, BM) * cdiv(K, BK),)


def _persistent_grid(x: torch.Tensor, M: int, K: int, BM: int, BK: int, per_sm: int = 4) -> tuple[int]:
    return persistent_grid(x, cdiv(M, BM) * cdiv(K, BK), per_sm)


# Launch settings (BM rows x BK columns per program, num_warps; the amax pass runs per_sm persistent programs
# per multiprocessor). Measured best on the H200 in scripts/bench_quantize_sweep.py (docs/benchmarks.md):
# 64x256 per 4 warps needs 255 registers (8 warps per SM; with stochastic rounding it spills), 64x128 needs
# 168 and runs 12 warps per SM.
QUANTIZE_CONFIG = dict(block_m=64, block_k=128, num_warps=4)
AMAX_CONFIG = dict(block_m=32, block_k=256, num_warps=4, per_sm=3)


def _native_cvt(x: torch.Tensor) -> bool:
    """On CUDA the kernels let the hardware convert bf16 -> fp32 (exact), fp32 -> bf16 (RNE) and
    fp32 -> E4M3 (RNE), and run the inline PTX steps; the interpreter's conversions differ, so there they use
    the bit arithmetic."""
    return x.is_cuda


def _launch_amax(x, out, M, K, is_bf16, col_rht, block_m, block_k, num_warps, per_sm):
    _amax_grouped_kernel[_persistent_grid(x, M, K, block_m, block_k, per_sm)](
        x, out, M, K, x.stride(0), x.stride(1), DO_COL_RHT=col_rht, IS_BF16=is_bf16,
        NATIVE_CVT=_native_cvt(x), EVEN=M % block_m == 0 and K % block_k == 0,
        BM=block_m, BK=block_k, num_warps=num_warps, enable_fp_fusion=False,
    )


def amax_triton(x: torch.Tensor, col_rht: bool, **cfg) -> torch.Tensor:
    """float32 [2]: raw amax of x (non-finite as +Inf) and of RHT(x^T) (or x^T). ``cfg`` overrides
    ``AMAX_CONFIG``."""
    M, K = x.shape
    c = dict(AMAX_CONFIG, **cfg)
    out = torch.zeros(2, dtype=torch.float32, device=x.device)
    _launch_amax(as_kernel_input(x), out, M, K, x.dtype == torch.bfloat16, col_rht, c["block_m"],
                 c["block_k"], c["num_warps"], c["per_sm"])
    if not col_rht:
        out[1] = out[0]
    return out


_DEFAULT_LAUNCH = (QUANTIZE_CONFIG["block_m"], QUANTIZE_CONFIG["block_k"], QUANTIZE_CONFIG["num_warps"], None,
                   AMAX_CONFIG)


def _launch_config(block_m, block_k, num_warps, maxnreg, amax_cfg):
    """(block_m, block_k, num_warps, maxnreg, amax pass config) of the quantize pass: the overrides given,
    the defaults for the others (the hot path, without overrides, builds nothing)."""
    if block_m is None and block_k is None and num_warps is None and maxnreg is None and amax_cfg is None:
        return _DEFAULT_LAUNCH
    base = QUANTIZE_CONFIG
    return (block_m or base["block_m"], block_k or base["block_k"], num_warps or base["num_warps"], maxnreg,
            dict(AMAX_CONFIG, **(amax_cfg or {})))


def _amax_pair(row_amax: torch.Tensor, col_amax: torch.Tensor) -> torch.Tensor | None:
    """The two given amaxes as the kernel's float32 [2] input without a copy, when they already are the two
    consecutive fp32 elements of one buffer (``am[0], am[1]`` of ``nvfp4_amax``, all-reduced across a
    tensor-parallel group): the kernel only reads it. Else None (the caller copies them into a new buffer)."""
    if (row_amax.dtype != torch.float32 or col_amax.dtype != torch.float32 or row_amax.dim() != 0
            or col_amax.dim() != 0 or col_amax.data_ptr() != row_amax.data_ptr() + 4):
        return None
    if row_amax.untyped_storage().data_ptr() != col_amax.untyped_storage().data_ptr():  # one buffer's elements
        return None
    return row_amax.as_strided((2,), (1,))


def quantize_nvfp4_rowcol_triton(
    x: torch.Tensor,
    *,
    write_row: bool = True,
    write_col: bool = False,
    block_2d: bool = False,
    col_rht: bool = False,
    row_stochastic: bool = False,
    col_stochastic: bool = False,
    row_key=0,
    col_key=0,
    row_amax: torch.Tensor | None = None,
    col_amax: torch.Tensor | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    maxnreg: int | None = None,
    amax_cfg: dict | None = None,
    swizzled: bool = False,
):
    """Launch the fused kernels. Inputs are validated by the caller (``nvfp4_train.kernels.nvfp4``).

    ``block_m``, ``block_k``, ``num_warps`` and ``maxnreg`` (a register cap per thread) override the quantize
    pass's launch (default ``QUANTIZE_CONFIG``), ``amax_cfg`` the amax pass's (``AMAX_CONFIG``; its ``per_sm``
    is the number of persistent programs per SM): performance only, the bits do not depend on them.

    ``swizzled``: both copies' scales as the 1-D buffers of the native GEMM's 128x4-tile
    layout (``kernels/fp4_layout.py``), written by the same stores at other addresses; zero padding.

    ``row_key`` / ``col_key``: int keys (``seed_key``), or 0-d int64 seed tensors on x's device (the kernel
    loads them and applies ``seed_key``; see ``launch_keys``).

    Returns (row_codes, row_scales_u8, col_codes, col_scales_u8, amax[2]) where absent copies are None and
    ``amax`` holds the (policy-adjusted) row and column amax.
    """
    M, K = x.shape
    dev = x.device
    is_bf16 = x.dtype == torch.bfloat16
    x = as_kernel_input(x)
    block_m, block_k, num_warps, maxnreg, ac = _launch_config(block_m, block_k, num_warps, maxnreg, amax_cfg)
    need_col_amax = write_col and not block_2d
    have_row = row_amax is not None
    have_col = col_amax is not None or not need_col_amax
    amax_in = _amax_pair(row_amax, col_amax) if have_row and need_col_amax and col_amax is not None else None
    if amax_in is None:
        amax_in = torch.zeros(2, dtype=torch.float32, device=dev)
        if have_row:
            amax_in[0] = row_amax.to(torch.float32).reshape(())
        if need_col_amax and col_amax is not None:
            amax_in[1] = col_amax.to(torch.float32).reshape(())
    if M == 0 or K == 0:  # nothing to quantize: no launch (and no 64-bit view of an empty column buffer)
        if need_col_amax and not col_rht and col_amax is None:
            amax_in[1] = amax_in[0]
        if write_col and block_2d:
            amax_in[1] = amax_in[0]
        empty = [torch.empty(shape, dtype=torch.uint8, device=dev) if want else None
                 for shape, want in (((M, K // 2), write_row), ((M, K // 16), write_row),
                                     ((K, M // 2), write_col), ((K, M // 16), write_col))]
        if swizzled:
            empty[1] = scale_buffer(M, K // 16, True, dev) if write_row else None
            empty[3] = scale_buffer(K, M // 16, True, dev) if write_col else None
        return (*empty, torch.where(torch.isinf(amax_in), float("nan"), amax_in))  # the policy, as in the kernel
    if not (have_row and have_col):
        # the amax pass max-reduces into slot 0, and into slot 1 when it mixes the columnwise copy: when one of
        # those slots holds a given amax, compute into a scratch buffer and keep the given one; else directly
        # (e.g. 2-D tiles, which need no column amax: slot 1 stays 0 either way)
        mixed = need_col_amax and col_rht
        scratch = have_row or (mixed and col_amax is not None)
        target = torch.zeros(2, dtype=torch.float32, device=dev) if scratch else amax_in
        _launch_amax(x, target, M, K, is_bf16, mixed, ac["block_m"], ac["block_k"], ac["num_warps"], ac["per_sm"])
        if target is not amax_in:
            if not have_row:
                amax_in[0] = target[0]
            if not have_col:
                amax_in[1] = target[1]
        if need_col_amax and not col_rht and col_amax is None:
            amax_in[1] = amax_in[0]  # x^T has the same amax as x
    row_codes = torch.empty((M, K // 2), dtype=torch.uint8, device=dev) if write_row else None
    row_scales = scale_buffer(M, K // 16, swizzled, dev) if write_row else None
    col_codes = torch.empty((K, M // 2), dtype=torch.uint8, device=dev) if write_col else None
    col_scales = scale_buffer(K, M // 16, swizzled, dev) if write_col else None
    amax_out = torch.empty(2, dtype=torch.float32, device=dev)
    dummy = amax_out
    enc_tab = torch.empty(256, dtype=torch.float32, device=dev)
    flags = dict(WRITE_ROW=write_row, WRITE_COL=write_col, BLOCK_2D=block_2d, COL_RHT=col_rht,
                 ROW_SR=row_stochastic, COL_SR=col_stochastic, BM=block_m, BK=block_k,
                 num_warps=num_warps, enable_fp_fusion=False)
    if maxnreg is not None:  # a register cap per thread (more programs per multiprocessor)
        flags["maxnreg"] = maxnreg
    # the columnwise codes are written as one 64-bit word per 16 elements
    native = _native_cvt(x)
    rkey, ckey, kptr = launch_keys(row_key, col_key, row_stochastic, col_stochastic)
    _quantize_grouped_kernel[_grid(M, K, block_m, block_k)](
        x, amax_in,
        row_codes if write_row else dummy, row_scales if write_row else dummy,
        col_codes.view(torch.int64) if write_col else dummy, col_scales if write_col else dummy, amax_out,
        enc_tab,
        M, K, x.stride(0), x.stride(1), rkey, ckey,
        IS_BF16=is_bf16, NATIVE_CVT=native, EVEN=M % block_m == 0 and K % block_k == 0, ASM=native,
        SWIZZLE=swizzled, KEY_PTR=kptr, **flags,
    )
    if write_col and block_2d:
        amax_out[1] = amax_out[0]
    return row_codes, row_scales, col_codes, col_scales, amax_out
