"""The MXFP4 Triton GEMM against the reference (``nvfp4_train.kernels.mxfp4.reference.mxfp4_gemm_ref``).

Runs under TRITON_INTERPRET=1 on CPU (fp32 dot: the interpreter's bf16 dot is wrong) and natively on CUDA
(bf16 dot). Operands are built directly from codes and E8M0 scale bytes, and from the reference quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nvfp4_train.kernels.fp4_reference import pack_nibbles
from nvfp4_train.kernels.mxfp4.gemm import mxfp4_gemm_triton
from nvfp4_train.kernels.mxfp4.reference import dequantize_mxfp4_ref, mxfp4_gemm_ref, quantize_mxfp4_ref

pytestmark = pytest.mark.triton

E8M0_ONE = 127


@dataclass
class MX:
    """codes uint8 [M, K/2], scales uint8 E8M0 [M, K/32] (the MXFP4Tensor fields, built by hand)."""

    codes: torch.Tensor
    scales: torch.Tensor
    swizzled: bool = False  # row-major scales, as the Hopper GEMMs take them

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    def rowmajor_scales(self) -> torch.Tensor:
        return self.scales


def make(codes: torch.Tensor, scale_bytes: torch.Tensor, device: str) -> MX:
    return MX(pack_nibbles(codes).to(device), scale_bytes.to(torch.uint8).to(device))


def cpu(q) -> MX:
    return MX(q.codes.cpu(), q.scales.cpu())


def variants(device: str) -> list[dict]:
    """The default dot dtype (bf16 on the GPU, fp32 under the interpreter), and fp32 on the GPU too."""
    return [dict()] + ([dict(dot_dtype="fp32")] if device == "cuda" else [])


def assert_bitwise(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equality, NaN/Inf positions included; the sign of an exact zero is not compared (``+ 0.0``)."""
    got, ref = got.cpu(), ref.cpu()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN positions differ"
    keep = ~torch.isnan(ref)
    g, r = got[keep] + 0.0, ref[keep] + 0.0
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    bad = g.view(bits) != r.view(bits)
    assert not bad.any(), f"{int(bad.sum())} elements differ, e.g. {g[bad][:5].tolist()} vs {r[bad][:5].tolist()}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: Inf * 0 in the interpreter's matmul
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_exact_every_code_times_every_scale_byte(triton_device, out_dtype):
    """A [256, 32]: row m has E8M0 byte m (2^-127 .. 2^127 and NaN) and every code twice; B = the 32x32
    identity (code 2 = 1.0, scale 2^0). Each output is one product plus exact zeros, so C is A's dequantized
    values exactly: the fp32 subnormals of bytes 0..2, and the NaN row. At bytes 253 and 254 the large codes
    overflow to Inf, and Inf times B's zeros makes those whole rows NaN, in the reference as in the kernel."""
    codes = (torch.arange(32)[None, :] + torch.arange(256)[:, None]) % 16
    a = make(codes, torch.arange(256)[:, None], triton_device)
    b = make(torch.eye(32, dtype=torch.int64) * 2, torch.full((32, 1), E8M0_ONE), triton_device)
    ref = mxfp4_gemm_ref(cpu(a), cpu(b), out_dtype)
    expect = dequantize_mxfp4_ref(cpu(a))
    expect[torch.isinf(expect).any(dim=1)] = float("nan")
    assert torch.isnan(expect).any(dim=1).nonzero().flatten().tolist() == [253, 254, 255]
    assert_bitwise(ref, expect.to(out_dtype))
    for kw in variants(triton_device):
        assert_bitwise(mxfp4_gemm_triton(a, b, out_dtype, **kw), ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_exact_partial_sums(triton_device, gen, out_dtype):
    """Random codes, scales 2^j with j in [-2, 2]; odd M, N; K = 32 * odd.

    Every partial sum is exact in fp32: values e2m1 * 2^j are multiples of 2^-3 with |v| <= 24, products
    multiples of 2^-6 with |p| <= 576, so any partial sum of K <= 448 products is a multiple of 2^-6 below
    576 K < 2^18, fewer than 2^24 units: representable, no addition rounds, in any order. Kernel and
    reference (float64 sum, then fp32, then out_dtype) give the same bits."""
    M, N, K = (300, 520, 32 * 13) if triton_device == "cuda" else (37, 45, 32 * 5)
    assert 576 * K < 2**18
    a = make(torch.randint(0, 16, (M, K), generator=gen),
             E8M0_ONE + torch.randint(-2, 3, (M, K // 32), generator=gen), triton_device)
    b = make(torch.randint(0, 16, (N, K), generator=gen),
             E8M0_ONE + torch.randint(-2, 3, (N, K // 32), generator=gen), triton_device)
    ref = mxfp4_gemm_ref(cpu(a), cpu(b), out_dtype)
    for kw in variants(triton_device):
        assert_bitwise(mxfp4_gemm_triton(a, b, out_dtype, **kw), ref)


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def error_bound(a, b, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(C64, bound) in float64 for the fp32 output: |C - C64| <= gamma_K(u) S + gamma_K(2^-53) S + 2^-149,
    S = sum_k |a_k b_k|. The derivation is ``error_bound`` in test_nvfp4_gemm.py without the alpha step
    (products exact in fp32: 2+2 significant bits; any-order fp32 sum: gamma_{K-1} S; the float64 reference's
    own error; an underflowing result's half subnormal). u = 2^-24 (numpy, round to nearest), 2^-22 on the
    GPU's truncating tensor-core accumulation (see there)."""
    K = a.shape[1]
    da = dequantize_mxfp4_ref(cpu(a)).double()
    db = dequantize_mxfp4_ref(cpu(b)).double()
    u = 2.0**-22 if device == "cuda" else 2.0**-24
    c64 = da @ db.t()
    bound = (da.abs() @ db.abs().t()) * (gamma(K, u) + gamma(K, 2.0**-53)) + 2.0**-149
    return c64, bound


@pytest.mark.parametrize("source", ["quantizer", "direct"])
def test_random_within_derived_bound(triton_device, gen, source):
    M, N, K = (1000, 528, 32 * 31) if triton_device == "cuda" else (33, 47, 32 * 7)
    if source == "quantizer":
        def operand(rows):
            x = torch.randn(rows, K, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * 3)
            q = quantize_mxfp4_ref(x)
            return MX(q.codes.to(triton_device), q.scales.to(triton_device))
    else:
        def operand(rows):  # scales spread over 2^-20 .. 2^20, every code
            return make(torch.randint(0, 16, (rows, K), generator=gen),
                        E8M0_ONE + torch.randint(-20, 21, (rows, K // 32), generator=gen), triton_device)
    a, b = operand(M), operand(N)
    c64, bound = error_bound(a, b, triton_device)
    for kw in variants(triton_device):
        c = mxfp4_gemm_triton(a, b, torch.float32, **kw).cpu().double()
        err = (c - c64).abs()
        assert (err <= bound).all(), f"{kw}: max err/bound {float((err / bound).max()):.3g}"
        cb = mxfp4_gemm_triton(a, b, torch.bfloat16, **kw)
        assert_bitwise(cb, c.float().to(torch.bfloat16))


def test_nan_scale_propagates(triton_device, gen):
    a = make(torch.randint(0, 16, (20, 96), generator=gen), torch.full((20, 3), E8M0_ONE), triton_device)
    b = make(torch.randint(0, 16, (18, 96), generator=gen), torch.full((18, 3), E8M0_ONE - 1), triton_device)
    a.scales[3, 1] = 0xFF
    b.scales[5, 2] = 0xFF
    ref = mxfp4_gemm_ref(cpu(a), cpu(b), torch.float32)
    assert torch.isnan(ref).sum() == 18 + 20 - 1
    for kw in variants(triton_device):
        assert_bitwise(mxfp4_gemm_triton(a, b, torch.float32, **kw), ref)


def test_public_dispatch(triton_device, gen):
    """``nvfp4_train.kernels.mxfp4.mxfp4_gemm`` runs this kernel on the Triton device."""
    from nvfp4_train.kernels.mxfp4 import mxfp4_gemm

    a = make(torch.randint(0, 16, (9, 64), generator=gen), torch.full((9, 2), E8M0_ONE), triton_device)
    b = make(torch.randint(0, 16, (7, 64), generator=gen), torch.full((7, 2), E8M0_ONE), triton_device)
    assert_bitwise(mxfp4_gemm(a, b, torch.float32), mxfp4_gemm_ref(cpu(a), cpu(b), torch.float32))


def test_bad_inputs_raise(triton_device):
    def q(m, k):
        return MX(torch.zeros(m, k // 2, dtype=torch.uint8, device=triton_device),
                  torch.zeros(m, max(k // 32, 1), dtype=torch.uint8, device=triton_device))

    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        mxfp4_gemm_triton(q(4, 48), q(5, 48))
    with pytest.raises(ValueError, match="reduction dims differ"):
        mxfp4_gemm_triton(q(4, 32), q(5, 64))
    with pytest.raises(ValueError, match="fp16"):
        mxfp4_gemm_triton(q(4, 32), q(5, 32), dot_dtype="fp16")
    if triton_device == "cpu":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            mxfp4_gemm_triton(q(4, 32), q(5, 32), dot_dtype="bf16")
