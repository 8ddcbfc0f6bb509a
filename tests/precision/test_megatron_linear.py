"""The megatron quantized layers at TP=1: bf16 is the stock layer bit for bit; nvfp4 computes the dequantized
product of RECIPE §3's operands; set_recipe keeps the parameters; shapes a recipe cannot take are refused."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from nvfp4_train.kernels.nvfp4.reference import dequantize_nvfp4_ref, quantize_nvfp4_ref
from nvfp4_train.precision.megatron_linear import (
    QuantColumnParallelLinear,
    QuantRowParallelLinear,
    invalidate_weight_caches,
    quant_layers,
    recipe_padding,
    recipe_shape_problems,
    set_sr_streams,
    set_weight_cache,
    token_block,
)
from nvfp4_train.precision.recipe import BF16, Ablations, apply_ablations, named_recipe
from tests.precision.mcore_util import column, config, megatron_single_rank, row


@pytest.fixture(scope="module", autouse=True)
def mcore():
    with megatron_single_rank():
        yield


def _pair(cls_col, cls_row, cfg, bias, **extra):
    fc1 = column(cls_col, 64, 128, cfg, bias=bias, **extra.get("fc1", {}))
    fc2 = row(cls_row, 128, 64, cfg, bias=bias, **extra.get("fc2", {}))
    return fc1, fc2


def _copy_params(dst, src):
    with torch.no_grad():
        for (nd, pd), (ns, ps) in zip(dst.named_parameters(), src.named_parameters(), strict=True):
            assert nd == ns
            pd.copy_(ps)


def _run(fc1, fc2, x, dy):
    for p in (*fc1.parameters(), *fc2.parameters()):
        p.grad = None
    x = x.detach().clone().requires_grad_()
    h, _ = fc1(x)
    y, _ = fc2(torch.relu(h))
    y.backward(dy)
    return y, x.grad, [p.grad.clone() for p in (*fc1.parameters(), *fc2.parameters())]


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_stock_layer_bitwise(gen, bias):
    cfg = config()
    stock = _pair(ColumnParallelLinear, RowParallelLinear, cfg, bias)
    ours = _pair(QuantColumnParallelLinear, QuantRowParallelLinear, cfg, bias)
    for a, b in zip(ours, stock):
        assert list(a.state_dict()) == list(b.state_dict())
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
        _copy_params(a, b)
        with torch.no_grad():
            if bias:
                b.bias.normal_(generator=gen)
                a.bias.copy_(b.bias)
    x = torch.randn(16, 2, 64, generator=gen).bfloat16()
    dy = torch.randn(16, 2, 64, generator=gen).bfloat16()
    y0, gx0, gp0 = _run(*stock, x, dy)
    y1, gx1, gp1 = _run(*ours, x, dy)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(gp0, gp1, strict=True))


def test_build_module_from_spec_params():
    cfg = config()
    nv = named_recipe("nvfp4")
    spec = ModuleSpec(module=QuantColumnParallelLinear, params={"recipe": nv, "layer_name": "3.mlp.fc1", "seed": 7})
    fc1 = build_module(spec, 64, 128, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                       gather_output=False, skip_bias_add=True)
    assert isinstance(fc1, ColumnParallelLinear) and fc1.recipe is nv and fc1.layer_name == "3.mlp.fc1"
    spec = ModuleSpec(module=QuantRowParallelLinear, params={"recipe": nv, "layer_name": "3.mlp.fc2"})
    fc2 = build_module(spec, 128, 64, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                       input_is_parallel=True, skip_bias_add=True)
    assert isinstance(fc2, RowParallelLinear) and fc2.recipe is nv
    # different layers draw different stochastic-rounding bits from the same run seed
    assert fc1.lctx.seed != build_module(
        ModuleSpec(module=QuantColumnParallelLinear, params={"recipe": nv, "layer_name": "4.mlp.fc1", "seed": 7}),
        64, 128, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
    ).lctx.seed


def _pow2_scaled(gen, shape, top: float, cap: float) -> torch.Tensor:
    """Random bf16 values with |v| <= cap < top and one element equal to ``top``: ``top = 2688 * 2^k`` makes
    the NVFP4 tensor scale amax/2688 a power of two."""
    t = (torch.randn(shape, generator=gen) * cap / 3).clamp(-cap, cap).bfloat16()
    t.view(-1)[0] = top
    return t


@pytest.mark.parametrize("cls", [QuantColumnParallelLinear, QuantRowParallelLinear])
def test_nvfp4_forward_is_the_dequantized_product(gen, cls):
    """y == bf16(deq(Q1x16(x)) @ deq(Q16x16(W))ᵀ) exactly. Why exact: with both tensor amaxes 2688·2^k
    (2.625 = 2688·2^-10, 0.08203125 = 2688·2^-15, both bf16 values) the tensor scales and alpha are powers of
    two, so dequantized values q·sdec·2^k are exact in fp32, their float64 products (<= 12 significant bits)
    and sums are exact, and the layer's GEMM (fp64 sum -> fp32, times alpha, -> bf16) rounds the same
    number the same two times as the right-hand side (fp64 -> fp32 -> bf16)."""
    cfg = config()
    layer = (column if cls is QuantColumnParallelLinear else row)(cls, 64, 48, cfg,
                                                                    recipe=named_recipe("nvfp4"))
    with torch.no_grad():
        layer.weight.copy_(_pow2_scaled(gen, (48, 64), 2688 * 2.0**-15, 0.08))
    x = _pow2_scaled(gen, (8, 4, 64), 2.625, 2.5)
    y, _ = layer(x)
    qx = quantize_nvfp4_ref(x.reshape(-1, 64))
    qw = quantize_nvfp4_ref(layer.weight.detach(), block_2d=True)
    assert float(qx.amax) == 2.625 and float(qw.amax) == 2688 * 2.0**-15
    expect = (dequantize_nvfp4_ref(qx).double() @ dequantize_nvfp4_ref(qw).double().t()).float().bfloat16()
    assert torch.equal(y, expect.view(8, 4, 48))
    # and the quantized path really ran: the product differs from the bf16 layer's
    assert not torch.equal(y, torch.matmul(x, layer.weight.t()))


def test_set_recipe_keeps_parameters_and_switches_numerics(gen):
    cfg = config()
    nv = named_recipe("nvfp4")
    fc1, fc2 = _pair(QuantColumnParallelLinear, QuantRowParallelLinear, cfg, True,
                     fc1={"recipe": nv, "layer_name": "fc1"}, fc2={"recipe": nv, "layer_name": "fc2"})
    stock = _pair(ColumnParallelLinear, RowParallelLinear, cfg, True)
    for a, b in zip(stock, (fc1, fc2)):
        a.load_state_dict(b.state_dict(), strict=True)  # same keys: checkpoints are precision-free
    x = torch.randn(16, 2, 64, generator=gen).bfloat16()
    dy = torch.randn(16, 2, 64, generator=gen).bfloat16()
    before = {k: v.clone() for m in (fc1, fc2) for k, v in m.state_dict(prefix=m.layer_name + ".").items()
              if v is not None}
    y_nv, _, _ = _run(fc1, fc2, x, dy)
    for m in (fc1, fc2):
        m.set_recipe(BF16)
        assert m.recipe is BF16 and m.lctx.weight_cache.key is None
    after = {k: v for m in (fc1, fc2) for k, v in m.state_dict(prefix=m.layer_name + ".").items() if v is not None}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    y_bf, gx_bf, gp_bf = _run(fc1, fc2, x, dy)
    y_st, gx_st, gp_st = _run(*stock, x, dy)
    assert torch.equal(y_bf, y_st) and torch.equal(gx_bf, gx_st)
    assert all(torch.equal(a, b) for a, b in zip(gp_bf, gp_st, strict=True))
    assert not torch.equal(y_nv, y_bf)
    # and back: the same numbers as before the switch (forward uses RNE only: deterministic)
    for m in (fc1, fc2):
        m.set_recipe(nv)
    y_nv2, _, _ = _run(fc1, fc2, x, dy)
    assert torch.equal(y_nv, y_nv2)


@pytest.mark.parametrize(
    "recipe, n, k, pads",
    [
        ("nvfp4", 40, 64, (8, 0)),
        ("nvfp4", 64, 72, (0, 8)),
        ("mxfp4", 48, 64, (16, 0)),
        ("fp8", 64, 200, (64, 56)),
        ("fp8_tensorwise", 7, 13, (0, 0)),
    ],
)
def test_odd_shapes_are_zero_padded_exactly(gen, recipe, n, k, pads):
    """A dim that is not a multiple of its block is zero-padded (recipe_padding): the output equals the layer's
    output on the same weight explicitly padded with further zeros up to the GEMM's own summation order (zeros
    change no amax, no block scale of a real element), and the padded columns never reach the caller."""
    cfg = config()
    r = named_recipe(recipe)
    assert recipe_padding(r, n, k) == pads
    layer = column(QuantColumnParallelLinear, k, n, cfg, recipe=r, layer_name="7.mlp.fc1")
    x = torch.randn(4, 32, k, generator=gen).bfloat16()
    y = layer(x)[0]
    assert y.shape == (4, 32, n)
    assert y.is_contiguous()  # what the consumers and the layer's non-finite check kernel take without a copy
    # the same layer with 128 extra zero rows and columns in W (and x) computes the same values
    big = column(QuantColumnParallelLinear, k + 128, n + 128, cfg, recipe=r, layer_name="7.mlp.fc1")
    with torch.no_grad():
        big.weight.zero_()
        big.weight[:n, :k] = layer.weight
    y_big = big(torch.nn.functional.pad(x, (0, 128)))[0][..., :n]
    # The quantized operands are the same (zeros change no amax, no scale of a real element), but the two GEMMs
    # sum k and k + 128 terms in different orders: the CPU engines round the sum in float64 (products of quantized
    # values times fp32 scales are not exact there), so an output that cancels to ~0 can differ before its bf16
    # rounding. Bound: |q(v)| <= 2 amax(v) for every recipe here (a block scale rounds the block's max up by at
    # most x2, E8M0), so the float64 sums differ by at most eps = (k + 128) * 2^-53 * k * 4 amax(x) amax(W), and
    # the two bf16 roundings add at most one bf16 ulp, <= 2^-7 of the larger magnitude.
    eps = (k + 128) * 2.0**-53 * k * 4 * float(x.abs().max()) * float(layer.weight.detach().abs().max())
    diff = (y.double() - y_big.double()).abs()
    mag = torch.maximum(y.double().abs(), y_big.double().abs())
    assert bool((diff <= eps + 2.0**-7 * mag).all()), float((diff - eps - 2.0**-7 * mag).max())


def test_padded_layer_weight_cache_hits_and_keeps_gradients(gen, monkeypatch):
    """A padded layer with the weight cache on quantizes its weight once per optimizer step, whatever the
    allocator does: the cache is keyed on the parameter, not on a padded copy (a key on the copy's address hit
    on some tensor-parallel ranks and missed on others, and the miss's amax all-reduce then hung, seen with
    TP=2 during validation). Forward and gradients equal those of the uncached layer bitwise."""
    import nvfp4_train.precision.linear as lin

    r = named_recipe("nvfp4")
    n, k = 40, 64
    assert recipe_padding(r, n, k) == (8, 0)
    layer = column(QuantColumnParallelLinear, k, n, config(), recipe=r, layer_name="7.mlp.fc1")
    x = torch.randn(2, 16, k, generator=gen).bfloat16()
    dy = torch.randn(2, 16, n, generator=gen).bfloat16()

    def fwd_bwd():
        xi = x.clone().requires_grad_(True)
        layer.weight.grad = None
        layer.lctx.calls = 0  # the same stochastic-rounding draws of dy at every call
        y = layer(xi)[0]
        y.backward(dy)
        return y.detach(), xi.grad, layer.weight.grad.clone()

    ref = fwd_bwd()  # cache off: the weight is quantized at every call
    weight_casts = []
    real = lin.cast_pair
    monkeypatch.setattr(lin, "cast_pair", lambda t, *a, **kw: (weight_casts.append(t.shape) if t.shape == (
        n + 8, k) else None) or real(t, *a, **kw))
    set_weight_cache(layer, True)
    # padded copies made between the calls: the allocator may hand their addresses around
    outs = [fwd_bwd() for _ in range(3) if torch.zeros(n + 8, k).sum() == 0]
    assert len(weight_casts) == 1, weight_casts
    assert layer.weight.grad.shape == (n, k)
    for got in outs:
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    invalidate_weight_caches(layer)
    fwd_bwd()
    assert len(weight_casts) == 2


def test_shape_rules():
    # per-tensor fp8 takes any shape; every fp4 operand block must divide its dims
    assert recipe_shape_problems(named_recipe("fp8_tensorwise"), 7, 13) == []
    assert recipe_shape_problems(named_recipe("nvfp4"), 48, 32) == []
    assert recipe_shape_problems(named_recipe("mxfp4"), 32, 96) == []
    # the 1-D-weight ablation still blocks W along N (dgrad's Wᵀ is blocked along N)
    w1d = apply_ablations(named_recipe("nvfp4"), Ablations(weight_2d=False))
    assert any("N=24" in p for p in recipe_shape_problems(w1d, 24, 32))
    assert [token_block(named_recipe(r)) for r in ("bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4")] == [
        1, 128, 1, 16, 32]


def test_token_count_checked_at_forward(gen):
    layer = column(QuantColumnParallelLinear, 64, 32, config(), recipe=named_recipe("nvfp4"), layer_name="L")
    with pytest.raises(ValueError, match=r"'L'.*M=12 tokens.*multiple of 16"):
        layer(torch.randn(6, 2, 64, generator=gen).bfloat16())


def _dyadic(gen, *shape) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2] (exact in bf16): every product is a multiple of 2^-6 and every sum over the
    <= 64 tokens below is exact in fp32 and in bf16's range of those values (|sum| <= 256, at most 14 bits)."""
    return (torch.randint(-16, 17, shape, generator=gen) / 8).bfloat16()


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_gradient_accumulation_fusion(gen, kind, recipe):
    """megatron's ``gradient_accumulation_fusion``: a bf16 layer (megatron's own fused path, our stand-in for
    APEX's kernel) adds dy^T x into the weight's fp32 ``main_grad`` and returns megatron's dummy gradient with
    ``grad_added_to_main_grad`` set; on CPU a quantized layer keeps returning its gradient (its fused Wgrad is a
    cuBLASLt epilogue, CUDA only: tests/precision/test_wgrad_fusion_gpu.py). Dyadic inputs make every sum exact,
    so the accumulated fp32 gradient equals float64's, and a second micro-batch adds to the first."""
    build = column if kind == "column" else row
    cls = QuantColumnParallelLinear if kind == "column" else QuantRowParallelLinear
    layer = build(cls, 64, 32, config(gradient_accumulation_fusion=True), layer_name="L",
                  recipe=named_recipe(recipe))
    w = layer.weight
    with torch.no_grad():
        w.copy_(_dyadic(gen, *w.shape))
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    expected = torch.zeros(w.shape, dtype=torch.float64)
    for _ in range(2):
        w.grad_added_to_main_grad = False
        x, dy = _dyadic(gen, 16, 2, 64), _dyadic(gen, 16, 2, 32)
        y, _ = layer(x)
        y.backward(dy)
        if recipe == "bf16":
            expected += dy.reshape(-1, 32).double().t() @ x.reshape(-1, 64).double()
            assert w.grad_added_to_main_grad and w.grad.shape == w.shape
            assert torch.equal(w.main_grad, expected.float())
        else:
            assert not w.grad_added_to_main_grad and w.grad is not None
            assert not w.main_grad.any()
        w.grad = None


