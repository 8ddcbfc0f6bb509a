"""megatron-core's ``apply_rope_fusion=True`` served by our fused rotary embedding
(``nvfp4_train.mcore_compat.rope``): the switch validates, refuses what the kernel does not do, and a rope model
gives the unfused path's outputs and gradients bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nvfp4_train.mcore_compat.rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    install_fused_rope,
)
from nvfp4_train.mcore_compat.transformer import no_cuda_graph_kwargs
from nvfp4_train.models.config import model_config
from nvfp4_train.precision.layer_map import LayerPrecisionMap
from tests.precision.mcore_util import megatron_single_rank


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def test_install_is_idempotent_and_the_config_accepts_the_switch():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    install_fused_rope()
    install_fused_rope()
    assert rope_utils.fused_apply_rotary_pos_emb is fused_apply_rotary_pos_emb
    assert rope_utils.fused_apply_rotary_pos_emb_thd is fused_apply_rotary_pos_emb_thd
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True,
                            **no_cuda_graph_kwargs())
    assert cfg.apply_rope_fusion
    # dataclasses.replace runs megatron's validation again
    off = dataclasses.replace(cfg, apply_rope_fusion=False)
    assert dataclasses.replace(off, apply_rope_fusion=True).apply_rope_fusion


def test_what_the_kernel_does_not_do_is_refused_with_the_switch_named():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    install_fused_rope()
    t = torch.zeros(4, 1, 2, 8)
    freqs = torch.zeros(4, 1, 1, 8)
    for kw in ({"interleaved": True}, {"transpose_output_memory": True}, {"mscale": 2.0}):
        with pytest.raises(ValueError, match="apply_rope_fusion=False"):
            fused_apply_rotary_pos_emb(t, freqs, **kw)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True,
                            **no_cuda_graph_kwargs())
    cu_seqlens = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences"):
        # megatron's own dispatcher, packed (thd) sequences
        rope_utils.apply_rotary_pos_emb(t[:, 0], freqs, cfg, cu_seqlens=cu_seqlens, cp_group=_OneRank())
    with pytest.raises(ValueError, match="apply_rope_fusion=False"):
        rope_utils.apply_rotary_pos_emb(t, torch.zeros(4, 2, 1, 8), cfg, cp_group=_OneRank())  # batch-wide mRoPE


class _OneRank:
    """A context-parallel group of one rank (megatron's dispatcher reads its size and rank)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _rope_model(device: str):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    mc = model_config("tiny").replace(position_embedding="rope", pattern="*-*-", num_layers=4)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = transformer_config(mc, use_cpu_initialization=True)
    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=cfg, seq_length=64)
    return mc, model.to(device)


def _step(model, ids, pos):
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids)
    loss.float().sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _fused_equals_unfused(device: str, monkeypatch) -> None:
    """The same model and batch with megatron's switch off (twice: the baseline must itself repeat bit for bit),
    then on: the per-token losses and every parameter's gradient agree bit for bit, and the fused op ran for q
    and k of both attention blocks. Attention runs on SDPA's math backend, whose backward is deterministic on a
    GPU too (the fused ones may accumulate in any order)."""
    from megatron.core.models.common.embeddings import rope_utils
    from torch.nn.attention import SDPBackend, sdpa_kernel

    install_fused_rope()
    mc, model = _rope_model(device)
    calls = []

    def counted(t, freqs, **kw):
        calls.append(tuple(t.shape))
        return fused_apply_rotary_pos_emb(t, freqs, **kw)

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", counted)
    g = torch.Generator().manual_seed(0)  # fixed tokens: the comparison is bitwise, the draw does not matter
    ids = torch.randint(0, mc.vocab_size, (2, 64), generator=g).to(device)
    pos = torch.arange(64, device=device)[None].expand(2, 64)
    assert model.config.apply_rope_fusion is False
    with sdpa_kernel(SDPBackend.MATH):
        loss_u, grads_u = _step(model, ids, pos)
        loss_u2, grads_u2 = _step(model, ids, pos)
        assert calls == []
        model.config.apply_rope_fusion = True  # every block shares the model's config
        try:
            loss_f, grads_f = _step(model, ids, pos)
        finally:
            model.config.apply_rope_fusion = False
    assert torch.equal(loss_u2, loss_u) and all(torch.equal(grads_u2[n], grads_u[n]) for n in grads_u), (
        "the unfused model does not repeat its own bits on this device: no bitwise comparison is possible")
    assert len(calls) == 4  # q and k of each of the two attention blocks
    assert torch.equal(loss_f, loss_u)
    assert grads_f.keys() == grads_u.keys()
    for name in grads_u:
        assert torch.equal(grads_f[name], grads_u[name]), name


def test_rope_model_fused_equals_unfused_bitwise(single_rank, monkeypatch):
    """On CPU without the interpreter the fused op runs its reference: megatron's wiring of the switch."""
    _fused_equals_unfused("cpu", monkeypatch)


@pytest.mark.triton
def test_rope_model_fused_kernel_equals_unfused_bitwise(single_rank, triton_device, monkeypatch):
    """The Triton kernels inside megatron's SelfAttention (the interpreter on CPU, natively on a GPU)."""
    _fused_equals_unfused(triton_device, monkeypatch)

