"""The NVFP4 GEMM on Hopper (both operands dequantized once, then the Triton or the cuBLAS engine) against the
reference.

Runs under TRITON_INTERPRET=1 on CPU (``make test``) and natively on CUDA (``make test-gpu``). Under the
interpreter the variants run the GPU kernels' code with the fp16 dot (right in the interpreter) or the fp32
dot; the bf16 dot of the Triton engine only on the GPU (the interpreter multiplies raw bf16 bits).

Two kinds of checks:
* EXACT: inputs whose partial sums are all exactly representable in fp32, so every summation order gives
  the same fp32 sum and the output equals ``nvfp4_gemm_ref`` bit for bit (fp32 and bf16 out).
* RANDOM: real quantized data, odd shapes, fp32 output within a bound derived below of the float64 product.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.fp4_reference import pack_nibbles
from nvfp4_train.kernels.nvfp4 import nvfp4_gemm, nvfp4_gemm_ref, quantize_nvfp4_ref
from nvfp4_train.kernels.fp4_gemm import GemmConfig, dequantize_fp4_blockwise_pair_triton, gemm_alpha_triton
from nvfp4_train.kernels.nvfp4.gemm import nvfp4_gemm_predequant
from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor, _blockwise_values, nvfp4_alpha

pytestmark = pytest.mark.triton

# E4M3 byte of 2^j (exponent field j + 7, mantissa 0); 0x38 = 1.0
E4M3_ONE = 0x38


def e4m3_pow2(j: int) -> int:
    return (j + 7) << 3


def variants(device: str) -> list[dict]:
    """Every code path: both engines, each operand dtype they take (kwargs of nvfp4_gemm_predequant)."""
    v = [dict(engine="triton"), dict(engine="cublas"), dict(engine="cublas", dot_dtype="fp16")]
    v += [dict(engine="triton", dot_dtype="bf16")] if device == "cuda" else [dict(engine="triton", dot_dtype="fp32")]
    return v


def run(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype, kw: dict) -> torch.Tensor:
    return nvfp4_gemm_predequant(a, b, out_dtype, **kw)


def make(codes: torch.Tensor, scale_bytes: torch.Tensor, amax: float, device: str) -> NVFP4Tensor:
    """An NVFP4Tensor from unpacked codes [M, K] and scale bytes [M, K/16]."""
    return NVFP4Tensor(
        codes=pack_nibbles(codes).to(device),
        scales=scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn).to(device),
        amax=torch.tensor(amax, dtype=torch.float32).to(device),
    )


def to_cpu(q: NVFP4Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(codes=q.codes.cpu(), scales=q.scales.cpu(), amax=q.amax.cpu(), block_2d=q.block_2d)


def on(q: NVFP4Tensor, device: str) -> NVFP4Tensor:
    return NVFP4Tensor(codes=q.codes.to(device), scales=q.scales.to(device), amax=q.amax.to(device),
                       block_2d=q.block_2d)


def assert_bitwise(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bitwise equality, NaN positions included; the sign of an exact zero is not compared (the kernel's
    accumulator starts at +0, a BLAS sum of all -0 products may end at -0): ``x + 0.0`` maps -0 to +0."""
    got, ref = got.cpu(), ref.cpu()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN positions differ"
    keep = ~torch.isnan(ref)
    g, r = (got[keep] + 0.0), (ref[keep] + 0.0)
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    bad = g.view(bits) != r.view(bits)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements differ, e.g. {g[bad][:5].tolist()} vs "
                           f"{r[bad][:5].tolist()}")


