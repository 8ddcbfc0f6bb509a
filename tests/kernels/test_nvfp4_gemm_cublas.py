"""The "cublas" engine of the NVFP4 GEMM on Hopper (kernels/fp4_gemm.py): one cuBLASLt GEMM with alpha read
from the device in its epilogue (kernels/cublaslt.py; on CPU under TRITON_INTERPRET=1: ``a.float() @ b.float().t()``,
then the Triton alpha pass ``scale_alpha_triton``); and the engine choice (``engine=``, the run's
``precision.gemm_engine``).

Tiers: ``triton`` tests run under the interpreter on CPU (``make test``) and natively on CUDA (``make
test-gpu``); ``gpu`` tests need CUDA; the unmarked ones (argument and environment errors) launch nothing.
The GEMM checks reuse tests/kernels/test_nvfp4_gemm.py's constructions and derived bound unchanged.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.fp4_gemm import (
    GemmConfig,
    dequantize_fp4_blockwise_pair_triton,
    gemm_alpha_cublas,
    predequant_fp4_gemm,
    scale_alpha_triton,
)
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, GEMM_ENGINES, resolve_gemm_engine
from nvfp4_train.kernels.nvfp4 import nvfp4_gemm, nvfp4_gemm_ref
from nvfp4_train.kernels.nvfp4.gemm import nvfp4_gemm_predequant
from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor
from tests.kernels.test_nvfp4_gemm import (
    assert_bitwise,
    e4m3_pow2,
    error_bound,
    make,
    on,
    random_operand,
    to_cpu,
)

OUT_DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------------------------------------
# (1) the alpha pass, bit for bit against torch on CPU
# ----------------------------------------------------------------------------------------------------------


def special_accumulators(gen: torch.Generator) -> torch.Tensor:
    """fp32 values that exercise every rounding case of fl(acc * alpha) -> bf16 with alpha = 1 or 2 (exact
    multiplies, so the bf16 rounding sees these very bits) and with a general alpha:
    random bit patterns (all exponents, NaNs and Infs included), exact bf16 ties (low half 0x8000) with
    even and odd kept bit, one ulp either side of a tie, the largest finite values (round up to Inf),
    fp32 subnormals (to bf16 subnormals, ties among them too), zeros of both signs, +-Inf, NaNs."""
    rnd = torch.randint(-(2**31), 2**31, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    hi = torch.randint(0, 2**16, (2048,), generator=gen, dtype=torch.int64)
    ties = (hi << 16) | 0x8000
    near = torch.cat([ties - 1, ties + 1, hi << 16, (hi << 16) | 0xFFFF])
    sub_hi = torch.randint(0, 0x80, (512,), generator=gen, dtype=torch.int64)  # bf16 subnormal high halves
    subs = torch.cat([(sub_hi << 16) | 0x8000, (sub_hi << 16) | 0x7FFF, (sub_hi << 16) | 0x8001,
                      torch.randint(1, 0x800000, (512,), generator=gen, dtype=torch.int64)])
    fixed = torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF,
                          0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x80000001, 0x007FFFFF,
                          0x00008000, 0x00018000, 0x00800000, 0x3F808000, 0x3F818000], dtype=torch.int64)
    bits = torch.cat([near, subs, fixed])
    bits = torch.cat([bits, bits | 0x80000000])  # both signs
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return torch.cat([rnd, bits]).view(torch.float32)


def assert_same_as_torch(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit for bit, NaN positions included (a NaN's payload is not compared: torch's CPU cast writes 0xFFFF,
    the kernel the canonical 0x7FC0, checked separately)."""
    got = got.cpu()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    bits = torch.int32 if ref.dtype == torch.float32 else torch.int16
    g, r = got[~nan].view(bits), ref[~nan].view(bits)
    bad = g != r
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements differ, e.g. got {g[bad][:5].tolist()} vs "
                           f"{r[bad][:5].tolist()}")


