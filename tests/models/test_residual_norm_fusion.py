"""``fusion.residual_norm`` in the hybrid stack (``HybridStack``, ``HybridTransformerLayer``, ``MambaLayer``): each
block's residual add fused into the next norm.

The wiring is checked bit for bit: with the fused op replaced by the unfused arithmetic (torch's add, then the
norm), the fused stack gives the unfused model's per-token losses and every gradient exactly, so every add and
every norm is where it was and gradients reach both operands of each add. The op itself is checked against the
unfused arithmetic in ``tests/kernels/test_residual_norm.py`` (bitwise sums, norms within a derived bound); here
the model with the real op stays close to the unfused one, and its kernels equal its reference bit for bit."""

from __future__ import annotations

import pytest
import torch

import nvfp4_train.models.layers as layers
from nvfp4_train.kernels.fused.residual_norm import residual_norm
from nvfp4_train.kernels.fused.residual_norm_reference import residual_norm_ref
from nvfp4_train.models.config import model_config
from nvfp4_train.models.fusion import FusionConfig
from nvfp4_train.precision.layer_map import LayerPrecisionMap
from tests.precision.mcore_util import megatron_single_rank

# every block kind, an M after a '-' and a '*', two '*' in a row's neighbourhood, RoPE on
PATTERN = "M-*-M*"
SEQ = 64


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _build(fused: bool, device: str = "cpu", **changes):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    mc = model_config("tiny").replace(pattern=PATTERN, num_layers=len(PATTERN), position_embedding="rope", **changes)
    fusion = FusionConfig(rope=False, cross_entropy=False, wgrad_accumulation=False, mamba=False, residual_norm=fused)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = transformer_config(mc, fusion=fusion, use_cpu_initialization=True)
    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=cfg, seq_length=SEQ, fusion=fusion)
    return mc, model.to(device)


def _batch(mc, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)  # fixed tokens: the comparisons are bitwise or bounded, not statistical
    ids = torch.randint(0, mc.vocab_size, (2, SEQ), generator=g).to(device)
    return ids, torch.arange(SEQ, device=device)[None].expand(2, SEQ)


def _step(model, ids, pos):
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids)
    loss.float().sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _unfused_op(residual, delta, weight, eps):
    x = residual + delta
    return x, layers.rms_norm(x, weight, eps)


def _counting(monkeypatch, op) -> list:
    calls = []

    def counted(residual, delta, weight, eps):
        calls.append(tuple(residual.shape))
        return op(residual, delta, weight, eps)

    monkeypatch.setattr(layers, "residual_norm", counted)
    return calls


def test_fused_stack_with_the_unfused_arithmetic_is_the_unfused_model_bitwise(single_rank, monkeypatch):
    """Loss and every gradient bitwise; the op ran once per block boundary (5) and for the final norm; the blocks'
    norm modules ran through their own ``__call__`` (their hooks see every norm); the checkpoint keys are the same."""
    mc, unfused = _build(False)
    _, fused = _build(True)
    assert fused.decoder.fused_residual_norm and not unfused.decoder.fused_residual_norm
    assert set(fused.sharded_state_dict()) == set(unfused.sharded_state_dict())
    ids, pos = _batch(mc)
    loss_u, grads_u = _step(unfused, ids, pos)
    calls = _counting(monkeypatch, _unfused_op)
    seen = []
    for name, module in fused.named_modules():
        if isinstance(module, layers.RMSNorm):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.append(name))
    loss_f, grads_f = _step(fused, ids, pos)
    assert len(calls) == len(PATTERN)  # 5 boundaries + the final norm
    assert len(seen) == len(PATTERN) + 1  # every block norm and the final one
    assert torch.equal(loss_f, loss_u)
    assert grads_f.keys() == grads_u.keys()
    for name in grads_u:
        assert torch.equal(grads_f[name], grads_u[name]), name


def test_stage_without_final_norm_returns_the_materialised_stream(single_rank, monkeypatch):
    """A pipeline stage that is not the last (no final norm) hands on ``h + delta``, and one that is not the first
    starts from its input tensor with nothing pending: the stack's output and input gradient bitwise the unfused
    stack's, with the op replaced by the unfused arithmetic."""
    outs = []
    for fused in (False, True):
        _, model = _build(fused)
        stack = model.decoder
        stack.final_norm = None
        stack.pre_process = False
        g = torch.Generator().manual_seed(1)
        h = torch.randn(SEQ, 2, stack.config.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
        stack.set_input_tensor(h)
        if fused:
            _counting(monkeypatch, _unfused_op)
        out = stack(hidden_states=None, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(SEQ))
        (grad,) = torch.autograd.grad(out, h, torch.ones_like(out))
        outs.append((out.detach(), grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_fused_model_stays_close_to_the_unfused_model(single_rank):
    """The real op (its reference on CPU): each norm within one bf16 ulp of the unfused one (the op's bound, derived
    and tested in tests/kernels/test_residual_norm.py), which the blocks carry on. On these fixed inputs the losses
    within 1e-2 relative and every gradient within 5% of its norm: an allowance that catches a misplaced add or
    norm (an O(1) change), not a bound derived through the blocks."""
    mc, unfused = _build(False)
    _, fused = _build(True)
    ids, pos = _batch(mc)
    loss_u, grads_u = _step(unfused, ids, pos)
    loss_f, grads_f = _step(fused, ids, pos)
    assert torch.allclose(loss_f, loss_u, rtol=1e-2, atol=0)
    for name in grads_u:
        diff = (grads_f[name].float() - grads_u[name].float()).norm()
        assert diff <= 0.05 * grads_u[name].float().norm() + 1e-12, name


def test_dropout_is_refused(single_rank):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    mc = model_config("tiny")
    fusion = FusionConfig(rope=False, cross_entropy=False, wgrad_accumulation=False, mamba=False, residual_norm=True)
    model_parallel_cuda_manual_seed(0)
    cfg = transformer_config(mc, fusion=fusion, use_cpu_initialization=True)
    cfg.hidden_dropout = 0.1
    with pytest.raises(ValueError, match="fusion.residual_norm=false"):
        build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=cfg, seq_length=SEQ, fusion=fusion)


@pytest.mark.triton
def test_fused_model_kernels_equal_their_reference_bitwise(single_rank, triton_device, monkeypatch):
    """The Triton kernels inside the model (the interpreter on CPU, natively on a GPU) against the same model
    running the op's reference: loss and every gradient bitwise."""
    mc, model = _build(True, triton_device)
    ids, pos = _batch(mc, triton_device)
    calls = _counting(monkeypatch, residual_norm)
    loss_k, grads_k = _step(model, ids, pos)
    assert len(calls) == len(PATTERN)
    _counting(monkeypatch, residual_norm_ref)
    loss_r, grads_r = _step(model, ids, pos)
    assert torch.equal(loss_k, loss_r)
    for name in grads_r:
        assert torch.equal(grads_k[name], grads_r[name]), name
