"""Residual add + RMSNorm in one Triton kernel per direction (``fusion.residual_norm``).

``residual_norm(residual, delta, weight, eps)`` returns ``(x, normed)`` with ``x = residual + delta`` (the add
that ends block i: megatron's bias-dropout-add with no bias and dropout 0) and ``normed = RMSNorm(x) * weight``
(the norm that starts block i + 1), as an autograd op of one launch forward and one launch (plus the partials' sum)
backward. The arithmetic, op by op, is ``residual_norm_reference.py``'s; the kernels give its bits (under the
interpreter, and on the GPU: every reduction has one fixed order, IEEE square root and division, no contraction).

Layout. residual, delta and the outputs are contiguous [rows, N] (all leading dims are rows; N the hidden size);
a row is loaded whole as a [BLOCK_N] fp32 vector (BLOCK_N = the next power of two >= N, masked to N), bf16 through
its int16 bits (``_elements.py``). The row's sums (sum of squares forward, sum of ``dn * v`` backward) are the
reference's pairwise tree: ``tl.reshape(t, [BLOCK_M, 2, W / 2])`` summed over the axis of two, log2(BLOCK_N)
times; every partial sum is one fp32 add of two values, so the order is the reference's whatever the compiler does
with a ``tl.sum`` over two. The launches set ``enable_fp_fusion=False`` (no product contracted into an add), rstd
is ``div_rn(1, sqrt_rn(.))`` (the GPU's rsqrt approximates).

- forward (``_fwd_kernel``): a program owns BLOCK_M rows; reads residual and delta, writes x (rounded once) and
  normed, and one fp32 rstd per row (for the backward).
- backward (``_bwd_kernel``): program p owns the ``WGRAD_ROWS`` (32) rows from ``32 p`` and walks them one at a
  time: reads ``g_normed``, ``g_skip`` (the gradient of x from the next residual add, when x has one), x and rstd,
  writes ``dsum`` (the gradient of residual and of delta: the add passes one tensor to both), and accumulates
  ``g * n`` in fp32 for the weight gradient; its [N] partial goes to row p of a [ceil(rows / 32), N] fp32 buffer,
  which ``torch.sum(dim=0)`` reduces (Liger-Kernel's and Apex's two stages; the partition depends on the rows only,
  so the sum has one order on every device).

Bytes and time (prediction). Per element of one [rows, N] boundary, bf16: forward reads 2 tensors and writes 2
(8 bytes; unfused: the add reads 2 and writes 1, the norm reads 1 and writes 1, 10 bytes), backward reads 3 and
writes 1 (8 bytes; unfused: torch's fused CUDA norm backward reads g and x and writes dx, its weight-gradient pass
reads g and x again, and autograd's sum of the two gradients of x reads 2 and writes 1: 16 bytes). The ``1.2b``
model (bf16, hidden 2048, 8192 tokens per micro-batch, 40 blocks, 4 micro-batches): one [8192, 2048] tensor is
33.5 MB, so

    per boundary and micro-batch
    forward   4 tensors = 134 MB -> 33.6 us       (unfused  5 tensors = 168 MB -> 41.9 us)
    backward  4 tensors = 134 MB -> 33.6 us       (unfused  8 tensors = 268 MB -> 67.1 us)
    per step: 40 boundaries (39 block boundaries + the final norm) x 4 micro-batches = 160 of each:
              fused 42.9 GB -> 10.7 ms; unfused 69.8 GB -> 17.4 ms (measured unfused: 7.2 ms of adds + 15.6 ms
              of norms, which include the first block's norm, unchanged here: no add before it)

at ~4 TB/s (the weight, rstd and the partials, ~0.1%, left out): 26.8 GB and ~6.7 ms less per step. Launches per
boundary: 4 (forward 1; backward the kernel, the partials' sum and its cast to the weight's dtype) against the
unfused 5 or more (add, norm, the norm's backward kernels, the sum of the two gradients).

The kernels run where ``nvfp4_train.kernels._dispatch.use_triton(residual)`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``), the reference otherwise; both give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fp4_triton import cdiv
from nvfp4_train.kernels.fused._elements import KIND, load_f32, round_to_kind, store_rounded
from nvfp4_train.kernels.fused.residual_norm_reference import (
    WGRAD_ROWS,
    next_pow2,
    check_residual_norm_input,
    residual_norm_backward_ref,
    residual_norm_forward_ref,
    residual_norm_function,
    residual_norm_ref,
)

__all__ = [
    "residual_norm",
    "residual_norm_ref",
    "residual_norm_forward_triton",
    "residual_norm_backward_triton",
    "residual_norm_forward_ref",
    "residual_norm_backward_ref",
]

MAX_HIDDEN = 1 << 16  # a row lives in registers: BLOCK_N fp32 values per tensor spread over the program's threads
# elements of one forward program's tile on the GPU, and under the interpreter (which pays per operation, not per
# element: it takes the whole test tensor in a few programs)
TILE = 4096
TILE_INTERPRETER = 1 << 15


@triton.jit
def _tree_row_sum(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 -> [BLOCK_M]: ``t[:, :W/2] + t[:, W/2:]`` until one column is left (the
    reference's ``tree_row_sum``; masked columns hold +0)."""
    for i in tl.static_range(LOG2_N):
        t = tl.sum(tl.reshape(t, [BLOCK_M, 2, BLOCK_N >> (i + 1)]), axis=1)
    return tl.reshape(t, [BLOCK_M])


