"""The Wgrad GEMM of a quantized layer added into megatron's fp32 ``main_grad`` in cuBLASLt's epilogue
(``LinearContext.wgrad_fusion``, megatron's ``gradient_accumulation_fusion``) against the unfused path (a bf16
weight gradient that megatron's DDP hook adds), on the GPU.

Bound. Both paths quantize the same operands with the same stochastic-rounding keys (same layer stream, same call
count), so dy, x and the fprop/dgrad products are bitwise equal. The Wgrad accumulator acc is the same fp32 sum up
to summation order (the same cuBLASLt engine and shape: in practice the same bits). Unfused: main_grad =
fl32(C + bf16(fl32(alpha * acc))); fused: fl32(alpha * acc + C) with one or two fp32 roundings. With p =
fl32(alpha * acc): |bf16(p) - p| <= 2^-9 |p| (RNE to 8 significant bits), and each fp32 rounding adds at most 2^-24
of its result, so |fused - unfused| <= 2^-9 |p| + 2^-23 (|p| + |C| + |p|) per element, per micro-batch; over n
micro-batches (C carrying the earlier ones) the bounds add up.
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
                p = w.grad.double().abs()  # |bf16(p)| within 2^-9 of |p|: the bound's |p| up to that factor
                bound += p * (2.0 ** -9 * (1 + 2.0 ** -8)) + 2.0 ** -23 * (2 * p + w.main_grad.double().abs())
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