@pytest.mark.triton
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_alpha_pass_bitwise_vs_torch(triton_device, gen, out_dtype):
    """scale_alpha_triton(acc, alpha) == (acc * alpha).to(out_dtype) computed by torch on CPU (a correctly
    rounded fp32 multiply, an RNE cast to bf16), for alphas 1 and 2 (the cast sees the special values
    themselves), a random general alpha, a tiny one (products into the subnormals) and a huge one
    (overflow to Inf); and alpha None = 1. Odd sizes: the last block is partial."""
    acc = special_accumulators(gen)
    acc = acc[: acc.numel() // 7 * 7].reshape(-1, 7)  # a 2-D accumulator; 4096 does not divide the size
    alphas = [1.0, 2.0, float(torch.rand((), generator=gen)) * 3 + 1e-3, 2.0**-100 * 1.37, 2.0**100 * 1.61]
    for a in alphas:
        alpha = torch.tensor([a], dtype=torch.float32)
        ref = (acc * alpha).to(out_dtype)
        got = scale_alpha_triton(acc.clone().to(triton_device), alpha.to(triton_device), out_dtype)
        assert_same_as_torch(got, ref, f"alpha {a!r}")
    got = scale_alpha_triton(acc.clone().to(triton_device), None, out_dtype)
    assert_same_as_torch(got, acc.to(out_dtype), "alpha None")
    if out_dtype == torch.bfloat16:  # NaN is written as the canonical quiet NaN
        nan = torch.isnan(acc)
        assert nan.any() and (got.cpu()[nan].view(torch.int16) == 0x7FC0).all()


@pytest.mark.triton
def test_alpha_pass_in_place_for_fp32(triton_device, gen):
    acc = torch.randn(33, 65, generator=gen).to(triton_device)
    ref = acc.cpu() * torch.tensor([0.731])
    out = scale_alpha_triton(acc, torch.tensor([0.731], device=triton_device), torch.float32)
    assert out.data_ptr() == acc.data_ptr()
    assert_same_as_torch(out, ref, "in place")
    out_b = scale_alpha_triton(acc, torch.tensor([0.5], device=triton_device), torch.bfloat16)
    assert out_b.data_ptr() != acc.data_ptr() and out_b.dtype == torch.bfloat16
    empty = torch.empty(0, 5, device=triton_device)
    assert scale_alpha_triton(empty, torch.ones(1, device=triton_device), torch.bfloat16).shape == (0, 5)


@pytest.mark.triton
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_alpha_pass_from_amax_bitwise(triton_device, gen, out_dtype):
    """scale_alpha_triton(acc, None, amax=(amax_a, amax_b)) forms nvfp4_alpha in the kernel (two correctly
    rounded divisions by 2688, one fp32 product): bit for bit (acc * nvfp4_alpha(amax_a, amax_b)) by torch
    on CPU, for amaxes over the whole fp32 range (quotients down in the subnormals, products under- and
    overflowing), bf16-valued amaxes (what the quantizers produce), 0, Inf and NaN."""
    from nvfp4_train.kernels.nvfp4.reference import nvfp4_alpha

    acc = special_accumulators(gen)[:3001]
    exps = torch.randint(-149, 128, (60,), generator=gen).float()
    am = ((torch.rand(60, generator=gen) + 1) * torch.pow(2.0, exps)).clamp(max=3.4e38)
    am = torch.cat([am, am.to(torch.bfloat16).float(),
                    torch.tensor([0.0, float("inf"), float("nan"), 2688.0, 1.0, 2.0**-149, 3.4028235e38])])
    pairs = [(am[i], am[(7 * i + 3) % am.numel()]) for i in range(am.numel())]
    for amax_a, amax_b in pairs:
        ref = (acc * nvfp4_alpha(amax_a, amax_b)).to(out_dtype)
        got = scale_alpha_triton(acc.clone().to(triton_device), None, out_dtype,
                                 amax=(amax_a.to(triton_device), amax_b.reshape(1).to(triton_device)))
        assert_same_as_torch(got, ref, f"amax {float(amax_a)!r}, {float(amax_b)!r}")


def test_alpha_pass_amax_argument_checks():
    acc = torch.zeros(4, 4)
    one = torch.ones(())
    with pytest.raises(ValueError, match="alpha or amax, not both"):
        scale_alpha_triton(acc, torch.ones(1), torch.bfloat16, amax=(one, one))
    with pytest.raises(ValueError, match="1-element"):
        scale_alpha_triton(acc, None, torch.bfloat16, amax=(torch.ones(2), one))
    a = random_operand(torch.Generator().manual_seed(0), 16, 32)
    with pytest.raises(ValueError, match="engine 'cublas' without alpha"):
        predequant_fp4_gemm(a.codes, a.scales, a.codes, a.scales, block=16, scale_format="e4m3", alpha=None,
                            out_dtype=torch.float32, dot_dtype=None, engine="triton", amax=(one, one))


# ----------------------------------------------------------------------------------------------------------
# (2) engine "cublas" against the reference GEMM
# ----------------------------------------------------------------------------------------------------------


def exact_sum_operands(gen, M, N, K, device, *, small: bool = False):
    """test_nvfp4_gemm.py's EXACT construction: random codes and power-of-two scales 2^j, so that every
    partial sum is a multiple of 2^-6 (dequantized values are multiples of 2^-3). With all 16 codes and
    j in [-2, 2] a product is at most 576 in magnitude and needs 576 K < 2^18. ``small`` (for large K):
    codes with |e2m1| <= 1.5 and j in [-2, 0], products at most 2.25: exact for 2.25 K < 2^18, K <= 116508.
    Then every summation order gives the exact sum, and the output equals nvfp4_gemm_ref bit for bit."""
    if small:
        pool = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])  # 0, 0.5, 1, 1.5 and their negatives
        a_codes = pool[torch.randint(0, 8, (M, K), generator=gen)]
        b_codes = pool[torch.randint(0, 8, (N, K), generator=gen)]
        jlo, jhi, pmax = -2, 0, 2.25
    else:
        a_codes = torch.randint(0, 16, (M, K), generator=gen)
        b_codes = torch.randint(0, 16, (N, K), generator=gen)
        jlo, jhi, pmax = -2, 2, 576
    assert pmax * K < 2**18
    a_sc = torch.tensor([e4m3_pow2(j) for j in torch.randint(jlo, jhi + 1, (M * K // 16,), generator=gen).tolist()])
    b_sc = torch.tensor([e4m3_pow2(j) for j in torch.randint(jlo, jhi + 1, (N * K // 16,), generator=gen).tolist()])
    amax_a, amax_b = (float(torch.rand((), generator=gen)) * 100 + 1e-3 for _ in range(2))
    return (make(a_codes, a_sc.view(M, K // 16), amax_a, device), make(b_codes, b_sc.view(N, K // 16), amax_b, device))


@pytest.mark.triton
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_cublas_engine_exact_partial_sums(triton_device, gen, out_dtype):
    M, N, K = (300, 520, 16 * 27) if triton_device == "cuda" else (37, 45, 16 * 9)
    a, b = exact_sum_operands(gen, M, N, K, triton_device)
    ref = nvfp4_gemm_ref(to_cpu(a), to_cpu(b), out_dtype)
    for dot in ("bf16", "fp16"):
        assert_bitwise(nvfp4_gemm_predequant(a, b, out_dtype, engine="cublas", dot_dtype=dot), ref, f"cublas {dot}")
    assert_bitwise(nvfp4_gemm_predequant(a, b, out_dtype, engine="cublas"), ref, "cublas default dtype")


@pytest.mark.triton
@pytest.mark.parametrize("b_2d", [False, True])
def test_cublas_engine_random_within_derived_bound(triton_device, gen, b_2d):
    """Real quantized data, odd shapes: fp32 output within test_nvfp4_gemm.py's derived bound of the float64
    product; bf16 output the RNE of an fp32 result within that bound: |cb - y| <= 2^-8 |y| (bf16's unit roundoff;
    2^-134, half its smallest subnormal, below its normal range) with |y| <= |c64| + bound. Under the interpreter
    both outputs come from one accumulator and one alpha pass, so there bf16 is exactly the fp32 output rounded;
    on CUDA each output dtype is its own cuBLASLt GEMM, whose fp32 summation order may differ."""
    M, N, K = (1000, 528, 16 * 63) if triton_device == "cuda" else (33, 48 if b_2d else 47, 16 * 13)
    a = on(random_operand(gen, M, K), triton_device)
    b = on(random_operand(gen, N, K, block_2d=b_2d), triton_device)
    c64, bound = error_bound(a, b, triton_device)
    assert torch.isfinite(c64).all()
    c = nvfp4_gemm_predequant(a, b, torch.float32, engine="cublas").cpu().double()
    err = (c - c64).abs()
    assert (err <= bound).all(), f"max err/bound {float((err / bound).max()):.3g}"
    cb = nvfp4_gemm_predequant(a, b, torch.bfloat16, engine="cublas")
    err16 = (cb.cpu().double() - c64).abs()
    assert (err16 <= bound + 2.0**-8 * (c64.abs() + bound) + 2.0**-134).all()
    if triton_device != "cuda":
        assert_bitwise(cb, c.float().to(torch.bfloat16))


@pytest.mark.triton
def test_cublas_engine_nan_and_device_alpha(triton_device, gen):
    """NaN block scales give NaN rows/columns as in the reference; alpha is read from the device amax (doubling
    amax_A doubles C exactly; on CUDA without a host sync)."""
    a = random_operand(gen, 20, 48)
    b = random_operand(gen, 18, 48)
    a.scales.view(torch.uint8)[3, 1] = 0x7F
    b.scales.view(torch.uint8)[5, 2] = 0xFF
    ref = nvfp4_gemm_ref(a, b, torch.float32)
    c = nvfp4_gemm_predequant(on(a, triton_device), on(b, triton_device), torch.float32, engine="cublas").cpu()
    assert torch.equal(torch.isnan(c), torch.isnan(ref))
    keep = ~torch.isnan(ref)
    c64, bound = error_bound(a, b, triton_device)
    assert ((c[keep].double() - c64[keep]).abs() <= bound[keep]).all()

    a = on(random_operand(gen, 40, 64), triton_device)
    b = on(random_operand(gen, 24, 64), triton_device)
    c1 = nvfp4_gemm_predequant(a, b, torch.float32, engine="cublas")
    a2 = NVFP4Tensor(codes=a.codes, scales=a.scales, amax=a.amax * 2)
    if triton_device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        c2 = nvfp4_gemm_predequant(a2, b, torch.float32, engine="cublas")
    finally:
        if triton_device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert_bitwise(c2, c1 * 2)


@pytest.mark.triton
def test_gemm_alpha_cublas_exact_dyadic(triton_device, gen):
    """gemm_alpha_cublas on dyadic 16-bit inputs with exact partial sums (as test_gemm_alpha_16bit)."""
    M, N, K = 37, 29, 80
    for dt in (torch.bfloat16, torch.float16):
        a = (torch.randint(-32, 33, (M, K), generator=gen) / 8).to(dt)
        b = (torch.randint(-32, 33, (N, K), generator=gen) / 8).to(dt)
        alpha = torch.tensor([0.37], dtype=torch.float32)
        s = (a.double() @ b.double().t()).float()
        got = gemm_alpha_cublas(a.to(triton_device), b.to(triton_device), alpha.to(triton_device), torch.float32)
        assert_bitwise(got, s * alpha)
        got1 = gemm_alpha_cublas(a.to(triton_device), b.to(triton_device), alpha.to(triton_device), torch.bfloat16)
        assert_bitwise(got1, (s * alpha).to(torch.bfloat16))
        got2 = gemm_alpha_cublas(a.to(triton_device), b.to(triton_device), None, torch.bfloat16)
        assert_bitwise(got2, s.to(torch.bfloat16))


@pytest.mark.triton
def test_public_entry_point_engines(triton_device, gen):
    """nvfp4_gemm runs the engine it is given; on exact-sum inputs every engine gives the reference ("native"
    and "auto" only where the device has no native FP4 GEMM: the Hopper default then)."""
    a, b = exact_sum_operands(gen, 21, 19, 16 * 5, triton_device)
    ref = nvfp4_gemm_ref(to_cpu(a), to_cpu(b), torch.bfloat16)
    dev = torch.device(triton_device)
    for engine in GEMM_ENGINES:
        if resolve_gemm_engine(engine, dev) == "native":
            continue
        assert_bitwise(nvfp4_gemm(a, b, torch.bfloat16, engine=engine), ref, engine)
    with pytest.raises(ValueError, match="GEMM engine 'cuBLAS' is not one of"):
        nvfp4_gemm(a, b, engine="cuBLAS")


@pytest.mark.triton
def test_mxfp4_default_engine_unchanged(triton_device, gen):
    """The MXFP4 GEMM (the Triton 16-bit GEMM) gives the same bits as the cublas engine of the shared GEMM on
    an exact input (E8M0 scales 2^0: values are e2m1, partial sums exact)."""
    from nvfp4_train.kernels.mxfp4.gemm import MX_BLOCK, mxfp4_gemm_triton

    class Q:
        def __init__(self, codes, scales):
            self.codes, self.scales = codes, scales

    from nvfp4_train.kernels.fp4_reference import pack_nibbles

    M, N, K = 9, 11, 64
    qa = Q(pack_nibbles(torch.randint(0, 16, (M, K), generator=gen)).to(triton_device),
           torch.full((M, K // MX_BLOCK), 127, dtype=torch.uint8, device=triton_device))
    qb = Q(pack_nibbles(torch.randint(0, 16, (N, K), generator=gen)).to(triton_device),
           torch.full((N, K // MX_BLOCK), 127, dtype=torch.uint8, device=triton_device))
    dot = "fp32" if triton_device == "cpu" else "bf16"
    base = mxfp4_gemm_triton(qa, qb, torch.float32, dot_dtype=dot)
    cub = predequant_fp4_gemm(qa.codes, qa.scales, qb.codes, qb.scales, block=MX_BLOCK, scale_format="e8m0",
                              alpha=None, out_dtype=torch.float32, dot_dtype=None, fmt_name="MXFP4",
                              engine="cublas")
    assert_bitwise(cub, base)


# ----------------------------------------------------------------------------------------------------------
# GPU only: cuBLAS's split-K reductions stay fp32
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 64), (128, 256), (1024, 512)])
def test_cublas_engine_exact_at_large_k_gpu(gen, shape):
    """K = 20480 (mlp fc2's K) with exact partial sums: every fp32 summation order (split-K included) gives
    the exact sum, so the output must equal nvfp4_gemm_ref bit for bit. A split-K reduction in bf16/fp16
    (what torch's reduced-precision-reduction switches allow for 16-bit OUTPUT) would round partial sums of
    ~10 significant bits and fail here; the switches are turned ON to make sure they do not apply to the
    fp32-output GEMM. Small M x N make cuBLAS's heuristics likely to pick split-K."""
    M, N = shape
    K = 20480
    a, b = exact_sum_operands(gen, M, N, K, "cuda", small=True)
    ref32 = nvfp4_gemm_ref(to_cpu(a), to_cpu(b), torch.float32)
    ref16 = nvfp4_gemm_ref(to_cpu(a), to_cpu(b), torch.bfloat16)
    mm = torch.backends.cuda.matmul
    saved = (mm.allow_bf16_reduced_precision_reduction, mm.allow_fp16_reduced_precision_reduction)
    try:
        mm.allow_bf16_reduced_precision_reduction = True
        mm.allow_fp16_reduced_precision_reduction = True
        for dot in ("bf16", "fp16"):
            assert_bitwise(nvfp4_gemm_predequant(a, b, torch.float32, engine="cublas", dot_dtype=dot), ref32, dot)
            assert_bitwise(nvfp4_gemm_predequant(a, b, torch.bfloat16, engine="cublas", dot_dtype=dot), ref16, dot)
        # the raw accumulator itself (no alpha): the exact sum of the dequantized products
        da, db = dequantize_fp4_blockwise_pair_triton(a.codes, a.scales, b.codes, b.scales, block=16,
                                                      scale_format="e4m3", dtype=torch.bfloat16)
        acc = gemm_alpha_cublas(da, db, None, torch.float32)
        exact = (da.double() @ db.double().t())
        assert torch.equal(acc.double(), exact)
    finally:
        mm.allow_bf16_reduced_precision_reduction, mm.allow_fp16_reduced_precision_reduction = saved


@pytest.mark.gpu
def test_engines_agree_on_exact_inputs_gpu(gen):
    a, b = exact_sum_operands(gen, 513, 767, 16 * 27, "cuda")
    for out_dtype in OUT_DTYPES:
        t = nvfp4_gemm_predequant(a, b, out_dtype, engine="triton")
        c = nvfp4_gemm_predequant(a, b, out_dtype, engine="cublas")
        assert_bitwise(c, t)
        assert_bitwise(c, nvfp4_gemm_ref(to_cpu(a), to_cpu(b), out_dtype))


# ----------------------------------------------------------------------------------------------------------
# (3) errors (no launch)
# ----------------------------------------------------------------------------------------------------------


def _q(m, k):
    return NVFP4Tensor(codes=torch.zeros(m, k // 2, dtype=torch.uint8),
                       scales=torch.zeros(m, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
                       amax=torch.ones(()))


def test_invalid_engine_raises():
    for bad in ("cuBLAS", "torch", "", None):
        with pytest.raises(ValueError, match=r"one of \('cublas', 'triton'\)"):
            nvfp4_gemm_predequant(_q(4, 32), _q(5, 32), engine=bad)
        with pytest.raises(ValueError, match="cublas.*triton"):
            predequant_fp4_gemm(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8),
                                torch.zeros(5, 16, dtype=torch.uint8), torch.zeros(5, 1, dtype=torch.uint8),
                                block=32, scale_format="e8m0", alpha=None, out_dtype=torch.bfloat16,
                                dot_dtype="bf16", engine=bad)
    with pytest.raises(ValueError, match="16-bit operands"):
        nvfp4_gemm_predequant(_q(4, 32), _q(5, 32), engine="cublas", dot_dtype="fp32")
    with pytest.raises(ValueError, match="config"):
        nvfp4_gemm_predequant(_q(4, 32), _q(5, 32), engine="cublas", config=GemmConfig(32, 32, 64, 4, 1))
    # operand errors come before any launch, as for the Triton engine
    k24 = [NVFP4Tensor(codes=torch.zeros(m, 12, dtype=torch.uint8), amax=torch.ones(()),
                       scales=torch.zeros(m, 1, dtype=torch.uint8).view(torch.float8_e4m3fn)) for m in (4, 5)]
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_gemm_predequant(*k24, engine="cublas")


def test_gemm_alpha_cublas_argument_checks():
    a = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="A \\[M, K\\] and B \\[N, K\\]"):
        gemm_alpha_cublas(a, torch.zeros(5, 16, dtype=torch.bfloat16), None)
    with pytest.raises(TypeError, match="dtypes differ"):
        gemm_alpha_cublas(a, torch.zeros(5, 32, dtype=torch.float16), None)
    with pytest.raises(TypeError, match="bfloat16, float16 operands"):
        gemm_alpha_cublas(a.float(), torch.zeros(5, 32), None)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_alpha_cublas(a, torch.zeros(5, 32, dtype=torch.bfloat16), None, torch.float16)
    with pytest.raises(TypeError, match="float32"):
        scale_alpha_triton(torch.zeros(3, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="contiguous"):
        scale_alpha_triton(torch.zeros(4, 6).t(), torch.ones(1), torch.float32)


def test_engine_names_and_resolution():
    assert DEFAULT_GEMM_ENGINE == "cublas"  # the default (measured faster on the H200)
    cpu = torch.device("cpu")
    assert [resolve_gemm_engine(e, cpu) for e in GEMM_ENGINES] == ["cublas", "triton", "cublas", "cublas"]
    for bad in ("CUBLAS", "torch", " triton", "", None):
        # nvfp4_gemm validates on every call, on the reference path (CPU, no interpreter) too
        with pytest.raises(ValueError, match=r"is not one of \('cublas', 'triton', 'native', 'auto'\)"):
            nvfp4_gemm(_q(4, 32), _q(5, 32), engine=bad)
