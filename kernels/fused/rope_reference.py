"""The rotary embedding's arithmetic in PyTorch: megatron-core's unfused path, operation by operation.

Layout (megatron's ``sbhd``): ``t`` [s, b, h, d], ``freqs`` [s, 1, 1, rot_dim] (megatron's ``RotaryEmbedding``
output, ``cat(f, f)`` along the last dim, fp32), rot_dim even and <= d; the tail ``t[..., rot_dim:]`` passes
through. With ``half = rot_dim / 2``, ``x = t[..., :rot_dim]`` and the tables
``cos_ = cos(freqs).to(t.dtype)``, ``sin_ = sin(freqs).to(t.dtype)`` (torch's own cos/sin, rounded once to
t's dtype), megatron computes (``_apply_rotary_pos_emb_bshd`` with ``_rotate_half``, non-interleaved)

    out[:half]  = R(R(x[:half] * cos_[:half]) + R(-x[half:] * sin_[:half]))
    out[half:]  = R(R(x[half:] * cos_[half:]) + R( x[:half] * sin_[half:]))
    out[rot:]   = t[rot:]                                                    (a copy, bits kept)

where R rounds an fp32 result to t's dtype (each torch op on bf16/fp16 computes in fp32 and rounds; the products
of two bf16 or two fp16 values are exact in fp32, the sum is rounded once in fp32 and once to t's dtype; for
fp32 t, R is the identity and every product and sum is rounded once in fp32).

Autograd's backward of that expression, for the output gradient g (``rope_backward_ref``): each product
``x * cos_`` gives ``R(g * cos_)``; ``rotate_half(x) * sin_`` gives ``r = R(g * sin_)``, which ``cat`` / ``neg``
/ ``chunk`` send back rotated the other way, ``(r[half:], -r[:half])``; the two reach x and are added (rounded
once), and the slices ``t[..., :rot]`` and ``t[..., rot:]`` each give a zero-filled full-size gradient that
autograd adds, which turns a -0 into +0 (the only change adding zeros makes):

    dt[:half]   = Z(R(R(g[:half] * cos_[:half]) + R(g[half:] * sin_[half:])))
    dt[half:]   = Z(R(R(g[half:] * cos_[half:]) - R(g[:half] * sin_[:half])))
    dt[rot:]    = Z(g[rot:])                                 Z: -0 -> +0, everything else unchanged

Non-finite values follow IEEE arithmetic (NaN in, NaN out; the NaN's sign and payload are not specified).
"""

from __future__ import annotations

import torch

__all__ = [
    "ROPE_DTYPES",
    "check_rope_input",
    "rope_tables_ref",
    "rope_forward_ref",
    "rope_backward_ref",
    "apply_rope_ref",
]

ROPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_rope_input(t: torch.Tensor, freqs: torch.Tensor) -> int:
    """``t`` [s, b, h, d] bf16/fp16/fp32 and ``freqs`` [s, 1, 1, rot_dim] floating on t's device, rot_dim
    even and <= d; returns rot_dim."""
    if not isinstance(t, torch.Tensor) or not isinstance(freqs, torch.Tensor):
        raise TypeError(f"the rotary embedding takes tensors, got {type(t).__name__} and {type(freqs).__name__}")
    if t.dtype not in ROPE_DTYPES:
        raise ValueError(f"the rotary embedding takes a bfloat16, float16 or float32 t, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"the rotary embedding takes t as [s, b, h, d] (megatron's sbhd layout), got shape "
                         f"{tuple(t.shape)}; packed (thd) sequences are not supported")
    if not freqs.is_floating_point() or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"the rotary embedding takes freqs as a floating [s, 1, 1, rot_dim] tensor, got "
                         f"{freqs.dtype} {tuple(freqs.shape)}; per-sample frequencies (mRoPE with batch > 1) "
                         f"need megatron's unfused path: set apply_rope_fusion=False")
    if freqs.shape[0] != t.shape[0]:
        raise ValueError(f"freqs covers {freqs.shape[0]} positions, t has {t.shape[0]}: slice freqs to t's "
                         f"sequence (freqs[:s])")
    rot = freqs.shape[-1]
    if rot % 2 != 0 or rot > t.shape[-1]:
        raise ValueError(f"rot_dim={rot} (freqs.shape[-1]) must be even and at most the head dim {t.shape[-1]}")
    if freqs.device != t.device:
        raise ValueError(f"freqs is on {freqs.device}, t on {t.device}: move freqs to t's device")
    if freqs.requires_grad and torch.is_grad_enabled():
        raise ValueError("freqs requires grad: the fused rotary embedding gives no gradient for freqs; detach it "
                         "or set apply_rope_fusion=False")
    return rot


def rope_tables_ref(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_, sin_)``, each [s, rot_dim] contiguous in ``dtype``: megatron's ``torch.cos(freqs).to(dtype)``
    and ``torch.sin(freqs).to(dtype)`` on the same tensor (its ``* mscale`` with mscale = 1.0 changes no bit)."""
    s, rot = freqs.shape[0], freqs.shape[-1]
    cos_ = torch.cos(freqs).to(dtype).reshape(s, rot).contiguous()
    sin_ = torch.sin(freqs).to(dtype).reshape(s, rot).contiguous()
    return cos_, sin_


def rope_forward_ref(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous [s, b, h, d] tensor: megatron's ops in its order (slice, chunk, neg, cat, mul, mul,
    add, cat), so that autograd's backward of this function is megatron's too."""
    rot = cos_.shape[-1]
    c = cos_[:, None, None, :]
    s = sin_[:, None, None, :]
    x, x_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = (x * c) + (torch.cat((-x2, x1), dim=-1) * s)
    return torch.cat((out, x_pass), dim=-1)


def rope_backward_ref(g: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor) -> torch.Tensor:
    """The gradient of ``rope_forward_ref``'s t for the output gradient ``g`` [s, b, h, d] (the module
    docstring's dt), a fresh contiguous tensor of g's dtype."""
    rot = cos_.shape[-1]
    half = rot // 2
    c = cos_[:, None, None, :]
    s = sin_[:, None, None, :]
    g_rot = g[..., :rot]
    a = g_rot * c
    r = g_rot * s
    d = a + torch.cat((r[..., half:], -r[..., :half]), dim=-1)
    out = torch.cat((d, g[..., rot:]), dim=-1)
    return out.masked_fill(out == 0, 0.0)  # -0 -> +0 (NaN != 0 keeps its bits)


def apply_rope_ref(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``t`` [s, b, h, d] by ``freqs`` [s, 1, 1, rot_dim] with torch ops (autograd
    differentiates it w.r.t. t as it does megatron's unfused path, bit for bit)."""
    check_rope_input(t, freqs)
    cos_, sin_ = rope_tables_ref(freqs, t.dtype)
    return rope_forward_ref(t, cos_, sin_)
