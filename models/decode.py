"""Incremental decoding of the hybrid model: the per-layer state of a batch of sequences being generated.

A full forward of ``n`` tokens costs O(n) in every Mamba layer and O(n^2) in attention, so generating ``n`` tokens
by recomputing the sequence costs O(n^2) (attention O(n^3)). With a :class:`DecodeState` each position is computed
once: the prompt in one forward (the prefill), then one token per forward, each layer reading what it kept of the
earlier positions:

==============  ========================================================================  ==========================
block           state kept per sequence                                                   one-token step
==============  ========================================================================  ==========================
``*``           keys and values of every position, after RoPE                             SDPA of the new query over
                (:class:`~nvfp4_train.models.attention.KVCache`, ``[max_length, b,        all cached keys
                groups, head_dim]`` each)
``M``           the conv inputs of the last ``width - 1`` positions and the SSM state     ``causal_conv1d_update``,
                ``[b, heads, head_dim, state]`` in fp32                                   ``selective_state_update``
                (:class:`~nvfp4_train.models.mamba.mixer.MambaDecodeCache`)               (CUDA) or PyTorch steps
``-``           nothing (the MLP is per token)
==============  ========================================================================  ==========================

:meth:`nvfp4_train.models.hybrid.HybridModel.forward_cached` runs the model over the positions after those a state
holds; :func:`attached` hands each layer its cache for the duration of that forward (the layers' ``kv_cache`` and
``decode_cache`` are None otherwise, so training and full-sequence forwards never see a cache). Every linear layer
must run in bf16 (a quantized recipe blocks the tokens of a forward in 16s with a per-tensor amax over all of them:
one new token has no such blocks). Same batch of sequences, all of one length; TP = PP = 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from nvfp4_train.models.attention import KVCache, SDPAttention
from nvfp4_train.models.mamba.mixer import MambaDecodeCache, MambaMixer

__all__ = ["DecodeState", "attached"]


class DecodeState:
    """The caches of the layers of one model for one batch of sequences (keyed by module name, made at first use),
    and ``length``, the positions the model has consumed; at most ``max_length`` positions in all."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1")
        self.max_length = max_length
        self.length = 0
        self._kv: dict[str, KVCache] = {}
        self._mamba: dict[str, MambaDecodeCache] = {}

    def kv_cache(self, name: str) -> KVCache:
        if name not in self._kv:
            self._kv[name] = KVCache(self.max_length)
        return self._kv[name]

    def mamba_cache(self, name: str) -> MambaDecodeCache:
        if name not in self._mamba:
            self._mamba[name] = MambaDecodeCache()
        return self._mamba[name]


@contextlib.contextmanager
def attached(model: torch.nn.Module, state: DecodeState) -> Iterator[None]:
    """Within the block, every attention core and Mamba mixer of ``model`` reads and extends its cache in ``state``;
    after it (also on an error) they hold none."""
    hooked: list[torch.nn.Module] = []
    try:
        for name, module in model.named_modules():
            if isinstance(module, SDPAttention):
                module.kv_cache = state.kv_cache(name)
                hooked.append(module)
            elif isinstance(module, MambaMixer):
                module.decode_cache = state.mamba_cache(name)
                hooked.append(module)
        yield
    finally:
        for module in hooked:
            if isinstance(module, SDPAttention):
                module.kv_cache = None
            else:
                module.decode_cache = None
