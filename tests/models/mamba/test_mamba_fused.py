"""The Mamba mixer's core (conv + SSD scan + gated RMSNorm) as one fused op (``ops.mamba_conv_scan_norm_fused``)
and as three ops: the same results, within bounds derived in ``tests/models/mamba/core_bounds.py``.

Tiers: CPU (``fused`` changes nothing on CPU; the PyTorch path in bf16 is within its derived bound of the exact
result), ``triton`` (the fused op in fp32 against the exact result: under the interpreter with a PyTorch
stand-in for causal-conv1d's CUDA functions, natively on CUDA with them), ``gpu`` (the fused and the unfused
mixer in bf16, the ``small`` shape and an odd one: output and every gradient within twice the bound).

Every test draws its norm's eps near the mean square of the norm's input (``gate_input_mean_square``): there
the norm is far from scale invariance, whose exact cancellation would leave D's gradient at the noise level
of its terms (no bound could then see a wrong D), and a misplaced eps changes the output by O(1).
"""

from __future__ import annotations

import contextlib
import importlib
import types

import pytest
import torch

from nvfp4_train.models.mamba import _import
from nvfp4_train.models.mamba import ops as mamba_ops
from nvfp4_train.models.mamba._import import FusedMambaOps, load_fused_mamba, load_mamba_ssm
from nvfp4_train.models.mamba.ops import (
    causal_conv1d_ref,
    init_A_log,
    init_dt_bias,
    mamba_conv_scan_norm,
    mamba_conv_scan_norm_fused,
    mamba_conv_scan_norm_ref,
)
from tests.models.mamba.core_bounds import (
    TORCH_BF16,
    TRITON_BF16,
    TRITON_FP32_CUDA,
    TRITON_FP32_INTERPRETER,
    U,
    rounded,
    assert_within,
    bound_used,
    core_bounds,
    gate_input_mean_square,
    gemm_bound,
    median_relative_bound,
)
from tests.precision.mcore_util import megatron_single_rank

GRADS = ("zxbcdt", "conv_weight", "conv_bias", "dt_bias", "A", "D", "norm_weight")


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _core_inputs(gen, s, b, h, p, g, n, *, dtype, device="cpu"):
    """Mixer-like draws: zxbcdt ~ N(0, 1) with the dt part at 0.5 (dt = softplus(. + dt_bias) in Mamba-2's
    range), torch's depthwise-conv init, Mamba-2's dt_bias / A, D around 1, norm weight around 1; A, D and
    dt_bias in fp32 (the mixer passes them so), the rest in ``dtype``; and an upstream gradient."""
    d, cd = h * p, h * p + 2 * g * n
    zx = torch.randn(s, b, d + cd + h, generator=gen)
    zx[..., d + cd:] *= 0.5
    t = dict(
        zxbcdt=zx.to(dtype),
        conv_weight=(torch.rand(cd, 4, generator=gen) - 0.5).to(dtype),
        conv_bias=(torch.rand(cd, generator=gen) - 0.5).to(dtype),
        dt_bias=init_dt_bias(h, generator=gen),
        A=-torch.exp(init_A_log(h, generator=gen)),
        D=1 + 0.5 * torch.randn(h, generator=gen),
        norm_weight=(1 + 0.1 * torch.randn(d, generator=gen)).to(dtype),
    )
    dy = torch.randn(s, b, d, generator=gen).to(dtype)
    return {k: v.to(device) for k, v in t.items()}, dy.to(device)


def _kw(inp, p, g, Q):
    """The op's keywords, eps near the norm input's mean square (module docstring)."""
    eps = gate_input_mean_square(*(inp[k] for k in ("zxbcdt", "conv_weight", "conv_bias", "dt_bias", "A", "D")),
                                 headdim=p, ngroups=g, chunk_size=Q)
    return dict(headdim=p, ngroups=g, chunk_size=Q, eps=eps)


