"""megatron-core's ``apply_rope_fusion`` switch, served by our fused rotary embedding instead of Transformer Engine.

And :func:`rotary_follows_model`: the rotary frequencies stay on the device of the model's parameters.

megatron-core 0.16.1 ... 0.19.x: ``megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb`` (what
``SelfAttention`` calls for q and for k) calls the module global ``fused_apply_rotary_pos_emb(t, freqs,
interleaved=config.rotary_interleaved)`` when ``config.apply_rope_fusion`` is set and the sequences are not packed,
and ``fused_apply_rotary_pos_emb_thd`` when they are. Both globals are None without Transformer Engine, and
``TransformerConfig.__post_init__`` refuses ``apply_rope_fusion=True`` while both are None (it imports them from
``rope_utils`` when it runs, so it sees what :func:`install_fused_rope` sets). :func:`install_fused_rope` sets
them to :func:`fused_apply_rotary_pos_emb` (``nvfp4_train.kernels.fused.rope.apply_rope``: bitwise megatron's
unfused arithmetic, forward and backward) and to :func:`fused_apply_rotary_pos_emb_thd` (a ValueError: we do
not pack sequences). Transformer Engine's kernel, where installed, is replaced too: it computes in fp32 without
the unfused path's roundings, and the switch promises the unfused bits.

What else reads the switch, in both releases, and why it is safe:
- megatron's dispatcher itself runs its unfused path, with a warning, for ``mscale != 1`` (YaRN), mRoPE with
  batch > 1 and (0.19) MLA-style interleaving, without calling the fused function: the results stay megatron's.
- ``rotary_interleaved=True`` with the switch: ``__post_init__`` asks for Transformer Engine >= 2.3 (a config
  error without it); the fused function refuses it too.
- multi-latent attention (``multi_latent_attention=True``) with the switch calls megatron's own MLA/YaRN fused
  kernels, not these globals; our models have no MLA.
- ``rotary_pos_cos``/``rotary_pos_sin`` (flash decoding, flashinfer) are inference-only and do not read it.

And megatron's ``fused_single_qkv_rope`` switch (``fusion.qkv_rope``): with it, ``Attention.forward`` (0.16.1 ...
0.19.x, the same code) asks ``get_query_key_value_tensors`` for the unsplit qkv projection output and the split
sizes, and calls the module global ``apply_fused_qkv_rotary_pos_emb(mixed_qkv, q_freqs, k_freqs, split)`` instead
of splitting, copying the query to [s, b, heads, d] and applying the rotary embedding to q and k (and, backward,
concatenating the three gradients). It takes that path only where the module global ``HAVE_FUSED_QKV_ROPE`` is
True (Transformer Engine's kernel importable) and asserts when the switch is on and the path is not taken (no
rotary embedding, packed sequences, megatron's inference context, q/k norms, flash decoding):
:func:`install_fused_qkv_rope` sets both globals to :func:`fused_qkv_rotary_pos_emb`
(``kernels/fused/rope.py: apply_rope_qkv``, bitwise the split path), and the model builder sets the switch only
for a model with the rotary embedding.
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels.fused.rope import apply_rope, apply_rope_qkv

__all__ = ["install_fused_rope", "install_fused_qkv_rope", "fused_apply_rotary_pos_emb",
           "fused_apply_rotary_pos_emb_thd", "fused_qkv_rotary_pos_emb", "rotary_follows_model"]


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory, interleaved)`` (its Transformer
    Engine wrapper's signature) by ``apply_rope``: t [s, b, h, d], freqs [s, 1, 1, rot_dim]. Interleaved RoPE,
    ``transpose_output_memory`` and a scale other than 1 are refused (megatron passes none of them here today)."""
    if interleaved:
        raise ValueError("rotary_interleaved=True: the fused rotary embedding is non-interleaved only; set "
                         "apply_rope_fusion=False (or rotary_interleaved=False)")
    if transpose_output_memory:
        raise ValueError("transpose_output_memory=True is not supported by the fused rotary embedding; pass False "
                         "or set apply_rope_fusion=False")
    if mscale != 1.0:
        raise ValueError(f"mscale={mscale}: the fused rotary embedding applies no scale; set apply_rope_fusion=False")
    return apply_rope(t, freqs)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *args,
                                   **kwargs) -> torch.Tensor:
    """Packed sequences (``thd``, ``cu_seqlens``) are not supported: a ValueError naming the switch."""
    raise ValueError("the fused rotary embedding takes [s, b, h, d] tensors; packed sequences (thd format, "
                     "cu_seqlens) need megatron's unfused path: set apply_rope_fusion=False")


