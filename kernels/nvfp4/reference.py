"""NVFP4 reference quantizer, dequantizer and GEMM in pure PyTorch (imports only torch).

This file transcribes the arithmetic of the NVFP4 recipe (docs/recipe.md §2-3, after NVIDIA's paper and
Transformer Engine's reference quantizer) operation by operation, in fp32, in this order:

    amax   = max |x|                                   (whole tensor; of the Hadamard-mixed x when rht)
    S_enc  = 2688 / amax;  S_enc = min(S_enc, FLT_MAX);  if amax == 0 or S_enc == 0: S_enc = 1
    S_dec  = 1 / S_enc                                 (a true, correctly rounded division)
    c      = S_enc * fp32(1/6)                         (one product)
    sdec_b = e4m3_rne(min(blk_amax * c, 448))          (stored block scale; no lower clamp)
    enc_b  = min(1 / (fp32(sdec_b) * S_dec), FLT_MAX)
    q_i    = e2m1_round(x_i * enc_b)                   (RNE, or stochastic for gradients)

Blocks are 16 consecutive elements of the LAST dim (1x16), or 16x16 tiles (``block_2d``: one scale per
tile, stored replicated on each of the tile's 16 rows so the layout is the same [M, K/16]).

Random Hadamard Transform (``rht=True``): each 16 consecutive elements of the last dim are multiplied by
``H = diag(s) H16 / 4`` (Sylvester H16, the fixed sign vector s below) before quantizing. The product is
computed in fp32 as ``y = x * (s/4)`` (exact) followed by the four butterfly stages of the fast
Walsh-Hadamard transform (stride 1, 2, 4, 8; ``a+b`` and ``a-b``), then rounded to the input dtype (bf16
input -> bf16 values, as a bf16 matmul with fp32 accumulation would give). The butterfly fixes the fp32
summation order, so the Triton kernel reproduces it bit for bit; it equals the matmul whenever the fp32
partial sums are exact.

Non-finite policy: if any element of the tensor being quantized (after mixing) is NaN or +-Inf, ``amax`` is
NaN, every block scale is NaN (E4M3 0x7F) and every code is 0, so dequantization and GEMMs give NaN and
the trainer's non-finite check sees it. (A plain max would let +-Inf slip through as S_enc = 1.)

Shapes: the last dim must be a multiple of 16 (and the first of 16 in 2-D mode); otherwise ValueError.
Inputs: 2-D bf16 or fp32 tensors (non-contiguous is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvfp4_train.kernels._checks import check_2d_float
from nvfp4_train.kernels.fp4_layout import from_blocked, to_blocked
from nvfp4_train.kernels.fp4_reference import (
    FLT_MAX,
    RHT_SIGNS,
    e2m1_decode,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    pack_nibbles,
    random_bits8,
    round_to_dtype,
    unpack_nibbles,
)

BLOCK = 16
E4M3_MAX = 448.0
FP4_MAX = 6.0
# 6 * 448: the largest magnitude representable by E2M1 x E4M3
FP4_E4M3_RANGE = FP4_MAX * E4M3_MAX


@dataclass
class NVFP4Tensor:
    """A quantized 2-D tensor: blocks along the last dim.

    codes:  uint8 [M, K // 2], element 2j in the low nibble, 2j+1 in the high nibble.
    scales: torch.float8_e4m3fn [M, K // 16], the decode scale of each 1x16 block (replicated over the 16
            rows of a tile in 2-D mode).
    amax:   float32 0-d tensor, the tensor amax that sets the fp32 tensor scale (amax / (6*448)).
    block_2d: whether the scales are per 16x16 tile.
    swizzled: the scales are instead the 1-D buffer of the native FP4 GEMM's 128x4-tile layout
            (``kernels/fp4_layout.py``: ``to_blocked`` of the [M, K // 16] matrix, zero padding).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    block_2d: bool = False
    swizzled: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + 4

    def rowmajor_scales(self) -> torch.Tensor:
        """The [M, K // 16] scale matrix whatever the layout (a new tensor when swizzled)."""
        if not self.swizzled:
            return self.scales
        m, k = self.shape
        return from_blocked(self.scales, m, k // BLOCK)


def check_input(x: torch.Tensor, block_2d: bool) -> None:
    """Validate what the quantizers accept (shared by the reference and the Triton path)."""
    check_2d_float(x, "NVFP4 quantization")
    m, k = x.shape
    if k % BLOCK != 0:
        raise ValueError(
            f"NVFP4 blocks are {BLOCK} elements along the last dim, but it has {k} elements "
            f"(shape {tuple(x.shape)}); pad the last dim to a multiple of {BLOCK}"
        )
    if block_2d and m % BLOCK != 0:
        raise ValueError(
            f"2-D NVFP4 scaling uses {BLOCK}x{BLOCK} tiles, but the first dim has {m} rows "
            f"(shape {tuple(x.shape)}); pad it to a multiple of {BLOCK}"
        )


def check_amax(amax: torch.Tensor | None, name: str = "amax") -> None:
    """A supplied tensor amax is one number (0-d or one element), as ``nvfp4_amax(x)[0]`` gives."""
    if amax is not None and (not isinstance(amax, torch.Tensor) or amax.numel() != 1):
        got = f"shape {tuple(amax.shape)}" if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(f"{name} must be a one-element tensor (the tensor amax, e.g. nvfp4_amax(x)[0]), got {got}")


def hadamard16_ref(x: torch.Tensor) -> torch.Tensor:
    """Random Hadamard Transform of each 16 consecutive elements of the last dim; returns fp32 values
    rounded to ``x.dtype`` (see the module docstring for the exact order of operations)."""
    if x.shape[-1] % BLOCK != 0:
        raise ValueError(f"the Hadamard transform mixes groups of {BLOCK}; last dim is {x.shape[-1]}")
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device) * 0.25
    y = x.to(torch.float32).reshape(-1, BLOCK) * signs
    for h in (1, 2, 4, 8):
        y = y.view(-1, BLOCK // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
    y = y.reshape(x.shape)
    return round_to_dtype(y, x.dtype)


def hadamard16_matrix() -> torch.Tensor:
    """``diag(s) @ H16 / 4`` as an fp32 [16, 16] matrix (x_row @ this == the transform)."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return torch.diag(torch.tensor(RHT_SIGNS, dtype=torch.float32)) @ h / 4


def raw_amax(x32: torch.Tensor) -> torch.Tensor:
    """max |x| with NaN and +-Inf counted as +Inf: the form that can be all-reduced with MAX across ranks
    (the quantizers turn +Inf into the NaN amax of the non-finite policy)."""
    if x32.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x32.device)
    a = x32.abs().amax().to(torch.float32)
    return torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))


def nvfp4_amax_ref(x: torch.Tensor, col_rht: bool = False) -> torch.Tensor:
    """float32 [2]: the raw amax of x and of the columnwise copy (RHT(x^T) when ``col_rht``, else x^T)."""
    x32 = x.to(torch.float32)
    col = raw_amax(hadamard16_ref(x.t())) if col_rht else raw_amax(x32)
    return torch.stack((raw_amax(x32), col))


def nonfinite_amax(x32: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor; NaN if any element is NaN or +-Inf (the non-finite policy)."""
    if x32.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x32.device)
    amax = x32.abs().amax()
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("nan")))


def tensor_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) of RECIPE §2 from the tensor amax (fp32 0-d tensors)."""
    s_enc = torch.tensor(FP4_E4M3_RANGE, dtype=torch.float32, device=amax.device) / amax
    s_enc = torch.minimum(s_enc, torch.tensor(FLT_MAX, device=amax.device))
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    s_dec = 1.0 / s_enc
    return s_enc, s_dec


def e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-448, 448] (or NaN) -> float8_e4m3fn, round-to-nearest-even (subnormals kept)."""
    return v.to(torch.float8_e4m3fn)