def _run_core(fn, inp, dy, kw):
    """Output and the gradients of <out, dy> for every input of the core."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inp.items()}
    out = fn(*leaves.values(), **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), dy)
    return {"y": out.detach(), **dict(zip(leaves, grads))}


# ------------------------------------------------------------------------------------------ CPU tier

CORE_SHAPES = {  # (s, b, h, p, g, n, chunk): odd lengths, chunks that do not divide them, groups < heads
    "odd": (37, 2, 6, 8, 2, 16, 16),
    "one_group": (29, 3, 4, 6, 1, 12, 8),
}


@pytest.mark.parametrize("name", list(CORE_SHAPES))
def test_core_bf16_on_cpu_within_its_bound(gen, name):
    """The core's PyTorch path in bf16 (fp32 inside each op, bf16 between them, as the CUDA kernels) against the
    exact result: output and every gradient within core_bounds' bound (the derivation the GPU tests use, here
    with the chunked scan's own error in place of the Triton kernel's). The same core reading z in the wrong
    token order, a layout mistake, exceeds it."""
    s, b, h, p, g, n, Q = CORE_SHAPES[name]
    inp, dy = _core_inputs(gen, s, b, h, p, g, n, dtype=torch.bfloat16)
    kw = _kw(inp, p, g, Q)
    got = _run_core(mamba_conv_scan_norm, inp, dy, kw)
    ref = _run_core(mamba_conv_scan_norm_ref, inp, dy, kw)
    for key in got:  # on CPU the dispatching op is the reference
        assert torch.equal(got[key], ref[key]), key
    exact, bound = core_bounds(*inp.values(), dy, fmt=TORCH_BF16, **kw)
    used = {key: assert_within(key, got[key], exact[key], bound[key]) for key in ("y",) + GRADS}
    print({k: round(v, 4) for k, v in used.items()})  # fraction of the bound used
    assert median_relative_bound(bound["y"], exact["y"]) < 0.1  # the bound leaves room to see a mistake

    d = h * p
    wrong = dict(inp)
    wrong["zxbcdt"] = inp["zxbcdt"].clone()
    wrong["zxbcdt"][..., :d] = inp["zxbcdt"][..., :d].transpose(0, 1).reshape(s, b, d)  # z in [b, s] order
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_within("y", mamba_conv_scan_norm_ref(*wrong.values(), **kw), exact["y"], bound["y"])


def test_fused_flag_changes_nothing_on_cpu(single_rank, gen, monkeypatch):
    """On CPU, MambaMixer(fused=True) runs the three ops: the same bits as fused=False, forward and backward,
    and the fused op is never entered."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config("tiny")  # M-*-M-: layer 0 is a Mamba block
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    from nvfp4_train.models.fusion import FusionConfig

    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=transformer_config(mc), seq_length=64,
                        fusion=FusionConfig())
    mixer = model.decoder.layers[0].mixer
    assert mixer.fused  # fusion.mamba's default
    hidden = torch.randn(45, 3, mc.hidden_size, generator=gen).bfloat16()
    gout = torch.randn(45, 3, mc.hidden_size, generator=gen).bfloat16()

    def never(*_a, **_k):
        raise AssertionError("the fused op ran on CPU")

    monkeypatch.setattr(mamba_ops._ConvScanNormFn, "apply", never)
    results = []
    for fused in (True, False):
        mixer.fused = fused
        for prm in mixer.parameters():
            prm.grad = None
        x = hidden.clone().requires_grad_()
        out, bias = mixer(x)
        assert bias is None
        out.backward(gout)
        results.append([out, x.grad] + [prm.grad for prm in mixer.parameters()])
    assert len(results[0]) >= 9
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_fused_op_refuses_what_it_cannot_run(gen, monkeypatch):
    inp, _ = _core_inputs(gen, 9, 2, 2, 8, 1, 8, dtype=torch.float32)
    kw = dict(headdim=8, ngroups=1, chunk_size=4)
    monkeypatch.setattr(mamba_ops, "load_fused_mamba", lambda: (None, "causal-conv1d is not installed"))
    with pytest.raises(RuntimeError, match="causal-conv1d is not installed"):
        mamba_conv_scan_norm_fused(*inp.values(), **kw)
    standin = (FusedMambaOps(*(lambda *a, **k: None,) * 6), "stand-in")
    monkeypatch.setattr(mamba_ops, "load_fused_mamba", lambda: standin)
    with pytest.raises(RuntimeError, match="multiples of 8"):  # d_inner 16, conv channels 32, width 50
        mamba_conv_scan_norm_fused(*inp.values(), **kw)
    with pytest.raises(RuntimeError, match="width 2..4"):
        mamba_conv_scan_norm_fused(*{**inp, "conv_weight": inp["conv_weight"].repeat(1, 2)}.values(), **kw)
    with pytest.raises(ValueError, match=r"zxbcdt must be \[seq, batch"):
        mamba_conv_scan_norm(*{**inp, "zxbcdt": inp["zxbcdt"][..., 1:]}.values(), **kw)
    with pytest.raises(ValueError, match="ngroups=3 must divide nheads=2"):
        mamba_conv_scan_norm_ref(*inp.values(), **{**kw, "ngroups": 3})
    with pytest.raises(ValueError, match="norm_weight"):
        mamba_conv_scan_norm_ref(*{**inp, "norm_weight": inp["norm_weight"][:-1]}.values(), **kw)