@triton.jit
def _fwd_kernel(
    res_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, rstd_ptr, M, eps,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_N: tl.constexpr, KIND: tl.constexpr,
    W_KIND: tl.constexpr, NATIVE: tl.constexpr,
):
    """Rows [program_id(0) * BLOCK_M, +BLOCK_M): x = R(residual + delta), normed = R((v * rstd) * w), rstd."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    m = rmask[:, None] & cmask[None, :]
    x = round_to_kind(load_f32(res_ptr + offs, m, KIND) + load_f32(delta_ptr + offs, m, KIND), KIND, NATIVE)
    store_rounded(sum_ptr + offs, x, m, KIND, NATIVE)  # x is a value of the element type: stored as it is
    ss = _tree_row_sum(x * x, BLOCK_M, BLOCK_N, LOG2_N)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, N * 1.0) + eps))
    w = load_f32(w_ptr + cols, cmask, W_KIND)
    store_rounded(out_ptr + offs, (x * rstd[:, None]) * w[None, :], m, KIND, NATIVE)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _bwd_kernel(
    gn_ptr, gs_ptr, x_ptr, w_ptr, rstd_ptr, dsum_ptr, part_ptr, M,
    N: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_N: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr,
    W_KIND: tl.constexpr, NATIVE: tl.constexpr, HAS_SKIP: tl.constexpr,
):
    """Rows [program_id(0) * ROWS, +ROWS), one at a time: dsum of each, and the program's weight-gradient partial
    (its row of part_ptr, [N] fp32) accumulated in row order."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = load_f32(w_ptr + cols, cmask, W_KIND)[None, :]
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for k in range(ROWS):
        row = pid * ROWS + k
        live = row < M
        offs = row.to(tl.int64) * N + cols[None, :]
        m = cmask[None, :] & live
        g = load_f32(gn_ptr + offs, m, KIND)
        v = load_f32(x_ptr + offs, m, KIND)
        r = tl.load(rstd_ptr + row, mask=live, other=0.0)
        acc = acc + g * (v * r)  # a row past M adds +0
        dn = g * w
        s = _tree_row_sum(dn * v, 1, BLOCK_N, LOG2_N)  # [1]: the gradient of rstd
        gsq = tl.math.div_rn((-0.5 * s) * (r * r * r), N * 1.0)
        dx = round_to_kind(dn * r + gsq[:, None] * (2.0 * v), KIND, NATIVE)
        if HAS_SKIP:
            dx = load_f32(gs_ptr + offs, m, KIND) + dx
        store_rounded(dsum_ptr + offs, dx, m, KIND, NATIVE)
    tl.store(part_ptr + pid.to(tl.int64) * N + cols[None, :], acc, mask=cmask[None, :])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors reach the kernels as their int16 bits (``_elements.py``)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _row_block(n: int) -> tuple[int, int]:
    if n > MAX_HIDDEN:
        raise ValueError(f"the fused residual add + RMSNorm keeps a row in registers: hidden size {n} > "
                         f"{MAX_HIDDEN}; set fusion.residual_norm=false")
    block_n = max(16, next_pow2(n))
    return block_n, block_n.bit_length() - 1


