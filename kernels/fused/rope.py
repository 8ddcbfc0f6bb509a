"""The rotary embedding in one Triton kernel per direction, bitwise megatron-core's unfused arithmetic.

``apply_rope(t, freqs)`` computes ``rope_reference.apply_rope_ref(t, freqs)`` (the arithmetic and its
derivation, forward and backward, are in ``rope_reference.py``) as an autograd op of one launch forward and
one launch backward, where megatron's unfused path runs 6 elementwise launches over t each way (neg, cat, two
products, add, cat) plus the small ones that make its cos/sin tables.

Layout. t is megatron's [s, b, h, d] with any strides (q, k and v are views of the fused qkv projection's
output); the output, and the gradient w.r.t. t, are fresh contiguous [s, b, h, d] tensors. A row is one head
vector (position ``i``, ``r = b_idx * h + h_idx``); a program owns ``BLOCK_S`` positions x ``BLOCK_R`` of their
b*h rows and loads each row as its two halves ``x_lo = x[:half]``, ``x_hi = x[half:rot]`` ([BLOCK_S, BLOCK_R,
BLOCK_H] tiles, so that rotate_half is a choice of operand, not a data movement) and its pass-through tail.
The tables ``cos_`` and ``sin_`` ([s, rot] in t's dtype, computed by torch exactly as megatron does, so that no
transcendental function of the kernel has to match torch's) are loaded once per program and position, as four
half-rows broadcast over the rows. Per element, in fp32, R rounding to t's dtype:

    forward   lo = R(R(x_lo * c_lo) - R(x_hi * s_lo))      hi = R(R(x_hi * c_hi) + R(x_lo * s_hi))
    backward  lo = Z(R(R(g_lo * c_lo) + R(g_hi * s_hi)))  hi = Z(R(R(g_hi * c_hi) - R(g_lo * s_lo)))
    tail      forward: copied bits; backward: Z(g)         (Z: -0 -> +0, as autograd's zero-filled slices give)

(``R(-x * s) = -R(x * s)``: the rounding is symmetric.) R for bf16: the GPU's paired RNE conversion
(cvt.rn.bf16x2.f32; the last one's bf16 pair is stored as it is), the bit arithmetic of
``kernels/fp4_triton.py`` under the interpreter (whose own bf16 conversion differs); bf16 is read through its
bits (exact, subnormals included). fp16: the RNE cast (the compiler turns cast-multiply-cast into the GPU's
fp16 multiply and add, the same bits: the fp32 product is exact, and fp32 has the 2p + 2 = 24 bits that make
the double rounding of a sum innocuous). fp32: R is the identity, and the launch sets
``enable_fp_fusion=False`` so that no product is contracted into the following add (megatron rounds each
product on its own). Static count on sm_90 (``nvfp4_train/bench/sass.py``, q's tile of 32 x 128 elements,
4 warps): 16 SASS instructions per element forward, 18 backward (bf16), about half of the issue rate the
copy bandwidth asks for, so the kernels should be bound by memory.

The tables are cached on the ``freqs`` tensor itself (megatron's ``RotaryEmbedding.forward`` is an
``lru_cache``: every layer and every step gets the same freqs object), keyed by dtype and freqs' version
counter, so a step computes no cos/sin at all. The cache lives exactly as long as freqs does, which a captured
CUDA graph relies on already (megatron's unfused path reads freqs from inside the graph): a graph captured after
an eager step reads the cached tables; nothing is cached during a capture (a table computed there is the
graph's own and holds no values until it is replayed).

Bytes and time (prediction). Each direction reads t (or g) once and writes the result once, 4 bytes per
bf16 element, plus the tables (4 * rot bytes per position, read by the programs of a position, mostly from
L2). The ``1.2b`` model (bf16, s = 4096, micro-batch 2, 16 query heads and 8 KV groups of 128):

    q  [4096, 2, 16, 128]  16.8 MB in + 16.8 MB out  -> 8.4 us at ~4 TB/s
    k  [4096, 2, 8, 128]    8.4 MB in +  8.4 MB out  -> 4.2 us         (+ 2.1 MB of tables per launch)
    one attention block, one direction: 50.3 MB -> 12.6 us
    per step (20 blocks x forward + backward x 4 micro-batches): 8.05 GB in 320 launches -> 2.0 ms

against megatron's unfused path, which moves ~6x those bytes forward (12 element reads and writes per element
of t: 24 bytes against our 4) and more backward (zero-filled slice gradients and their sums).

The kernels run where ``nvfp4_train.kernels._dispatch.use_triton(t)`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``), the reference otherwise; both give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fp4_triton import cdiv
from nvfp4_train.kernels.fused._elements import KIND, kernel_bits, load_f32, round_to_kind, store_rounded
from nvfp4_train.kernels.fused.rope_reference import (
    apply_rope_ref,
    check_rope_input,
    rope_backward_ref,
    rope_forward_ref,
    rope_tables_ref,
)

__all__ = [
    "apply_rope",
    "apply_rope_qkv",
    "apply_rope_qkv_ref",
    "apply_rope_ref",
    "rope_tables",
    "rope_forward_triton",
    "rope_backward_triton",
    "rope_forward_ref",
    "rope_backward_ref",
    "rope_tables_ref",
]

# elements of one program's [BLOCK_S, BLOCK_R, BLOCK_H] half-tile (at least 64: two per thread of one warp); the
# interpreter pays per operation, not per element, so it takes the whole test tensor in a few programs
TILE = 2048
TILE_INTERPRETER = 1 << 15


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, S, B, H, stride_s, stride_b, stride_g, stride_h, stride_d,
    os_s, os_b, os_g, os_h,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr, KIND: tl.constexpr, NATIVE: tl.constexpr, BACKWARD: tl.constexpr, HG: tl.constexpr,
):
    """Positions [program_id(0) * BLOCK_S, +BLOCK_S) x head vectors [program_id(1) * BLOCK_R, +BLOCK_R) of
    their B*H of x (strided) -> out (strided, the last dim contiguous); tiles [BLOCK_S, BLOCK_R, BLOCK_H].
    Head h lies at group h // HG, head h % HG of the group (strides ``stride_g``/``os_g`` and ``stride_h``/``os_h``):
    HG = 1 for a plain [s, b, h, d] tensor, the query heads per KV group for q read from (or its gradient written
    into) megatron's fused qkv layout [s, b, groups, (HG + 2) * d]. BACKWARD: x is the output gradient (module
    docstring)."""
    ROT: tl.constexpr = 2 * HALF
    PASS: tl.constexpr = D - ROT
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = pos < S
    pos = pos.to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # b_idx * H + h_idx (int32: B * H is small)
    rmask = r < B * H
    bi = (r // H).to(tl.int64)
    gi = ((r % H) // HG).to(tl.int64)
    hi_ = ((r % H) % HG).to(tl.int64)
    row = bi * stride_b + gi * stride_g + hi_ * stride_h
    row_in = (pos * stride_s)[:, None] + row[None, :]  # [BLOCK_S, BLOCK_R] element offsets into x
    row_out = (pos * os_s)[:, None] + (bi * os_b + gi * os_g + hi_ * os_h)[None, :]
    row_mask = smask[:, None] & rmask[None, :]

    k = tl.arange(0, BLOCK_H)
    kmask = k < HALF
    m = row_mask[:, :, None] & kmask[None, None, :]
    lo_ptrs = x_ptr + row_in[:, :, None] + (k * stride_d)[None, None, :]
    a_lo = load_f32(lo_ptrs, m, KIND)
    a_hi = load_f32(lo_ptrs + HALF * stride_d, m, KIND)
    # the tables of each position, once per program, broadcast over its rows
    tab = (pos * ROT)[:, None] + k[None, :]
    tmask = smask[:, None] & kmask[None, :]
    c_lo = load_f32(cos_ptr + tab, tmask, KIND)[:, None, :]
    c_hi = load_f32(cos_ptr + tab + HALF, tmask, KIND)[:, None, :]
    s_lo = load_f32(sin_ptr + tab, tmask, KIND)[:, None, :]
    s_hi = load_f32(sin_ptr + tab + HALF, tmask, KIND)[:, None, :]
    # lo, hi: the fp32 sums before their last rounding (done by the store)
    if BACKWARD:
        lo = round_to_kind(a_lo * c_lo, KIND, NATIVE) + round_to_kind(a_hi * s_hi, KIND, NATIVE)
        hi = round_to_kind(a_hi * c_hi, KIND, NATIVE) - round_to_kind(a_lo * s_lo, KIND, NATIVE)
        # Z before the rounding is Z after it: a non-zero sum of two values of the element type is at least its
        # smallest subnormal in magnitude, so it never rounds to zero
        lo = tl.where(lo == 0.0, 0.0, lo)
        hi = tl.where(hi == 0.0, 0.0, hi)
    else:
        lo = round_to_kind(a_lo * c_lo, KIND, NATIVE) - round_to_kind(a_hi * s_lo, KIND, NATIVE)
        hi = round_to_kind(a_hi * c_hi, KIND, NATIVE) + round_to_kind(a_lo * s_hi, KIND, NATIVE)
    out_ptrs = out_ptr + row_out[:, :, None] + k[None, None, :]
    store_rounded(out_ptrs, lo, m, KIND, NATIVE)
    store_rounded(out_ptrs + HALF, hi, m, KIND, NATIVE)

    if PASS > 0:
        p = tl.arange(0, BLOCK_P)
        pm = row_mask[:, :, None] & (p < PASS)[None, None, :]
        v = tl.load(x_ptr + row_in[:, :, None] + ((ROT + p) * stride_d)[None, None, :], mask=pm)
        if BACKWARD:
            if KIND == 1:
                v = tl.where(v == -32768, 0, v).to(tl.int16)  # the bits of bf16 -0
            else:
                v = tl.where(v == 0.0, 0.0, v).to(v.dtype)
        tl.store(out_ptr + row_out[:, :, None] + (ROT + p)[None, None, :], v, mask=pm)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1; 1 for n = 0)."""
    return 1 << max(0, n - 1).bit_length()