def test_fused_loader_reports_what_is_missing(monkeypatch):
    load_fused_mamba.cache_clear()
    try:
        monkeypatch.setattr(_import, "load_mamba_ssm", lambda: (object(), "ok"))
        monkeypatch.setattr(_import, "load_causal_conv1d", lambda: (None, "causal-conv1d is not installed"))
        assert load_fused_mamba() == (None, "causal-conv1d is not installed")
        load_fused_mamba.cache_clear()
        monkeypatch.setattr(_import, "load_mamba_ssm", lambda: (None, "mamba-ssm is not installed"))
        assert load_fused_mamba() == (None, "mamba-ssm is not installed")
    finally:
        load_fused_mamba.cache_clear()


# ------------------------------------------------------------------ the fused op in fp32 (Triton tier)


def _conv_fwd_standin(x, weight, bias, seq_idx, initial_states, final_states_out, silu):
    """causal-conv1d's causal_conv1d_fwd_function in PyTorch: its output allocated like the kernel's."""
    out = torch.empty_like(x)
    return out.copy_(causal_conv1d_ref(x, weight, bias, "silu" if silu else None))


def _conv_bwd_standin(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinit, silu):
    """causal-conv1d's causal_conv1d_bwd_function in PyTorch: writes dx into the given buffer, as the kernel."""
    with torch.enable_grad():
        xx, ww = x.detach().requires_grad_(), weight.detach().requires_grad_()
        bb = None if bias is None else bias.detach().requires_grad_()
        out = causal_conv1d_ref(xx, ww, bb, "silu" if silu else None)
        grads = torch.autograd.grad(out, [t for t in (xx, ww, bb) if t is not None], dout)
    dx = torch.empty_like(x) if dx is None else dx
    dx.copy_(grads[0])
    return dx, grads[1].to(weight.dtype), None if bias is None else grads[2].to(bias.dtype), None


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:Deterministic mode")
def test_fused_core_fp32_within_its_bound(gen, triton_device, monkeypatch):
    """The fused op (mamba-ssm's Triton scan and norm, sequence-first strides, gradients written in place) in
    fp32 against the exact result, within core_bounds' bound: under the interpreter with causal-conv1d's two
    functions replaced by PyTorch (its CUDA extension cannot load there), natively with them on CUDA (tl.dot
    in TF32 there: u_f = 2^-11). Batch 2 and several heads per group, so that a mix-up of the sequence-first
    strides, the heads or the groups shows; the bound is ~1e-3 of the values: a plumbing mistake exceeds it."""
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")  # the cheapest autotune config (read at mamba-ssm's import)
    if triton_device == "cpu":
        monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda dev=None: types.SimpleNamespace(multi_processor_count=4))
        mamba, reason = load_mamba_ssm()
        if mamba is None:
            pytest.skip(reason)
        ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        norm = importlib.import_module("mamba_ssm.ops.triton.layernorm_gated")
        standin = FusedMambaOps(_conv_fwd_standin, _conv_bwd_standin, ssd._mamba_chunk_scan_combined_fwd,
                                ssd._mamba_chunk_scan_combined_bwd, norm._layer_norm_fwd, norm._layer_norm_bwd)
        monkeypatch.setattr(mamba_ops, "load_fused_mamba", lambda: (standin, "stand-in"))
        # widths that are multiples of 8 are causal-conv1d's kernel's condition, not the stand-in's: 4 heads
        # here (the interpreter's time grows with the heads)
        monkeypatch.setattr(mamba_ops, "_fused_unusable", lambda *_a: None)
        fmt = TRITON_FP32_INTERPRETER
        s, b, h, p, g, n, Q = 21, 2, 4, 8, 2, 16, 16  # 2 chunks, the last one partial
    else:
        fused, reason = load_fused_mamba()
        if fused is None:
            pytest.skip(reason)
        fmt = TRITON_FP32_CUDA
        s, b, h, p, g, n, Q = 45, 2, 8, 8, 2, 16, 16  # widths multiples of 8 (causal-conv1d's channel-last layout)
    inp, dy = _core_inputs(gen, s, b, h, p, g, n, dtype=torch.float32, device=triton_device)
    kw = _kw(inp, p, g, Q)
    got = _run_core(mamba_conv_scan_norm_fused, inp, dy, kw)
    exact, bound = core_bounds(*inp.values(), dy, fmt=fmt, **kw)
    used = {key: assert_within(key, got[key], exact[key], bound[key]) for key in ("y",) + GRADS}
    print({k: round(v, 4) for k, v in used.items()})
    # the bound leaves room to see a mistake (a plumbing error changes values by O(1)); on the GPU the fp32 format's
    # exp and the kernels' orders make it ~1.4% of the values (H200, 2026-12-04), on the interpreter well under 1%
    assert median_relative_bound(bound["zxbcdt"], exact["zxbcdt"]) < 0.05


