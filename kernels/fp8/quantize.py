"""FP8 (E4M3) quantization in Triton, bitwise equal to ``kernels/fp8/reference.py``.

Blockwise (the paper's baseline), ONE launch:
  * 1x128: the rowwise copy (blocks along K)           data [M, K]  scale_inv [M, K/128]  (stored M-major)
    and, when asked, the columnwise copy of x^T        data [K, M]  scale_inv [K, M/128]  (stored K-major)
    (blocks along M): Fprop/Dgrad read the first, Wgrad the second. The rowwise copy alone: the tile kernel
    (``_fp8_blockwise_kernel``, a [BM, BK] tile per program, BK a multiple of 128); both copies: the grouped
    kernel (``_fp8_rowcol_grouped_kernel``, the comment above it), a [128, 128] tile per program.
  * 128x128 (weights): the tile kernel, BM = BK = 128, one tile per program; the columnwise copy is the same
    bytes transposed with the transposed tile scales, i.e. W in Fprop and W^T in Dgrad are the same values.
Per tensor, two launches: an amax pass (persistent programs, one atomic max each, NaN/Inf counted as +Inf,
which the cast pass turns into the NaN amax of the non-finite policy), then a cast pass that writes the
rowwise copy and optionally the transposed copy (which needs no new scale).
Every copy is computed from the tile as loaded (the columnwise 1x128 blocks reduce over 128 rows of it) and
the transposed bytes are stored through transposed addresses: no fp32 tile is ever transposed in registers.
In the grouped kernel each thread holds 4 consecutive rows, so x^T's bytes leave as 32-bit words, and the tile is
read in chunks twice. It replaced the tile kernel's two-copy launch, which stored x^T one byte at a time through
shared memory. sm_90 (``scripts/sass_count.py --fp8-rowcol``): 18.4 instructions per element at 64-row chunks on
8 warps, 79 registers, no spills, against that launch's 30.6, 255 registers and 46 spills; on an H100 (2026-12-05)
0.73-0.83x its time on the 12B and ``1.2b`` shapes, 69-76% of a device copy's bandwidth on the large ones
(``docs/benchmarks.md``, "FP8 casts").

Arithmetic per block, as in the reference: ``s = min(448 / amax, FLT_MAX)`` (1 for an all-zero block),
``scale_inv = 1 / s``, both correctly rounded divisions (``div_rn``), ``q = e4m3_rne(x * s)``: on GPUs of compute
capability 8.9+ the hardware's saturating conversion (``cvt.rn.satfinite.e4m3x2.f32``, two values per instruction;
the same RNE, subnormals, saturation and NaN byte), elsewhere (older GPUs, the interpreter) the bit arithmetic of
``kernels/fp4_triton.py`` (``e4m3_byte``). Launch options: ``enable_fp_fusion=False`` (no FMA contraction) and
``enable_reflect_ftz=False``, so that libdevice's ``div_rn`` keeps subnormal results (``scale_inv`` is subnormal
when amax < 448 * 2^-126) as the CPU reference does. bf16 input is
read through its bits (``load_as_f32``), exact for subnormals too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import has_e4m3_convert, persistent_grid
from nvfp4_train.kernels.fp4_triton import as_kernel_input, e4m3_byte, e4m3_rne, load_tile, u32

FLT_MAX = tl.constexpr(3.4028234663852886e38)
_LAUNCH_OPTS = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


@triton.jit
def _abs_inf(v):
    """|v| with NaN counted as +Inf (the GPU's max ignores NaN, the interpreter's propagates it)."""
    a = tl.abs(v)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _fp8_scales(amax):
    """(s, scale_inv) from block amax values (a tensor; +Inf marks a non-finite block -> NaN scales)."""
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    s = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    s = tl.where(s > FLT_MAX, FLT_MAX, s)
    s = tl.where(amax == 0.0, 1.0, s)
    sinv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s)
    return s, sinv


@triton.jit
def _fp8_blockwise_kernel(
    x_ptr, row_data_ptr, row_sinv_ptr, col_data_ptr, col_sinv_ptr,
    M, K, stride_m, stride_k,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, TILE_2D: tl.constexpr,
    BF16_BITS: tl.constexpr, NATIVE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BK)
    m0 = (pid // n_k) * BM
    k0 = (pid % n_k) * BK
    x, rm, rk, mask = load_tile(x_ptr, m0, k0, M, K, stride_m, stride_k, BM, BK, BF16_BITS)

    if TILE_2D:
        # BM == BK == 128: the tile is one scaling block; [1, 1]-shaped scales broadcast over it
        amax = tl.max(tl.max(_abs_inf(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
        s, sinv = _fp8_scales(amax)
        q = e4m3_byte(x * s, NATIVE)
        if WRITE_ROW:
            tl.store(row_data_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
            tl.store(row_sinv_ptr + (m0 // 128) * (K // 128) + (k0 // 128) + tl.zeros([1, 1], tl.int32), sinv)
        if WRITE_COL:
            # x^T [K, M]: element (k, m) at k * M + m (the store's layout change is Triton's, on the bytes)
            tl.store(col_data_ptr + rk[None, :] * M + rm[:, None], q, mask=mask)
            tl.store(col_sinv_ptr + (k0 // 128) * (M // 128) + (m0 // 128) + tl.zeros([1, 1], tl.int32), sinv)
    else:
        # 1x128, the rowwise copy only (both copies: _fp8_rowcol_grouped_kernel)
        if WRITE_ROW:
            v = tl.reshape(x, [BM, BK // 128, 128])
            amax = tl.max(_abs_inf(v), axis=2)  # [BM, BK/128]
            s, sinv = _fp8_scales(amax)
            q = tl.reshape(e4m3_byte(v * s[:, :, None], NATIVE), [BM, BK])
            tl.store(row_data_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
            rkb = k0 // 128 + tl.arange(0, BK // 128)
            smask = (rm[:, None] < M) & (rkb[None, :] < K // 128)
            # scale_inv [M, K/128] stored M-major: element (m, kb) at m + kb * M
            tl.store(row_sinv_ptr + rm[:, None] + rkb[None, :] * M, sinv, mask=smask)


# ----------------------------------------------------------------------------------------------------------
# Both 1x128 copies in the grouped layout (the rowwise copy and x^T's): every thread owns 4 consecutive rows
# ----------------------------------------------------------------------------------------------------------
#
# A program owns the [128, 128] tile at (m0, k0): one block of x^T's rows along M, one of x's along K. It reads
# the tile twice, CM rows at a time, as 4 tensors x0..x3 of shape [G, 128] (G = CM / 4): x_i[g, k] = x[r + 4g + i,
# k0 + k] with r the chunk's first row. The four have one layout, so one thread holds 4 consecutive rows of each
# column it owns: the 4 bytes of x^T's row k at m = r + 4g .. r + 4g + 3, one 32-bit word, where the tile kernel
# above stored them one byte at a time through shared memory.
#   pass 1, per chunk: each row's amax over its 128 elements, its scales, its bytes (4 per word along k) and its
#           scale_inv, stored; the column maxima folded into one [G, 128] register tile;
#   then:   the 128 column amaxes (one reduction over G) and their scales;
#   pass 2, per chunk: the chunk read again (from L2: the program read it a moment before) and x^T's words.
# Both passes are loops (not unrolled), so that at most one chunk is live: 72 registers at CM = 32 on 4 warps.
# The launch takes CM = 64 on 8 warps, the fastest of the sweep on an H100 (docs/benchmarks.md, "FP8 casts").
# For bf16 input the block amax is a bf16 value (a max of bf16 magnitudes), so (s, scale_inv) is looked up by
# its 15 magnitude bits in a 256 KiB table of the reference's own scales (``fp8_scale_table``) instead of two
# correctly rounded divisions in each of the 16 threads that hold a part of a row; fp32 input divides.


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN if either is NaN (one FMNMX.NAN on the GPU). A block with a NaN gets a NaN amax, one with
    an Inf an Inf amax; ``_fp8_scales`` and the table turn both into NaN scales, as the reference does."""
    return tl.maximum(a, b, tl.PropagateNan.ALL)