def _sr_violations(recipe, gen, samples: int, bound_samples: int) -> float:
    """Share of the entries of the mean input gradient of a quantized column layer that fall outside the
    bound for an UNBIASED stochastic rounding of dy (dgrad: dx = Q(dy) · Wq, dy 1x16 blocks along N).

    Derivation. The quantizer scales each element to v = dy·enc_b (replicated below with the reference's
    fp32 operations) and stochastic rounding picks one of the two E2M1 neighbours of v, gap g(v) apart
    (0.5 below 2, 1 below 4, 2 up to 6; |v| > 6 saturates to 6 deterministically), with
    E[q] - clip(v) in [0, g/256) (8 random bits, docs/numerics.md). With d the block's decode scale, every
    sample is dx_i = Σ_n q_imn·d_mn·Wq[n,k] up to its bf16/fp32 rounding, so for the mean of N samples:
      |mean_i dx_i - Σ_n clip(v)_mn d_mn Wq[n,k]| <= bias + noise + rounding, where
      bias     = Σ_n g_mn d_mn |Wq[n,k]| / 256,
      noise    = sqrt(Σ_n (g_mn d_mn Wq[n,k])² · ln(2/δ) / (2N)): Hoeffding over the N·(#n) independent
                 draws, each confined to an interval of width g·d·|Wq| / N; δ = 1e-9 per entry (1024 entries:
                 a false failure has probability < 1e-6), the hash bits treated as independent draws,
      rounding = 2^-7 · mean_i |dx_i| (bf16 output 2^-9 relative, fp32 alpha and sum 2^-23, with slack).
    """
    from nvfp4_train.kernels.nvfp4.reference import tensor_scales, transpose_nvfp4_ref

    layer = column(QuantColumnParallelLinear, 32, 64, config(), recipe=recipe, layer_name="sr")
    layer.weight.requires_grad_(False)  # dgrad only (wgrad's draws would only cost time)
    x = torch.randn(16, 2, 32, generator=gen).bfloat16()
    dy = torch.randn(16, 2, 64, generator=gen).bfloat16()
    total = torch.zeros(32, 32, dtype=torch.float64)
    total_abs = torch.zeros(32, 32, dtype=torch.float64)
    for _ in range(samples):
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        y.backward(dy)
        g = xi.grad.reshape(32, 32).double()
        total += g
        total_abs += g.abs()
    mean, mean_abs = total / samples, total_abs / samples

    dy2 = dy.reshape(32, 64)
    q = quantize_nvfp4_ref(dy2)  # round-to-nearest: the same amax and block scales as the stochastic copy
    _, s_dec = tensor_scales(q.amax)
    sdec = q.scales.to(torch.float32)
    enc = torch.clamp(1.0 / (sdec * s_dec), max=torch.finfo(torch.float32).max).repeat_interleave(16, dim=1)
    v = (dy2.float() * enc).double()
    d = (sdec.double() * (q.amax.double() / 2688.0)).repeat_interleave(16, dim=1)
    a = v.abs()
    gap = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)) * (a <= 6)
    target = torch.sign(v) * a.clamp(max=6.0) * d
    wq = dequantize_nvfp4_ref(transpose_nvfp4_ref(quantize_nvfp4_ref(layer.weight.detach(), block_2d=True)))
    wq = wq.double()  # Wᵀ [K=32, N=64]
    expect = target @ wq.t()
    gd = gap * d
    bias = gd @ wq.abs().t() / 256
    noise = torch.sqrt((gd.square() @ wq.square().t()) * math.log(2 / 1e-9) / (2 * bound_samples))
    bound = bias + noise + 2.0**-7 * mean_abs
    return ((mean - expect).abs() > bound).double().mean().item()