# ------------------------------------------------------------------------- the mixer (gpu tier)

MIXER_SHAPES = {  # seq, batch, model-size overrides
    "small": (256, 2, {}),  # configs/model/small.yaml's mixer: 16 heads x 64, 4 groups, state 128, chunk 128
    # one TP-2 shard's proportions at odd sizes: 8 heads x 48 in 2 groups (norm groups of 192), state 64,
    # chunk 64 not dividing the sequence, batch 3
    "odd": (200, 3, dict(hidden_size=256, mamba_num_heads=8, mamba_head_dim=48, mamba_num_groups=2,
                         mamba_state_dim=64, mamba_chunk_size=64)),
}


def _mixer(overrides, device):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config("small", pattern="M", num_layers=1, **overrides)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = transformer_config(mc, params_dtype=torch.bfloat16, use_cpu_initialization=device == "cpu")
    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=cfg, seq_length=256)
    return model.decoder.layers[0].mixer


def _run_mixer(mixer, hidden, dout):
    """Output, input gradient and parameter gradients, plus what flows between in_proj, the core and out_proj."""
    seen = {}

    def keep(name, t):
        seen[name] = t
        t.register_hook(lambda gr: seen.update({"d" + name: gr}))

    hooks = [mixer.in_proj.register_forward_hook(lambda _m, _i, o: keep("zxbcdt", o[0])),
             mixer.out_proj.register_forward_pre_hook(lambda _m, i: keep("y", i[0]))]
    try:
        for prm in mixer.parameters():
            prm.grad = None
        x = hidden.clone().requires_grad_()
        out, _ = mixer(x)
        out.backward(dout)
    finally:
        for hk in hooks:
            hk.remove()
    res = {"out": out.detach(), "hidden": x.grad, **{k: v.detach() for k, v in seen.items()}}
    res.update({name: prm.grad for name, prm in mixer.named_parameters()})
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(MIXER_SHAPES))
def test_fused_mixer_matches_unfused_on_gpu(single_rank, gen, shape, monkeypatch):
    """bf16 mixer, fused vs unfused (the same in_proj and out_proj): both run the same kernels with the same
    rounding points, so each is within core_bounds' bound E (TRITON_BF16: test_mamba_ssd's bf16 scan bound,
    the conv's and the norm's) of the exact result, and they differ by <= 2 E: the core's output and input
    gradient, every parameter's gradient (the casts of dt_bias', D's and A_log's to bf16 added), and, through
    the GEMMs around the core (gemm_bound), the mixer's output, input gradient and projection weights'
    gradients. bf16 split-K reductions are turned off for the bound on the GEMMs."""
    fused_ops, reason = load_fused_mamba()
    if fused_ops is None:
        pytest.skip(f"the fused path needs mamba-ssm and causal-conv1d's CUDA extension: {reason}")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    calls = []  # the fused op must run in the fused mixer (a silent fallback would compare the unfused twice)
    apply = mamba_ops._ConvScanNormFn.apply
    monkeypatch.setattr(mamba_ops._ConvScanNormFn, "apply", lambda *a: calls.append(a) or apply(*a))
    _compare_mixers(gen, shape, "cuda", calls)


