"""The quantized linear Function: bf16 is F.linear bitwise; nvfp4 runs exactly the GEMMs of RECIPE §3."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvfp4_train.kernels.nvfp4.reference import (
    dequantize_nvfp4_ref,
    nvfp4_gemm_ref,
    quantize_nvfp4_ref,
    transpose_nvfp4_ref,
)
from nvfp4_train.precision import operand as operand_mod
from nvfp4_train.precision.linear import LinearContext, quantized_linear
from nvfp4_train.precision.recipe import Ablations, apply_ablations, named_recipe


def _inputs(gen, m=32, k=64, n=48, dtype=torch.bfloat16):
    x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=gen).to(dtype)
    return x, w, dy


def test_bf16_is_f_linear_bitwise(gen):
    x, w, dy = _inputs(gen)
    y = quantized_linear(x, w, None, LinearContext(named_recipe("bf16")))
    (gx, gw) = torch.autograd.grad(y, (x, w), dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = F.linear(x2, w2)
    (gx2, gw2) = torch.autograd.grad(y2, (x2, w2), dy)
    assert torch.equal(y, y2) and torch.equal(gx, gx2) and torch.equal(gw, gw2)


class _Capture:
    """Records the operands every GEMM of the layer receives."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.engines = []
        real = operand_mod.qgemm

        def spy(a, b, out_dtype, engine):
            self.calls.append((a, b))
            self.engines.append(engine)
            return real(a, b, out_dtype, engine)

        monkeypatch.setattr("nvfp4_train.precision.linear.qgemm", spy)


def _same_q(a, b):
    return (torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
            and torch.equal(a.amax, b.amax))


def test_nvfp4_gemm_operands_are_recipe_section_3(gen, monkeypatch):
    cap = _Capture(monkeypatch)
    x, w, dy = _inputs(gen)
    lctx = LinearContext(named_recipe("nvfp4"), seed=3)
    y = quantized_linear(x, w, None, lctx)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    (fa, fb), (da, db), (wa, wb) = cap.calls
    xd, wd, dyd = x.detach(), w.detach(), dy
    # fprop: x 1x16 RNE, W 16x16 RNE
    assert _same_q(fa.data, quantize_nvfp4_ref(xd))
    assert _same_q(fb.data, quantize_nvfp4_ref(wd, block_2d=True))
    # the forward output is the NVFP4 GEMM of those operands, and that equals the dequantized product
    assert torch.equal(y, nvfp4_gemm_ref(fa.data, fb.data, torch.bfloat16))
    exact = dequantize_nvfp4_ref(fa.data).double() @ dequantize_nvfp4_ref(fb.data).double().t()
    # bf16 output: half an ulp of bf16 (2^-9 relative) + fp32 roundings
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()
    # dgrad: W^T is fprop's quantized W, transposed (the same values), dy 1x16 stochastic
    assert _same_q(db.data, transpose_nvfp4_ref(fb.data))
    assert torch.equal(dequantize_nvfp4_ref(db.data), dequantize_nvfp4_ref(fb.data).t())
    seed = (3 * 1_000_003 + 1 * 7_919) & 0xFFFFFFFF  # LinearContext.next_seed() for the first call
    sr_row, sr_col = (((seed + 4) * 2) & 0xFFFFFFFF), (((seed + 4) * 2 + 1) & 0xFFFFFFFF)
    assert _same_q(da.data, quantize_nvfp4_ref(dyd, stochastic=True, seed=sr_row))
    # wgrad: dy columnwise with RHT and stochastic rounding; x columnwise with RHT, RNE; own amaxes
    assert _same_q(wa.data, quantize_nvfp4_ref(dyd.t(), rht=True, stochastic=True, seed=sr_col))
    assert _same_q(wb.data, quantize_nvfp4_ref(xd.t(), rht=True))
    assert torch.equal(gx, nvfp4_gemm_ref(da.data, db.data, torch.bfloat16))
    assert torch.equal(gw, nvfp4_gemm_ref(wa.data, wb.data, torch.bfloat16))


# ids: a bare id "triton" would mark the test a Triton one (tests/conftest.py reads the keywords)
@pytest.mark.parametrize("engine", ["cublas", "triton", "native", "auto"], ids=lambda e: f"engine_{e}")
def test_recipe_gemm_engine_reaches_every_gemm(gen, monkeypatch, engine):
    """The recipe's gemm_engine is passed to the three GEMMs; on the reference path (CPU) it does not change
    the result."""
    x, w, dy = _inputs(gen)
    ref = quantized_linear(x, w, None, LinearContext(named_recipe("nvfp4")))
    ref_g = torch.autograd.grad(ref, (x, w), dy)
    cap = _Capture(monkeypatch)
    y = quantized_linear(x, w, None, LinearContext(named_recipe("nvfp4").replace(gemm_engine=engine)))
    g = torch.autograd.grad(y, (x, w), dy)
    assert cap.engines == [engine] * 3
    assert torch.equal(y, ref) and all(torch.equal(a, b) for a, b in zip(g, ref_g, strict=True))


