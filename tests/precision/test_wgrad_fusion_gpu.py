"""The Wgrad GEMM of a quantized layer added into megatron's fp32 ``main_grad`` in cuBLASLt's epilogue
(``LinearContext.wgrad_fusion``, megatron's ``gradient_accumulation_fusion``) against the unfused path (a bf16
weight gradient that megatron's DDP hook adds), on the GPU.

Bound. Both paths quantize the same operands with the same stochastic-rounding keys (same layer stream, same call
count), so dy, x and the fprop/dgrad products are bitwise equal (asserted). The Wgrad accumulators are fp32 sums of
the same exact products (dequantized NVFP4 values are exact in bf16, their products exact in fp32) over the M tokens,
but the two GEMMs (bf16 output vs fp32 output with beta = 1) may run different cuBLASLt algorithms, so their
summation orders differ: |acc_fused - acc_unfused| <= 2 (M - 1) u S with u = 2^-24 and S = sum_m |a_m b_m| the sum of
the products' magnitudes. S is bounded from the bf16 inputs: per 16-token block the RHT is orthonormal, so by
Cauchy-Schwarz sum_blk |a_i||b_i| <= ||a_blk|| ||b_blk|| of the Hadamard-mixed (= the original) block norms, and
quantization grows an element by at most its scale's step: E2M1's largest relative gap 1/2 (between 1 and 1.5 at
the block max scale, plus E4M3 scale rounding 2^-4): a factor (1 + 2^-1)(1 + 2^-4) per operand, so
S <= (1.5 * 1.0625)^2 sum_blk ||dy_blk,n|| ||x_blk,k|| (in the products' real units, alpha included). Then
unfused: main_grad = fl32(C + bf16(p)), p = fl32(alpha * acc); fused: fl32(alpha * acc + C) with one or two fp32
roundings. cuBLASLt's bf16 output is within 1 bf16 ulp of fl32(alpha * acc), not always within half of one
(measured on random operands on an H200, 2026-12-04: up to 0.91 ulp; docs/numerics.md, "Fused step"), so |bf16(p) - p| <= 2^-8 |p|; each fp32 rounding <= 2^-24 of its result:
|fused - unfused| <= 2 (M - 1) u S + 2^-8 |p| + 2^-23 (2|p| + |C|) per element and micro-batch, summed over the
micro-batches (C carrying the earlier ones).
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.precision.linear import LinearContext, QuantLinearFunction
from nvfp4_train.precision.recipe import named_recipe

pytestmark = pytest.mark.gpu


def test_nvfp4_wgrad_into_main_grad_within_bound(gen):
    recipe = named_recipe("nvfp4")
    M, K, N = 512, 384, 272
    w0 = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
    runs = []
    for fused in (False, True):
        w = torch.nn.Parameter(w0.clone().cuda())
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device="cuda")
        lctx = LinearContext(recipe=recipe, seed=1234, wgrad_fusion=fused)
        g = torch.Generator().manual_seed(7)
        ys, dxs, bound = [], [], torch.zeros(N, K, dtype=torch.float64, device="cuda")
        for _ in range(2):  # two micro-batches: the second adds to the first
            x = torch.randn(M, K, generator=g).bfloat16().cuda().requires_grad_()
            dy = torch.randn(M, N, generator=g).bfloat16().cuda()
            w.grad_added_to_main_grad = False
            y = QuantLinearFunction.apply(x, w, None, lctx)
            y.backward(dy)
            if fused:
                assert w.grad_added_to_main_grad
            else:
                assert not w.grad_added_to_main_grad
                w.main_grad += w.grad.float()  # what megatron's DDP hook does
                p = w.grad.double().abs()  # |bf16(p)| within 2^-8 of |p|: the bound's |p| up to that factor
                bound += p * (2.0 ** -8 * (1 + 2.0 ** -7)) + 2.0 ** -23 * (2 * p + w.main_grad.double().abs())
                blk = lambda t: t.double().reshape(M // 16, 16, -1).square().sum(1).sqrt()  # noqa: E731
                s_bound = (1.5 * 1.0625) ** 2 * (blk(dy).t() @ blk(x.detach()))
                bound += 2 * (M - 1) * 2.0 ** -24 * s_bound
            w.grad = None
            ys.append(y.detach())
            dxs.append(x.grad)
        runs.append((ys, dxs, w.main_grad.clone(), bound))
    (y0, dx0, mg0, bound), (y1, dx1, mg1, _) = runs
    assert all(torch.equal(a, b) for a, b in zip(y0, y1)) and all(torch.equal(a, b) for a, b in zip(dx0, dx1))
    diff = (mg1.double() - mg0.double()).abs()
    assert (diff <= bound + 1e-30).all(), float((diff - bound).max())
    assert diff.max() > 0  # the fused path skipped a rounding somewhere (the comparison is not vacuous)


def test_padded_weight_falls_back_to_the_returned_gradient(gen):
    """A weight the recipe pads (N not a multiple of 16) cannot take the padded product in place: the layer returns
    the gradient as without the fusion."""
    recipe = named_recipe("nvfp4")
    w = torch.nn.Parameter((torch.randn(40, 64, generator=gen) * 0.05).bfloat16().cuda())
    w.main_grad = torch.zeros(40, 64, dtype=torch.float32, device="cuda")
    w.grad_added_to_main_grad = False
    lctx = LinearContext(recipe=recipe, seed=3, wgrad_fusion=True, weight_pad=(8, 0))
    x = torch.randn(32, 64, generator=gen).bfloat16().cuda()
    y = QuantLinearFunction.apply(x, w, None, lctx)
    y.backward(torch.randn(y.shape, generator=gen).bfloat16().cuda())
    assert not w.grad_added_to_main_grad and w.grad.shape == (40, 64) and not w.main_grad.any()


@pytest.mark.parametrize("M,N,K", [(272, 384, 512), (64, 48, 4096)])
def test_nvfp4_gemm_accumulate_against_float64(gen, M, N, K):
    """The fused NVFP4 GEMM into an fp32 buffer, and the fp32-output GEMM with C added after, each against the
    float64 value C + alpha * sum_k a_k b_k of the same dequantized operands (exact in bf16, as the GEMM reads them).
    Bounds: an fp32 sum of K exact products in any order is within (K - 1) u S of the exact sum (u = 2^-24,
    S = sum_k |a_k b_k|, computed exactly here); the epilogue's alpha product and the add of C each round once more
    (u of their results)."""
    from nvfp4_train.kernels.fp4_gemm import dequantize_fp4_blockwise_pair_triton
    from nvfp4_train.kernels.nvfp4 import nvfp4_gemm, quantize_nvfp4
    from nvfp4_train.kernels.nvfp4.gemm import nvfp4_gemm_accumulate
    from nvfp4_train.kernels.nvfp4.reference import nvfp4_alpha

    u = 2.0 ** -24
    a = quantize_nvfp4((torch.randn(M, K, generator=gen) * 3).bfloat16().cuda())
    b = quantize_nvfp4((torch.randn(N, K, generator=gen) * 0.02).bfloat16().cuda())
    c = (torch.randn(M, N, generator=gen) * 5).cuda()
    da, db = dequantize_fp4_blockwise_pair_triton(a.codes, a.scales, b.codes, b.scales, block=16,
                                                  scale_format="e4m3", dtype=torch.bfloat16)
    alpha = float(nvfp4_alpha(a.amax, b.amax))
    exact_acc = da.double() @ db.double().t()
    s = da.double().abs() @ db.double().abs().t()
    ref = c.double() + alpha * exact_acc
    bound = alpha * (K - 1) * u * s + u * (alpha * exact_acc.abs() + ref.abs()) * (1 + 4 * u) + 1e-38
    fused = nvfp4_gemm_accumulate(a, b, c.clone())
    p32 = nvfp4_gemm(a, b, out_dtype=torch.float32, engine="cublas")
    ratios = {name: float(((got.double() - ref).abs() / bound).max()) for name, got in (
        ("fused", fused), ("fp32 out + C", c + p32))}
    assert all(r <= 1 for r in ratios.values()), ratios
