"""The FP8 Wgrad GEMM added into an fp32 ``main_grad`` in cuBLASLt's epilogue (``kernels/fp8/gemm.py:
fp8_gemm_accumulate``, ``kernels/cublaslt.py: matmul_fp8_scaled``).

CPU tests (unmarked): the scales handed to cuBLASLt decode, in each mode's documented layout, to every element's
decode scale of its operand, for each scaling pair the FP8 recipes form; the argument checks; a CPU operand is
never fused. GPU tests: exact on exactly summable operands (small integers, power-of-two block scales: every
partial sum exact in fp32, so any summation order gives C + the emulation bit for bit), and an FP8 layer's fused
``main_grad`` against the unfused path within the bound of ``docs/numerics.md`` ("Fused step").
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.cublaslt import (
    SCALE_BLK128x128_32F,
    SCALE_SCALAR_32F,
    SCALE_VEC128_32F,
    matmul_fp8_scaled,
)
from nvfp4_train.kernels.fp8 import FP8Tensor, fp8_gemm_accumulate, fp8_gemm_ref
from nvfp4_train.kernels.fp8.gemm import cublas_scales
from nvfp4_train.kernels.fp8.reference import m_major

ONE_BY, TILE = (1, 128), (128, 128)
# (A's block, B's block): the recipes' Wgrad pairs (1x128 x 1x128, per tensor) and the others fp8_gemm maps
PAIRS = [(None, None), (ONE_BY, ONE_BY), (ONE_BY, TILE), (TILE, ONE_BY), (TILE, TILE), (None, ONE_BY)]


def operand(gen: torch.Generator, rows: int, k: int, block, device="cpu") -> FP8Tensor:
    """Small integers with power-of-two decode scales that differ per block (so a misplaced scale changes sums)."""
    data = torch.randint(-4, 5, (rows, k), generator=gen).to(torch.float32).to(torch.float8_e4m3fn)
    shape = {None: (), ONE_BY: (rows, k // 128), TILE: (rows // 128, k // 128)}[block]
    scale = torch.exp2(torch.randint(-3, 4, shape, generator=gen).to(torch.float32))
    if block == ONE_BY:
        scale = m_major(scale)
    return FP8Tensor(data=data.to(device), scale_inv=scale.to(device), block=block)


def element_scales(q: FP8Tensor) -> torch.Tensor:
    """Each element's decode scale, [rows, k] fp32."""
    rows, k = q.shape
    s = q.scale_inv.float()
    if q.block is None:
        return s.reshape(1, 1).expand(rows, k)
    if q.block == ONE_BY:
        return s.repeat_interleave(128, dim=1)
    return s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)


