"""FP8 (E4M3) reference quantizers, dequantizer and GEMM in pure PyTorch (imports only torch).

Two scalings, both "current" (computed from the tensor being quantized, no history):

* per tensor (``block=None``): one fp32 scale for the whole tensor.
* blockwise, the paper's FP8 baseline (DeepSeek-V3 style): 1x128 blocks (128 consecutive elements of the
  last dim; activations and gradients) or 128x128 tiles (weights), one fp32 scale each.

Per block (the whole tensor for per-tensor scaling), in fp32, in this order (bf16 input upcast first):

    amax      = max |x_i|                       (NaN if the block holds any NaN or +-Inf, see below)
    s         = 448 / amax                      (encode scale, a correctly rounded fp32 division)
    s         = min(s, FLT_MAX)                 (a tiny amax overflows 448 / amax to +Inf)
    s         = 1         if amax == 0          (all-zero block: every element is +-0)
    scale_inv = 1 / s                           (stored decode scale, correctly rounded; may be subnormal)
    q_i       = e4m3_rne(clamp(x_i * s, -448, 448))

``q_i * scale_inv`` approximates x_i. The scales are plain fp32, NOT rounded to powers of two: that is the
paper's baseline ("FP32 scales"); Transformer Engine's Float8BlockScaling recipe defaults to power-of-two
scales instead (it truncates the mantissa of s; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 turns that off) and
clamps s to the input dtype's max where we clamp to FLT_MAX. x_i * s never exceeds 448 by more than a
rounding error (s is rounded 448 / amax), so the clamp only catches that; E4M3 rounding is RNE with
subnormals (multiples of 2^-9) kept. Signs: -0.0 and negative values that round to zero give 0x80.

Non-finite policy: a block (the tensor, for per-tensor scaling) holding any NaN or +-Inf gets amax = NaN,
hence s = scale_inv = NaN, and every element of it is the E4M3 NaN 0x7F; dequantization and GEMMs give NaN
for it (the trainer's non-finite check sees it). Other blocks are unaffected.

Tensor parallelism: per-tensor scaling can take a precomputed ``amax`` (``fp8_amax`` gives the raw one,
non-finite counted as +Inf so that a MAX all-reduce keeps it; +Inf or NaN follows the non-finite policy),
e.g. the MAX over the tensor-parallel group, so that the result does not depend on the TP size. Blockwise
scales are local to their block: they need nothing as long as shard boundaries fall on block boundaries.

Layout (``FP8Tensor``):
    data       float8_e4m3fn [M, K]
    scale_inv  float32: 0-d (per tensor), [M, K/128] (1x128), [M/128, K/128] (128x128). Only the logical
               shape is the contract: 1x128 scales are stored M-major (strides (1, M)), the layout cuBLAS
               reads, by both the reference and the Triton kernels.
    block      None, (1, 128) or (128, 128)
Shapes: blocked dims must be multiples of 128 (the last dim; both dims for 128x128); otherwise ValueError
(pad the tensor). Inputs: 2-D bf16 or fp32 tensors (non-contiguous is fine).

The columnwise copy a linear layer needs for Wgrad is x^T quantized in 1x128 blocks (blocks along M of x);
for 128x128 tiles (and per-tensor scaling) the transpose of the quantized tensor IS the quantization of
x^T, so W in Fprop and W^T in Dgrad are bitwise the same values.

GEMM: ``C[M, N] = sum_k A[m, k] B[n, k]`` with each operand dequantized per block. The emulation
dequantizes in float64 (``q * scale_inv`` is exact there: 4 + 24 significant bits), multiplies and sums in
float64, rounds the sum to fp32 and then to ``out_dtype``. Hopper's scaled GEMM sums each 128-long
K-block in its tensor-core accumulator, scales it, and accumulates in fp32: the same value up to
accumulation rounding (see ``kernels/fp8/gemm.py`` for the bound the GPU tests use).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from nvfp4_train.kernels._checks import check_2d_float

E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
BLOCK = 128
E4M3_NAN_BYTE = 0x7F
BLOCK_SHAPES = (None, (1, BLOCK), (BLOCK, BLOCK))


@dataclass
class FP8Tensor:
    """An E4M3 tensor with fp32 decode scales (see the module docstring for shapes and layouts)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1])

    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale_inv.numel()