def test_stochastic_rounding_gradient_is_unbiased(gen):
    assert _sr_violations(named_recipe("nvfp4"), gen, samples=400, bound_samples=400) == 0.0
    # the bound has power: round-to-nearest (biased by up to half a gap per element) is deterministic, so one
    # sample is its mean over 400, and that breaks the 400-sample bound widely
    rne = apply_ablations(named_recipe("nvfp4"), Ablations(stochastic_rounding=False))
    assert _sr_violations(rne, gen, samples=1, bound_samples=400) > 0.25


def test_set_sr_streams_gives_the_streams_of_a_model_built_with_that_seed():
    """A model built with run seed 0, then set_sr_streams(model, s), has every quantized layer's stream that a
    model built with run seed s has (nvfp4_train.models.hybrid: block_seed -> layer_stream), its call counter restarted."""
    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import SIZES
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = SIZES["tiny"]
    lm = LayerPrecisionMap(mc.pattern, "nvfp4", keep_first=0, keep_last=0)
    tcfg = transformer_config(mc, params_dtype=torch.bfloat16, use_cpu_initialization=True)
    a = quant_layers(build_model(mc, lm, config=tcfg, seed=0, seq_length=64))
    b = quant_layers(build_model(mc, lm, config=tcfg, seed=1234, seq_length=64))
    assert len(a) == len(b) == 12
    for m in a:
        m.lctx.calls = 5
    container = torch.nn.ModuleList(a)
    assert set_sr_streams(container, 1234) == 12
    assert [m.lctx.seed for m in a] == [m.lctx.seed for m in b]
    assert all(m.lctx.calls == 0 for m in a)
    set_sr_streams(container, 0)
    assert len({m.lctx.seed for m in a} | {m.lctx.seed for m in b}) == 24  # other seeds: other streams
    with pytest.raises(ValueError, match="run_seed"):
        set_sr_streams(container, -1)
    loose = column(QuantColumnParallelLinear, 64, 128, config(), recipe=named_recipe("nvfp4"), layer_name="x")
    with pytest.raises(ValueError, match="'x' has no global block index"):
        set_sr_streams(loose, 0)
