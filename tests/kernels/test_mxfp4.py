"""MXFP4 (OCP MX v1.0, E2M1 elements, 32-element blocks, E8M0 scales): the reference against an independent
brute-force computation, its policies, and the Triton quantizer bit for bit against the reference.

Unmarked tests exercise the pure-PyTorch reference (CPU). ``triton``-marked tests run the kernel under
TRITON_INTERPRET=1 on CPU (``make test``) or natively on CUDA (``make test-gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_train.kernels.fp4_reference import E2M1_VALUES, unpack_nibbles
from nvfp4_train.kernels.mxfp4 import quantize_mxfp4, quantize_mxfp4_rowcol, transpose_mxfp4
from nvfp4_train.kernels.mxfp4.reference import (
    BLOCK,
    MXFP4Tensor,
    dequantize_mxfp4_ref,
    e8m0_to_float32,
    mxfp4_gemm_ref,
    quantize_mxfp4_ref,
    quantize_mxfp4_rowcol_ref,
    transpose_mxfp4_ref,
)

E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
# the interpreter evaluates the kernels' intentional 448/0, inf*0 ... with numpy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------------------------------------
# brute force: float64 arithmetic, math.frexp for the exponent, nearest-value search for the element
# ----------------------------------------------------------------------------------------------------------
def nearest_e2m1_index(m: torch.Tensor) -> torch.Tensor:
    """Index (0..7) of the E2M1 magnitude nearest to each m >= 0 (float64); ties to the even index."""
    d = (m.unsqueeze(-1) - E2M1).abs()
    best = d == d.min(dim=-1, keepdim=True).values
    even = (torch.arange(8) % 2 == 0).to(torch.int64)
    return (best.to(torch.int64) * (1 + even)).argmax(dim=-1)  # first maximal score: the even tie winner


def brute_force_mxfp4(x: torch.Tensor, block_2d: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K] uint8 unpacked, scales [M, K/32] uint8) computed without the reference's bit tricks;
    ``block_2d``: the scale of each 32-element block comes from its whole 32x32 tile."""
    x64 = x.to(torch.float32).to(torch.float64)
    m, k = x64.shape
    blocks = x64.view(m, k // BLOCK, BLOCK)
    codes = torch.zeros(m, k // BLOCK, BLOCK, dtype=torch.uint8)
    scales = torch.zeros(m, k // BLOCK, dtype=torch.uint8)
    for i in range(m):
        for j in range(k // BLOCK):
            blk = blocks[i, j]
            group = x64[i // BLOCK * BLOCK : (i // BLOCK + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] if block_2d else blk
            if not torch.isfinite(group).all():
                scales[i, j] = 0xFF
                continue
            amax = group.abs().max().item()
            if amax == 0:
                x_exp = -127
            else:
                _, e = math.frexp(amax)  # amax = f * 2^e, f in [0.5, 1): floor(log2(amax)) = e - 1
                x_exp = max(min(e - 1 - 2, 127), -127)
            scales[i, j] = x_exp + 127
            v = blk / 2.0**x_exp  # exact in float64
            idx = nearest_e2m1_index(v.abs())
            codes[i, j] = (idx | ((blk < 0).to(torch.int64) << 3)).to(torch.uint8)
    return codes.view(m, k), scales


def assert_same(got: MXFP4Tensor, ref: MXFP4Tensor) -> None:
    assert got.codes.dtype == torch.uint8 and got.scales.dtype == torch.uint8
    assert got.block_2d == ref.block_2d
    assert got.codes.shape == ref.codes.shape and got.scales.shape == ref.scales.shape
    assert torch.equal(got.scales.cpu(), ref.scales), "E8M0 scales differ"
    assert torch.equal(got.codes.cpu(), ref.codes), "codes differ"


def random_tensor(gen: torch.Generator, shape, dtype=torch.float32, spread: float = 3.0) -> torch.Tensor:
    """Normal values with a per-row magnitude spread of e^(spread * N(0,1))."""
    x = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen) * spread)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------------------
# edge-case inputs (shared by the reference and Triton tests)
# ----------------------------------------------------------------------------------------------------------
def f32_next(v: float, toward: float) -> float:
    """The fp32 neighbour of the fp32 value v in the direction of ``toward``."""
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(toward, dtype=torch.float32)).item()


def ties_tensor() -> torch.Tensor:
    """Every RNE tie (both signs) and the values one fp32 ulp beside them, at several block exponents: each
    block is [4 * 2^j, values...] so X = j and the values reach the rounding exactly as t * 2^j."""
    vals = []
    for t in TIES:
        lo, hi = f32_next(t, 0.0), f32_next(t, 10.0)
        vals += [t, -t, lo, hi, -lo, -hi]
    vals += [6.0, -6.0, 0.1, -0.1, 0.0, -0.0]  # 48 values: two blocks of [4, 31 values] (zero padded)
    vals += [0.0] * (62 - len(vals))
    rows = []
    for j in (-130, -127, -126, -20, 0, 3, 60, 125):
        blk = torch.tensor([4.0] + vals[:31] + [4.0] + vals[31:], dtype=torch.float64) * 2.0**j
        rows.append(blk.to(torch.float32))
    x = torch.stack(rows)  # [8, 64]
    return torch.cat([x, -x.flip(1)], dim=0)  # [16, 64]


def saturation_tensor() -> torch.Tensor:
    """Blocks whose amax / 2^X is in (6, 8): the largest elements saturate to 6 (code 7)."""
    x = torch.zeros(4, 64)
    for r, amax in enumerate((7.999, 6.5, 6.0001, 7.0)):
        x[r, :32] = torch.linspace(-amax, amax, 32)
        x[r, 32:] = torch.linspace(amax, -amax, 32) * 2.0**-40
    return x


def exponent_boundary_tensor() -> torch.Tensor:
    """Block amaxes at and one fp32 ulp beside powers of two, over the whole fp32 range (where a rounded
    log2 would be off by one), including subnormal amaxes and FLT_MAX."""
    amaxes = []
    for e in range(-149, 128, 3):
        p = 2.0**e
        amaxes += [p, f32_next(p, 0.0), f32_next(p, math.inf)]
    amaxes += [torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny]
    amaxes = torch.tensor(amaxes, dtype=torch.float64).to(torch.float32)
    n = amaxes.numel()
    rows = (n + 1) // 2
    x = torch.zeros(rows * 2, BLOCK)
    x[:n, 0] = amaxes
    x[:n, 1] = -amaxes * 0.3
    x[:n, 2] = amaxes * 0.74
    return x.view(rows, 2 * BLOCK)


def nonfinite_tensor(gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(32, 96, generator=gen)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 70] = float("-inf")
    x[3, 0:32] = float("nan")
    return x


def outlier_tensor(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(32, 64, generator=gen)
    x[7, 13] = 3e4 if dtype == torch.bfloat16 else 1e30
    return x.to(dtype)


EDGE_CASES = {
    "zeros": lambda g: torch.zeros(32, 64),
    "zero_blocks": lambda g: torch.cat([torch.zeros(32, 32), torch.randn(32, 64, generator=g)], dim=1),
    "negative_zeros": lambda g: -torch.zeros(32, 32),
    "ties": lambda g: ties_tensor(),
    "saturation": lambda g: saturation_tensor(),
    "exponent_boundaries": lambda g: exponent_boundary_tensor(),
    "subnormal_fp32": lambda g: torch.randn(32, 64, generator=g) * 1e-39,
    "subnormal_bf16": lambda g: (torch.randn(32, 64, generator=g) * 1e-39).bfloat16(),
    "tiny_beside_large": lambda g: torch.randn(32, 64, generator=g) * torch.tensor([1e30, 1e-30]).repeat(32),
    "outlier_fp32": lambda g: outlier_tensor(g, torch.float32),
    "outlier_bf16": lambda g: outlier_tensor(g, torch.bfloat16),
    "huge": lambda g: (torch.rand(32, 64, generator=g) * 2 - 1) * 3.4e38,
    "nonfinite": nonfinite_tensor,
}


# ----------------------------------------------------------------------------------------------------------
# reference (CPU)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 96), (33, 32), (16, 160)])
def test_reference_matches_brute_force(gen, dtype, shape):
    x = random_tensor(gen, shape, dtype)
    q = quantize_mxfp4_ref(x)
    codes, scales = brute_force_mxfp4(x)
    assert torch.equal(q.scales, scales)
    assert torch.equal(unpack_nibbles(q.codes), codes)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x32", "32x32"])
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_reference_edge_cases_match_brute_force(gen, case, block_2d):
    x = EDGE_CASES[case](gen)
    if block_2d and x.shape[0] < BLOCK:
        x = torch.cat([x] * (BLOCK // x.shape[0] + 1))[:BLOCK]
    elif block_2d:
        x = x[: x.shape[0] // BLOCK * BLOCK]
    q = quantize_mxfp4_ref(x, block_2d=block_2d)
    codes, scales = brute_force_mxfp4(x, block_2d)
    assert torch.equal(q.scales, scales)
    assert torch.equal(unpack_nibbles(q.codes), codes)


def test_ties_round_to_even_and_saturate():
    # block amax 4 -> X = 0: the elements reach E2M1 rounding unchanged
    x = torch.zeros(1, 32)
    vals = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.1, -0.1, -0.0, 0.0]
    x[0, : len(vals)] = torch.tensor(vals)
    q = quantize_mxfp4_ref(x)
    assert q.scales.item() == 127
    got = unpack_nibbles(q.codes)[0, : len(vals)].tolist()
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0; negative zero results are code 8
    assert got == [6, 0, 2, 2, 4, 4, 6, 6, 8, 10, 14, 0, 8, 0, 0]
    y = torch.zeros(1, 32)
    y[0, :3] = torch.tensor([7.9, 6.5, -7.0])  # X = floor(log2 7.9) - 2 = 0: 7.9, 6.5 saturate to 6
    q = quantize_mxfp4_ref(y)
    assert q.scales.item() == 127 and unpack_nibbles(q.codes)[0, :3].tolist() == [7, 7, 15]


def test_scale_exponent_is_exact_at_powers_of_two():
    below = f32_next(8.0, 0.0)  # floor(log2) = 2, although the fp32 log2 of it rounds to 3
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = 8.0, below, 2.0**-125, 2.0**-140
    s = quantize_mxfp4_ref(x).scales[:, 0].tolist()
    assert s == [127 + 1, 127 + 0, 0, 0]  # X = 3-2, 2-2, clamp(-125-2), clamp(-140-2)


def test_zero_and_tiny_blocks_get_the_smallest_scale():
    x = torch.zeros(2, 64)
    x[1, 32:] = 2.0**-130  # subnormal amax: X clamps to -127, elements 2^-3 -> 0 (<= 0.25)
    x[1, 33] = 2.0**-126 * 3  # 3 * 2^-126 * 2^127 = 6
    q = quantize_mxfp4_ref(x)
    assert q.scales.tolist() == [[0, 0], [0, 0]]
    codes = unpack_nibbles(q.codes)
    assert codes[0].eq(0).all() and codes[1, :32].eq(0).all()
    assert codes[1, 33].item() == 7 and codes[1, 32].item() == 0
    d = dequantize_mxfp4_ref(q)
    assert d[1, 33].item() == 6 * 2.0**-127 and d[0].eq(0).all()


def test_nonfinite_policy(gen):
    x = nonfinite_tensor(gen)
    q = quantize_mxfp4_ref(x)
    blk_bad = ~torch.isfinite(x).view(32, 3, 32).all(dim=-1)
    assert torch.equal(q.scales == 0xFF, blk_bad)
    codes = unpack_nibbles(q.codes).view(32, 3, 32)
    assert codes[blk_bad].eq(0).all()
    d = dequantize_mxfp4_ref(q).view(32, 3, 32)
    assert torch.isnan(d[blk_bad]).all() and torch.isfinite(d[~blk_bad]).all()
    # the other blocks are what they would be without the bad ones
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    qc = quantize_mxfp4_ref(clean)
    assert torch.equal(qc.scales[~blk_bad], q.scales[~blk_bad])
    assert torch.equal(unpack_nibbles(qc.codes).view(32, 3, 32)[~blk_bad], codes[~blk_bad])


def test_packing_low_nibble_is_even_element():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 4.0, -1.0  # X = 0: codes 6 and 10
    assert quantize_mxfp4_ref(x).codes[0, 0].item() == 6 | (10 << 4)


def test_e8m0_decoding():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_to_float32(codes)
    for c in (0, 1, 100, 127, 200, 254):
        assert v[c].item() == math.ldexp(1.0, c - 127)
    assert math.isnan(v[255].item())


def test_dequantize_is_exact(gen):
    x = random_tensor(gen, (9, 64))
    q = quantize_mxfp4_ref(x)
    codes = unpack_nibbles(q.codes).view(9, 2, 32).long()
    vals = torch.where(codes >= 8, -E2M1[codes % 8], E2M1[codes % 8])
    want = vals * torch.exp2(q.scales.to(torch.float64) - 127).unsqueeze(-1)
    assert torch.equal(dequantize_mxfp4_ref(q).to(torch.float64), want.view(9, 64))
    # values on the MXFP4 grid survive a round trip (block amax in [4, 6] * 2^X)
    grid = (E2M1[torch.randint(0, 8, (4, 64), generator=gen)] * torch.where(
        torch.rand(4, 64, generator=gen) < 0.5, -1.0, 1.0)).to(torch.float32)
    grid[:, 0] = grid[:, 32] = 4.0
    grid = grid * torch.exp2(torch.randint(-100, 100, (4, 1), generator=gen).to(torch.float32))
    assert torch.equal(dequantize_mxfp4_ref(quantize_mxfp4_ref(grid)), grid)


@pytest.mark.parametrize("shape", [(4, 48), (4, 16), (2, 3, 32), (64,)])
def test_bad_shapes_raise(shape):
    with pytest.raises(ValueError, match="MXFP4"):
        quantize_mxfp4(torch.zeros(shape))


def test_bad_dtype_and_rowcol_shape_raise():
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="pad the token dim to a multiple of 32"):
        quantize_mxfp4_rowcol(torch.zeros(48, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_tiles_match_brute_force_and_transpose(gen, dtype):
    x = random_tensor(gen, (64, 96), dtype)
    x[40, 70] = float("nan")  # one non-finite tile
    q = quantize_mxfp4_ref(x, block_2d=True)
    codes, scales = brute_force_mxfp4(x, block_2d=True)
    assert q.block_2d and torch.equal(q.scales, scales) and torch.equal(unpack_nibbles(q.codes), codes)
    # W (Fprop) and W^T (Dgrad) are the same values: the transpose is the quantization of x^T
    assert_same(transpose_mxfp4(q), quantize_mxfp4_ref(x.t(), block_2d=True))
    row, col = quantize_mxfp4_rowcol_ref(x, block_2d=True)
    assert_same(row, q)
    assert_same(col, transpose_mxfp4_ref(q))
    with pytest.raises(ValueError, match="requantizing"):
        transpose_mxfp4_ref(quantize_mxfp4_ref(x))
    with pytest.raises(ValueError, match="pad it to a multiple of 32"):
        quantize_mxfp4(torch.zeros(48, 64), block_2d=True)
    with pytest.raises(ValueError, match="col_stochastic must equal row_stochastic"):
        quantize_mxfp4_rowcol(x, row_stochastic=True, block_2d=True)


def test_rowcol_columnwise_is_quantized_transpose(gen):
    x = random_tensor(gen, (64, 96))
    row, col = quantize_mxfp4_rowcol_ref(x, col_stochastic=True, col_seed=9)
    assert_same(row, quantize_mxfp4_ref(x))
    assert_same(col, quantize_mxfp4_ref(x.t().contiguous(), stochastic=True, seed=9))


# ---- stochastic rounding ---------------------------------------------------------------------------------
def sr_tensor(n_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[n_rows, 64]: every row holds the same two blocks [4, t_1..t_31] (X = 0, so v = t): t spans
    [-4, 4] including grid points, their neighbours and midpoints."""
    t = torch.rand(62, generator=gen) * 8 - 4
    t[:8] = torch.tensor([0.5, 1.5, 3.0, -2.0, 0.0, 0.75, 2.5, -3.5])  # grid points and midpoints
    row = torch.cat([torch.tensor([4.0]), t[:31], torch.tensor([4.0]), t[31:]])
    return row.expand(n_rows, 64).contiguous(), row


def neighbours(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) E2M1 magnitudes around |v| (float64, |v| <= 6)."""
    m = v.abs().to(torch.float64)
    lo = E2M1[(E2M1.unsqueeze(0) <= m.unsqueeze(-1)).sum(-1) - 1]
    hi = E2M1[torch.clamp(8 - (E2M1.unsqueeze(0) >= m.unsqueeze(-1)).sum(-1), max=7)]
    return lo, hi


def check_sr(q: MXFP4Tensor, x: torch.Tensor, row: torch.Tensor) -> None:
    n = x.shape[0]
    d = dequantize_mxfp4_ref(q).to(torch.float64)
    lo, hi = neighbours(row)
    sign = torch.where(row < 0, -1.0, 1.0).to(torch.float64)
    mag = d * sign
    only_two = (mag == lo) | (mag == hi)
    assert only_two.all(), "stochastic rounding produced a value other than the two neighbours"
    # unbiased within a bound derived in advance: E[q] = v + b with 0 <= b < gap/256 (8 random bits);
    # the sample mean of n Bernoulli-rounded draws has std <= gap / (2 sqrt(n)); allow 6 std.
    gap = (hi - lo).clamp(min=0)
    mean = mag.mean(dim=0)
    bound = gap / 256 + 6 * gap / (2 * math.sqrt(n)) + 1e-12
    assert ((mean - row.abs().to(torch.float64)).abs() <= bound).all()


def test_stochastic_reference_neighbours_unbiased_reproducible(gen):
    x, row = sr_tensor(2048, gen)
    seed = int(torch.randint(0, 2**32 - 1, (1,), generator=gen))
    q = quantize_mxfp4_ref(x, stochastic=True, seed=seed)
    check_sr(q, x, row)
    assert_same(quantize_mxfp4_ref(x, stochastic=True, seed=seed), q)
    assert not torch.equal(quantize_mxfp4_ref(x, stochastic=True, seed=seed ^ 1).codes, q.codes)


# ---- GEMM reference --------------------------------------------------------------------------------------
def test_gemm_ref_exact_on_exactly_summable_inputs(gen):
    # operands on the MXFP4 grid with scales 2^-2..2^2: every product and partial sum is a multiple of 2^-6
    # below 2^13, exact in fp32 and bf16 rounding of it is the only rounding. Compare with integer math.
    def grid(rows: int) -> torch.Tensor:
        v = E2M1[torch.randint(0, 8, (rows, 96), generator=gen)] * torch.where(
            torch.rand(rows, 96, generator=gen) < 0.5, -1.0, 1.0)
        v[:, ::32] = 4.0  # X = 0 before the per-block power of two below
        e = torch.randint(-2, 3, (rows, 3), generator=gen).to(torch.float64).repeat_interleave(32, dim=1)
        return (v * torch.exp2(e)).to(torch.float32)

    xa, xb = grid(11), grid(7)
    a, b = quantize_mxfp4_ref(xa), quantize_mxfp4_ref(xb)
    ia = (xa.to(torch.float64) * 8).to(torch.int64)  # integers: grid values * 2^-2 * 2 * 2^2 ... * 8
    ib = (xb.to(torch.float64) * 8).to(torch.int64)
    want = (ia @ ib.t()).to(torch.float64) / 64
    assert torch.equal(mxfp4_gemm_ref(a, b, torch.float32), want.to(torch.float32))
    assert torch.equal(mxfp4_gemm_ref(a, b, torch.bfloat16), want.to(torch.float32).to(torch.bfloat16))
    with pytest.raises(ValueError, match="reduction dims differ"):
        mxfp4_gemm_ref(a, quantize_mxfp4_ref(torch.zeros(4, 64)))


def test_gemm_ref_is_the_dequantized_product(gen):
    a = quantize_mxfp4_ref(random_tensor(gen, (13, 64)))
    b = quantize_mxfp4_ref(random_tensor(gen, (5, 64)))
    want = dequantize_mxfp4_ref(a).double() @ dequantize_mxfp4_ref(b).double().t()
    assert torch.equal(mxfp4_gemm_ref(a, b, torch.float32), want.float())


# ----------------------------------------------------------------------------------------------------------
# Triton kernel vs reference, bit for bit
# ----------------------------------------------------------------------------------------------------------
def check_kernel(x: torch.Tensor, device: str, stochastic: bool = False, seed: int = 0) -> None:
    xd = x.to(device)
    assert_same(quantize_mxfp4(xd, stochastic=stochastic, seed=seed), quantize_mxfp4_ref(x, stochastic, seed))
    if x.shape[0] % BLOCK == 0:
        assert_same(quantize_mxfp4(xd, stochastic, seed, block_2d=True), quantize_mxfp4_ref(x, stochastic, seed, True))
        row, col = quantize_mxfp4_rowcol(xd, stochastic, stochastic, seed, seed, block_2d=True)
        rref, cref = quantize_mxfp4_rowcol_ref(x, stochastic, stochastic, seed, seed, block_2d=True)
        assert_same(row, rref)
        assert_same(col, cref)
        row, col = quantize_mxfp4_rowcol(
            xd, row_stochastic=stochastic, col_stochastic=not stochastic, row_seed=seed, col_seed=seed + 1
        )
        rref, cref = quantize_mxfp4_rowcol_ref(
            x, row_stochastic=stochastic, col_stochastic=not stochastic, row_seed=seed, col_seed=seed + 1
        )
        assert_same(row, rref)
        assert_same(col, cref)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 96), (64, 160), (7, 32), (96, 224)])
def test_kernel_random_odd_shapes(triton_device, gen, dtype, shape):
    x = random_tensor(gen, shape, dtype)
    check_kernel(x, triton_device)
    check_kernel(x, triton_device, stochastic=True, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))


@pytest.mark.triton
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_kernel_edge_cases(triton_device, gen, case):
    x = EDGE_CASES[case](gen)
    check_kernel(x, triton_device)
    check_kernel(x, triton_device, stochastic=True, seed=123)


@pytest.mark.triton
def test_kernel_non_contiguous_input(triton_device, gen):
    base = random_tensor(gen, (96, 64))
    xt = base.to(triton_device).t()  # [64, 96], strides (1, 64)
    assert_same(quantize_mxfp4(xt), quantize_mxfp4_ref(base.t()))
    sl = random_tensor(gen, (64, 256)).to(triton_device)[:, ::2]  # [64, 128], stride 2 along K
    row, col = quantize_mxfp4_rowcol(sl, col_stochastic=True, col_seed=3)
    rref, cref = quantize_mxfp4_rowcol_ref(sl.cpu(), col_stochastic=True, col_seed=3)
    assert_same(row, rref)
    assert_same(col, cref)


@pytest.mark.triton
def test_kernel_stochastic_matches_reference_and_statistics(triton_device, gen):
    x, row = sr_tensor(1024, gen)
    q = quantize_mxfp4(x.to(triton_device), stochastic=True, seed=42)
    assert_same(q, quantize_mxfp4_ref(x, stochastic=True, seed=42))
    check_sr(MXFP4Tensor(q.codes.cpu(), q.scales.cpu()), x, row)