def normalize_block(block) -> tuple[int, int] | None:
    """Accept None, (1, 128), (128, 128) (tuples or lists); anything else is a ValueError."""
    if block is None:
        return None
    # only integers: int() would truncate (1.5, 128) to (1, 128), and a bare int or a string is no shape
    ok = isinstance(block, (tuple, list)) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in block)
    b = tuple(int(v) for v in block) if ok else ()
    if b not in BLOCK_SHAPES:
        raise ValueError(
            f"FP8 block must be None (per tensor), (1, {BLOCK}) or ({BLOCK}, {BLOCK}); got {block!r}"
        )
    return b


def check_input(x: torch.Tensor, block) -> tuple[int, int] | None:
    """Validate what the quantizers accept (shared by the reference and the Triton path)."""
    block = normalize_block(block)
    check_2d_float(x, "FP8 quantization")
    m, k = x.shape
    if block is not None and k % BLOCK != 0:
        raise ValueError(
            f"FP8 {block[0]}x{block[1]} blocks need the last dim to be a multiple of {BLOCK}, but it has {k} "
            f"elements (shape {tuple(x.shape)}); pad the last dim to a multiple of {BLOCK}"
        )
    if block == (BLOCK, BLOCK) and m % BLOCK != 0:
        raise ValueError(
            f"FP8 {BLOCK}x{BLOCK} tiles need the first dim to be a multiple of {BLOCK}, but it has {m} rows "
            f"(shape {tuple(x.shape)}); pad it to a multiple of {BLOCK}"
        )
    return block


def check_col_input(x: torch.Tensor, block) -> None:
    """The columnwise 1x128 copy (x^T, blocks along the first dim of x) needs the first dim blocked too."""
    if normalize_block(block) == (1, BLOCK) and x.shape[0] % BLOCK != 0:
        raise ValueError(
            f"the columnwise FP8 copy has 1x{BLOCK} blocks along the first dim, which has {x.shape[0]} rows "
            f"(shape {tuple(x.shape)}); pad the token dim to a multiple of {BLOCK}"
        )


def amax_nonfinite(a: torch.Tensor, dims) -> torch.Tensor:
    """max |x| over ``dims`` of the already-absolute ``a``; NaN where any reduced element is NaN or Inf."""
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    m = a.amax(dim=dims)
    return torch.where(torch.isinf(m), torch.full_like(m, float("nan")), m)


def encode_decode_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, scale_inv) from a block amax, fp32, elementwise (NaN amax gives NaN scales)."""
    s = torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device) / amax
    s = torch.clamp(s, max=FLT_MAX)  # clamp keeps NaN
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return s, 1.0 / s


def e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> float8_e4m3fn, RNE, saturating at +-448; NaN -> 0x7F."""
    q = torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(v), torch.full_like(q, E4M3_NAN_BYTE), q)
    return q.view(torch.float8_e4m3fn)


def m_major(t: torch.Tensor) -> torch.Tensor:
    """The same [R, C] values stored column-major (strides (1, R)): the layout cuBLAS reads 1x128 scales in."""
    return t.t().contiguous().t()


def fp8_amax_ref(x: torch.Tensor) -> torch.Tensor:
    """The raw tensor amax, float32 0-d: max |x| with NaN and +-Inf counted as +Inf (0 for an empty
    tensor). MAX-all-reducible; the quantizers turn +Inf into the NaN of the non-finite policy."""
    x32 = x.to(torch.float32)
    if x32.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x32.abs()
    return torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a).amax()


def quantize_fp8_tensorwise_ref(x: torch.Tensor, amax: torch.Tensor | None = None) -> FP8Tensor:
    """Per-tensor current scaling: one fp32 scale from the tensor amax (``amax``: optional precomputed raw
    amax, e.g. all-reduced over tensor-parallel ranks; it must be what ``fp8_amax_ref`` gives for the whole
    tensor for the result to be the recipe's)."""
    check_input(x, None)
    check_amax_block(None, amax)
    x32 = x.to(torch.float32)
    if amax is None:
        amax = fp8_amax_ref(x32)
    amax = amax.to(torch.float32).reshape(())
    amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("nan")))
    s, scale_inv = encode_decode_scales(amax)
    return FP8Tensor(data=e4m3_rne(x32 * s).contiguous(), scale_inv=scale_inv, block=None)


