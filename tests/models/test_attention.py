"""SDPAttention (PyTorch SDPA) computes what megatron's local DotProductAttention computes."""

from __future__ import annotations

import pytest
import torch

from tests.precision.mcore_util import megatron_single_rank


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_sdpa_matches_megatron_dot_product_attention(gen, heads, groups):
    """fp32: both compute softmax(q k^T / sqrt(d) + causal mask) v with fp32 sums over at most 64 terms; the
    two orders of summation differ by a few ulps (|out| <= max|v| ~ 4: 64 * 2^-24 * 4 ~ 2e-5 worst case)."""
    with megatron_single_rank():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        from nvfp4_train.models.attention import SDPAttention

        cfg = TransformerConfig(num_layers=1, hidden_size=heads * 16, num_attention_heads=heads,
                                num_query_groups=groups, kv_channels=16, attention_dropout=0.0,
                                masked_softmax_fusion=False, use_cpu_initialization=True)
        model_parallel_cuda_manual_seed(0)  # megatron's attention forks its dropout RNG stream
        ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        ours = SDPAttention(cfg, 1, AttnMaskType.causal, "self")
        s, b = 64, 2
        q = torch.randn(s, b, heads, 16, generator=gen)
        k = torch.randn(s, b, groups, 16, generator=gen)
        v = torch.randn(s, b, groups, 16, generator=gen)
        a = ref(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        o = ours(q, k, v, None)
        assert o.shape == a.shape == (s, b, heads * 16)
        assert (a - o).abs().max() < 2e-5
        # causal: the first 10 positions ignore later keys/values
        v2 = v.clone()
        v2[10:] += 1
        assert torch.equal(ours(q, k, v2, None)[:10], o[:10])
