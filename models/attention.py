"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (a megatron ``core_attention``
slot filler).

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` score matrix (and its
softmax) in memory: at sequence 8192 with 40 heads that is 5 GiB per copy per layer. Its fused alternative
needs Transformer Engine. ``SDPAttention`` hands the same causal, grouped-query attention to PyTorch's SDPA,
which on a GPU dispatches to the flash / cuDNN / memory-efficient kernels (O(s) memory) and on a CPU to its
math path. Same inputs and outputs as megatron's module: query ``[s, b, np, hn]``, key/value
``[s, b, ng, hn]`` (np, ng the heads and groups of this TP rank) -> ``[s, b, np * hn]``. The softmax is
always computed in fp32 inside the kernels; the scale is ``1/sqrt(hn)``; dropout is not supported (the
Nemotron-H recipe trains without it).

Incremental decoding (:mod:`nvfp4_train.models.decode`) gives the module a :class:`KVCache` for the length of one
generation (``kv_cache``; None, the default, in training and in every full-sequence forward). Each forward then
appends its keys and values (after RoPE, as megatron hands them over) to the cache and attends from its queries to
every cached position: a first chunk is the same causal SDPA call as training; one new token attends to all
positions with no mask; a later chunk of several tokens with the causal mask aligned to its end.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPAttention", "KVCache"]


class KVCache:
    """The keys and values of one attention layer for the positions decoded so far: ``[max_length, b, groups, hn]``
    buffers, allocated at the first :meth:`append` in the keys' dtype and device."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1")
        self.max_length = max_length
        self.length = 0
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store ``key``/``value`` [s, b, groups, hn] after the cached positions; returns (every cached key,
        every cached value, the position of the first new one)."""
        s = key.shape[0]
        start = self.length
        if start + s > self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions is full: {start} cached + {s} new")
        if self.key is None:
            self.key = key.new_empty((self.max_length, *key.shape[1:]))
            self.value = value.new_empty((self.max_length, *value.shape[1:]))
        self.key[start:start + s] = key
        self.value[start:start + s] = value
        self.length = start + s
        return self.key[:self.length], self.value[:self.length], start


class SDPAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention implements causal self-attention only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SDPAttention does not implement attention dropout ({dropout}): set it to 0")
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.kv_cache: KVCache | None = None  # set only while decoding (nvfp4_train.models.decode.attached)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention: attention_bias and packed sequences are not supported")
        s, b, heads, hn = query.shape
        start = 0
        if self.kv_cache is not None:
            key, value, start = self.kv_cache.append(key, value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads|groups, s, hn]
        mask = None  # start == 0: SDPA's causal mask (top-left aligned: right when queries and keys start together)
        if start and s > 1:  # a later chunk: query i (position start + i) sees keys 0 .. start + i
            mask = torch.ones(s, start + s, dtype=torch.bool, device=q.device).tril(diagonal=start)
        # grouped-query attention: SDPA maps each query head to its K/V group itself (no repeated copies of K and
        # V, and no sum over the copies in backward; on an H200, 1.2b's shape: 0.91x the time of repeat_interleave
        # + SDPA, forward + backward, docs/benchmarks.md)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=start == 0, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * hn)