def residual_norm_forward_triton(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``residual_norm_forward_ref`` in one launch: ``(x, normed, rstd)``."""
    check_residual_norm_input(residual, delta, weight)
    n = residual.shape[-1]
    block_n, log2_n = _row_block(n)
    residual, delta, weight = residual.contiguous(), delta.contiguous(), weight.contiguous()
    x, normed = torch.empty_like(residual), torch.empty_like(residual)
    rows = residual.numel() // n
    rstd = torch.empty(rows, dtype=torch.float32, device=residual.device)
    if rows == 0:
        return x, normed, rstd
    tile = TILE if residual.is_cuda else TILE_INTERPRETER
    block_m = max(1, min(next_pow2(rows), tile // block_n))
    num_warps = max(1, min(8, block_m * block_n // 512))
    _fwd_kernel[(cdiv(rows, block_m),)](
        _bits(residual), _bits(delta), _bits(weight), _bits(x), _bits(normed), rstd, rows, float(eps),
        N=n, BLOCK_M=block_m, BLOCK_N=block_n, LOG2_N=log2_n, KIND=KIND[residual.dtype], W_KIND=KIND[weight.dtype],
        NATIVE=residual.is_cuda, num_warps=num_warps, enable_fp_fusion=False,
    )
    return x, normed, rstd


def residual_norm_backward_triton(g_normed: torch.Tensor, g_skip: torch.Tensor | None, x: torch.Tensor,
                                  weight: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_norm_backward_ref`` in one launch and a sum over the partials: ``(dsum, dw)``."""
    n = x.shape[-1]
    block_n, log2_n = _row_block(n)
    g_normed, x, weight = g_normed.contiguous(), x.contiguous(), weight.contiguous()
    g_skip = g_skip.contiguous() if g_skip is not None else None
    if g_normed.shape != x.shape or g_normed.dtype != x.dtype or (
            g_skip is not None and (g_skip.shape != x.shape or g_skip.dtype != x.dtype)):
        raise ValueError(f"the gradients must have x's shape and dtype {x.dtype} {tuple(x.shape)}, got "
                         f"{g_normed.dtype} {tuple(g_normed.shape)} and "
                         f"{None if g_skip is None else (g_skip.dtype, tuple(g_skip.shape))}")
    rows = x.numel() // n
    dsum = torch.empty_like(x)
    programs = cdiv(rows, WGRAD_ROWS)
    partials = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    if programs:
        _bwd_kernel[(programs,)](
            _bits(g_normed), _bits(g_skip if g_skip is not None else g_normed), _bits(x), _bits(weight), rstd,
            _bits(dsum), partials, rows, N=n, BLOCK_N=block_n, LOG2_N=log2_n, ROWS=WGRAD_ROWS,
            KIND=KIND[x.dtype], W_KIND=KIND[weight.dtype], NATIVE=x.is_cuda, HAS_SKIP=g_skip is not None,
            num_warps=max(1, min(8, block_n // 256)), enable_fp_fusion=False,
        )
    return dsum, partials.sum(0).to(weight.dtype)


# one launch each way; saves x, the weight and the fp32 rstd per row
_ResidualNorm = residual_norm_function(residual_norm_forward_triton, residual_norm_backward_triton)


def residual_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, RMSNorm(residual + delta) * weight)`` of [..., N] tensors of one dtype
    (bf16/fp16/fp32) and a weight [N], differentiable w.r.t. the three tensors: fresh contiguous tensors, the
    reference's bits (``residual_norm_reference.py``; the kernels where ``use_triton``)."""
    check_residual_norm_input(residual, delta, weight)
    if not use_triton(residual):
        return residual_norm_ref(residual, delta, weight, eps)
    return _ResidualNorm.apply(residual, delta, weight, eps)
