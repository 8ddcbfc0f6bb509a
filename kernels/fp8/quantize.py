"""FP8 (E4M3) quantization in Triton, bitwise equal to ``kernels/fp8/reference.py``.

Blockwise (the paper's baseline), ONE launch, each program owning a [BM, BK] tile of x [M, K]:
  * 1x128: the rowwise copy (blocks along K)           data [M, K]  scale_inv [M, K/128]  (stored M-major)
    and, when asked, the columnwise copy of x^T        data [K, M]  scale_inv [K, M/128]  (stored K-major)
    (blocks along M): Fprop/Dgrad read the first, Wgrad the second. BK is a multiple of 128, and so is BM
    when the columnwise copy is written.
  * 128x128 (weights): BM = BK = 128, one tile per program; the columnwise copy is the same bytes
    transposed with the transposed tile scales, i.e. W in Fprop and W^T in Dgrad are the same values.
Per tensor, two launches: an amax pass (persistent programs, one atomic max each, NaN/Inf counted as +Inf,
which the cast pass turns into the NaN amax of the non-finite policy), then a cast pass that writes the
rowwise copy and optionally the transposed copy (which needs no new scale).
Every copy is computed from the tile as loaded (the columnwise 1x128 blocks reduce over 128 rows of it) and
the transposed bytes are stored through transposed addresses: no fp32 tile is ever transposed in registers.

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
from nvfp4_train.kernels.fp4_triton import as_kernel_input, e4m3_byte, load_tile

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
        if WRITE_COL:
            # x^T's blocks are 128 rows of x: reduce over them in place (no transpose of the fp32 tile), then
            # store the bytes through transposed addresses
            v = tl.reshape(x, [BM // 128, 128, BK])
            amax_t = tl.max(_abs_inf(v), axis=1)  # [BM/128, BK]: block (mb, k) of x^T's row k
            s_t, sinv_t = _fp8_scales(amax_t)
            qt = tl.reshape(e4m3_byte(v * s_t[:, None, :], NATIVE), [BM, BK])
            tl.store(col_data_ptr + rk[None, :] * M + rm[:, None], qt, mask=mask)
            rmb = m0 // 128 + tl.arange(0, BM // 128)
            smask = (rmb[:, None] < M // 128) & (rk[None, :] < K)
            # scale_inv [K, M/128] stored K-major: element (k, mb) at k + mb * K
            tl.store(col_sinv_ptr + rk[None, :] + rmb[:, None] * K, sinv_t, mask=smask)


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


def quantize_fp8_blockwise_triton(
    x: torch.Tensor,
    block: tuple[int, int],
    *,
    write_row: bool = True,
    write_col: bool = False,
    block_m: int | None = None,
    block_k: int = 128,
    num_warps: int | None = None,
):
    """Launch the blockwise kernel. Inputs are validated by the caller (``nvfp4_train.kernels.fp8``).

    Default launch (the fastest of ``scripts/bench_fp8_casts.py``'s sweep on the H200, ``docs/benchmarks.md``):
    128x128 tiles with 8 warps; 1x128 blocks with 4 warps, 128 x 128 tiles when the columnwise copy is written,
    else 32 x 128.

    Returns (row_data_u8, row_scale_inv, col_data_u8, col_scale_inv); absent copies are None.
    """
    M, K = x.shape
    dev = x.device
    tile_2d = block == (128, 128)
    if num_warps is None:
        num_warps = 8 if tile_2d else 4
    if tile_2d:
        bm, bk = 128, 128
    else:
        bm = block_m if block_m is not None else (128 if write_col else 32)
        bk = block_k
        assert bk % 128 == 0 and (not write_col or bm % 128 == 0)
    f32 = dict(dtype=torch.float32, device=dev)
    row_data = torch.empty((M, K), dtype=torch.uint8, device=dev) if write_row else None
    col_data = torch.empty((K, M), dtype=torch.uint8, device=dev) if write_col else None
    if tile_2d:
        row_sinv = torch.empty((M // 128, K // 128), **f32) if write_row else None
        col_sinv = torch.empty((K // 128, M // 128), **f32) if write_col else None
    else:
        row_sinv = torch.empty((K // 128, M), **f32).t() if write_row else None  # [M, K/128], M-major
        col_sinv = torch.empty((M // 128, K), **f32).t() if write_col else None  # [K, M/128], K-major
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    dummy_f = torch.empty(1, **f32)
    bf16 = x.dtype == torch.bfloat16
    _fp8_blockwise_kernel[_grid(M, K, bm, bk)](
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
