"""Model FLOPs per token (for MFU), counted from the config: 2 FLOPs per multiply-add of every matmul, the
attention score/value products included (causal: half of the s x s products are needed, and we count all
of them as megatron's MFU formulas do), the SSD scan's matmul-like work included; norms, activations,
convolutions and elementwise ops are left out. Training = 3 x forward (forward, dgrad, wgrad)."""

from __future__ import annotations

from nvfp4_train.models.config import ModelConfig
from nvfp4_train.models.pattern import ATTENTION, MAMBA, MLP

__all__ = ["forward_flops_per_token", "training_flops_per_token"]


def forward_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    h = cfg.hidden_size
    pattern = cfg.hybrid_pattern()
    total = 2.0 * h * cfg.vocab_size  # output layer (the embedding is a lookup)
    for kind in pattern.blocks:
        if kind == ATTENTION:
            q = cfg.attention_q_width
            total += 2.0 * h * cfg.attention_qkv_width + 2.0 * q * h  # qkv + proj
            total += 2.0 * 2.0 * seq_length * q  # scores (q.k) and values (p.v), each s x d per query
        elif kind == MLP:
            total += 2.0 * h * cfg.mlp_fc1_width + 2.0 * cfg.ffn_hidden_size * h
        elif kind == MAMBA:
            d_in = cfg.mamba_d_inner
            total += 2.0 * h * cfg.mamba_in_proj_width + 2.0 * d_in * h
            # SSD: per token, per head: state update and read-out, 2 * (headdim * state) each, in chunks
            # plus the intra-chunk quadratic part ~ chunk * (state + headdim) per head
            n, p, heads, c = cfg.mamba_state_dim, cfg.mamba_head_dim, cfg.mamba_num_heads, cfg.mamba_chunk_size
            total += heads * (2.0 * 2.0 * p * n + 2.0 * c * (n + p))
    return total


def training_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    return 3.0 * forward_flops_per_token(cfg, seq_length)
