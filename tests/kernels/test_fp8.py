"""FP8 E4M3 with fp32 scales (per tensor, 1x128 blocks, 128x128 tiles): the reference against an independent
brute-force computation and its policies; the Triton quantizers bit for bit against the reference; the
GEMM emulation exact on exactly summable inputs; the cuBLAS scale layouts; and (``gpu``) torch's scaled_mm
against the emulation.

Unmarked tests: pure PyTorch on CPU. ``triton``: kernels under TRITON_INTERPRET=1 (CPU) or on CUDA.
``gpu``: CUDA only (``make test-gpu`` on the H200).
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.fp8 import (
    FP8Tensor,
    dequantize_fp8,
    fp8_amax,
    fp8_gemm,
    fp8_gemm_backend,
    quantize_fp8,
    quantize_fp8_blockwise,
    quantize_fp8_rowcol,
    quantize_fp8_tensorwise,
    transpose_fp8,
)
from nvfp4_train.kernels.fp8.gemm import native_blockwise_pair, scale_128x128_operand, scale_1x128_operand
from nvfp4_train.kernels.fp8.reference import (
    dequantize_fp8_ref,
    fp8_gemm_ref,
    m_major,
    quantize_fp8_blockwise_ref,
    quantize_fp8_ref,
    quantize_fp8_rowcol_ref,
    quantize_fp8_tensorwise_ref,
    transpose_fp8_ref,
)

FLT_MAX = torch.finfo(torch.float32).max
# the interpreter evaluates the kernels' intentional 448/0, inf*0 ... with numpy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
BLOCKS = [None, (1, 128), (128, 128)]
BLOCK_IDS = ["tensor", "1x128", "128x128"]


# ----------------------------------------------------------------------------------------------------------
# brute force: float64 arithmetic rounded to fp32 where the recipe rounds, nearest E4M3 by search
# ----------------------------------------------------------------------------------------------------------
def e4m3_positive_values() -> torch.Tensor:
    """The 127 finite non-negative E4M3 values, indexed by byte 0..126, from the format's definition."""
    vals = []
    for byte in range(127):
        e, m = byte >> 3, byte & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E4M3_POS = e4m3_positive_values()


def brute_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32-valued float64 tensor -> E4M3 bytes: nearest value, ties to the even byte, saturating at 448,
    sign from the sign bit, NaN -> 0x7F."""
    flat = y.reshape(-1)
    m = flat.abs().clamp(max=448.0)
    d = (m.unsqueeze(-1) - E4M3_POS).abs()
    best = d == d.min(dim=-1, keepdim=True).values
    even = (torch.arange(127) % 2 == 0).to(torch.int64)
    idx = (best.to(torch.int64) * (1 + even)).argmax(dim=-1)
    byte = idx | (torch.signbit(flat).to(torch.int64) << 7)
    byte = torch.where(torch.isnan(flat), torch.full_like(byte, 0x7F), byte)
    return byte.to(torch.uint8).view(y.shape)


def to_f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 to fp32 (correctly rounded; for one +, *, / of fp32 operands computed exactly or in
    float64 this double rounding is innocuous) and back to float64."""
    return t.to(torch.float32).to(torch.float64)


def brute_force_fp8(x: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes [M, K] uint8, scale_inv fp32 in the logical shape) from the recipe's definition."""
    x64 = x.to(torch.float32).to(torch.float64)
    m, k = x64.shape
    br, bc = (m, k) if block is None else block
    if block is None and x64.numel() == 0:
        return torch.zeros(m, k, dtype=torch.uint8), torch.ones(())
    tiles = x64.view(m // br, br, k // bc, bc)
    finite = torch.isfinite(tiles).all(dim=3).all(dim=1)
    amax = tiles.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(1, 3))
    s = to_f32(448.0 / amax)  # +Inf for amax = 0 or tiny
    s = torch.where(torch.isinf(s), torch.full_like(s, FLT_MAX), s)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    sinv = to_f32(1.0 / s)
    s = torch.where(finite, s, torch.full_like(s, float("nan")))
    sinv = torch.where(finite, sinv, torch.full_like(sinv, float("nan")))
    y = to_f32(tiles * s[:, None, :, None])  # the product of two fp32 values is exact in float64
    data = brute_e4m3(y).view(m, k)
    sinv = sinv.to(torch.float32)
    return data, (sinv.reshape(()) if block is None else sinv)