def _launch(x: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, backward: bool,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel over x [s, b, h, d] or, 5-D, [s, b, groups, heads per group, d] (q in megatron's fused qkv
    layout: its heads are the groups' heads in order) into ``out`` (of x's shape, the last dim contiguous; a
    fresh contiguous [s, b, h, d] when None, returned as such)."""
    if x.dim() not in (4, 5) or x.dtype not in KIND:
        raise ValueError(f"the rotary embedding takes a [s, b, h, d] bfloat16, float16 or float32 tensor, got "
                         f"{x.dtype} {tuple(x.shape)}")
    x5 = x if x.dim() == 5 else x.unsqueeze(3)  # [s, b, groups, heads per group, d]
    S, B, NG, HG, D = x5.shape
    H = NG * HG
    rot = cos_.shape[-1]
    if cos_.shape != (S, rot) or sin_.shape != (S, rot) or cos_.dtype != x.dtype or sin_.dtype != x.dtype:
        raise ValueError(f"cos_ and sin_ must be [{S}, rot_dim] tables of {x.dtype} (rope_tables), got "
                         f"{cos_.dtype} {tuple(cos_.shape)} and {sin_.dtype} {tuple(sin_.shape)}")
    if rot % 2 != 0 or rot > D:
        raise ValueError(f"rot_dim={rot} must be even and at most the head dim {D}")
    cos_, sin_ = cos_.contiguous(), sin_.contiguous()
    if out is None:
        out = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
        out5 = out.view(S, B, NG, HG, D)
    else:
        out5 = out if out.dim() == 5 else out.unsqueeze(3)
        if out5.shape != x5.shape or out.dtype != x.dtype or out.stride(-1) != 1:
            raise ValueError(f"out must be a {x.dtype} tensor of shape {tuple(x.shape)} with a contiguous last "
                             f"dim, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if out.numel() == 0:
        return out
    half, rows = rot // 2, B * H
    tile = TILE if x.is_cuda else TILE_INTERPRETER
    block_h = max(16, _pow2(half))
    block_p = max(16, _pow2(D - rot))
    block_r = max(64 // block_h, min(_pow2(rows), tile // block_h))
    block_s = max(1, min(_pow2(S), tile // (block_r * block_h)))
    num_warps = max(1, min(4, block_s * block_r * block_h // 256))
    kind = KIND[x.dtype]
    grid = (cdiv(S, block_s), cdiv(rows, block_r))
    _rope_kernel[grid](
        kernel_bits(x), kernel_bits(cos_), kernel_bits(sin_), kernel_bits(out), S, B, H, *x5.stride(),
        *out5.stride()[:4], D=D, HALF=half, BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_P=block_p,
        KIND=kind, NATIVE=x.is_cuda, BACKWARD=backward, HG=HG, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


def rope_forward_triton(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor) -> torch.Tensor:
    """``rope_forward_ref(t, cos_, sin_)`` in one launch: t [s, b, h, d] (any strides), tables [s, rot_dim]
    of t's dtype (``rope_tables``) -> a fresh contiguous [s, b, h, d]."""
    return _launch(t, cos_, sin_, backward=False)


def rope_backward_triton(g: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor) -> torch.Tensor:
    """``rope_backward_ref(g, cos_, sin_)`` in one launch: the gradient w.r.t. t for the output gradient g."""
    return _launch(g, cos_, sin_, backward=True)


_CACHE_ATTR = "_rope_tables"


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables_ref(freqs, dtype)``, cached on ``freqs`` (module docstring: per dtype and version of
    freqs; never written during a CUDA-graph capture; an entry is never replaced, so a graph that read it keeps
    valid memory while freqs lives)."""
    if freqs.is_inference() or freqs.requires_grad:
        return rope_tables_ref(freqs, dtype)
    cache = freqs.__dict__.get(_CACHE_ATTR)
    hit = cache.get(dtype) if cache is not None else None
    if hit is not None and hit[0] == freqs._version:
        return hit[1], hit[2]
    tables = rope_tables_ref(freqs, dtype)
    if hit is None and not (freqs.is_cuda and torch.cuda.is_current_stream_capturing()):
        if cache is None:
            cache = {}
            setattr(freqs, _CACHE_ATTR, cache)
        cache[dtype] = (freqs._version, *tables)
    return tables


class _RoPE(torch.autograd.Function):
    """One launch each way; saves only the two tables (the backward needs no activation)."""

    @staticmethod
    def forward(ctx, t, cos_, sin_):
        ctx.save_for_backward(cos_, sin_)
        return rope_forward_triton(t, cos_, sin_)

    @staticmethod
    def backward(ctx, g):
        cos_, sin_ = ctx.saved_tensors
        return rope_backward_triton(g, cos_, sin_), None, None


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``t`` [s, b, h, d] (bf16/fp16/fp32, any strides) by megatron's ``freqs``
    [s, 1, 1, rot_dim] (non-interleaved: ``cat(f, f)``), differentiable w.r.t. t: a fresh contiguous
    [s, b, h, d], bitwise megatron's unfused ``_apply_rotary_pos_emb_bshd`` forward and backward."""
    check_rope_input(t, freqs)
    if not use_triton(t):
        return apply_rope_ref(t, freqs)
    cos_, sin_ = rope_tables(freqs, t.dtype)
    return _RoPE.apply(t, cos_, sin_)


def apply_rope_qkv_ref(mixed: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                       split: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's split path: the fused qkv projection's output ``mixed`` [s, b, groups, (heads per group + 2) * d]
    split as ``split`` = [heads per group * d, d, d] (``torch.split`` on dim 3), the query reshaped to [s, b, heads,
    d], then the rotary embedding of q and k (``apply_rope_ref``); v is the split's view."""
    q, k, v = torch.split(mixed, split, dim=3)
    q = q.reshape(q.size(0), q.size(1), -1, split[1])
    return apply_rope_ref(q, q_freqs), apply_rope_ref(k, k_freqs), v


def _check_qkv(mixed: torch.Tensor, split) -> tuple[int, int]:
    """(heads per group, head dim) of ``split``, checked against ``mixed``."""
    split = [int(n) for n in split]
    if mixed.dim() != 4 or len(split) != 3 or split[1] != split[2] or split[1] <= 0 or split[0] % split[1] \
            or sum(split) != mixed.shape[-1]:
        raise ValueError(f"the fused qkv rotary embedding takes megatron's [s, b, groups, (heads per group + 2) * "
                         f"head_dim] and the split [heads per group * head_dim, head_dim, head_dim], got "
                         f"{tuple(mixed.shape)} and {split}")
    return split[0] // split[1], split[1]


class _RoPEQKV(torch.autograd.Function):
    """q and k of the fused qkv output with the rotary embedding, v its view: forward, two launches that read q and
    k where they lie (no copy of q to [s, b, heads, d] first); backward, the gradient of the fused output written
    in place: two launches write q's and k's gradients into its slots, one copy puts v's (no concatenation)."""

    @staticmethod
    def forward(ctx, mixed, qc, qs, kc, ks, hg, d):
        ctx.save_for_backward(qc, qs, kc, ks)
        ctx.hg, ctx.d = hg, d
        q = _launch(mixed[..., : hg * d].unflatten(-1, (hg, d)), qc, qs, backward=False)
        k = _launch(mixed[..., hg * d: (hg + 1) * d], kc, ks, backward=False)
        return q, k, mixed[..., (hg + 1) * d:]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qc, qs, kc, ks = ctx.saved_tensors
        hg, d = ctx.hg, ctx.d
        s, b, ng = dk.shape[:3]
        grad = torch.empty((s, b, ng, (hg + 2) * d), dtype=dk.dtype, device=dk.device)
        _launch(dq.unflatten(2, (ng, hg)), qc, qs, backward=True, out=grad[..., : hg * d].unflatten(-1, (hg, d)))
        _launch(dk, kc, ks, backward=True, out=grad[..., hg * d: (hg + 1) * d])
        grad[..., (hg + 1) * d:].copy_(dv)
        return grad, None, None, None, None, None, None


def apply_rope_qkv(mixed: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                   split: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``apply_rope_qkv_ref`` bit for bit, forward and backward: the rotated query [s, b, heads, d] and key [s, b,
    groups, d] (fresh, contiguous) and the value (a view of ``mixed``), without the query's copy to its own layout
    before the rotary embedding nor the concatenation of the three gradients after it (megatron-core's
    ``fused_single_qkv_rope``)."""
    hg, d = _check_qkv(mixed, split)
    check_rope_input(mixed[..., :d], q_freqs)  # a [s, b, groups, d] view: the checks look at s, d, dtype
    check_rope_input(mixed[..., :d], k_freqs)
    if not use_triton(mixed):
        return apply_rope_qkv_ref(mixed, q_freqs, k_freqs, split)
    qc, qs = rope_tables(q_freqs, mixed.dtype)
    kc, ks = rope_tables(k_freqs, mixed.dtype)
    return _RoPEQKV.apply(mixed, qc, qs, kc, ks, hg, d)
