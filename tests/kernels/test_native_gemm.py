"""The native FP4 GEMM engine (``gemm_engine=native``): its torch call, checked on meta tensors by torch's own
argument checks; a CPU emulation of that call from the swizzled operands (un-swizzle, dequantize, fp32 matmul,
alpha) against our Hopper GEMM's reference (``nvfp4_gemm_ref`` / ``mxfp4_gemm_ref``): bitwise on exact-sum
inputs, within a derived bound on random ones; the engine choice (``native`` refuses below sm_100 with the
compute capability in the message, ``auto`` picks it only on sm_100+). The ``gpu`` tests run the real call
where a GPU is present (Blackwell: against the reference; Hopper: the refusal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvfp4_train.kernels.fp4_native import check_native_fp4, native_fp4_supported
from nvfp4_train.kernels.gemm_engine import resolve_gemm_engine
from nvfp4_train.kernels.fp4_reference import pack_nibbles
from nvfp4_train.kernels.mxfp4 import MXFP4Tensor, mxfp4_gemm, mxfp4_gemm_ref, quantize_mxfp4
from nvfp4_train.kernels.mxfp4.native import emulate_mxfp4_scaled_mm, mxfp4_gemm_native, mxfp4_native_args
from nvfp4_train.kernels.mxfp4.reference import swizzle_mxfp4
from nvfp4_train.kernels.nvfp4 import (
    NVFP4Tensor,
    nvfp4_alpha,
    nvfp4_gemm,
    nvfp4_gemm_ref,
    quantize_nvfp4,
)
from nvfp4_train.kernels.nvfp4.native import emulate_nvfp4_scaled_mm, nvfp4_gemm_native, nvfp4_native_args
from nvfp4_train.kernels.nvfp4.reference import _blockwise_values, swizzle_nvfp4

# (M, N, K): M free, N % 16 == 0, K % 32 == 0; K/16 = 10 and 6 pad the scale tiles' 4 columns, M = 37 and
# 130 (and N = 48, 144) pad their 128 rows
SHAPES = [(37, 48, 160), (130, 144, 96), (128, 128, 256), (1, 16, 32)]
OUT_DTYPES = [torch.bfloat16, torch.float32]
U = 2.0**-24


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _pow2_e4m3(gen, n: int, lo: int, hi: int) -> torch.Tensor:
    """n E4M3 scales 2^j, j uniform in [lo, hi] (exact bytes: exponent field j + 7, mantissa 0)."""
    j = torch.randint(lo, hi + 1, (n,), generator=gen)
    return ((j + 7) << 3).to(torch.uint8).view(torch.float8_e4m3fn)


def exact_sum_nvfp4(gen, rows: int, k: int) -> NVFP4Tensor:
    """Random codes (all 16) and power-of-two block scales 2^j, j in [-2, 2]: dequantized values are multiples
    of 2^-3, products multiples of 2^-6 and at most 6*4 * 6*4 = 576 in magnitude, so every partial sum of a
    K <= 256 dot product is a multiple of 2^-6 below 576 * 256 < 2^18: exact in fp32 in any order."""
    codes = torch.randint(0, 16, (rows, k), generator=gen)
    scales = _pow2_e4m3(gen, rows * k // 16, -2, 2).view(rows, k // 16)
    amax = torch.rand((), generator=gen) * 100 + 1e-3
    return NVFP4Tensor(codes=pack_nibbles(codes), scales=scales, amax=amax)


def exact_sum_mxfp4(gen, rows: int, k: int) -> MXFP4Tensor:
    """The MXFP4 analogue: E8M0 scales 2^(byte - 127), byte in [125, 129] (2^-2 .. 2^2): exact sums as above."""
    codes = torch.randint(0, 16, (rows, k), generator=gen)
    scales = torch.randint(125, 130, (rows, k // 32), dtype=torch.uint8, generator=gen)
    return MXFP4Tensor(codes=pack_nibbles(codes), scales=scales)


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
        return [t.to("meta") for t in v]
    return v


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_nvfp4_args_pass_torch_checks(m, n, k, out_dtype):
    """torch's own checks of scaled_mm (its meta function: dtypes, the two-level recipe, swizzle, scale
    counts round_up(rows, 128) * round_up(K/16, 4)) accept our arguments; the output is [M, N] out_dtype."""
    g = torch.Generator().manual_seed(m * 7 + n)
    a = swizzle_nvfp4(exact_sum_nvfp4(g, m, k))
    b = swizzle_nvfp4(exact_sum_nvfp4(g, n, k))
    args = nvfp4_native_args(a, b, out_dtype)
    assert args["mat_b"].stride() == (1, k // 2)  # column-major [K/2, N]: B's codes as they are
    out = F.scaled_mm(**{name: _to_meta(v) for name, v in args.items()})
    assert out.shape == (m, n) and out.dtype == out_dtype
    # not vacuous: one scale byte short is refused by the same checks
    bad = dict(args, scale_a=[args["scale_a"][0][:-1], args["scale_a"][1]])
    with pytest.raises(RuntimeError, match="scale_a must have"):
        F.scaled_mm(**{name: _to_meta(v) for name, v in bad.items()})


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_nvfp4_emulation_equals_reference_exact_sums(gen, m, n, k, out_dtype):
    """From the swizzled operands (either scale layout of the inputs) the emulated native GEMM gives the
    Hopper reference's bits when every partial sum is exact (alpha, its product and both roundings agree)."""
    a, b = exact_sum_nvfp4(gen, m, k), exact_sum_nvfp4(gen, n, k)
    ref = nvfp4_gemm_ref(a, b, out_dtype)
    for qa, qb in ((swizzle_nvfp4(a), swizzle_nvfp4(b)), (a, b)):
        got = emulate_nvfp4_scaled_mm(**nvfp4_native_args(qa, qb, out_dtype))
        assert got.dtype == out_dtype and torch.equal(got, ref)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_nvfp4_emulation_random_within_bound(gen, m, n, k):
    """Quantized random tensors (scales written swizzled by the quantizer), fp32 output. Bound: with s the
    exact dot product and S = sum |a_k b_k| (the products are exact in fp32: <= 12 significant bits, >= 2^-20),
    the emulation's fp32 sum is within gamma_K * S of s (any order, gamma_K = K u / (1 - K u), u = 2^-24), the
    reference's float64 sum within K 2^-53 S, then rounded to fp32 (u |s| + ...); each output is fl(acc * alpha)
    (one more u). So |emu - ref| <= alpha * S * (gamma_K + K 2^-53 + 3.01 u) <= alpha * S * (K + 4) * u * 1.001
    for K <= 256 (the 1.001 also covers S's own float64 rounding)."""
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-8, 9, (m, 1), generator=gen).float())
    w = torch.randn(n, k, generator=gen)
    a = quantize_nvfp4(x, swizzled=True)
    b = quantize_nvfp4(w, block_2d=True, swizzled=True)
    assert a.swizzled and b.swizzled
    got = emulate_nvfp4_scaled_mm(**nvfp4_native_args(a, b, torch.float32)).double()
    ref = nvfp4_gemm_ref(a, b, torch.float32).double()
    alpha = float(nvfp4_alpha(a.amax, b.amax))
    S = _blockwise_values(a).double().abs() @ _blockwise_values(b).double().abs().t()
    bound = alpha * S * (k + 4) * U * 1.001
    assert ((got - ref).abs() <= bound).all()


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_mxfp4_emulation_equals_reference_exact_sums(gen, m, n, k, out_dtype):
    a, b = exact_sum_mxfp4(gen, m, k), exact_sum_mxfp4(gen, n, k)
    ref = mxfp4_gemm_ref(a, b, out_dtype)
    for qa, qb in ((swizzle_mxfp4(a), swizzle_mxfp4(b)), (a, b)):
        args = mxfp4_native_args(qa, qb, out_dtype)
        assert args["scale_a"].dtype == torch.float8_e8m0fnu
        got = emulate_mxfp4_scaled_mm(**args)
        assert got.dtype == out_dtype and torch.equal(got, ref)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_mxfp4_emulation_random_within_bound(gen, m, n, k):
    """As for NVFP4 without alpha: |emu - ref| <= S * (K + 3) * u * 1.001 (fp32 output; E2M1 x 2^X products are
    exact in fp32 here: block scales of randn inputs are far from the fp32 range ends)."""
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-8, 9, (m, 1), generator=gen).float())
    w = torch.randn(n, k, generator=gen)
    a, b = quantize_mxfp4(x, swizzled=True), quantize_mxfp4(w, swizzled=True)
    got = emulate_mxfp4_scaled_mm(**mxfp4_native_args(a, b, torch.float32)).double()
    ref = mxfp4_gemm_ref(a, b, torch.float32).double()
    from nvfp4_train.kernels.mxfp4 import dequantize_mxfp4_ref

    S = dequantize_mxfp4_ref(a).double().abs() @ dequantize_mxfp4_ref(b).double().abs().t()
    assert ((got - ref).abs() <= S * (k + 3) * U * 1.001).all()