def decode(scales: torch.Tensor, mode: int, rows: int, k: int) -> torch.Tensor:
    """Each element's scale as cuBLASLt reads ``scales`` in ``mode`` from memory (cublasLt.h's layouts: VEC128
    element (r, kb) at kb * rows + r; BLK128x128 tile (rb, kb) at rb * Kp + kb, Kp = K/128 rounded up to 4)."""
    flat = scales.as_strided((scales.untyped_storage().nbytes() // 4 - scales.storage_offset(),), (1,))
    r = torch.arange(rows)[:, None]
    kb = (torch.arange(k) // 128)[None, :]
    if mode == SCALE_SCALAR_32F:
        return flat[0].expand(rows, k)
    if mode == SCALE_VEC128_32F:
        return flat[kb * rows + r]
    assert mode == SCALE_BLK128x128_32F
    kp = (k // 128 + 3) // 4 * 4
    return flat[(r // 128) * kp + kb]


@pytest.mark.parametrize("blocks", PAIRS)
@pytest.mark.parametrize("k", [512, 384])  # K/128 a multiple of 4, and not (the 128x128 scales' padding)
def test_cublas_scales_decode_to_each_elements_scale(gen, blocks, k):
    m, n = 256, 384
    a, b = operand(gen, m, k, blocks[0]), operand(gen, n, k, blocks[1])
    sa, ma, sb, mb = cublas_scales(a, b)
    assert sa.dtype == sb.dtype == torch.float32
    assert (ma == SCALE_SCALAR_32F) == (mb == SCALE_SCALAR_32F) == (blocks == (None, None))
    assert not (ma == mb == SCALE_BLK128x128_32F)  # Hopper has no 128x128 x 128x128 FP8 GEMM
    assert torch.equal(decode(sa, ma, m, k), element_scales(a))
    assert torch.equal(decode(sb, mb, n, k), element_scales(b))


def test_cpu_operands_are_not_fused(gen):
    a, b = operand(gen, 128, 256, ONE_BY), operand(gen, 128, 256, ONE_BY)
    c = torch.ones(128, 128)
    assert fp8_gemm_accumulate(a, b, c) is False
    assert torch.equal(c, torch.ones(128, 128))


def test_matmul_fp8_scaled_argument_errors():
    a = torch.zeros(16, 128).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="one CUDA device"):
        matmul_fp8_scaled(a, a, one, SCALE_SCALAR_32F, one, SCALE_SCALAR_32F)


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", PAIRS)
@pytest.mark.parametrize("m,n,k", [(256, 384, 512), (128, 256, 384), (512, 128, 1024)])
def test_accumulate_exact_on_summable_operands(gen, blocks, m, n, k):
    a, b = operand(gen, m, k, blocks[0], "cuda"), operand(gen, n, k, blocks[1], "cuda")
    c0 = torch.randint(-64, 65, (m, n), generator=gen).to(torch.float32).cuda()
    c = c0.clone()
    assert fp8_gemm_accumulate(a, b, c)
    assert torch.equal(c, c0 + fp8_gemm_ref(a, b, torch.float32))


@pytest.mark.gpu
def test_accumulate_refuses_what_hopper_cannot_and_writes_nothing(gen):
    a, b = operand(gen, 250, 256, None, "cuda"), operand(gen, 128, 256, None, "cuda")  # M not a multiple of 16
    c = torch.full((250, 128), 3.0, device="cuda")
    assert not fp8_gemm_accumulate(a, b, c)
    assert torch.equal(c, torch.full_like(c, 3.0))
    a = operand(gen, 256, 256, None, "cuda")
    assert not fp8_gemm_accumulate(a, b, torch.zeros(256, 128, device="cuda", dtype=torch.bfloat16))  # not fp32


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["fp8", "fp8_tensorwise"])
def test_fp8_layer_wgrad_into_main_grad_within_bound(gen, recipe_name):
    """Two micro-batches through a QuantLinearFunction with and without the fusion: the forward outputs and input
    gradients are bitwise equal (the fusion touches only Wgrad); main_grad within the bound of docs/numerics.md,
    with S = sum_m |a_m b_m| from the layer's own Wgrad operands (FP8 quantization is deterministic)."""
    from nvfp4_train.precision.linear import LinearContext, QuantLinearFunction
    from nvfp4_train.precision.operand import cast_pair
    from nvfp4_train.kernels.fp8 import dequantize_fp8
    from nvfp4_train.precision.recipe import named_recipe

    recipe = named_recipe(recipe_name)
    M, K, N = 512, 384, 256
    w0 = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
    data = [(torch.randn(M, K, generator=gen).bfloat16(), torch.randn(M, N, generator=gen).bfloat16())
            for _ in range(2)]
    runs = []
    bound = torch.zeros(N, K, dtype=torch.float64, device="cuda")
    for fused in (False, True):
        w = torch.nn.Parameter(w0.clone().cuda())
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device="cuda")
        lctx = LinearContext(recipe=recipe, seed=99, wgrad_fusion=fused)
        ys, dxs = [], []
        for x_cpu, dy_cpu in data:
            x, dy = x_cpu.cuda().requires_grad_(), dy_cpu.cuda()
            w.grad_added_to_main_grad = False
            y = QuantLinearFunction.apply(x, w, None, lctx)
            y.backward(dy)
            assert w.grad_added_to_main_grad == fused
            if not fused:
                w.main_grad += w.grad.float()  # megatron's DDP hook
                # the unfused path's bf16 rounding of p (within 2^-8 |p|, |p| read back from bf16 up to 1 + 2^-7)
                # and the fp32 roundings of both adds (2^-24 each of |result| <= 2|p| + |C|)
                p = w.grad.double().abs()
                bound += p * (2.0 ** -8 * (1 + 2.0 ** -7)) + 2.0 ** -23 * (2 * p + w.main_grad.double().abs())
                _, a = cast_pair(dy, None, recipe.wgrad.a, (0, 0), None, recipe.gemm_engine)
                _, b = cast_pair(x.detach(), None, recipe.wgrad.b, (0, 0), None, recipe.gemm_engine)
                s = dequantize_fp8(a.data).double().abs() @ dequantize_fp8(b.data).double().abs().t()
                # each GEMM's accumulator within (128 u_tc + (Kb + 2) u) S of the exact sum (kernels/fp8/gemm.py:
                # u_tc = 2^-13 per 128-long block in the tensor cores, fp32 u = 2^-24 across the Kb blocks): twice
                kb = M // 128
                bound += 2 * (128 * 2.0 ** -13 + (kb + 2) * 2.0 ** -24) * s
            w.grad = None
            ys.append(y.detach())
            dxs.append(x.grad)
        runs.append((ys, dxs, w.main_grad.clone()))
    (ys0, dxs0, g0), (ys1, dxs1, g1) = runs
    assert all(torch.equal(u, v) for u, v in zip(ys0, ys1))
    assert all(torch.equal(u, v) for u, v in zip(dxs0, dxs1))
    assert ((g1.double() - g0.double()).abs() <= bound).all()
    assert not torch.equal(g0, torch.zeros_like(g0))