def quantize_fp8_blockwise_ref(x: torch.Tensor, block=(1, BLOCK)) -> FP8Tensor:
    """Blockwise current scaling: 1x128 blocks along the last dim, or 128x128 tiles."""
    block = check_input(x, block)
    if block is None:
        return quantize_fp8_tensorwise_ref(x)
    m, k = x.shape
    x32 = x.to(torch.float32).contiguous()
    if block == (1, BLOCK):
        blocks = x32.view(m, k // BLOCK, BLOCK)
        s, scale_inv = encode_decode_scales(amax_nonfinite(blocks.abs(), -1))
        data = e4m3_rne(blocks * s.unsqueeze(-1)).view(m, k)
        return FP8Tensor(data=data, scale_inv=m_major(scale_inv), block=block)
    tiles = x32.view(m // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s, scale_inv = encode_decode_scales(amax_nonfinite(tiles.abs(), (1, 3)))
    data = e4m3_rne(tiles * s[:, None, :, None]).view(m, k)
    return FP8Tensor(data=data, scale_inv=scale_inv.contiguous(), block=block)


def check_amax_block(block, amax) -> None:
    if amax is not None and (not isinstance(amax, torch.Tensor) or amax.numel() != 1):
        got = f"shape {tuple(amax.shape)}" if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(f"amax must be a one-element tensor (the tensor amax, e.g. fp8_amax(x)), got {got}")
    if amax is not None and block is not None:
        raise ValueError(f"a precomputed amax is for per-tensor scaling (block=None), not {block} blocks, "
                         "whose scales come from their own block amax")


def quantize_fp8_ref(x: torch.Tensor, block=None, amax: torch.Tensor | None = None) -> FP8Tensor:
    """Per tensor (``block=None``, optional precomputed ``amax``) or blockwise."""
    block = normalize_block(block)
    check_amax_block(block, amax)
    if block is None:
        return quantize_fp8_tensorwise_ref(x, amax)
    return quantize_fp8_blockwise_ref(x, block)


def transpose_fp8_ref(q: FP8Tensor) -> FP8Tensor:
    """The same quantized values transposed ([K, M]). Only for per-tensor and 128x128 scaling, whose scales
    serve both orientations; a 1x128 tensor must be requantized from x^T instead (its blocks change)."""
    if q.block == (1, BLOCK):
        raise ValueError("a 1x128-blocked FP8 tensor cannot be transposed without requantizing; "
                         "quantize x.t() (or use quantize_fp8_rowcol) for the columnwise copy")
    data = q.data.t().contiguous()
    scale_inv = q.scale_inv if q.block is None else q.scale_inv.t().contiguous()
    return FP8Tensor(data=data, scale_inv=scale_inv, block=q.block)


def quantize_fp8_rowcol_ref(
    x: torch.Tensor, block=(1, BLOCK), amax: torch.Tensor | None = None
) -> tuple[FP8Tensor, FP8Tensor]:
    """The rowwise copy of x [M, K] and the columnwise copy (x^T [K, M]): for 1x128 blocks, x^T quantized in
    blocks along M; for 128x128 tiles and per-tensor scaling, the rowwise copy transposed (same values)."""
    block = check_input(x, block)
    check_col_input(x, block)
    row = quantize_fp8_ref(x, block, amax)
    if block == (1, BLOCK):
        return row, quantize_fp8_blockwise_ref(x.t(), block)
    return row, transpose_fp8_ref(row)


def expand_scale_inv(q: FP8Tensor) -> torch.Tensor:
    """The decode scale of every element, fp32 [M, K]."""
    m, k = q.shape
    if q.block is None:
        return q.scale_inv.to(torch.float32).reshape(1, 1).expand(m, k)
    sr, sc = q.block
    return q.scale_inv.to(torch.float32).repeat_interleave(sr, dim=0).repeat_interleave(sc, dim=1)


def dequantize_fp8_ref(q: FP8Tensor) -> torch.Tensor:
    """``q * scale_inv`` as float32 [M, K] (one correctly rounded fp32 product per element)."""
    return q.data.to(torch.float32) * expand_scale_inv(q)


def dequantize_fp8_f64(q: FP8Tensor) -> torch.Tensor:
    """``q * scale_inv`` as float64 [M, K]: exact (4 + 24 significant bits)."""
    return q.data.to(torch.float64) * expand_scale_inv(q).to(torch.float64)


def fp8_gemm_ref(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``C[M, N] = A[M, K] . B[N, K]^T`` with per-block scales: exact float64 dequantization, float64
    products and sums, rounded to fp32 and then to ``out_dtype``. Any pair of scalings is accepted."""
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"FP8 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    acc = dequantize_fp8_f64(a) @ dequantize_fp8_f64(b).t()
    return acc.to(torch.float32).to(out_dtype)