def test_native_shape_errors(gen):
    a = exact_sum_nvfp4(gen, 8, 48)  # K = 48: not a multiple of 32
    with pytest.raises(ValueError, match="K % 32 == 0 and N % 16 == 0"):
        nvfp4_native_args(a, a)
    b = exact_sum_nvfp4(gen, 8, 64)  # N = 8
    with pytest.raises(ValueError, match="N % 16 == 0"):
        nvfp4_native_args(b, b)
    with pytest.raises(ValueError, match="reduction dims differ"):
        nvfp4_native_args(a, b)
    with pytest.raises(TypeError, match="out_dtype"):
        nvfp4_native_args(b, exact_sum_nvfp4(gen, 16, 64), torch.float16)


# ----------------------------------------------------------------------------------------------------------
# the engine choice
# ----------------------------------------------------------------------------------------------------------


def _fake_gpu(monkeypatch, cap: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    import nvfp4_train.kernels.gemm_engine

    monkeypatch.setattr(nvfp4_train.kernels.gemm_engine, "_NATIVE_BY_DEVICE", {})  # the per-device cache of the real device


def test_native_refused_on_hopper_with_capability(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert not native_fp4_supported("cuda")
    msg = "gemm_engine=native needs sm_100+ (Blackwell); this GPU is sm_90 (NVIDIA H200): use gemm_engine=auto"
    with pytest.raises(ValueError) as e:
        check_native_fp4("cuda")
    assert str(e.value).startswith(msg)
    assert resolve_gemm_engine("auto", torch.device("cuda", 0)) == "cublas"


def test_auto_picks_native_on_blackwell(monkeypatch):
    for cap in ((10, 0), (10, 3), (12, 0)):
        _fake_gpu(monkeypatch, cap, "NVIDIA B200")
        assert native_fp4_supported("cuda")
        check_native_fp4("cuda")
        assert resolve_gemm_engine("native", torch.device("cuda", 0)) == "native"
    assert resolve_gemm_engine("triton", torch.device("cuda", 0)) == "triton"  # an explicit Hopper engine stays


def test_engine_on_cpu(gen, monkeypatch):
    """On CPU ``native`` is refused (also by the public GEMMs and the native calls), ``auto`` is the exact path:
    the reference's bits."""
    assert not native_fp4_supported("cpu")
    with pytest.raises(ValueError, match="this is a cpu device"):
        check_native_fp4("cpu")
    a, b = exact_sum_nvfp4(gen, 20, 64), exact_sum_nvfp4(gen, 16, 64)
    ma, mb = exact_sum_mxfp4(gen, 20, 64), exact_sum_mxfp4(gen, 16, 64)
    with pytest.raises(ValueError, match="sm_100"):
        nvfp4_gemm_native(a, b)
    with pytest.raises(ValueError, match="sm_100"):
        mxfp4_gemm_native(ma, mb)
    for engine in ("native", "auto"):  # the public GEMMs on CPU: the reference path whatever the engine
        assert torch.equal(nvfp4_gemm(a, b, engine=engine), nvfp4_gemm_ref(a, b))
        assert torch.equal(nvfp4_gemm(swizzle_nvfp4(a), b, engine=engine), nvfp4_gemm_ref(a, b))  # both layouts
        assert torch.equal(mxfp4_gemm(ma, mb, engine=engine), mxfp4_gemm_ref(ma, mb))
    with pytest.raises(ValueError, match="'Native' is not one of"):
        nvfp4_gemm(a, b, engine="Native")


def test_operands_swizzled_only_for_native(monkeypatch):
    """The layer's casts write swizzled scales exactly when the recipe's engine resolves to native: never on
    CPU; on a (faked) sm_100 device for "native" and "auto" (the resolution the casts call)."""
    import nvfp4_train.precision.operand as operand
    from nvfp4_train.precision.operand import cast_one
    from nvfp4_train.precision.recipe import OperandCast

    x = torch.randn(32, 64)
    cast = OperandCast(format="nvfp4", block=(1, 16), rounding="nearest")
    for engine in ("native", "auto", "cublas", "triton"):
        assert not cast_one(x, cast, seed=0, engine=engine).data.swizzled
    monkeypatch.setattr(operand, "resolve_gemm_engine", lambda e, d: "native")
    for engine in ("native", "auto"):
        q = cast_one(x, cast, seed=0, engine=engine).data
        assert q.swizzled
        rowmajor = cast_one(x, cast, seed=0).data.scales
        assert torch.equal(q.rowmajor_scales().view(torch.uint8), rowmajor.view(torch.uint8))
    for engine in ("cublas", "triton"):
        assert not cast_one(x, cast, seed=0, engine=engine).data.swizzled


# ----------------------------------------------------------------------------------------------------------
# on a GPU: the real call (Blackwell), or the refusal (Hopper and older)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_native_on_this_gpu(gen, monkeypatch, out_dtype):
    """sm_100+: the native GEMMs equal the reference bitwise on exact-sum inputs (the quantizer's swizzled
    scales included). Below: ``native`` raises the capability error and ``auto`` runs the exact BF16 engine."""
    dev = torch.device("cuda")
    cpu_a, cpu_b = exact_sum_nvfp4(gen, 300, 256), exact_sum_nvfp4(gen, 144, 256)
    cpu_ma, cpu_mb = exact_sum_mxfp4(gen, 300, 256), exact_sum_mxfp4(gen, 144, 256)
    a, b = (NVFP4Tensor(q.codes.to(dev), q.scales.to(dev), q.amax.to(dev)) for q in (cpu_a, cpu_b))
    ma, mb = (MXFP4Tensor(q.codes.to(dev), q.scales.to(dev)) for q in (cpu_ma, cpu_mb))
    ref = nvfp4_gemm_ref(cpu_a, cpu_b, out_dtype)
    mref = mxfp4_gemm_ref(cpu_ma, cpu_mb, out_dtype)
    if native_fp4_supported(dev):
        assert torch.equal(nvfp4_gemm_native(a, b, out_dtype).cpu(), ref)
        assert torch.equal(nvfp4_gemm_native(swizzle_nvfp4(a), swizzle_nvfp4(b), out_dtype).cpu(), ref)
        assert torch.equal(mxfp4_gemm_native(ma, mb, out_dtype).cpu(), mref)
        assert resolve_gemm_engine("auto", dev) == "native"
        assert torch.equal(nvfp4_gemm(a, b, out_dtype, engine="auto").cpu(), ref)
        x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
        q = quantize_nvfp4(x, swizzled=True)
        assert torch.equal(q.rowmajor_scales().cpu().view(torch.uint8),
                           quantize_nvfp4(x).scales.cpu().view(torch.uint8))
        # zero and subnormal E4M3 block scales: B picks one element of A per output (B[n, k] = 1 iff k == n),
        # so C[m, n] = alpha * a[m, n] * sa exactly
        k = 64
        za = exact_sum_nvfp4(gen, 128, k)
        za.scales = torch.randint(0, 8, za.scales.shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
        eye = NVFP4Tensor(codes=pack_nibbles(torch.eye(k, dtype=torch.uint8) * 2), amax=torch.tensor(2688.0),
                          scales=torch.full((k, k // 16), 1.0).to(torch.float8_e4m3fn))
        zref = nvfp4_gemm_ref(za, eye, torch.float32)
        zd, ed = (NVFP4Tensor(q.codes.to(dev), q.scales.to(dev), q.amax.to(dev)) for q in (za, eye))
        assert torch.equal(nvfp4_gemm_native(zd, ed, torch.float32).cpu(), zref)
        # random inputs: within the bound of test_nvfp4_emulation_random_within_bound (K = 512); a tensor core
        # that accumulated a block-scaled MMA in less than fp32 would show here
        wq = quantize_nvfp4(torch.randn(144, 512, device=dev), block_2d=True, swizzled=True)
        qc = NVFP4Tensor(q.codes.cpu(), q.rowmajor_scales().cpu(), q.amax.cpu())
        wc = NVFP4Tensor(wq.codes.cpu(), wq.rowmajor_scales().cpu(), wq.amax.cpu())
        got = nvfp4_gemm_native(q, wq, torch.float32).cpu().double()
        r32 = nvfp4_gemm_ref(qc, wc, torch.float32).double()
        S = _blockwise_values(qc).double().abs() @ _blockwise_values(wc).double().abs().t()
        assert ((got - r32).abs() <= float(nvfp4_alpha(qc.amax, wc.amax)) * S * (512 + 4) * U * 1.001).all()
    else:
        major, minor = torch.cuda.get_device_capability(dev)
        with pytest.raises(ValueError, match=rf"needs sm_100\+ \(Blackwell\); this GPU is sm_{major}{minor} "):
            nvfp4_gemm_native(a, b, out_dtype)
        with pytest.raises(ValueError, match=rf"this GPU is sm_{major}{minor}"):
            mxfp4_gemm_native(ma, mb, out_dtype)
        with pytest.raises(ValueError, match=rf"this GPU is sm_{major}{minor}"):
            nvfp4_gemm(a, b, out_dtype, engine="native")
        assert resolve_gemm_engine("auto", dev) == "cublas"
        # exact sums: the cublas engine's bits too
        assert torch.equal(nvfp4_gemm(a, b, out_dtype, engine="auto").cpu(), ref)