def same_f32(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal fp32 tensors, except that any NaN equals any NaN (the GPU's NaN payload differs)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb)) and bool(
        torch.equal(torch.where(na, 0.0, a).view(torch.int32), torch.where(nb, 0.0, b).view(torch.int32))
    )


def assert_same(got: FP8Tensor, ref: FP8Tensor) -> None:
    assert got.data.dtype == torch.float8_e4m3fn and got.scale_inv.dtype == torch.float32
    assert got.block == ref.block
    assert got.data.shape == ref.data.shape
    assert torch.equal(got.data.cpu().view(torch.uint8), ref.data.view(torch.uint8)), "E4M3 bytes differ"
    assert same_f32(got.scale_inv, ref.scale_inv), "scale_inv differs"


def check_brute(x: torch.Tensor, block) -> None:
    q = quantize_fp8_ref(x, block)
    data, sinv = brute_force_fp8(x, block)
    assert torch.equal(q.data.view(torch.uint8), data), "E4M3 bytes differ from the brute force"
    assert same_f32(q.scale_inv, sinv), "scale_inv differs from the brute force"


def random_tensor(gen: torch.Generator, shape, dtype=torch.float32, spread: float = 2.0) -> torch.Tensor:
    """Normal values; rows and 128-column groups get independent magnitudes e^(spread * N(0,1))."""
    m, k = shape
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * spread)
    cols = torch.exp(torch.randn(1, (k + 127) // 128, generator=gen) * spread).repeat_interleave(128, dim=1)
    return (x * cols[:, :k]).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# edge-case inputs
# ----------------------------------------------------------------------------------------------------------
def f32_next(v: float, toward: float) -> float:
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(toward, dtype=torch.float32)).item()


def ties_tensor() -> torch.Tensor:
    """[128, 256]: every block has amax 448 (s = 1 exactly), and holds the midpoints between consecutive
    E4M3 values (normal and subnormal), the values one fp32 ulp beside them, both signs."""
    mids = ((E4M3_POS[1:] + E4M3_POS[:-1]) / 2).to(torch.float32)
    vals = []
    for t in mids.tolist():
        vals += [t, -t, f32_next(t, 0.0), -f32_next(t, 1e9)]
    flat = torch.tensor(vals)
    x = torch.empty(128, 256)
    for r in range(128):
        x[r] = flat.roll(3 * r)[:256]
    x[:, 0] = 448.0
    x[:, 128] = -448.0
    return x


def saturation_tensor() -> torch.Tensor:
    """Blocks whose amax makes amax * fp32(448 / amax) round above 448 (the clamp catches it), found by
    search, plus blocks where x * s lands just beside 448 and 464 (the rounding boundary to NaN)."""
    found = []
    a = torch.tensor(1.0, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    while len(found) < 64:
        cand = (torch.rand(4096, generator=g) * 1000 + 1e-3).to(torch.float32)
        s = (448.0 / cand.double()).float()
        over = (cand.double() * s.double()).float() > 448.0
        found += cand[over].tolist()
    x = torch.randn(128, 256, generator=g)
    for r in range(64):
        x[r, 5] = found[r]
        x[r, 200] = -found[r]
    x[64:, 0] = 448.0
    x[64:, 1:6] = torch.tensor([f32_next(448.0, 0), 447.0, 463.99, -447.99, 440.0])
    return x


def subnormal_tensor(gen: torch.Generator) -> torch.Tensor:
    """fp32 subnormal inputs (s clamps to FLT_MAX), block amaxes that make scale_inv = 1/s subnormal
    (amax < 448 * 2^-126), and E4M3 subnormal outputs (elements far below the block amax)."""
    x = torch.randn(128, 384, generator=gen)
    x[:32, :128] *= 1e-40  # subnormal fp32 inputs
    x[32:64, :128] *= 2e-37  # amax ~ 5e-37 .. 1e-36: s ~ 1e39 > FLT_MAX? no: s ~ 4e38..1e39
    x[64:96, :128] = torch.rand(32, 128, generator=gen) * 3e-36  # s ~ 1.5e38 .. 3e38: scale_inv ~ 3e-39
    x[:, 128:256] *= 2.0**-12  # E4M3 subnormal range after scaling, next to ...
    x[:, 128] = 448.0  # ... an amax of 448
    return x


def nonfinite_tensor(gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(128, 384, generator=gen)
    x[0, 5] = float("nan")
    x[1, 140] = float("inf")
    x[2, 300] = float("-inf")
    x[3, 0:128] = float("nan")
    return x


def outlier_tensor(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(128, 256, generator=gen)
    x[77, 13] = 3e4 if dtype == torch.bfloat16 else 1e30
    return x.to(dtype)


EDGE_CASES = {
    "zeros": lambda g: torch.zeros(128, 256),
    "negative_zeros": lambda g: -torch.zeros(128, 128),
    "zero_blocks": lambda g: torch.cat([torch.zeros(128, 128), torch.randn(128, 256, generator=g)], dim=1),
    "ties": lambda g: ties_tensor(),
    "saturation": lambda g: saturation_tensor(),
    "subnormal": subnormal_tensor,
    "subnormal_bf16": lambda g: (torch.randn(128, 128, generator=g) * 1e-39).bfloat16(),
    "outlier_fp32": lambda g: outlier_tensor(g, torch.float32),
    "outlier_bf16": lambda g: outlier_tensor(g, torch.bfloat16),
    "huge": lambda g: (torch.rand(128, 256, generator=g) * 2 - 1) * 3.4e38,
    "nonfinite": nonfinite_tensor,
}


# ----------------------------------------------------------------------------------------------------------
# reference (CPU)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_brute_force(gen, block, dtype):
    shape = (256, 384) if block == (128, 128) else (37, 256)
    check_brute(random_tensor(gen, shape, dtype), block)


@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_reference_edge_cases_match_brute_force(gen, case, block):
    check_brute(EDGE_CASES[case](gen), block)


def test_ties_round_to_even():
    x = torch.zeros(1, 128)
    # s = 1 (amax 448): 0.5 ulp ties between E4M3 neighbours; subnormal grid 2^-9
    vals = [448.0, 1.0625, 1.1875, 17.0, 240.0, 2.0**-10, 3 * 2.0**-10, -1.0625, 416.0, -0.0]
    x[0, : len(vals)] = torch.tensor(vals)
    q = quantize_fp8_blockwise_ref(x).data.to(torch.float32)[0, : len(vals)].tolist()
    assert q == [448.0, 1.0, 1.25, 16.0, 240.0, 0.0, 2 * 2.0**-9, -1.0, 416.0, -0.0]
    assert quantize_fp8_blockwise_ref(x).data.view(torch.uint8)[0, 9].item() == 0x80  # -0.0 keeps its sign


def test_scales_are_fp32_not_powers_of_two():
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 128] = 3.0, 0.0
    q = quantize_fp8_blockwise_ref(x)
    s = torch.tensor(448.0) / torch.tensor(3.0)
    assert q.scale_inv[0, 0].item() == (1.0 / s).item() and q.scale_inv[0, 1].item() == 1.0
    assert q.data.to(torch.float32)[0, 0].item() == 448.0


def test_nonfinite_policy(gen):
    x = nonfinite_tensor(gen)
    q = quantize_fp8_blockwise_ref(x, (1, 128))
    bad = ~torch.isfinite(x).view(128, 3, 128).all(dim=-1)
    assert torch.equal(torch.isnan(q.scale_inv), bad)
    data = q.data.view(torch.uint8).view(128, 3, 128)
    assert data[bad].eq(0x7F).all() and not data[~bad].bitwise_and(0x7F).eq(0x7F).any()
    d = dequantize_fp8_ref(q).view(128, 3, 128)
    assert torch.isnan(d[bad]).all() and torch.isfinite(d[~bad]).all()
    qt = quantize_fp8_tensorwise_ref(x)
    assert torch.isnan(qt.scale_inv) and qt.data.view(torch.uint8).eq(0x7F).all()
    q2 = quantize_fp8_blockwise_ref(x, (128, 128))
    assert torch.equal(torch.isnan(q2.scale_inv), torch.tensor([[True, True, True]]))


def test_zero_blocks_get_unit_scale_and_zero_bytes():
    x = torch.zeros(128, 256)
    x[:, 128:] = -0.0
    x[3, 200] = 1.0
    for block in BLOCKS:
        q = quantize_fp8_ref(x, block)
        if block == (1, 128):
            assert q.scale_inv[:, 0].eq(1.0).all()
        b = q.data.view(torch.uint8)
        assert b[:, :128].eq(0).all() and b[:, 128:].bitwise_and(0x7F).eq(0).sum() == 128 * 128 - 1


def test_dequantize_is_data_times_scale_and_error_bounded(gen):
    x = random_tensor(gen, (128, 256))
    for block in BLOCKS:
        q = quantize_fp8_ref(x, block)
        d = dequantize_fp8(q)
        sinv = q.scale_inv.to(torch.float64)
        if block is None:
            full = sinv.expand(128, 256)
        else:
            full = sinv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        assert torch.equal(d, (q.data.to(torch.float64) * full).to(torch.float32))
        # |q - x s| <= 2^-4 |x s| (normal E4M3, 3 mantissa bits) or <= 2^-10 (subnormal spacing 2^-9 / 2);
        # scaling by scale_inv ~ 1/s (relative error 2^-24 each for 1/s, s and the product) keeps it
        err = (d.double() - x.double()).abs()
        bound = (2.0**-4 * x.double().abs() + 2.0**-10 * full) * (1 + 2.0**-20)
        assert (err <= bound).all()


def test_transpose_is_the_quantized_transpose(gen):
    """128x128 tiles and per-tensor scales serve both orientations: W in Fprop and W^T in Dgrad are the
    same values (quantizing x^T gives the transpose of quantizing x)."""
    x = random_tensor(gen, (256, 384))
    for block in (None, (128, 128)):
        assert_same(transpose_fp8(quantize_fp8_ref(x, block)), quantize_fp8_ref(x.t().contiguous(), block))
    with pytest.raises(ValueError, match="requantiz"):
        transpose_fp8_ref(quantize_fp8_blockwise_ref(x))


def test_rowcol_reference(gen):
    x = random_tensor(gen, (256, 384))
    row, col = quantize_fp8_rowcol_ref(x, (1, 128))
    assert_same(row, quantize_fp8_blockwise_ref(x))
    assert_same(col, quantize_fp8_blockwise_ref(x.t().contiguous()))
    assert row.scale_inv.shape == (256, 3) and row.scale_inv.stride() == (1, 256)  # M-major, as cuBLAS reads
    assert col.scale_inv.shape == (384, 2) and col.scale_inv.stride() == (1, 384)


@pytest.mark.parametrize(
    "shape,block,match",
    [
        ((4, 100), (1, 128), "pad the last dim to a multiple of 128"),
        ((100, 128), (128, 128), "pad it to a multiple of 128"),
        ((2, 3, 128), None, "2-D"),
        ((4, 128), (1, 64), "block must be"),
    ],
)
def test_bad_shapes_raise(shape, block, match):
    with pytest.raises(ValueError, match=match):
        quantize_fp8(torch.zeros(shape), block)


def test_bad_dtype_and_rowcol_shape_raise():
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        quantize_fp8_tensorwise(torch.zeros(4, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="pad the token dim to a multiple of 128"):
        quantize_fp8_rowcol(torch.zeros(100, 128), (1, 128))


def test_tensorwise_precomputed_amax_makes_shards_agree(gen):
    """Tensor parallelism: shards quantized with the MAX of their raw amaxes are slices of the whole
    tensor's quantization (what ``amax_group`` computes with an all-reduce)."""
    x = random_tensor(gen, (64, 256))
    x[5, 7] = float("inf")
    xs = x[:, 128:]  # finite columns
    whole = quantize_fp8_tensorwise_ref(xs)
    amax = torch.maximum(fp8_amax(xs[:32]), fp8_amax(xs[32:]))
    for i in range(2):
        q = quantize_fp8(xs[32 * i : 32 * (i + 1)], None, amax=amax)
        assert torch.equal(q.data.view(torch.uint8), whole.data.view(torch.uint8)[32 * i : 32 * (i + 1)])
        assert same_f32(q.scale_inv, whole.scale_inv)
    # a non-finite element anywhere makes the raw amax +Inf and every shard NaN (the non-finite policy)
    amax = torch.maximum(fp8_amax(x[:32]), fp8_amax(x[32:]))
    assert amax.item() == float("inf")
    q = quantize_fp8(x[32:], None, amax=amax)
    assert torch.isnan(q.scale_inv) and q.data.view(torch.uint8).eq(0x7F).all()
    with pytest.raises(ValueError, match="per-tensor scaling"):
        quantize_fp8(x, (1, 128), amax=amax)


def test_amax_group_all_reduces(tmp_path, gen):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        x = random_tensor(gen, (32, 256))
        for q, ref in (
            (quantize_fp8(x, None, amax_group=dist.group.WORLD), quantize_fp8_tensorwise_ref(x)),
            (quantize_fp8_rowcol(x, None, amax_group=dist.group.WORLD)[1], transpose_fp8_ref(quantize_fp8_ref(x))),
            (quantize_fp8(x, (1, 128), amax_group=dist.group.WORLD), quantize_fp8_blockwise_ref(x)),
        ):
            assert_same(q, ref)
    finally:
        dist.destroy_process_group()


def test_tensorwise_any_shape(gen):
    x = random_tensor(gen, (7, 50))
    check_brute(x, None)
    assert quantize_fp8_tensorwise_ref(x).scale_inv.shape == ()


# ---- GEMM emulation --------------------------------------------------------------------------------------
def summable_operand(gen: torch.Generator, rows: int, k: int, block, lim: int = 8) -> FP8Tensor:
    """Integer E4M3 data in [-lim, lim] and power-of-two scales 2^-2..2^2 (varying per block): for lim = 8
    and K <= 640 every product and partial sum is a multiple of 2^-4 below 2^20, exact in fp32; the only
    rounding is to the out dtype. (lim = 4 keeps each 128-long block sum below 2^11, exact even in a
    reduced-precision tensor-core accumulator.)"""
    data = torch.randint(-lim, lim + 1, (rows, k), generator=gen).to(torch.float32).to(torch.float8_e4m3fn)
    if block is None:
        shape = ()
    elif block == (1, 128):
        shape = (rows, k // 128)
    else:
        shape = (rows // 128, k // 128)
    scale = torch.exp2(torch.randint(-2, 3, shape, generator=gen).to(torch.float32))
    return FP8Tensor(data=data, scale_inv=m_major(scale) if block == (1, 128) else scale, block=block)


def gemm_by_kblocks(a: FP8Tensor, b: FP8Tensor) -> torch.Tensor:
    """Independent computation: per 128-long K block, an integer GEMM of the E4M3 integers times the
    block scales, summed over blocks (exact for summable operands)."""
    (m, k), n = a.shape, b.shape[0]

    def scale_at(q: FP8Tensor, rows: int) -> torch.Tensor:  # [rows, K/128] float64
        s = q.scale_inv.to(torch.float64)
        if q.block is None:
            return s.reshape(1, 1).expand(rows, k // 128)
        if q.block == (128, 128):
            return s.repeat_interleave(128, dim=0)
        return s

    sa, sb = scale_at(a, m), scale_at(b, n)
    ia, ib = a.data.to(torch.float32).to(torch.int64), b.data.to(torch.float32).to(torch.int64)
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(k // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        out += (ia[:, cols] @ ib[:, cols].t()).to(torch.float64) * sa[:, kb : kb + 1] * sb[:, kb].unsqueeze(0)
    return out


PAIRS = [((1, 128), (128, 128)), ((1, 128), (1, 128)), ((128, 128), (1, 128)), ((128, 128), (128, 128)),
         (None, None), (None, (1, 128)), ((1, 128), None)]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace(" ", ""))
def test_gemm_ref_exact_on_summable_inputs(gen, pair):
    a = summable_operand(gen, 256, 640, pair[0])
    b = summable_operand(gen, 128, 640, pair[1])
    want = gemm_by_kblocks(a, b)
    assert torch.equal(fp8_gemm_ref(a, b, torch.float32), want.to(torch.float32))
    assert torch.equal(fp8_gemm_ref(a, b, torch.bfloat16), want.to(torch.float32).to(torch.bfloat16))
    assert torch.equal(fp8_gemm(a, b, torch.float32), want.to(torch.float32))  # CPU: the emulation
    assert fp8_gemm_backend(a, b) == "emulated_fp64"


def test_gemm_errors(gen):
    a = summable_operand(gen, 128, 256, (1, 128))
    with pytest.raises(ValueError, match="reduction dims differ"):
        fp8_gemm(a, summable_operand(gen, 128, 384, (1, 128)))
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend"):
        fp8_gemm(a, a, backend="fast")
    with pytest.raises(TypeError, match="FP8Tensor"):
        fp8_gemm(a, a.data)


def test_gemm_linear_layer_forms(gen):
    """Fprop y = x W^T, Dgrad dx = dy W, Wgrad dW = dy^T x with the recipe's operands (x and dy 1x128
    rowwise and columnwise, W in 128x128 tiles, W^T its transpose) equal the products of the fp32
    dequantized operands within their rounding: each fp32 factor is within 2^-24 relative of the exact
    one, so |ref - fp32 product| <= 3 * 2^-24 * sum |a b| (two factors + the fp32 output rounding)."""
    x, w, dy = random_tensor(gen, (128, 256)), random_tensor(gen, (128, 256)), random_tensor(gen, (128, 128))
    xr, xc = quantize_fp8_rowcol_ref(x, (1, 128))
    wq = quantize_fp8_blockwise_ref(w, (128, 128))
    wt = transpose_fp8_ref(wq)
    dyr, dyc = quantize_fp8_rowcol_ref(dy, (1, 128))
    assert wt.shape == (256, 128) and xc.shape == (256, 128) and dyc.shape == (128, 128)

    def f(q: FP8Tensor) -> torch.Tensor:
        return dequantize_fp8_ref(q).double()

    for a, b in ((xr, wq), (dyr, wt), (dyc, xc)):
        got = fp8_gemm_ref(a, b, torch.float32).double()
        want = f(a) @ f(b).t()
        tol = 3 * 2.0**-24 * (f(a).abs() @ f(b).abs().t()) + 1e-40
        assert ((got - want).abs() <= tol).all()


# ---- cuBLAS scale layouts (checked on CPU against torch's documented acceptance rules) --------------------
def _cublas_read(q: FP8Tensor, scale: torch.Tensor, form: str, rows: int, k: int) -> torch.Tensor:
    """Per-element decode scale [rows, K] as cuBLAS reads the array passed to scaled_mm."""
    kb = k // 128
    if form == "1x128":  # [rows, Kb]: element (r, kb)
        per_block = scale[:, :kb]
        return per_block.repeat_interleave(128, dim=1)
    per_tile = scale[:kb, :].t()  # [Kp, rows/128]: element (kb, r // 128)
    return per_tile.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)


def _check_torch_layout_rules(scale: torch.Tensor, form: str, rows: int, k: int) -> None:
    """The shape/stride conditions of ATen's _scaled_block{1x128,128x128}_* (ScaledBlas.cpp)."""
    kb = k // 128
    kp = (kb + 3) // 4 * 4
    assert scale.dtype == torch.float32
    if form == "1x128":
        assert scale.shape == (rows, kb)
        assert scale.stride(0) == 1 and (scale.stride(1) == rows or (kb == 1 and scale.stride(1) == 1))
    else:
        assert scale.shape == (kp, rows // 128)
        assert scale.stride(0) == 1 and (scale.stride(1) == kp or (rows // 128 == 1 and scale.stride(1) == 1))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace(" ", ""))
@pytest.mark.parametrize("k", [512, 640, 128])
def test_scaled_mm_scale_layouts(gen, pair, k):
    if pair == (None, None):
        pytest.skip("per-tensor operands use tensorwise _scaled_mm (0-d scales)")
    a = summable_operand(gen, 256, k, pair[0])
    b = summable_operand(gen, 384, k, pair[1])
    form_a, form_b = native_blockwise_pair(a, b)
    sa = scale_128x128_operand(a) if form_a == "128x128" else scale_1x128_operand(a)
    sb = scale_128x128_operand(b) if form_b == "128x128" else scale_1x128_operand(b)
    _check_torch_layout_rules(sa, form_a, 256, k)
    _check_torch_layout_rules(sb, form_b, 384, k)
    ea = a.data.double() * _cublas_read(a, sa, form_a, 256, k).double()
    eb = b.data.double() * _cublas_read(b, sb, form_b, 384, k).double()
    assert torch.equal((ea @ eb.t()).float(), fp8_gemm_ref(a, b, torch.float32))


@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[2], PAIRS[5]], ids=lambda p: f"{p[0]}x{p[1]}".replace(" ", ""))
def test_rowwise_per_kblock_fallback_logic_on_cpu(gen, pair):
    """The fallback's slicing and per-block scales, run through torch's CPU _scaled_mm (rowwise) where the
    installed torch has it: exact on summable inputs."""
    a = summable_operand(gen, 128, 384, pair[0], lim=4)
    b = summable_operand(gen, 256, 384, pair[1], lim=4)
    try:
        got = fp8_gemm(a, b, torch.bfloat16, backend="scaled_mm_rowwise_per_kblock")
    except (RuntimeError, NotImplementedError, ValueError) as e:
        pytest.skip(f"this torch has no CPU rowwise _scaled_mm: {e}")
    assert torch.equal(got, fp8_gemm_ref(a, b, torch.bfloat16))


def test_backend_probe_falls_back_with_a_warning(gen):
    """The capability probe: a form torch refuses (blockwise scaling on CPU) is reported unusable, with a
    warning naming it, and the answer is cached."""
    from nvfp4_train.kernels.fp8 import gemm as G

    key = ("scaled_mm_blockwise", "cpu", "1x128", "128x128", "test", torch.bfloat16)
    G._probe_cache.pop(key, None)
    with pytest.warns(UserWarning, match="scaled_mm_blockwise"):
        assert not G._probe("scaled_mm_blockwise", key, (1, 128), (128, 128), 512, torch.bfloat16, "cpu")
    assert G._probe_cache[key] is False
    G._probe_cache.pop(key)


# ----------------------------------------------------------------------------------------------------------
# Triton quantizers vs reference, bit for bit
# ----------------------------------------------------------------------------------------------------------
def check_kernels(x: torch.Tensor, device: str) -> None:
    xd = x.to(device)
    m, k = x.shape
    for block in BLOCKS:
        if block is not None and k % 128:
            continue
        if block == (128, 128) and m % 128:
            continue
        assert_same(quantize_fp8(xd, block), quantize_fp8_ref(x, block))
        if block != (1, 128) or m % 128 == 0:
            row, col = quantize_fp8_rowcol(xd, block)
            rref, cref = quantize_fp8_rowcol_ref(x, block)
            assert_same(row, rref)
            assert_same(col, cref)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 256), (256, 384), (128, 128), (7, 50), (130, 640)])
def test_kernels_random_odd_shapes(triton_device, gen, dtype, shape):
    check_kernels(random_tensor(gen, shape, dtype), triton_device)


@pytest.mark.triton
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_kernels_edge_cases(triton_device, gen, case):
    check_kernels(EDGE_CASES[case](gen), triton_device)


@pytest.mark.triton
def test_kernels_non_contiguous_input(triton_device, gen):
    base = random_tensor(gen, (384, 256))
    xt = base.to(triton_device).t()  # [256, 384], strides (1, 256)
    for block in BLOCKS:
        assert_same(quantize_fp8(xt, block), quantize_fp8_ref(base.t(), block))
        row, col = quantize_fp8_rowcol(xt, block)
        rref, cref = quantize_fp8_rowcol_ref(base.t(), block)
        assert_same(row, rref)
        assert_same(col, cref)
    sl = random_tensor(gen, (128, 512), torch.bfloat16).to(triton_device)[:, ::2]  # stride 2 along K
    assert_same(quantize_fp8_blockwise(sl), quantize_fp8_blockwise_ref(sl.cpu()))


@pytest.mark.triton
def test_kernels_precomputed_amax(triton_device, gen):
    x = random_tensor(gen, (64, 256))
    xd = x.to(triton_device)
    assert fp8_amax(xd).cpu().item() == x.abs().max().item()
    amax = fp8_amax(x) * 2  # a larger (e.g. all-reduced) amax
    assert_same(quantize_fp8(xd, None, amax=amax.to(triton_device)), quantize_fp8_ref(x, None, amax=amax))
    row, col = quantize_fp8_rowcol(xd, None, amax=amax.to(triton_device))
    rref, cref = quantize_fp8_rowcol_ref(x, None, amax=amax)
    assert_same(row, rref)
    assert_same(col, cref)
    bad = torch.tensor(float("inf"))
    assert_same(quantize_fp8(xd, None, amax=bad.to(triton_device)), quantize_fp8_ref(x, None, amax=bad))
    x[3, 3] = float("nan")
    assert fp8_amax(x.to(triton_device)).cpu().item() == float("inf")


@pytest.mark.triton
def test_kernel_scale_layout_is_m_major(triton_device, gen):
    x = random_tensor(gen, (256, 384)).to(triton_device)
    row, col = quantize_fp8_rowcol(x, (1, 128))
    assert row.scale_inv.shape == (256, 3) and row.scale_inv.stride() == (1, 256)
    assert col.scale_inv.shape == (384, 2) and col.scale_inv.stride() == (1, 384)


# ----------------------------------------------------------------------------------------------------------
# the grouped kernel of both 1x128 copies (kernels/fp8/quantize.py: _fp8_rowcol_grouped_kernel) and its scale table
# ----------------------------------------------------------------------------------------------------------
def grouped_rowcol(x: torch.Tensor, chunk_m: int = 64) -> tuple[FP8Tensor, FP8Tensor]:
    from nvfp4_train.kernels.fp8.quantize import quantize_fp8_blockwise_triton

    rd, rs, cd, cs = quantize_fp8_blockwise_triton(x, (1, 128), write_row=True, write_col=True, chunk_m=chunk_m)
    e4m3 = torch.float8_e4m3fn
    return FP8Tensor(rd.view(e4m3), rs, (1, 128)), FP8Tensor(cd.view(e4m3), cs, (1, 128))


def check_grouped(x: torch.Tensor, device: str, chunk_m: int = 64) -> None:
    row, col = grouped_rowcol(x.to(device), chunk_m)
    rref, cref = quantize_fp8_rowcol_ref(x, (1, 128))
    assert_same(row, rref)
    assert_same(col, cref)
    assert row.scale_inv.stride() == (1, x.shape[0]) and col.scale_inv.stride() == (1, x.shape[1])  # M-major


def test_scale_table_is_the_recipe_for_every_bf16_amax():
    """Entry j of the grouped kernel's table: the block scale s (low 32 bits) and scale_inv (high 32 bits) of the
    block amax whose bf16 magnitude bits are j, against the recipe computed in float64 (s = fp32(448 / amax),
    FLT_MAX where that overflows, 1 for amax = 0, scale_inv = fp32(1 / s)); NaN for the Inf and NaN patterns."""
    from nvfp4_train.kernels.fp8.quantize import fp8_scale_table

    tab = fp8_scale_table(torch.device("cpu"))
    assert tab.dtype == torch.int64 and tab.shape == (1 << 15,)
    pair = tab.view(torch.float32).view(-1, 2)
    amax = (torch.arange(1 << 15, dtype=torch.int32) << 16).view(torch.float32).double()
    finite = torch.isfinite(amax)
    s = to_f32(448.0 / amax)
    s = torch.where(torch.isinf(s), torch.full_like(s, FLT_MAX), s)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    sinv = to_f32(1.0 / s)
    nan = torch.full_like(s, float("nan"))
    assert same_f32(pair[:, 0], torch.where(finite, s, nan).float())
    assert same_f32(pair[:, 1], torch.where(finite, sinv, nan).float())
    assert int(finite.sum()) == 0x7F80 and bool((pair[0x7F80:].isnan()).all())  # Inf and every NaN pattern


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(set(EDGE_CASES) - {"subnormal_bf16", "outlier_bf16", "outlier_fp32"}))
def test_grouped_kernel_edge_cases(triton_device, gen, case, dtype):
    """Both 1x128 copies from the grouped kernel bit for bit against the reference: fp32 input (scales by
    division) and bf16 input (scales from the table) on every edge case (ties, saturation, subnormal inputs and
    scales, zero and non-finite blocks)."""
    check_grouped(EDGE_CASES[case](gen).to(dtype), triton_device)


@pytest.mark.triton
def test_grouped_kernel_random_chunks_and_strides(triton_device, gen, monkeypatch):
    """Rows and 128-column groups of independent magnitudes, in chunks of 64 (the default), 128 (one step) and 32
    rows, an outlier per dtype, a transposed (non-contiguous) input, and bf16 input with the table absent
    (division)."""
    from nvfp4_train.kernels.fp8 import quantize as Q

    x = random_tensor(gen, (256, 384), torch.bfloat16, spread=6.0)
    check_grouped(x, triton_device)
    check_grouped(x, triton_device, chunk_m=128)
    check_grouped(outlier_tensor(gen, torch.bfloat16), triton_device)
    check_grouped(outlier_tensor(gen, torch.float32), triton_device, chunk_m=32)
    base = random_tensor(gen, (384, 256), torch.bfloat16)
    check_grouped(base.t(), triton_device)  # strides (1, 256)
    monkeypatch.setattr(Q, "fp8_scale_table", lambda device: None)
    check_grouped(random_tensor(gen, (128, 256), torch.bfloat16), triton_device)


# ----------------------------------------------------------------------------------------------------------
# GPU: torch scaled_mm against the emulation (run on the H200 with `make test-gpu`)
# ----------------------------------------------------------------------------------------------------------
def accumulation_bound(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """|C_gpu - C_exact| bound, derived in kernels/fp8/gemm.py: each 128-long K block is summed in the
    tensor-core accumulator (>= 13 fraction bits: u_tc = 2^-13, recursive summation of 128 terms), scaled
    and accumulated over Kb blocks in fp32 (u = 2^-24): (128 u_tc + (Kb + 2) u) * sum_k |a_k b_k|, plus the
    final rounding to the output dtype (2^-8 relative for bf16, 2^-24 for fp32)."""
    a64 = a.data.double().cpu() * _scales_full(a)
    b64 = b.data.double().cpu() * _scales_full(b)
    kb = a.shape[1] // 128
    absprod = a64.abs() @ b64.abs().t()
    exact = a64 @ b64.t()
    out_u = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-24
    return (128 * 2.0**-13 + (kb + 2) * 2.0**-24) * absprod * (1 + out_u) + out_u * exact.abs() + 1e-30


def _scales_full(q: FP8Tensor) -> torch.Tensor:
    m, k = q.shape
    s = q.scale_inv.double().cpu()
    if q.block is None:
        return s.reshape(1, 1).expand(m, k)
    return s.repeat_interleave(q.block[0], 0).repeat_interleave(q.block[1], 1)


def _to(q: FP8Tensor, device) -> FP8Tensor:
    return FP8Tensor(data=q.data.to(device), scale_inv=q.scale_inv.to(device), block=q.block)


GPU_PAIRS = [((1, 128), (128, 128)), ((1, 128), (1, 128)), ((128, 128), (1, 128)), ((128, 128), (128, 128)),
             (None, None)]


@pytest.mark.gpu
def test_gpu_grouped_kernel_captured_before_its_table(gen, monkeypatch):
    """A CUDA graph captured before the scale table exists (its host-to-device copy cannot be captured) runs the
    grouped kernel's division path: nothing is built inside the capture, the replay gives the reference's bits, and
    the next eager call builds the table (and gives them too)."""
    from nvfp4_train.kernels.fp8 import quantize as Q

    x = random_tensor(gen, (256, 384), torch.bfloat16, spread=6.0).cuda()
    monkeypatch.setattr(Q, "_SCALE_TABLES", {})
    table = Q.fp8_scale_table
    monkeypatch.setattr(Q, "fp8_scale_table", lambda device: None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped_rowcol(x)  # compiles the division kernel: a capture must not compile
    torch.cuda.current_stream().wait_stream(side)
    monkeypatch.setattr(Q, "fp8_scale_table", table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row, col = grouped_rowcol(x)
    assert not Q._SCALE_TABLES
    graph.replay()
    torch.cuda.synchronize()
    rref, cref = quantize_fp8_rowcol_ref(x.cpu(), (1, 128))
    assert_same(row, rref)
    assert_same(col, cref)
    check_grouped(x.cpu(), "cuda")
    assert list(Q._SCALE_TABLES) == [torch.device("cuda", torch.cuda.current_device())]


@pytest.mark.gpu
def test_gpu_blockwise_is_native_on_hopper(gen):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch runs DeepSeek-style blockwise FP8 scaling on sm_90 only")
    for k in (512, 640):  # Kb % 4 == 0 and the padded 128x128 scale layout
        for pair in GPU_PAIRS[:4]:
            a = _to(summable_operand(gen, 256, k, pair[0]), "cuda")
            b = _to(summable_operand(gen, 384, k, pair[1]), "cuda")
            assert fp8_gemm_backend(a, b, torch.bfloat16) == "scaled_mm_blockwise", (pair, k)
    a = _to(summable_operand(gen, 256, 512, None), "cuda")
    assert fp8_gemm_backend(a, a, torch.bfloat16) == "scaled_mm_tensorwise"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pair", GPU_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace(" ", ""))
@pytest.mark.parametrize("m,n,k", [(272, 384, 640), (256, 256, 512), (128, 128, 128)])
def test_gpu_gemm_exact_on_summable_inputs(gen, pair, out_dtype, m, n, k):
    """Small integers and power-of-two scales: every backend must reproduce the emulation bit for bit."""
    if pair[0] == (128, 128) and m % 128:
        m = 256
    a, b = summable_operand(gen, m, k, pair[0], lim=4), summable_operand(gen, n, k, pair[1], lim=4)
    want = fp8_gemm_ref(a, b, out_dtype)
    ad, bd = _to(a, "cuda"), _to(b, "cuda")
    backends = [None] if pair == (None, None) else [None, "scaled_mm_rowwise_per_kblock"]
    for backend in backends:
        got = fp8_gemm(ad, bd, out_dtype, backend=backend)
        assert got.dtype == out_dtype and torch.equal(got.cpu(), want), (backend, fp8_gemm_backend(ad, bd, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pair", GPU_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace(" ", ""))
def test_gpu_gemm_random_within_derived_bound(gen, pair, out_dtype):
    """Random operands quantized on the GPU (scales varying by e^(2 N(0,1)) per block, so a misplaced scale
    is far outside the bound) against the exact emulation."""
    m, n, k = 384, 256, 1280
    x = random_tensor(gen, (m, k)).cuda()
    w = random_tensor(gen, (n, k)).cuda()
    a, b = quantize_fp8(x, pair[0]), quantize_fp8(w, pair[1])
    got = fp8_gemm(a, b, out_dtype).double().cpu()
    want = fp8_gemm_ref(_to(a, "cpu"), _to(b, "cpu"), torch.float32).double()
    bound = accumulation_bound(a, b, out_dtype)
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
