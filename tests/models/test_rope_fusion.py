"""megatron-core's ``apply_rope_fusion=True`` and ``fused_single_qkv_rope=True`` served by our fused rotary
embedding (``nvfp4_train.mcore_compat.rope``): the switches validate, refuse what the kernels do not do, and a rope
model gives the unfused path's outputs and gradients bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nvfp4_train.mcore_compat.rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    fused_qkv_rotary_pos_emb,
    install_fused_qkv_rope,
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


def _batch(mc, device: str):
    """Fixed tokens and positions (the comparisons are bitwise: the draw does not matter)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (2, 64), generator=g).to(device)
    return ids, torch.arange(64, device=device)[None].expand(2, 64)


def _assert_same_step(got, want) -> None:
    """Two ``_step`` results bit for bit: the per-token losses and every parameter's gradient."""
    (loss_g, grads_g), (loss_w, grads_w) = got, want
    assert torch.equal(loss_g, loss_w)
    assert grads_g.keys() == grads_w.keys()
    for name in grads_w:
        assert torch.equal(grads_g[name], grads_w[name]), name


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
    ids, pos = _batch(mc, device)
    assert model.config.apply_rope_fusion is False
    with sdpa_kernel(SDPBackend.MATH):
        unfused = _step(model, ids, pos)
        loss_u2, grads_u2 = _step(model, ids, pos)
        assert calls == []
        model.config.apply_rope_fusion = True  # every block shares the model's config
        try:
            fused = _step(model, ids, pos)
        finally:
            model.config.apply_rope_fusion = False
    loss_u, grads_u = unfused
    assert torch.equal(loss_u2, loss_u) and all(torch.equal(grads_u2[n], grads_u[n]) for n in grads_u), (
        "the unfused model does not repeat its own bits on this device: no bitwise comparison is possible")
    assert len(calls) == 4  # q and k of each of the two attention blocks
    _assert_same_step(fused, unfused)


def test_rope_model_fused_equals_unfused_bitwise(single_rank, monkeypatch):
    """On CPU without the interpreter the fused op runs its reference: megatron's wiring of the switch."""
    _fused_equals_unfused("cpu", monkeypatch)


@pytest.mark.triton
def test_rope_model_fused_kernel_equals_unfused_bitwise(single_rank, triton_device, monkeypatch):
    """The Triton kernels inside megatron's SelfAttention (the interpreter on CPU, natively on a GPU)."""
    _fused_equals_unfused(triton_device, monkeypatch)


def _qkv_fused_equals_split(device: str, monkeypatch) -> None:
    """The same model and batch on megatron's split path (q and k rotated by our per-tensor kernel, as the default
    fusion runs it), then with ``fused_single_qkv_rope``: the per-token losses and every gradient agree bit for
    bit, and the fused qkv op ran once per attention block (not the per-tensor one)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    install_fused_rope()
    install_fused_qkv_rope()
    mc, model = _rope_model(device)
    calls, qkv_calls = [], []

    def counted(t, freqs, **kw):
        calls.append(tuple(t.shape))
        return fused_apply_rotary_pos_emb(t, freqs, **kw)

    def counted_qkv(qkv, qf, kf, split, **kw):
        qkv_calls.append(tuple(qkv.shape))
        return fused_qkv_rotary_pos_emb(qkv, qf, kf, split, **kw)

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", counted)
    monkeypatch.setattr(attention, "apply_fused_qkv_rotary_pos_emb", counted_qkv)
    ids, pos = _batch(mc, device)
    with sdpa_kernel(SDPBackend.MATH):
        model.config.apply_rope_fusion = True
        try:
            split = _step(model, ids, pos)
            model.config.fused_single_qkv_rope = True
            fused = _step(model, ids, pos)
        finally:
            model.config.apply_rope_fusion = False
            model.config.fused_single_qkv_rope = False
    assert len(calls) == 4 and len(qkv_calls) == 2  # split: q and k of 2 blocks; fused: one call per block
    _assert_same_step(fused, split)


def test_qkv_rope_model_equals_the_split_path_bitwise(single_rank, monkeypatch):
    """On CPU without the interpreter the fused qkv op runs its reference: megatron's wiring of the switch."""
    _qkv_fused_equals_split("cpu", monkeypatch)


@pytest.mark.triton
def test_qkv_rope_model_kernels_equal_the_split_path_bitwise(single_rank, triton_device, monkeypatch):
    """The Triton kernels inside megatron's SelfAttention (the interpreter on CPU, natively on a GPU)."""
    _qkv_fused_equals_split(triton_device, monkeypatch)


def test_qkv_switch_installs_validates_and_refuses_what_it_does_not_do():
    """The builder sets the switch for a rope model only (megatron asserts the fused path is taken once it is on);
    the installed function refuses what megatron never passes on this path, naming the switch."""
    from megatron.core.transformer import attention

    from nvfp4_train.models.build import transformer_config
    from nvfp4_train.models.fusion import FusionConfig

    rope = model_config("tiny").replace(position_embedding="rope", pattern="*-*-", num_layers=4)
    cfg = transformer_config(rope, use_cpu_initialization=True, fusion=FusionConfig(qkv_rope=True))
    assert cfg.fused_single_qkv_rope and attention.HAVE_FUSED_QKV_ROPE
    assert attention.apply_fused_qkv_rotary_pos_emb is fused_qkv_rotary_pos_emb
    assert transformer_config(rope, use_cpu_initialization=True, fusion=FusionConfig()).fused_single_qkv_rope
    assert not transformer_config(rope, use_cpu_initialization=True,
                                  fusion=FusionConfig(qkv_rope=False)).fused_single_qkv_rope
    plain = model_config("tiny").replace(pattern="*-*-", num_layers=4)  # no rotary embedding
    assert plain.position_embedding != "rope"
    assert not transformer_config(plain, use_cpu_initialization=True,
                                  fusion=FusionConfig(qkv_rope=True)).fused_single_qkv_rope
    qkv, freqs = torch.zeros(4, 1, 2, 32), torch.zeros(4, 1, 1, 8)
    for kw in ({"tensor_format": "bshd"}, {"interleaved": True}, {"cp_size": 2}, {"start_positions": torch.zeros(1)}):
        with pytest.raises(ValueError, match="fusion.qkv_rope=false"):
            fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [16, 8, 8], **kw)