# ----------------------------------------------------------------------------------------------------------
# EXACT
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_exact_every_code_times_every_scale_byte(triton_device, out_dtype):
    """A [256, 16]: row m has scale byte m (all 256 E4M3 bytes: subnormals, 448, -0, negatives, both NaNs)
    and all 16 codes; B = the 16x16 identity (code 2 = 1.0, scale 1.0); amax = 2688 for both, so alpha = 1.
    Each output is ONE product plus exact zeros: C = A's dequantized values, exactly, NaN rows included."""
    codes = (torch.arange(16)[None, :] + torch.arange(256)[:, None]) % 16
    a = make(codes, torch.arange(256)[:, None], 2688.0, triton_device)
    b = make(torch.eye(16, dtype=torch.int64) * 2, torch.full((16, 1), E4M3_ONE), 2688.0, triton_device)
    ref = nvfp4_gemm_ref(to_cpu(a), to_cpu(b), out_dtype)
    assert_bitwise(ref, _blockwise_values(to_cpu(a)).to(out_dtype))  # the construction does what it says
    for kw in variants(triton_device):
        assert_bitwise(run(a, b, out_dtype, kw), ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_exact_partial_sums(triton_device, gen, out_dtype):
    """Random codes (all 16) and power-of-two scales 2^j, j in [-2, 2]; odd M, N; K = 16 * odd.

    Why every partial sum is exact in fp32: a dequantized value is e2m1 * 2^j, a multiple of 0.5 * 2^-2 =
    2^-3 with |v| <= 6 * 4 = 24; a product of two is a multiple of 2^-6 with |p| <= 576. Any partial sum of
    K products (any order, any grouping, the tensor cores' included) is a multiple of 2^-6 with magnitude
    <= 576 K; for K <= 432, 576 K < 2^18, i.e. fewer than 2^24 units of 2^-6: representable in fp32's 24-bit
    significand, so no addition ever rounds. The kernel's fp32 sum and the reference's float64 sum are both
    the exact sum; the epilogue (fl(acc * alpha), then the rounding to out_dtype) is the same operation in
    both. Random amax values make alpha a general fp32 number."""
    M, N, K = (300, 520, 16 * 27) if triton_device == "cuda" else (37, 45, 16 * 9)
    assert 576 * K < 2**18
    a_codes = torch.randint(0, 16, (M, K), generator=gen)
    b_codes = torch.randint(0, 16, (N, K), generator=gen)
    a_sc = torch.tensor([e4m3_pow2(j) for j in torch.randint(-2, 3, (M * K // 16,), generator=gen).tolist()])
    b_sc = torch.tensor([e4m3_pow2(j) for j in torch.randint(-2, 3, (N * K // 16,), generator=gen).tolist()])
    amax_a, amax_b = (float(torch.rand((), generator=gen)) * 100 + 1e-3 for _ in range(2))
    a = make(a_codes, a_sc.view(M, K // 16), amax_a, triton_device)
    b = make(b_codes, b_sc.view(N, K // 16), amax_b, triton_device)
    ref = nvfp4_gemm_ref(to_cpu(a), to_cpu(b), out_dtype)
    for kw in variants(triton_device):
        assert_bitwise(run(a, b, out_dtype, kw), ref, f"variant {kw}")
    # the public entry point dispatches to the kernels, whatever the engine
    for engine in ("cublas", "triton", "auto"):
        assert_bitwise(nvfp4_gemm(a, b, out_dtype, engine=engine), ref, f"nvfp4_gemm {engine}")


# ----------------------------------------------------------------------------------------------------------
# RANDOM, within a derived bound
# ----------------------------------------------------------------------------------------------------------


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def error_bound(a: NVFP4Tensor, b: NVFP4Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(C64, bound) in float64 for the fp32-output GEMM.

    Derivation (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1 and §4.2). Let
    p_k = a_k b_k (a_k, b_k the dequantized values without tensor scale). Each p_k is exact in fp32 (at most
    5 + 5 significant bits) and the tensor cores / numpy form it exactly. A sum of K terms in floating point
    with unit roundoff u, in ANY order, satisfies |s_hat - s| <= gamma_{K-1} sum_k |p_k| <= gamma_K S with
    S = sum_k |p_k|, gamma_n = n u / (1 - n u). The epilogue computes fl(s_hat * alpha) = s_hat alpha (1 + d),
    |d| <= u, so
        |C - s alpha| <= alpha (gamma_K S + u |s_hat|) <= alpha S (gamma_K + u + u gamma_K) <= gamma_{K+1} alpha S
    (Higham Lemma 3.3). The float64 comparison value C64 = fl64(s64) * alpha has its own error
    <= gamma_K(2^-53) alpha S, added to the bound, and an fp32 result that underflows can be off by half the
    smallest subnormal, 2^-150: the absolute term 2^-149.
    u: 2^-24 for round-to-nearest fp32 accumulation (the interpreter's numpy matmul). On the GPU the tensor
    cores align the products of each K-step to the largest exponent and truncate (Fasi, Higham, Mikaitis,
    Pranesh 2021, "Numerical behavior of NVIDIA tensor cores"): a relative error below 2^-23 per addition,
    and the multi-term adder's alignment can lose one more bit, so the GPU bound uses u = 2^-22.
    """
    K = a.shape[1]
    da = _blockwise_values(to_cpu(a)).double()
    db = _blockwise_values(to_cpu(b)).double()
    alpha = nvfp4_alpha(a.amax.cpu(), b.amax.cpu()).double()
    u = 2.0**-22 if device == "cuda" else 2.0**-24
    c64 = (da @ db.t()) * alpha
    s_abs = da.abs() @ db.abs().t()
    bound = alpha * s_abs * (gamma(K + 1, u) + gamma(K, 2.0**-53)) + 2.0**-149
    return c64, bound


def random_operand(gen: torch.Generator, rows: int, k: int, block_2d: bool = False) -> NVFP4Tensor:
    """Gaussian rows with per-row magnitudes spread over 10^+-3 and a few outliers, quantized by the
    reference (RNE)."""
    x = torch.randn(rows, k, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * 2)
    idx = torch.randint(0, rows * k, (max(1, rows * k // 500),), generator=gen)
    x.view(-1)[idx] *= 50
    return quantize_nvfp4_ref(x, block_2d=block_2d)


@pytest.mark.parametrize("b_2d", [False, True])
def test_random_within_derived_bound(triton_device, gen, b_2d):
    M, N, K = (1000, 528, 16 * 63) if triton_device == "cuda" else (33, 48 if b_2d else 47, 16 * 13)
    a = on(random_operand(gen, M, K), triton_device)
    b = on(random_operand(gen, N, K, block_2d=b_2d), triton_device)
    c64, bound = error_bound(a, b, triton_device)
    assert torch.isfinite(c64).all()
    for kw in variants(triton_device):
        c = run(a, b, torch.float32, kw).cpu().double()
        err = (c - c64).abs()
        assert (err <= bound).all(), f"{kw}: max err/bound {float((err / bound).max()):.3g}"
        # bf16 output = the same fp32 accumulator and epilogue product, rounded to nearest-even
        cb = run(a, b, torch.bfloat16, kw)
        assert_bitwise(cb, c.float().to(torch.bfloat16))


def test_odd_tiny_shapes(triton_device, gen):
    """M, N smaller than a tile, K = 16 (a single, partial K step)."""
    for M, N, K in [(1, 1, 16), (3, 70, 16), (65, 2, 48)]:
        a = on(random_operand(gen, M, K), triton_device)
        b = on(random_operand(gen, N, K), triton_device)
        c64, bound = error_bound(a, b, triton_device)
        for kw in variants(triton_device)[:2]:
            c = run(a, b, torch.float32, kw).cpu().double()
            assert c.shape == (M, N) and ((c - c64).abs() <= bound).all(), kw


# ----------------------------------------------------------------------------------------------------------
# alpha, NaN, errors
# ----------------------------------------------------------------------------------------------------------


def test_alpha_is_read_from_device_amax(triton_device, gen):
    """The epilogue reads alpha from the amax tensors at launch: doubling amax_A doubles C exactly (a power
    of two moves through fl(acc * alpha) exactly), and on CUDA the call makes no host sync."""
    a = on(random_operand(gen, 40, 64), triton_device)
    b = on(random_operand(gen, 24, 64), triton_device)
    a2 = NVFP4Tensor(codes=a.codes, scales=a.scales, amax=a.amax * 2)
    for engine in ("triton", "cublas"):
        c1 = nvfp4_gemm_predequant(a, b, torch.float32, engine=engine)  # compiles outside the sync check
        if triton_device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
        try:
            c2 = nvfp4_gemm_predequant(a2, b, torch.float32, engine=engine)
        finally:
            if triton_device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        assert_bitwise(c2, c1 * 2, engine)


def test_nan_scale_and_nan_amax_propagate(triton_device, gen):
    a = random_operand(gen, 20, 48)
    b = random_operand(gen, 18, 48)
    a.scales.view(torch.uint8)[3, 1] = 0x7F  # NaN block in row 3 of A
    b.scales.view(torch.uint8)[5, 2] = 0xFF  # NaN block in row 5 of B (column 5 of C)
    ref = nvfp4_gemm_ref(a, b, torch.float32)
    assert torch.isnan(ref[3]).all() and torch.isnan(ref[:, 5]).all() and torch.isnan(ref).sum() == 18 + 20 - 1
    ad, bd = on(a, triton_device), on(b, triton_device)
    for kw in variants(triton_device):
        c = run(ad, bd, torch.float32, kw).cpu()
        assert torch.equal(torch.isnan(c), torch.isnan(ref)), kw
        keep = ~torch.isnan(ref)
        c64, bound = error_bound(a, b, triton_device)
        assert ((c[keep].double() - c64[keep]).abs() <= bound[keep]).all()
    nan_a = NVFP4Tensor(codes=ad.codes, scales=ad.scales, amax=torch.full_like(ad.amax, float("nan")))
    for kw in variants(triton_device)[:2]:
        assert torch.isnan(run(nan_a, bd, torch.bfloat16, kw)).all(), kw


def test_bad_inputs_raise(triton_device):
    def q(m, k):
        return NVFP4Tensor(codes=torch.zeros(m, k // 2, dtype=torch.uint8, device=triton_device),
                           scales=torch.zeros(m, max(k // 16, 1), dtype=torch.uint8, device=triton_device)
                           .view(torch.float8_e4m3fn),
                           amax=torch.ones((), device=triton_device))

    for engine in ("triton", "cublas"):
        with pytest.raises(ValueError, match="multiple of the scale block 16"):
            nvfp4_gemm_predequant(q(4, 24), q(5, 24), engine=engine)
        with pytest.raises(ValueError, match="reduction dims differ"):
            nvfp4_gemm_predequant(q(4, 32), q(5, 48), engine=engine)
        with pytest.raises(TypeError, match="out_dtype"):
            nvfp4_gemm_predequant(q(4, 32), q(5, 32), torch.float16, engine=engine)
        # M = 0: an empty result
        assert nvfp4_gemm_predequant(q(0, 32), q(5, 32), engine=engine).shape == (0, 5)
    with pytest.raises(ValueError, match="dot_dtype"):
        nvfp4_gemm_predequant(q(4, 32), q(5, 32), dot_dtype="fp8")
    with pytest.raises(ValueError, match="block_k"):
        nvfp4_gemm_predequant(q(4, 32), q(5, 32), config=GemmConfig(32, 32, 24, 4, 1))
    if triton_device == "cpu":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            nvfp4_gemm_predequant(q(4, 32), q(5, 32), dot_dtype="bf16")
    with pytest.raises(ValueError, match=r"GEMM engine 'cuBLAS' is not one of"):
        nvfp4_gemm(q(4, 32), q(5, 32), engine="cuBLAS")


# ----------------------------------------------------------------------------------------------------------
# the pieces: the pair dequantize and the 16-bit GEMM
# ----------------------------------------------------------------------------------------------------------


def test_dequantize_blockwise_exact(triton_device, gen):
    """q * sdec_b for every code and every scale byte, in each 16-bit dtype (and fp32)."""
    codes = torch.randint(0, 16, (256, 48), generator=gen)
    sc = torch.arange(256)[:, None].repeat(1, 3)
    q = make(codes, sc, 1.0, triton_device)
    ref = _blockwise_values(to_cpu(q))
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        ga, gb = dequantize_fp4_blockwise_pair_triton(q.codes, q.scales, q.codes[:100], q.scales[:100], block=16,
                                                      scale_format="e4m3", dtype=dt)
        assert ga.dtype == gb.dtype == dt and ga.shape == (256, 48) and gb.shape == (100, 48)
        assert_bitwise(ga.cpu().float(), ref)
        assert_bitwise(gb.cpu().float(), ref[:100])


def test_gemm_alpha_16bit(triton_device, gen):
    """The 16-bit GEMM with a device alpha: exact on dyadic fp16 inputs with exact partial sums (values
    k/8, |v| <= 4: products multiples of 2^-6 below 16, K * 16 < 2^18 -> exact, as above)."""
    M, N, K = 37, 29, 80
    a = (torch.randint(-32, 33, (M, K), generator=gen) / 8).to(torch.float16)
    b = (torch.randint(-32, 33, (N, K), generator=gen) / 8).to(torch.float16)
    alpha = torch.tensor([0.37], dtype=torch.float32)
    ref = ((a.double() @ b.double().t()).float() * alpha)
    got = gemm_alpha_triton(a.to(triton_device), b.to(triton_device), alpha.to(triton_device), torch.float32)
    assert_bitwise(got, ref)
    got1 = gemm_alpha_triton(a.to(triton_device), b.to(triton_device), None, torch.bfloat16)
    assert_bitwise(got1, (a.double() @ b.double().t()).float().to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------
# GPU only: the bits do not depend on the tiling
# ----------------------------------------------------------------------------------------------------------


def test_bits_independent_of_config_gpu(triton_device, gen):
    """On the GPU a [BM, BK] x [BK, BN] tile dot issues its K=16 tensor-core steps in increasing k into one
    accumulator, so every config of the Triton engine should give the same bits for the same dot dtype. If
    this fails, results depend on the config table and it must be frozen per shape."""
    if triton_device != "cuda":
        pytest.skip("summation order is the GPU's; the interpreter sums each tile dot with numpy")
    M, N, K = 513, 767, 16 * 97
    a = on(random_operand(gen, M, K), triton_device)
    b = on(random_operand(gen, N, K), triton_device)
    for dot in ("fp16", "bf16"):
        base = nvfp4_gemm_predequant(a, b, torch.float32, dot_dtype=dot, config=GemmConfig(64, 64, 64, 4, 2))
        outs = [nvfp4_gemm_predequant(a, b, torch.float32, dot_dtype=dot, config=cfg) for cfg in (
            GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 128, 8, 3), GemmConfig(64, 128, 256, 4, 2))]
        outs.append(nvfp4_gemm_predequant(a, b, torch.float32, dot_dtype=dot))
        for o in outs:
            assert_bitwise(o, base)