def _compare_mixers(gen, shape, device, calls):
    s, b, overrides = MIXER_SHAPES[shape]
    m = _mixer(overrides, device)
    hidden = torch.randn(s, b, m.config.hidden_size, generator=gen).to(device, torch.bfloat16)
    dout = torch.randn(s, b, m.config.hidden_size, generator=gen).to(device, torch.bfloat16)
    core = dict(conv_weight=m.conv1d.weight.detach().squeeze(1), conv_bias=m.conv1d.bias.detach(),
                dt_bias=m.dt_bias.detach().float(), A=-torch.exp(m.A_log.detach().float()), D=m.D.detach().float(),
                norm_weight=m.norm.weight.detach())
    kw = dict(headdim=m.head_dim, ngroups=m.ngroups_local, chunk_size=m.chunk_size)
    with torch.no_grad():
        zx = m.in_proj(hidden)[0]
    m.eps = gate_input_mean_square(zx, *list(core.values())[:5], **kw)  # module docstring

    m.fused = False
    u = _run_mixer(m, hidden, dout)
    assert not calls
    m.fused = True
    f = _run_mixer(m, hidden, dout)
    assert len(calls) == (device == "cuda")
    # the GEMMs see the same operands: in_proj's output and out_proj's input gradient are the same bits
    assert torch.equal(u["zxbcdt"], f["zxbcdt"]) and torch.equal(u["dy"], f["dy"])

    exact, E = core_bounds(u["zxbcdt"], *core.values(), u["dy"], fmt=TRITON_BF16, eps=m.eps, **kw)
    bs = 2.0**-8  # the parameters' and activations' bf16
    A = core["A"].double()
    E["A_log"] = rounded(A.abs() * E.pop("A") + U * (A * exact["A"]).abs(), A * exact["A"], bs)
    E["dt_bias"], E["D"] = rounded(E["dt_bias"], exact["dt_bias"], bs), rounded(E["D"], exact["D"], bs)
    tok = lambda t: t.reshape(s * b, -1).double()  # noqa: E731  [s, b, .] -> tokens x channels
    W_out, W_in = m.out_proj.weight.detach(), m.in_proj.weight.detach()
    out, E_out = gemm_bound(tok(exact["y"]), tok(E["y"]), W_out.t(), u_s=bs)
    dW_out, E_dWout = gemm_bound(tok(exact["y"]).t(), tok(E["y"]).t(), tok(dout), u_s=bs)  # transposed
    dh, E_dh = gemm_bound(tok(exact["zxbcdt"]), tok(E["zxbcdt"]), W_in, u_s=bs)
    dW_in, E_dWin = gemm_bound(tok(exact["zxbcdt"]).t(), tok(E["zxbcdt"]).t(), tok(hidden), u_s=bs)

    checks = {  # name: (fused, unfused, exact, bound on each one's error)
        "core output y": (f["y"], u["y"], exact["y"], E["y"]),
        "core input grad (in_proj's output grad)": (f["dzxbcdt"], u["dzxbcdt"], exact["zxbcdt"], E["zxbcdt"]),
        "conv1d.weight": (f["conv1d.weight"].squeeze(1), u["conv1d.weight"].squeeze(1), exact["conv_weight"],
                          E["conv_weight"]),
        "conv1d.bias": (f["conv1d.bias"], u["conv1d.bias"], exact["conv_bias"], E["conv_bias"]),
        "norm.weight": (f["norm.weight"], u["norm.weight"], exact["norm_weight"], E["norm_weight"]),
        "dt_bias": (f["dt_bias"], u["dt_bias"], exact["dt_bias"], E["dt_bias"]),
        "A_log": (f["A_log"], u["A_log"], A * exact["A"], E["A_log"]),
        "D": (f["D"], u["D"], exact["D"], E["D"]),
        "output": (tok(f["out"]), tok(u["out"]), out, E_out),
        "input grad": (tok(f["hidden"]), tok(u["hidden"]), dh, E_dh),
        "out_proj.weight": (f["out_proj.weight"].t(), u["out_proj.weight"].t(), dW_out, E_dWout),
        "in_proj.weight": (f["in_proj.weight"], u["in_proj.weight"], dW_in, E_dWin),
    }
    assert {k for k, _ in m.named_parameters()} == {"in_proj.weight", "out_proj.weight", "conv1d.weight",
                                                    "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"}
    # the two within 2 E, and the unfused path within E of the exact result (what the 2 E rests on); all
    # reported at once, as fractions of the bound used
    used = {("fused vs unfused", name): bound_used(fused, unfused, 2 * bound)
            for name, (fused, unfused, _, bound) in checks.items()}
    used.update({("unfused vs exact", name): bound_used(unfused, want, bound)
                 for name, (_, unfused, want, bound) in checks.items()})
    print({f"{a}: {b_}": round(v, 4) for (a, b_), v in used.items()})
    over = {key: v for key, v in used.items() if not v <= 1}
    assert not over, f"errors above their bounds (multiples of the bound): {over}"