def install_fused_rope() -> None:
    """Make megatron-core's ``apply_rope_fusion=True`` run our fused rotary embedding (idempotent). Call it before
    a ``TransformerConfig(apply_rope_fusion=True)`` is built (its validation reads these globals)."""
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd


def fused_qkv_rotary_pos_emb(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, qkv_split_arg_list,
                             tensor_format: str = "sbhd", interleaved: bool = False, cp_size: int = 1,
                             cp_rank: int = 0, start_positions=None):
    """megatron's ``apply_fused_qkv_rotary_pos_emb`` (its Transformer Engine signature) by ``apply_rope_qkv``: the
    fused qkv output [s, b, groups, (heads per group + 2) * d] -> (query [s, b, heads, d], key [s, b, groups, d],
    value [s, b, groups, d]). Another tensor format, interleaving, context parallelism and start positions are
    refused (megatron passes none of them on this path)."""
    if tensor_format != "sbhd" or interleaved or cp_size != 1 or start_positions is not None:
        raise ValueError(f"the fused qkv rotary embedding takes sbhd tensors, non-interleaved, without context "
                         f"parallelism or start positions (got tensor_format={tensor_format!r}, interleaved="
                         f"{interleaved}, cp_size={cp_size}, start_positions={start_positions is not None}); set "
                         f"fusion.qkv_rope=false")
    return apply_rope_qkv(qkv, q_freqs, k_freqs, qkv_split_arg_list)


def install_fused_qkv_rope() -> None:
    """Make megatron-core's ``fused_single_qkv_rope=True`` run :func:`fused_qkv_rotary_pos_emb` (idempotent)."""
    from megatron.core.transformer import attention

    attention.apply_fused_qkv_rotary_pos_emb = fused_qkv_rotary_pos_emb
    attention.HAVE_FUSED_QKV_ROPE = True


def _get_emb_on_its_device(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """megatron-core's ``RotaryEmbedding.get_emb`` (0.16.1 ... 0.19.x, the same code) without its first statement,
    which moves ``inv_freq`` to ``torch.cuda.current_device()`` whenever it lies on the CPU: the frequencies stay
    where :func:`rotary_follows_model` put them. Non-interleaved only (our models; megatron's own path otherwise)."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def rotary_follows_model(rope: torch.nn.Module, device: torch.device) -> None:
    """Keep a megatron-core ``RotaryEmbedding``'s frequencies on ``device``, the device of the model's parameters
    (called by ``HybridModel._apply``, i.e. by every ``.to``/``.cuda``/``.cpu``).

    megatron-core 0.16.1 ... 0.19.x keep ``inv_freq`` as a plain attribute (``Module.to`` does not move it) and
    move it to the current CUDA device in ``get_emb`` whenever it lies on the CPU: a lazy move for models built
    on the CPU and trained on a GPU. A model meant to run on the CPU of a machine with a GPU (``generate`` /
    ``evaluate --device cpu``) then mixes devices. Here the frequencies move with the model, and a model on the
    CPU computes its embedding there (:func:`_get_emb_on_its_device`); on a GPU megatron's own ``get_emb`` runs.
    The embeddings ``forward`` cached (an ``lru_cache`` over every instance) are dropped when the device changes."""
    if not hasattr(rope, "inv_freq") or getattr(rope, "rotary_interleaved", False):
        return
    if rope.inv_freq.device != device:
        rope.inv_freq = rope.inv_freq.to(device)
        cache_clear = getattr(type(rope).forward, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    if device.type == "cpu":
        rope.get_emb = _get_emb_on_its_device.__get__(rope)  # this instance only
    else:
        rope.__dict__.pop("get_emb", None)
