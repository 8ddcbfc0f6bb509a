"""The Mamba mixer's layout: splitting in_proj's output in megatron's [s, b, w] order (so that the split's
backward hands in_proj a contiguous [s, b, w] grad) computes bitwise the same output and gradients as the
earlier split of the [b, s, w] transpose, kept here as the reference."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.models.config import model_config
from nvfp4_train.models.mamba.ops import causal_conv1d, rmsnorm_gated, ssd_scan
from nvfp4_train.precision.layer_map import LayerPrecisionMap
from tests.precision.mcore_util import megatron_single_rank


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _mixer(recipe):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    mc = model_config("tiny")  # M-*-M-: layer 0 is a Mamba block
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_model(mc, LayerPrecisionMap(mc.pattern, recipe), config=transformer_config(mc), seq_length=64)
    return model.decoder.layers[0].mixer


def _reference_forward(m, hidden_states):
    """MambaMixer.forward before the layout change (in_proj's output transposed to [b, s, w], then split)."""
    d, g, n, h, p = m.d_inner_local, m.ngroups_local, m.state_dim, m.nheads_local, m.head_dim
    zxbcdt, _ = m.in_proj(hidden_states)
    zxbcdt = zxbcdt.transpose(0, 1)
    z, xbc, dt = torch.split(zxbcdt, [d, d + 2 * g * n, h], dim=-1)
    xbc = causal_conv1d(xbc.transpose(1, 2), m.conv1d.weight.squeeze(1), m.conv1d.bias,
                        activation="silu").transpose(1, 2)
    x, B, C = torch.split(xbc, [d, g * n, g * n], dim=-1)
    y = ssd_scan(
        x.unflatten(-1, (h, p)), dt, -torch.exp(m.A_log.float()), B.unflatten(-1, (g, n)),
        C.unflatten(-1, (g, n)), m.chunk_size, D=m.D.float(), dt_bias=m.dt_bias.float(), dt_softplus=True,
    )
    y = rmsnorm_gated(y.flatten(-2), z, m.norm.weight, m.eps, group_size=d // g)
    return m.out_proj(y.transpose(0, 1).contiguous())


def _run(m, forward, hidden, grad_out):
    for p in m.parameters():
        p.grad = None
    x = hidden.clone().requires_grad_(True)
    out, bias = forward(x)
    assert bias is None
    out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in m.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_mixer_matches_the_transpose_then_split_layout_bitwise(single_rank, recipe):
    m = _mixer(recipe)
    dtype = m.in_proj.weight.dtype
    g = torch.Generator().manual_seed(1234)
    s, b = 64, 3  # batch > 1: at batch 1 the transposes are contiguous and the layouts coincide
    hidden = torch.randn(s, b, 128, generator=g).to(dtype)
    grad_out = torch.randn(s, b, 128, generator=g).to(dtype)

    seen = []  # the layout of the grad that in_proj's backward receives

    def watch(_mod, _inp, out):
        out[0].register_hook(lambda gr: seen.append(gr.is_contiguous()))

    hook = m.in_proj.register_forward_hook(watch)
    try:
        got = _run(m, m, hidden, grad_out)
        assert seen == [True]  # the split's backward writes [s, b, w] directly: megatron copies nothing
        want = _run(m, lambda h: _reference_forward(m, h), hidden, grad_out)
    finally:
        hook.remove()

    assert torch.equal(got[0], want[0]), "forward output changed"
    assert torch.equal(got[1], want[1]), "input grad changed"
    assert got[2].keys() == want[2].keys() and len(got[2]) >= 8
    for name in want[2]:
        assert got[2][name].dtype == want[2][name].dtype
        assert torch.equal(got[2][name], want[2][name]), f"grad of {name} changed"
        assert got[2][name].abs().sum() > 0, f"grad of {name} is zero: the comparison would be vacuous"
