"""The blocks' RMSNorm: torch's rms_norm (fused on CUDA) against the fp32 composite it replaced; and with
``fusion.rms_norm`` (its backward as one Triton kernel) against torch's autograd, in the tiny model."""

import dataclasses
import os

import pytest
import torch

from nvfp4_train.models.layers import rms_norm, rms_norm_composite

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _saved_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """The output of ``fn(*args)`` and the bytes autograd saved for its backward (each storage once)."""
    seen: set = set()
    total = 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*args)
    return y, total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 768), (33, 1280)])
def test_rms_norm_bitwise_equals_composite_on_cpu(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x[0, ..., :3] = 0  # a partly zero row
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    outs = []
    for fn in (rms_norm, rms_norm_composite):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-5)
        gx, gw = torch.autograd.grad(y, (xi, wi), dy)
        outs.append((y, gx, gw))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b)


def test_mixed_dtype_weight_takes_the_composite_path():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.rand(64) + 0.5  # fp32 weight, bf16 activations
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_composite(x, w, 1e-5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_on_gpu_saves_less_and_matches():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 768, generator=g) * 3).to(torch.bfloat16).cuda().requires_grad_()
    w = (torch.rand(768, generator=g) + 0.5).to(torch.bfloat16).cuda().requires_grad_()
    y, fused = _saved_bytes(rms_norm, x, w, 1e-5)
    y_ref, composite = _saved_bytes(rms_norm_composite, x, w, 1e-5)
    x_bytes = x.numel() * x.element_size()
    # fused: x, the weight and one fp32 rstd per row; the composite keeps two fp32 copies of x
    assert fused <= x_bytes + w.numel() * 2 + x.shape[0] * 4 + 1024, (fused, composite)
    assert composite >= 4 * x_bytes
    # same fp32 arithmetic up to the order of the row sum: at most one bf16 rounding step apart
    diff = (y.float() - y_ref.float()).abs()
    assert (diff <= y_ref.float().abs() * 2**-7 + 1e-30).all()


# ------------------------------------------------------------------- fusion.rms_norm: the backward as one kernel

@pytest.fixture
def single_rank():
    from tests.precision.mcore_util import megatron_single_rank

    with megatron_single_rank():
        yield


def _tiny(pattern: str, fusion):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config("tiny").replace(pattern=pattern, num_layers=len(pattern), vocab_size=1024)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return mc, build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=transformer_config(mc), seq_length=32,
                           fusion=fusion)


def _norms(model) -> dict:
    from nvfp4_train.models.layers import RMSNorm

    return {name: m for name, m in model.named_modules() if isinstance(m, RMSNorm)}


def test_build_model_sets_the_norms_from_fusion_rms_norm(single_rank):
    from nvfp4_train.models.fusion import FusionConfig

    for fusion, want in ((FusionConfig(), True), (FusionConfig(rms_norm=False), False), (None, False)):
        _, model = _tiny("M*-", fusion)
        norms = _norms(model)
        assert len(norms) == 4 and any(name.endswith("final_norm") for name in norms)  # 3 blocks + the final norm
        assert all(m.fused_backward == want for m in norms.values()), (fusion, want)


@pytest.mark.skipif(INTERPRET, reason="plain CPU: the fused backward's fallback")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_backward_off_the_triton_path_is_todays_autograd(dtype, gen):
    """On a CPU without the interpreter the switch changes nothing: ``rms_norm``'s forward and autograd, bit for
    bit (a weight of another dtype takes the composite everywhere)."""
    from nvfp4_train.models.layers import rms_norm_fused_backward

    x = (torch.randn(2, 5, 784, generator=gen) * 3).to(dtype)
    dy = torch.randn(2, 5, 784, generator=gen).to(dtype)
    for w in ((torch.rand(784, generator=gen) + 0.5).to(dtype), torch.rand(784, generator=gen) + 0.5):
        outs = []
        for fn in (rms_norm, rms_norm_fused_backward):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(xi, wi, 1e-5)
            outs.append((y, *torch.autograd.grad(y, (xi, wi), dy)))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


