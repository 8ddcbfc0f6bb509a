"""MXFP4 reference quantizer, dequantizer and GEMM in pure PyTorch (imports only torch).

MXFP4 is the OCP Microscaling (MX) format v1.0 with E2M1 elements: blocks of 32 consecutive elements of the
LAST dim share one E8M0 scale (a bare power of two, 2^X, stored as the biased exponent X + 127). There is
no tensor scale. Per block, in this order (bf16 input is upcast to fp32 first):

    amax  = max |x_i|                                   (fp32)
    X     = floor(log2(amax)) - 2                       (2 = emax of E2M1: 6 = 1.5 * 2^2)
    X     = clamp(X, -127, 127)                         (the E8M0 range; only the lower clamp can bind)
    code  = X + 127                                     (stored uint8 scale, 0..252 for finite blocks)
    v_i   = x_i * 2^-X                                  (exact: a power-of-two scaling in fp32, see below)
    q_i   = e2m1_round(v_i)                             (RNE saturating at 6, or stochastic for gradients)

* floor(log2(amax)) is read EXACTLY from the fp32 exponent field e of amax (floor(log2) = e - 127 for a
  normal amax), so no transcendental function is involved: ``code = max(e - 2, 0)``. A subnormal or zero
  amax (e = 0) and e = 1 clamp to X = -127, code 0.
* All-zero block: X = -127 (code 0), i.e. the smallest scale, which is what the formula gives once
  log2(0) = -inf is clamped; every element is code 0.
* v_i = x_i * 2^-X with 2^-X = 2^(127 - code) in [2^-125, 2^127], a NORMAL fp32 power of two (the scale 2^X
  itself, 2^-127 for code 0, is an fp32 subnormal, so we never divide by it). The product is exact unless
  it falls below 2^-126 (only possible for elements far smaller than the block amax); such products are
  flushed to zero before rounding (``v_i = 0 if |v_i| < 2^-126``). RNE gives 0 for them anyway; for
  stochastic rounding the flush fixes their (tiny) round-up probability at 0 on every device, whether or
  not the hardware flushes subnormals.
* The code's sign follows x_i: a negative x_i that rounds to zero is code 8 (-0), an exact -0.0 is code 0
  (the NVFP4 convention, kernels/fp4_reference.py).
* amax / 2^X lies in [4, 8): elements in (6, 8) * 2^X saturate to 6 (the OCP spec's behaviour).

Non-finite policy: a block holding any NaN or +-Inf gets the E8M0 NaN scale 0xFF and all its codes are 0,
so dequantization (and any GEMM) of that block gives NaN. Other blocks are unaffected.

Stochastic rounding uses 8 random bits per element from the shared counter-based hash
(``nvfp4_train.kernels.fp4_reference.random_bits8``) of the element's linear index in the tensor being quantized.

Dequantization: ``e2m1(q) * 2^X`` in fp32, exact (2^-127 * 0.5 = 2^-128 is still an fp32 subnormal).

2-D mode (``block_2d=True``, for weights): one scale per 32x32 tile, from the tile amax, stored replicated
on each of the tile's 32 rows (the same [M, K/32] layout), so W (Fprop) and W^T (Dgrad) are bitwise the
same values: ``transpose_mxfp4_ref`` gives the quantization of x^T.

Layout: codes uint8 [M, K/2] (element 2j in the low nibble), scales uint8 [M, K/32].
Shapes: the last dim must be a multiple of 32 (and the first too in 2-D mode); otherwise ValueError.
Inputs: 2-D bf16 or fp32 tensors (non-contiguous is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvfp4_train.kernels._checks import check_2d_float
from nvfp4_train.kernels.fp4_layout import from_blocked, to_blocked
from nvfp4_train.kernels.fp4_reference import (
    e2m1_decode,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    pack_nibbles,
    random_bits8,
    unpack_nibbles,
)

BLOCK = 32
E2M1_EMAX = 2  # floor(log2(6))
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# X = floor(log2(amax)) - 2 is clamped to [-127, 127]: code 0 is the smallest scale 2^-127
E8M0_MIN_EXP = -127
FLT_MIN_NORMAL = 2.0**-126


@dataclass
class MXFP4Tensor:
    """A quantized 2-D tensor: blocks of 32 along the last dim.

    codes:  uint8 [M, K // 2], element 2j in the low nibble, 2j+1 in the high nibble.
    scales: uint8 [M, K // 32], E8M0: the block scale is 2^(scales - 127); 0xFF is NaN (replicated over
            the 32 rows of a tile in 2-D mode).
    block_2d: whether the scales are per 32x32 tile.
    swizzled: the scales are instead the 1-D buffer of the native FP4 GEMM's 128x4-tile layout
            (``kernels/fp4_layout.py``: ``to_blocked`` of the [M, K // 32] matrix, zero padding).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    block_2d: bool = False
    swizzled: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def rowmajor_scales(self) -> torch.Tensor:
        """The [M, K // 32] scale matrix whatever the layout (a new tensor when swizzled)."""
        if not self.swizzled:
            return self.scales
        m, k = self.shape
        return from_blocked(self.scales, m, k // BLOCK)


def check_input(x: torch.Tensor, block_2d: bool = False) -> None:
    """Validate what the quantizers accept (shared by the reference and the Triton path)."""
    check_2d_float(x, "MXFP4 quantization")
    if x.shape[1] % BLOCK != 0:
        raise ValueError(
            f"MXFP4 blocks are {BLOCK} elements along the last dim, but it has {x.shape[1]} elements "
            f"(shape {tuple(x.shape)}); pad the last dim to a multiple of {BLOCK}"
        )
    if block_2d and x.shape[0] % BLOCK != 0:
        raise ValueError(
            f"2-D MXFP4 scaling uses {BLOCK}x{BLOCK} tiles, but the first dim has {x.shape[0]} rows "
            f"(shape {tuple(x.shape)}); pad it to a multiple of {BLOCK}"
        )


def check_col_input(x: torch.Tensor) -> None:
    """The columnwise copy (x^T, blocks along the first dim of x) needs the first dim blocked too."""
    if x.shape[0] % BLOCK != 0:
        raise ValueError(
            f"the columnwise MXFP4 copy has blocks of {BLOCK} along the first dim, which has "
            f"{x.shape[0]} rows (shape {tuple(x.shape)}); pad the token dim to a multiple of {BLOCK}"
        )


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes -> fp32 2^(code - 127), built from bits (code 0 is the subnormal 2^-127); 0xFF -> NaN."""
    c = scales.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    bits = torch.where(c == E8M0_NAN, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


def block_amax_nonfinite(blocks: torch.Tensor, dims=-1) -> torch.Tensor:
    """max |x| over ``dims``, with NaN counted as +Inf (so a block with NaN or Inf gives +Inf)."""
    a = blocks.abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    return a.amax(dim=dims)


def e8m0_codes(blk_amax: torch.Tensor) -> torch.Tensor:
    """fp32 block amax (non-negative; +Inf for non-finite blocks) -> int32 E8M0 codes.

    code = clamp(floor(log2(amax)) - 2, -127, 127) + 127 = max(e - 2, 0), e the fp32 exponent field."""
    e = (blk_amax.contiguous().view(torch.int32) >> 23) & 0xFF
    code = torch.clamp(e - E2M1_EMAX, min=0)
    return torch.where(torch.isinf(blk_amax), torch.full_like(code, E8M0_NAN), code)


def inverse_scale(code: torch.Tensor) -> torch.Tensor:
    """2^-X = 2^(127 - code) as fp32 from bits, for finite codes (0..252: always a normal number)."""
    c = torch.clamp(code, max=253)  # NaN blocks: any finite stand-in, their codes are forced to 0
    return ((2 * E8M0_BIAS - c) << 23).to(torch.int32).view(torch.float32)


def quantize_mxfp4_ref(
    x: torch.Tensor, stochastic: bool = False, seed: int | torch.Tensor = 0, block_2d: bool = False,
    swizzled: bool = False,
) -> MXFP4Tensor:
    """Quantize a 2-D tensor to MXFP4 with blocks of 32 along the last dim, or 32x32 tiles (``block_2d``);
    see the module docstring. ``swizzled``: the scales in the native GEMM's layout (the same values)."""
    check_input(x, block_2d)
    m, k = x.shape
    x32 = x.to(torch.float32).contiguous()
    blocks = x32.view(m, k // BLOCK, BLOCK)
    if block_2d:
        tiles = block_amax_nonfinite(x32.view(m // BLOCK, BLOCK, k // BLOCK, BLOCK), (1, 3))
        blk_amax = tiles.repeat_interleave(BLOCK, dim=0)
    else:
        blk_amax = block_amax_nonfinite(blocks)
    code = e8m0_codes(blk_amax)
    v = blocks * inverse_scale(code).unsqueeze(-1)
    v = torch.where(v.abs() < FLT_MIN_NORMAL, torch.zeros_like(v), v).view(m, k)
    if stochastic:
        q = e2m1_round_stochastic(v, random_bits8(m, k, seed, device=x.device))
    else:
        q = e2m1_round_nearest(v)
    q = (q & 7) | ((x32 < 0).to(torch.uint8) << 3)
    nonfinite = (code == E8M0_NAN).repeat_interleave(BLOCK, dim=1)
    q = torch.where(nonfinite, torch.zeros_like(q), q)
    if swizzled:
        return MXFP4Tensor(codes=pack_nibbles(q), scales=to_blocked(code.to(torch.uint8)), block_2d=block_2d,
                           swizzled=True)
    return MXFP4Tensor(codes=pack_nibbles(q), scales=code.to(torch.uint8), block_2d=block_2d)


def swizzle_mxfp4(q: MXFP4Tensor) -> MXFP4Tensor:
    """``q`` with its scales in the native GEMM's layout (itself when they already are)."""
    if q.swizzled:
        return q
    return MXFP4Tensor(codes=q.codes, scales=to_blocked(q.scales), block_2d=q.block_2d, swizzled=True)


def transpose_mxfp4_ref(q: MXFP4Tensor) -> MXFP4Tensor:
    """The same quantized values, transposed ([K, M], blocks along M). Only for 2-D (32x32) scaling, where
    each tile's scale serves both orientations."""
    if not q.block_2d:
        raise ValueError("only 2-D (32x32) scaled MXFP4 tensors can be transposed without requantizing")
    if q.swizzled:
        raise ValueError("transpose_mxfp4_ref takes row-major scales; quantize with swizzled=False first")
    codes = pack_nibbles(unpack_nibbles(q.codes).t())
    tile = q.scales[::BLOCK, :]  # [M/32, K/32]
    scales = tile.t().contiguous().repeat_interleave(BLOCK, dim=0)  # [K, M/32]
    return MXFP4Tensor(codes=codes.contiguous(), scales=scales, block_2d=True)


def check_rowcol_modes(block_2d: bool, row_stochastic: bool, col_stochastic: bool) -> None:
    if block_2d and col_stochastic != row_stochastic:
        raise ValueError("2-D scaling gives one set of values for both orientations: "
                         "col_stochastic must equal row_stochastic")


def quantize_mxfp4_rowcol_ref(
    x: torch.Tensor,
    row_stochastic: bool = False,
    col_stochastic: bool = False,
    row_seed: int | torch.Tensor = 0,
    col_seed: int | torch.Tensor = 0,
    block_2d: bool = False,
    swizzled: bool = False,
) -> tuple[MXFP4Tensor, MXFP4Tensor]:
    """The two copies a linear layer needs from one [M, K] tensor: rowwise (blocks along K) and the
    columnwise copy of x^T ([K, M], blocks along M). In 2-D mode the columnwise copy is the rowwise copy
    transposed (the same values; ``col_seed`` is unused). ``swizzled``: both copies' scales in the native
    GEMM's layout."""
    check_input(x, block_2d)
    check_col_input(x)
    check_rowcol_modes(block_2d, row_stochastic, col_stochastic)
    row = quantize_mxfp4_ref(x, stochastic=row_stochastic, seed=row_seed, block_2d=block_2d)
    if block_2d:
        col = transpose_mxfp4_ref(row)
    else:
        col = quantize_mxfp4_ref(x.t(), stochastic=col_stochastic, seed=col_seed)
    if swizzled:
        return swizzle_mxfp4(row), swizzle_mxfp4(col)
    return row, col


def dequantize_mxfp4_ref(q: MXFP4Tensor) -> torch.Tensor:
    """``e2m1(q) * 2^X`` as float32 [M, K] (exact; NaN for blocks with the NaN scale)."""
    m, k = q.shape
    vals = e2m1_decode(unpack_nibbles(q.codes)).view(m, k // BLOCK, BLOCK)
    return (vals * e8m0_to_float32(q.rowmajor_scales()).unsqueeze(-1)).view(m, k)


def mxfp4_gemm_ref(a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``C = A[M, K] . B[N, K]^T`` (alpha = 1): both operands dequantized (exact), products summed in
    float64, the sum rounded to fp32 and then to ``out_dtype``."""
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"MXFP4 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    da = dequantize_mxfp4_ref(a).to(torch.float64)
    db = dequantize_mxfp4_ref(b).to(torch.float64)
    return (da @ db.t()).to(torch.float32).to(out_dtype)
