"""The hybrid model with ``cross_entropy_loss_fusion`` on (our fused vocab-parallel cross-entropy) and off
(megatron-core's ``vocab_parallel_cross_entropy(logits.float(), labels)``), one CPU rank, the same weights.

What is compared, and why that covers the gradients of every parameter:
- the logits (the output layer's output): the same forward, bit for bit;
- the per-token loss: within the loss bound of ``tests/kernels/test_cross_entropy.py`` (ours vs exact plus
  megatron vs exact, evaluated on these logits);
- the logits' gradient: within that file's gradient bound after the bf16 rounding;
- every parameter's gradient: everything below the logits is the same deterministic backward, so feeding the
  fused run's logits gradient into the unfused run's graph (a tensor hook replaces megatron's after recording
  it) must reproduce the fused run's parameter gradients bit for bit. So the parameter gradients differ only
  through the logits' gradient, which is within its bound.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nvfp4_train.kernels.fused.cross_entropy_reference import BLOCK_V
from nvfp4_train.models.config import model_config
from nvfp4_train.precision.layer_map import LayerPrecisionMap
from tests.kernels.test_cross_entropy import (
    assert_grad_within,
    assert_loss_within,
    assert_same_bits,
    eta_megatron,
    eta_ours,
    exact_ce,
    grad_bound,
    loss_bound,
    rounded,
)
from tests.precision.mcore_util import megatron_single_rank


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _build(mc):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    lm = LayerPrecisionMap(mc.pattern, "bf16")
    return build_model(mc, lm, config=transformer_config(mc), seq_length=64)


def _step(model, ids, pos, labels, grad_loss, fusion: bool, logits_grad: torch.Tensor | None = None):
    """loss, logits, d loss / d logits (as the loss computed it) and the parameter gradients of one
    forward/backward; ``logits_grad`` replaces the logits' gradient before the output layer sees it."""
    model.zero_grad(set_to_none=True)
    model.config.cross_entropy_loss_fusion = fusion
    seen = {}

    def hook(g):
        seen["grad"] = g.detach().clone()
        return logits_grad

    def capture(_module, _args, out):
        seen["logits"] = out[0].detach().clone()
        out[0].register_hook(hook)

    handle = model.output_layer.register_forward_hook(capture)
    try:
        loss = model(ids, pos, None, labels=labels)
        loss.backward(grad_loss)
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), seen["logits"], seen["grad"], grads


def test_fused_loss_matches_megatron_on_the_tiny_model(single_rank, gen, monkeypatch):
    import nvfp4_train.models.hybrid as hybrid

    mc = model_config("tiny")
    model = _build(mc)
    b, s = 1, 64
    ids = torch.randint(0, mc.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, mc.vocab_size, (b, s), generator=gen)
    pos = torch.arange(s)[None].expand(b, s)
    grad_loss = torch.rand(b, s, generator=gen)

    groups = []
    fused_fn = hybrid.vocab_parallel_cross_entropy

    def spy(logits, target, tp_group=None, **kw):
        groups.append(tp_group)
        return fused_fn(logits, target, tp_group, **kw)

    monkeypatch.setattr(hybrid, "vocab_parallel_cross_entropy", spy)
    if not hybrid.use_triton(torch.empty(0)):
        # a plain CPU run keeps megatron's loss (the fused function would run its slow blocked reference) ...
        _step(model, ids, pos, labels, grad_loss, fusion=True)
        assert groups == []
        # ... so the hook is taken as on a GPU, where the function then runs its reference on these CPU tensors
        monkeypatch.setattr(hybrid, "use_triton", lambda t: True)
    loss1, logits1, dlogits1, grads1 = _step(model, ids, pos, labels, grad_loss, fusion=True)
    assert groups == [model.tp_group] and groups[0] is not None
    # megatron's loss; its logits gradient is recorded, then replaced by the fused one
    loss0, logits0, dlogits0, replay = _step(model, ids, pos, labels, grad_loss, fusion=False, logits_grad=dlogits1)
    assert len(groups) == 1
    assert loss1.dtype == torch.float32 and loss1.shape == (b, s)
    assert dlogits1.dtype == logits1.dtype == torch.bfloat16

    assert_same_bits(logits1, logits0, "logits")
    v = logits0.shape[-1]
    # rows in the logits' [s, b] order
    ex = exact_ce(logits0.reshape(-1, v), labels.t().reshape(-1), grad_loss.t().reshape(-1))
    eta_o, eta_m = eta_ours(ex, v, BLOCK_V), eta_megatron(ex, v)
    assert_loss_within(loss1.t(), loss0.t(), loss_bound(ex, eta_o) + loss_bound(ex, eta_m), ex, "loss")
    gb = rounded(grad_bound(ex, eta_o) + grad_bound(ex, eta_m), ex, torch.bfloat16)
    assert_grad_within(dlogits1, dlogits0, gb, ex, "logits gradient")

    assert grads1.keys() == replay.keys() and len(grads1) > 10
    for name, g in grads1.items():
        assert_same_bits(replay[name], g, name)


def test_megatron_config_accepts_the_fusion_switch():
    """megatron-core's ``TransformerConfig`` takes ``cross_entropy_loss_fusion=True`` without Transformer
    Engine; its ``cross_entropy_fusion_impl`` stays 'native' (only 'te' would need Transformer Engine, and our
    override runs instead of either)."""
    from nvfp4_train.models.build import transformer_config

    cfg = dataclasses.replace(transformer_config(model_config("tiny")), cross_entropy_loss_fusion=True)
    assert cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl == "native"
