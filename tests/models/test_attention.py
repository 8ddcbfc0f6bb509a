"""SDPAttention (PyTorch SDPA) computes what megatron's local DotProductAttention computes."""

from __future__ import annotations

import math

import pytest
import torch

from tests.precision.mcore_util import megatron_single_rank


U = 2.0 ** -24  # unit roundoff of fp32


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _attention_bound(q, k, v) -> float:
    """Bound on |o_a - o_b| between two fp32 evaluations of causal softmax(q k^T / sqrt(d)) v, any summation
    order (blocked online softmax included), q: (s, b, heads, d), k and v: (s, b, groups, d).

    One evaluation: each score q.k / sqrt(d) (d products summed; 1/sqrt(d) = 1/4 exact) is within
    D = gamma_d * max sum_i |q_i k_i| / sqrt(d) of the exact score. Scores perturbed by at most D change every
    softmax weight p_j by a factor in [e^-2D, e^2D] (numerator and normaliser), so sum_j |dp_j| <= e^2D - 1.
    Evaluating the weights (the max subtraction, exp within 2 ulp, at most s rescalings of a running sum by
    exp(m_old - m_new) and s additions, one division) is within gamma_(3s + 4) relative per weight, and the
    weighted sum of the values within gamma_s sum_j p_j |v_j|. With sum_j p_j = 1 and |v_j| <= max|v|, one
    evaluation is within max|v| ((e^2D - 1) + gamma_(3s + 4) + gamma_s) (1 + 1e-3: second-order terms) of the
    exact output; two evaluations differ by at most twice that."""
    s, d = q.shape[0], q.shape[-1]
    rep = q.shape[2] // k.shape[2]
    qa = q.abs().double().permute(1, 2, 0, 3)  # (b, heads, s, d)
    ka = k.abs().double().repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
    dot = float((qa @ ka.transpose(-1, -2)).max())
    dmax = _gamma(d) * dot / math.sqrt(d)
    one = float(v.abs().max()) * (math.expm1(2 * dmax) + _gamma(3 * s + 4) + _gamma(s)) * (1 + 1e-3)
    return 2 * one


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_sdpa_matches_megatron_dot_product_attention(gen, heads, groups):
    """fp32: both compute softmax(q k^T / sqrt(d) + causal mask) v, in different orders; the difference is
    within twice one evaluation's error bound (:func:`_attention_bound`, computed from the drawn inputs)."""
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
        err, bound = float((a - o).abs().max()), _attention_bound(q, k, v)
        assert err <= bound, (err, bound)
        # causal: the first 10 positions ignore later keys/values
        v2 = v.clone()
        v2[10:] += 1
        assert torch.equal(ours(q, k, v2, None)[:10], o[:10])