def quantize_nvfp4_ref(
    x: torch.Tensor,
    block_2d: bool = False,
    rht: bool = False,
    stochastic: bool = False,
    seed: int | torch.Tensor = 0,
    amax: torch.Tensor | None = None,
    swizzled: bool = False,
) -> NVFP4Tensor:
    """Quantize a 2-D tensor to NVFP4 with blocks along the last dim.

    ``amax``: optional precomputed tensor amax (of the mixed values when ``rht``); it must equal what this
    function would compute for the result to be the recipe's. ``swizzled``: the scales in the native GEMM's
    layout (``NVFP4Tensor.swizzled``; the same values).
    """
    check_input(x, block_2d)
    check_amax(amax)
    m, k = x.shape
    x32 = (hadamard16_ref(x) if rht else x.to(torch.float32)).contiguous()
    if amax is None:
        amax = nonfinite_amax(x32)
    amax = amax.to(torch.float32).reshape(())
    # a supplied amax may carry a non-finite input as +Inf (what an all-reduced raw amax holds)
    amax = torch.where(torch.isinf(amax), torch.full_like(amax, float("nan")), amax)
    s_enc, s_dec = tensor_scales(amax)
    c = s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=x.device)

    blocks = x32.view(m, k // BLOCK, BLOCK)
    if block_2d:
        tiles = x32.view(m // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax(dim=(1, 3))
        blk_amax = tiles.repeat_interleave(BLOCK, dim=0)
    else:
        blk_amax = blocks.abs().amax(dim=-1)
    sdec = e4m3_rne(torch.clamp(blk_amax * c, max=E4M3_MAX))  # clamp keeps NaN
    enc = 1.0 / (sdec.to(torch.float32) * s_dec)
    enc = torch.clamp(enc, max=FLT_MAX)
    v = blocks * enc.unsqueeze(-1)
    v = v.view(m, k)
    if stochastic:
        codes = e2m1_round_stochastic(v, random_bits8(m, k, seed, device=x.device))
    else:
        codes = e2m1_round_nearest(v)
    if swizzled:
        return NVFP4Tensor(codes=pack_nibbles(codes), scales=to_blocked(sdec), amax=amax, block_2d=block_2d,
                           swizzled=True)
    return NVFP4Tensor(codes=pack_nibbles(codes), scales=sdec, amax=amax, block_2d=block_2d)


def dequantize_nvfp4_ref(q: NVFP4Tensor) -> torch.Tensor:
    """``q * fp32(sdec_b) * (amax / (6*448))`` as float32 [M, K]: the block values of ``_blockwise_values``, then
    the tensor scale."""
    return _blockwise_values(q) * decode_scale(q.amax)


def transpose_nvfp4_ref(q: NVFP4Tensor) -> NVFP4Tensor:
    """The same quantized values, transposed ([K, M], blocks along M). Only for 2-D (16x16) scaling, where
    each tile's scale serves both orientations: W in Fprop and W^T in Dgrad are bitwise the same values."""
    if not q.block_2d:
        raise ValueError("only 2-D (16x16) scaled tensors can be transposed without requantizing")
    if q.swizzled:
        raise ValueError("transpose_nvfp4_ref takes row-major scales; quantize with swizzled=False first")
    m, k = q.shape
    codes = pack_nibbles(unpack_nibbles(q.codes).t())
    tile = q.scales[::BLOCK, :]  # [M/16, K/16]
    scales = tile.t().contiguous().repeat_interleave(BLOCK, dim=0)  # [K, M/16]
    return NVFP4Tensor(codes=codes.contiguous(), scales=scales, amax=q.amax, block_2d=True)


def check_rowcol_input(x: torch.Tensor, block_2d: bool, col_rht: bool, row_stochastic: bool,
                       col_stochastic: bool) -> None:
    """Validate a row + column quantization request (shared by the reference and the Triton path)."""
    check_input(x, block_2d)
    if block_2d and (col_rht or col_stochastic != row_stochastic):
        raise ValueError("2-D scaling gives one set of values for both orientations: no col_rht, "
                         "and col_stochastic must equal row_stochastic")
    if x.shape[0] % BLOCK != 0:
        raise ValueError(
            f"the columnwise NVFP4 copy has blocks of {BLOCK} along the first dim, which has "
            f"{x.shape[0]} rows; pad the token dim to a multiple of {BLOCK}"
        )


def quantize_nvfp4_rowcol_ref(
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
    """The two copies a linear layer needs from one [M, K] tensor: the rowwise copy (blocks along K) and
    the columnwise copy of x^T ([K, M], blocks along M; Hadamard-mixed when ``col_rht``, its own amax).
    In 2-D mode the columnwise copy is the rowwise copy transposed (same values, same amax).

    ``row_amax`` / ``col_amax``: given amaxes (e.g. all-reduced over tensor-parallel ranks) replace the local
    ones. Without ``col_rht`` the columnwise copy holds x's own values, so a given ``row_amax`` is its amax too
    when ``col_amax`` is not given (x^T has the amax of x), as in the Triton path. ``swizzled``: both copies'
    scales in the native GEMM's layout."""
    check_rowcol_input(x, block_2d, col_rht, row_stochastic, col_stochastic)
    check_amax(row_amax, "row_amax")
    check_amax(col_amax, "col_amax")
    row = quantize_nvfp4_ref(x, block_2d=block_2d, stochastic=row_stochastic, seed=row_seed, amax=row_amax)
    if block_2d:
        col = transpose_nvfp4_ref(row)
    else:
        if col_amax is None and not col_rht:
            col_amax = row_amax
        col = quantize_nvfp4_ref(x.t(), rht=col_rht, stochastic=col_stochastic, seed=col_seed, amax=col_amax)
    if swizzled:
        return swizzle_nvfp4(row), swizzle_nvfp4(col)
    return row, col


def swizzle_nvfp4(q: NVFP4Tensor) -> NVFP4Tensor:
    """``q`` with its scales in the native GEMM's layout (itself when they already are)."""
    if q.swizzled:
        return q
    return NVFP4Tensor(codes=q.codes, scales=to_blocked(q.scales), amax=q.amax, block_2d=q.block_2d, swizzled=True)


def decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor decode scale ``amax / 2688``, a correctly rounded division on every device.

    The divisor is a tensor on ``amax``'s device, not a Python number: for a CPU-scalar divisor PyTorch's
    CUDA division multiplies by the rounded reciprocal instead (``x * fl(1/2688)``), which differs from
    ``fl(x / 2688)`` in the last bit for about a fifth of all inputs (measured on CPU: 224,411 of 10^6
    uniform draws) and made the H200's GEMM epilogue factor differ from the CPU reference's."""
    a = amax.to(torch.float32)
    return a / _range_on(a.device)


_RANGE_ON: dict[torch.device, torch.Tensor] = {}


def _range_on(device: torch.device) -> torch.Tensor:
    """2688 as an fp32 0-d tensor on ``device``, made once per device: ``torch.tensor(2688., device=cuda)``
    at every call would copy from host memory and synchronize the stream in the GEMM's hot path."""
    t = _RANGE_ON.get(device)
    if t is None:
        t = _RANGE_ON[device] = torch.full((), FP4_E4M3_RANGE, dtype=torch.float32, device=device)
    return t


def nvfp4_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    """The GEMM epilogue factor ``(amax_a / 2688) * (amax_b / 2688)`` (fp32), the product of the two
    tensor decode scales used by dequantization (each a correctly rounded division, ``decode_scale``)."""
    return decode_scale(amax_a) * decode_scale(amax_b)


def nvfp4_gemm_ref(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``C = alpha * (A_blocks @ B_blocks^T)``: A [M, K], B [N, K], both blocked along K.

    Each operand is dequantized without its tensor scale (``q * sdec_b``: exact in bf16 and fp32), the
    products are summed in float64 (the Triton kernel sums in fp32 in its own order; on inputs whose
    partial sums are exact the two agree bitwise), the sum is rounded to fp32, multiplied by ``alpha`` in
    fp32 and rounded to ``out_dtype``.
    """
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"NVFP4 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    da = _blockwise_values(a).to(torch.float64)
    db = _blockwise_values(b).to(torch.float64)
    acc = (da @ db.t()).to(torch.float32)
    return (acc * nvfp4_alpha(a.amax, b.amax)).to(out_dtype)


def _blockwise_values(q: NVFP4Tensor) -> torch.Tensor:
    """``q * fp32(sdec_b)`` as fp32 [M, K] (no tensor scale)."""
    m, k = q.shape
    vals = e2m1_decode(unpack_nibbles(q.codes)).view(m, k // BLOCK, BLOCK)
    return (vals * q.rowmajor_scales().to(torch.float32).unsqueeze(-1)).view(m, k)