def _norm_step(model, ids, pos, replace: dict | None = None):
    """One forward and backward. Records, per RMSNorm (by module name): its input x, output y, the output's
    gradient dy and the gradient it gives x (``dx``: a view of x is the norm's own input, so its gradient is the
    norm's alone, not the residual path's); ``replace``: the ``dx`` to hand on instead of each norm's own (recorded
    first). Returns (per-token loss, records, every parameter's gradient)."""
    rec: dict[str, dict] = {}
    handles = []
    for name, norm in _norms(model).items():
        entry = rec.setdefault(name, {})

        def pre(module, args, entry=entry, name=name):
            x = args[0]
            entry["x"] = x.detach().clone()
            alias = x.view_as(x)

            def on_dx(g):
                entry["dx"] = g.detach().clone()
                return None if replace is None else replace[name]

            alias.register_hook(on_dx)
            return (alias, *args[1:])

        def post(module, args, out, entry=entry):
            entry["y"] = out.detach().clone()
            out.register_hook(lambda g: entry.__setitem__("dy", g.detach().clone()))

        handles += [norm.register_forward_pre_hook(pre), norm.register_forward_hook(post)]
    try:
        model.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=ids)
        loss.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return loss.detach(), rec, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    assert torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype])), what


@pytest.mark.triton
def test_tiny_model_fused_rms_norm_backward(single_rank, triton_device, gen, monkeypatch):
    """A tiny model with ``fusion.rms_norm`` on, then off (torch's autograd; the same weights and batch): the same
    forward bits (every norm's output, the loss); each norm's dx and weight gradient within the bound of
    ``tests/kernels/test_rms_norm.py`` (ours + torch's, from that norm's own x, dy, rstd and weight). The off run is
    handed the on run's dx of each norm, after recording its own: then every norm gets the same dy and every other
    parameter the same gradient, bit for bit, so the norms' gradients are the only difference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nvfp4_train.kernels.fused import rms_norm as kernel
    from nvfp4_train.kernels.fused.rms_norm_reference import rms_norm_backward_bound
    from nvfp4_train.models.fusion import FusionConfig
    from tests.kernels.test_rms_norm import assert_within

    launches, launch = [], kernel.rms_norm_backward_triton

    def counting(*args, **kwargs):
        launches.append(args[1].shape)
        return launch(*args, **kwargs)

    monkeypatch.setattr(kernel, "rms_norm_backward_triton", counting)  # what layers' rms_norm_backward runs

    fusion = dataclasses.replace(FusionConfig.all_off(), rms_norm=True)
    mc, model = _tiny("-*-", fusion)
    model = model.to(triton_device)
    norms = _norms(model)
    assert len(norms) == 4 and all(m.fused_backward for m in norms.values())
    seq, batch = 32, 2
    ids = torch.randint(0, mc.vocab_size, (batch, seq), generator=gen).to(triton_device)
    pos = torch.arange(seq, device=triton_device)[None].expand(batch, seq)
    with sdpa_kernel(SDPBackend.MATH):
        loss_on, on, grads_on = _norm_step(model, ids, pos)
        assert launches == [(seq * batch, mc.hidden_size)] * 4  # every norm's backward ran the kernel
        for m in norms.values():
            m.fused_backward = False
        loss_off, off, grads_off = _norm_step(model, ids, pos, replace={n: r["dx"] for n, r in on.items()})
        assert len(launches) == 4
    _same_bits(loss_on, loss_off, "loss")
    torch_impl = "torch_cuda" if triton_device == "cuda" else "torch_cpu"
    for name, norm in norms.items():
        a, b = on[name], off[name]
        for key in ("x", "y", "dy"):
            _same_bits(a[key], b[key], f"{name} {key}")
        h = a["x"].shape[-1]
        x, dy, w = a["x"].reshape(-1, h), a["dy"].reshape(-1, h), norm.weight.detach()
        rstd = torch.ops.aten._fused_rms_norm(x, [h], w, norm.eps)[1].reshape(-1)
        b_on = rms_norm_backward_bound(dy, x, rstd, w, "ours")
        b_off = rms_norm_backward_bound(dy, x, rstd, w, torch_impl)
        assert_within(a["dx"].reshape(-1, h), b["dx"].reshape(-1, h), b_on[0] + b_off[0], f"{name} dx")
        assert_within(grads_on[f"{name}.weight"], grads_off[f"{name}.weight"], b_on[1] + b_off[1], f"{name} dw")
    assert grads_on.keys() == grads_off.keys() and len(grads_on) > 10
    for pname, g in grads_on.items():
        if pname.removesuffix(".weight") not in norms:
            _same_bits(g, grads_off[pname], pname)