@triton.jit
def _e4m3_word(a, b, c, d, NATIVE: tl.constexpr):
    """``e4m3_rne`` of four fp32 tensors as one int32 word per element, a in the lowest byte. ``NATIVE``: two
    ``cvt.rn.satfinite.e4m3x2.f32`` whose halves ptxas merges into the word (F2FP ... MERGE_C), else the bit
    arithmetic."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)
    else:  # one call on the four joined (the interpreter's time goes by calls, not elements)
        ab, cd = tl.split(e4m3_rne(tl.join(tl.join(a, b), tl.join(c, d))))
        qa, qb = tl.split(ab)
        qc, qd = tl.split(cd)
        return qa | (qb << 8) | (qc << 16) | (qd << 24)


@triton.jit
def _block_scales(amax, tab_ptr, TABLE: tl.constexpr):
    """(s, scale_inv) of block amaxes (NaN-propagated maxima of |x|). ``TABLE`` (bf16 input): one 8-byte load
    from ``fp8_scale_table`` by the amax's magnitude bits (its low 16 bits are 0: a bf16 value); else
    ``_fp8_scales``' two divisions."""
    if TABLE:
        w = tl.load(tab_ptr + ((amax.to(tl.uint32, bitcast=True) >> 16) & 0x7FFF).to(tl.int32))
        s = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        sinv = (w >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        return s, sinv
    else:
        return _fp8_scales(amax.to(tl.float32, bitcast=True))


@triton.jit
def _ld_f32(p, BF16_BITS: tl.constexpr):
    """fp32 values at ``p`` (no mask), bf16 read through its bits (exact, subnormals included)."""
    if BF16_BITS:
        return (tl.load(p).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(p).to(tl.float32)


@triton.jit
def _load4(x_ptr, r, kk, stride_m, stride_k, BF16_BITS: tl.constexpr):
    """Rows r + 4g + i (i = 0..3) at columns kk as four fp32 tensors [G, BK] (no mask: the tile is inside x)."""
    p = x_ptr + r * stride_m + kk * stride_k
    return (_ld_f32(p, BF16_BITS), _ld_f32(p + stride_m, BF16_BITS), _ld_f32(p + 2 * stride_m, BF16_BITS),
            _ld_f32(p + 3 * stride_m, BF16_BITS))


@triton.jit
def _fold_max(v, G: tl.constexpr, N: tl.constexpr):
    """[G, N] -> [G, N / 2]: the NaN-propagating max of columns 2j and 2j + 1 (elementwise within a thread)."""
    a, b = tl.split(tl.reshape(v, [G, N // 2, 2]))
    return _max_nan(a, b)


@triton.jit
def _row_amax(x, G: tl.constexpr, BK: tl.constexpr):
    """max |x| over each row of x [G, BK], NaN-propagating, as int32 bits"""
    v = _fold_max(_fold_max(_fold_max(tl.abs(x), G, BK), G, BK // 2), G, BK // 4)
    return tl.max(v.to(tl.int32, bitcast=True), axis=1)


@triton.jit
def _row_words(x, s, G: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr):
    """The rowwise bytes of x * s (s per row, [G]) as words [G, BK/4], 4 consecutive k per word."""
    lo, hi = tl.split(tl.reshape(x * s[:, None], [G, BK // 4, 2, 2]))  # k = 4j + 2a + b: lo b = 0, hi b = 1
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    return _e4m3_word(v0, v1, v2, v3, NATIVE)


@triton.jit
def _rowwise4(x0, x1, x2, x3, r, k0, M, K, row_ptr, row_sinv_ptr, tab_ptr, TABLE: tl.constexpr,
              G: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr):
    """The rowwise copy of rows r + 4g + i: amaxes, scales (looked up together, one gather for the 4 rows),
    bytes and scale_inv (M-major: (m, kb) at m + kb * M)."""
    a = tl.join(tl.join(_row_amax(x0, G, BK), _row_amax(x2, G, BK)), tl.join(_row_amax(x1, G, BK), _row_amax(x3, G, BK)))
    s, sinv = _block_scales(a, tab_ptr, TABLE)  # [G, 2, 2]: row 4g + 2p + q at [g, p, q]
    s02, s13 = tl.split(s)
    s0, s2 = tl.split(s02)
    s1, s3 = tl.split(s13)
    j = k0 // 4 + tl.arange(0, BK // 4)[None, :]
    tl.store(row_ptr + r * (K // 4) + j, _row_words(x0, s0, G, BK, NATIVE))
    tl.store(row_ptr + (r + 1) * (K // 4) + j, _row_words(x1, s1, G, BK, NATIVE))
    tl.store(row_ptr + (r + 2) * (K // 4) + j, _row_words(x2, s2, G, BK, NATIVE))
    tl.store(row_ptr + (r + 3) * (K // 4) + j, _row_words(x3, s3, G, BK, NATIVE))
    rows = tl.reshape(r, [G])[:, None, None] + 2 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
    tl.store(row_sinv_ptr + rows + (k0 // 128) * M, sinv)


@triton.jit
def _fp8_rowcol_grouped_kernel(
    x_ptr, row_ptr, row_sinv_ptr, col_ptr, col_sinv_ptr, tab_ptr,
    M, K, stride_m, stride_k,
    BF16_BITS: tl.constexpr, NATIVE: tl.constexpr, TABLE: tl.constexpr, CM: tl.constexpr,
):
    """Both 1x128 copies of x [M, K] (M, K multiples of 128): ``row_ptr`` / ``col_ptr`` are the copies' bytes as
    int32 words ([M, K/4] and [K, M/4]), the scale_inv layouts those of ``_fp8_blockwise_kernel``."""
    BM: tl.constexpr = 128
    BK: tl.constexpr = 128
    G: tl.constexpr = CM // 4
    pid = tl.program_id(0)
    n_k = K // BK
    m0 = (pid // n_k) * BM
    k0 = (pid % n_k) * BK
    g4 = 4 * tl.arange(0, G)[:, None]
    kk = k0 + tl.arange(0, BK)[None, :]
    acc = tl.zeros([G, BK], tl.float32)
    for c in range(0, BM // CM):
        r = m0 + c * CM + g4
        x0, x1, x2, x3 = _load4(x_ptr, r, kk, stride_m, stride_k, BF16_BITS)
        _rowwise4(x0, x1, x2, x3, r, k0, M, K, row_ptr, row_sinv_ptr, tab_ptr, TABLE, G, BK, NATIVE)
        acc = _max_nan(acc, _max_nan(_max_nan(tl.abs(x0), tl.abs(x1)), _max_nan(tl.abs(x2), tl.abs(x3))))
    # the column scales looked up as [G, BK] (each of a column's G rows of threads loads its entry): a [BK] lookup's
    # result would come back to this layout through stmatrix (Triton 3.6 and 3.7 pick it for that change), the
    # suspect of the NVFP4 value copies' failure on the H200 (docs/numerics.md): kept out while it is one
    camax = tl.broadcast_to(tl.max(acc.to(tl.int32, bitcast=True), axis=0)[None, :], [G, BK])
    cs, csinv = _block_scales(camax, tab_ptr, TABLE)  # [G, BK], equal along G
    # scale_inv [K, M/128] stored K-major: (k, mb) at k + mb * K
    tl.store(col_sinv_ptr + kk + (m0 // 128) * K + 0 * g4, csinv, mask=g4 == 0)
    for c in range(0, BM // CM):
        x0, x1, x2, x3 = _load4(x_ptr, m0 + c * CM + g4, kk, stride_m, stride_k, BF16_BITS)
        w = _e4m3_word(x0 * cs, x1 * cs, x2 * cs, x3 * cs, NATIVE)
        # x^T row k, m = m0 + c * CM + 4g + i at byte i of word (k * M + m0 + c * CM) / 4 + g
        tl.store(col_ptr + kk * (M // 4) + (m0 + c * CM) // 4 + g4 // 4, w)


@triton.jit
def _fp8_amax_kernel(
    x_ptr, amax_ptr, M, K, stride_m, stride_k, BF16_BITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr
):
    """Persistent: each program folds its tiles into a register tile, reduces it and issues ONE atomic max
    (one per tile serializes thousands of atomics on one address)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_k = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(M, BM) * n_k
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        x, rm, rk, mask = load_tile(x_ptr, (tile // n_k) * BM, (tile % n_k) * BK, M, K, stride_m, stride_k,
                                    BM, BK, BF16_BITS)
        acc = tl.maximum(acc, _abs_inf(x))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _fp8_tensorwise_cast_kernel(
    x_ptr, amax_ptr, row_data_ptr, col_data_ptr, sinv_ptr,
    M, K, stride_m, stride_k,
    WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, BF16_BITS: tl.constexpr, NATIVE: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BK)
    x, rm, rk, mask = load_tile(x_ptr, (pid // n_k) * BM, (pid % n_k) * BK, M, K, stride_m, stride_k, BM, BK, BF16_BITS)
    one = tl.arange(0, 1)
    s, sinv = _fp8_scales(tl.load(amax_ptr + one))  # [1]
    if pid == 0:
        tl.store(sinv_ptr + one, sinv)
    q = e4m3_byte(x * s[:, None], NATIVE)
    if WRITE_ROW:
        tl.store(row_data_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
    if WRITE_COL:
        tl.store(col_data_ptr + rk[None, :] * M + rm[:, None], q, mask=mask)  # x^T: (k, m) at k * M + m


def _grid(M: int, K: int, BM: int, BK: int) -> tuple[int]:
    return (triton.cdiv(M, BM) * triton.cdiv(K, BK),)


def quantize_scale_inv_host(amax: torch.Tensor) -> torch.Tensor:
    """scale_inv (0-d) of an empty tensor's per-tensor quantization, with torch ops (no launch)."""
    from nvfp4_train.kernels.fp8.reference import encode_decode_scales

    a = amax.reshape(())
    a = torch.where(torch.isfinite(a), a, torch.full_like(a, float("nan")))
    return encode_decode_scales(a)[1]


_SCALE_TABLES: dict[torch.device, torch.Tensor] = {}


def fp8_scale_table(device: torch.device) -> torch.Tensor | None:
    """(s, scale_inv) of every block amax bf16 input can have, for ``_fp8_rowcol_grouped_kernel``: int64 [32768],
    entry j holding the reference's s (low 32 bits) and scale_inv (high 32 bits) for the amax whose magnitude bits
    as a bf16 are j (Inf and NaN patterns: NaN scales). Built once per device by the reference's own arithmetic on
    the CPU (``encode_decode_scales``), so every lookup is the reference's bits. None while a CUDA graph is being
    captured on the current stream and the table does not exist yet (a host-to-device copy cannot be captured):
    the kernel then divides, with the same bits."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tab = _SCALE_TABLES.get(device)
    if tab is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        from nvfp4_train.kernels.fp8.reference import encode_decode_scales

        amax = (torch.arange(1 << 15, dtype=torch.int32) << 16).view(torch.float32)
        amax = torch.where(torch.isinf(amax), torch.full_like(amax, float("nan")), amax)  # as amax_nonfinite
        s, sinv = encode_decode_scales(amax)
        tab = _SCALE_TABLES[device] = torch.stack([s, sinv], -1).view(torch.int64).reshape(-1).to(device)
    return tab


def quantize_fp8_blockwise_triton(
    x: torch.Tensor,
    block: tuple[int, int],
    *,
    write_row: bool = True,
    write_col: bool = False,
    block_m: int | None = None,
    block_k: int = 128,
    num_warps: int | None = None,
    chunk_m: int = 64,
):
    """Launch the blockwise kernel. Inputs are validated by the caller (``nvfp4_train.kernels.fp8``).

    Default launches (the fastest of ``scripts/bench_fp8_casts.py``'s sweep, ``docs/benchmarks.md``): 128x128
    tiles with 8 warps; 1x128, the rowwise copy alone, 32 x 128 tiles with 4 warps (``block_m``, ``block_k``);
    1x128, both copies (M and K multiples of 128): ``_fp8_rowcol_grouped_kernel``, ``chunk_m`` rows per step
    on 8 warps (``block_m`` / ``block_k`` do not apply).

    Returns (row_data_u8, row_scale_inv, col_data_u8, col_scale_inv); absent copies are None.
    """
    M, K = x.shape
    dev = x.device
    tile_2d = block == (128, 128)
    grouped = write_col and not tile_2d
    if grouped:
        assert write_row and M % 128 == 0 and K % 128 == 0 and chunk_m % 4 == 0 and 128 % chunk_m == 0
    if num_warps is None:
        num_warps = 8 if tile_2d or grouped else 4
    if tile_2d:
        bm, bk = 128, 128
    else:
        bm = block_m if block_m is not None else 32
        bk = block_k
        assert bk % 128 == 0
    f32 = dict(dtype=torch.float32, device=dev)
    row_data = torch.empty((M, K), dtype=torch.uint8, device=dev) if write_row else None
    col_data = torch.empty((K, M), dtype=torch.uint8, device=dev) if write_col else None
    if tile_2d:
        row_sinv = torch.empty((M // 128, K // 128), **f32) if write_row else None
        col_sinv = torch.empty((K // 128, M // 128), **f32) if write_col else None
    else:
        row_sinv = torch.empty((K // 128, M), **f32).t() if write_row else None  # [M, K/128], M-major
        col_sinv = torch.empty((M // 128, K), **f32).t() if write_col else None  # [K, M/128], K-major
    bf16 = x.dtype == torch.bfloat16
    if grouped:
        tab = fp8_scale_table(dev) if bf16 else None
        if M * K:
            _fp8_rowcol_grouped_kernel[(M // 128 * (K // 128),)](
                as_kernel_input(x), row_data.view(torch.int32), row_sinv, col_data.view(torch.int32), col_sinv,
                tab if tab is not None else row_sinv, M, K, x.stride(0), x.stride(1),
                BF16_BITS=bf16, NATIVE=has_e4m3_convert(x), TABLE=tab is not None, CM=chunk_m,
                num_warps=num_warps, **_LAUNCH_OPTS,
            )
        return row_data, row_sinv, col_data, col_sinv
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    dummy_f = torch.empty(1, **f32)
    _fp8_blockwise_kernel[_grid(M, K, bm, bk)](  # 1x128 here: the rowwise copy only
        as_kernel_input(x),
        row_data if write_row else dummy, row_sinv if write_row else dummy_f,
        col_data if write_col else dummy, col_sinv if write_col else dummy_f,
        M, K, x.stride(0), x.stride(1),
        WRITE_ROW=write_row, WRITE_COL=write_col, TILE_2D=tile_2d, BF16_BITS=bf16, NATIVE=has_e4m3_convert(x),
        BM=bm, BK=bk,
        num_warps=num_warps, **_LAUNCH_OPTS,
    )
    return row_data, row_sinv, col_data, col_sinv


def fp8_amax_triton(x: torch.Tensor, block_m: int = 64, block_k: int = 128, num_warps: int = 8,
                    per_sm: int = 4) -> torch.Tensor:
    """The raw amax (float32 [1]): max |x| with NaN/Inf counted as +Inf; 0 for an empty tensor."""
    M, K = x.shape
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    if M * K:
        _fp8_amax_kernel[persistent_grid(x, _grid(M, K, block_m, block_k)[0], per_sm)](
            as_kernel_input(x), amax, M, K, x.stride(0), x.stride(1),
            BF16_BITS=x.dtype == torch.bfloat16, BM=block_m, BK=block_k, num_warps=num_warps, **_LAUNCH_OPTS,
        )
    return amax


def quantize_fp8_tensorwise_triton(
    x: torch.Tensor,
    *,
    write_row: bool = True,
    write_col: bool = False,
    amax: torch.Tensor | None = None,
    block_m: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
):
    """Amax pass (skipped when ``amax`` is given: a raw amax, +Inf/NaN for non-finite) + cast pass.
    Returns (row_data_u8, col_data_u8, scale_inv 0-d); absent copies are None."""
    M, K = x.shape
    dev = x.device
    sinv = torch.empty(1, dtype=torch.float32, device=dev)
    row_data = torch.empty((M, K), dtype=torch.uint8, device=dev) if write_row else None
    col_data = torch.empty((K, M), dtype=torch.uint8, device=dev) if write_col else None
    if amax is None:
        amax = fp8_amax_triton(x)
    else:
        amax = amax.to(device=dev, dtype=torch.float32).reshape(1).clone()
    if M * K == 0:
        return row_data, col_data, quantize_scale_inv_host(amax)
    grid = _grid(M, K, block_m, block_k)
    bf16 = x.dtype == torch.bfloat16
    xk = as_kernel_input(x)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    _fp8_tensorwise_cast_kernel[grid](
        xk, amax, row_data if write_row else dummy, col_data if write_col else dummy, sinv,
        M, K, x.stride(0), x.stride(1),
        WRITE_ROW=write_row, WRITE_COL=write_col, BF16_BITS=bf16, NATIVE=has_e4m3_convert(x),
        BM=block_m, BK=block_k, num_warps=num_warps, **_LAUNCH_OPTS,
    )
    return row_data, col_data, sinv.reshape(())