def test_nvfp4_saves_quantized_operands_only(gen):
    x, w, _ = _inputs(gen, m=64, k=128, n=32)
    lctx = LinearContext(named_recipe("nvfp4"))
    quantized_linear(x, w, None, lctx)
    bf16_bytes = x.numel() * 2
    # 4-bit codes + one E4M3 scale per 16 + amax: 0.5625 bytes per element vs 2
    assert lctx.saved_bytes == x.numel() // 2 + x.numel() // 16 + 4
    assert lctx.saved_bytes <= 0.3 * bf16_bytes


def test_weight_quantized_once_per_step(gen, monkeypatch):
    x, w, dy = _inputs(gen)
    lctx = LinearContext(named_recipe("nvfp4"))
    calls = []
    real = operand_mod.cast_pair

    def spy(t, row, col, seed, amax_group=None, engine="cublas", **kw):
        calls.append(tuple(t.shape))
        return real(t, row, col, seed, amax_group, engine, **kw)

    monkeypatch.setattr("nvfp4_train.precision.linear.cast_pair", spy)
    for _ in range(3):  # three micro-batches, one step
        quantized_linear(x, w, None, lctx).backward(dy)
    assert calls.count(tuple(w.shape)) == 1
    with torch.no_grad():
        w.add_(0.01)  # the optimizer step bumps the version counter
    quantized_linear(x, w, None, lctx)
    assert calls.count(tuple(w.shape)) == 2


def test_forward_only_bf16_switch_uses_bf16_fprop(gen):
    x, w, dy = _inputs(gen)
    nv = named_recipe("nvfp4")
    bf = named_recipe("bf16")
    fwd_bf16 = nv.replace(name="nvfp4+fprop_bf16", fprop=bf.fprop)
    y = quantized_linear(x, w, None, LinearContext(fwd_bf16))
    assert torch.equal(y, F.linear(x, w))
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("abl", [
    Ablations(rht=False), Ablations(stochastic_rounding=False), Ablations(weight_2d=False),
    Ablations(rht_all_gemms=True), Ablations(stochastic_rounding_all=True),
])
def test_nvfp4_ablations_run(gen, abl):
    x, w, dy = _inputs(gen)
    r = apply_ablations(named_recipe("nvfp4"), abl)
    y = quantized_linear(x, w, None, LinearContext(r))
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert torch.isfinite(y).all() and torch.isfinite(gx).all() and torch.isfinite(gw).all()


def test_3d_input_and_bias(gen):
    x = torch.randn(4, 8, 32, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(16, 32, generator=gen) * 0.1).bfloat16().requires_grad_()
    b = torch.randn(16, generator=gen).bfloat16().requires_grad_()
    y = quantized_linear(x, w, b, LinearContext(named_recipe("nvfp4")))
    assert y.shape == (4, 8, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(b.grad, torch.full_like(b, 32.0))


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_sr_all", "mxfp4"])
def test_device_call_counter_gives_the_host_bits(gen, recipe):
    """A layer whose LinearContext counts its calls on the device (``call_counter``, what CUDA graphs replay)
    computes bitwise what the host counter gives, over several calls with the weight cache on, and the two
    counters stay equal."""
    if recipe == "nvfp4_sr_all":
        rec = apply_ablations(named_recipe("nvfp4"), Ablations(stochastic_rounding_all=True))
    else:
        rec = named_recipe(recipe)
    x, w, dy = _inputs(gen, m=64, n=64)  # mxfp4's 32x32 weight tiles
    seed = int(torch.randint(0, 2**32, (1,), generator=gen, dtype=torch.int64))
    start = int(torch.randint(0, 2**33, (1,), generator=gen, dtype=torch.int64))
    host = LinearContext(rec, seed=seed, calls=start)
    dev = LinearContext(rec, seed=seed, calls=start, call_counter=torch.tensor(start, dtype=torch.int64))
    for _ in range(3):
        outs = []
        for lctx in (host, dev):
            xi = x.detach().clone().requires_grad_()
            y = quantized_linear(xi, w, None, lctx)
            outs.append((y, *torch.autograd.grad(y, (xi, w), dy)))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        assert host.calls == dev.calls == int(dev.call_counter)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_tensorwise"])
@pytest.mark.parametrize("tensor", ["x", "W", "dy"])
def test_fp8_pair_is_the_two_casts(gen, recipe, tensor):
    """cast_pair takes both FP8 copies of a tensor from one fused read (quantize_fp8_rowcol); they are bit for
    bit the two separate casts (the rowwise copy of t, and t^T cast on its own)."""
    r = named_recipe(recipe)
    row, col = {"x": (r.fprop.a, r.wgrad.b), "W": (r.fprop.b, r.dgrad.b), "dy": (r.dgrad.a, r.wgrad.a)}[tensor]
    t = (torch.randn(256, 384, generator=gen) * 3).to(torch.bfloat16)
    got = operand_mod.cast_pair(t, row, col, (0, 0))
    want = (operand_mod.cast_one(t, row, 0), operand_mod.cast_one(t.t(), col, 0))
    for g, w in zip(got, want):
        assert g.format == w.format == "fp8_e4m3" and g.data.block == w.data.block
        assert torch.equal(g.data.data.view(torch.uint8), w.data.data.view(torch.uint8))
        assert torch.equal(g.data.scale_inv, w.data.scale_inv)
