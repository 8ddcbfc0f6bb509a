"""Vocab-parallel cross-entropy over bf16 (fp16, fp32) logits in two Triton kernels, fp32 math.

``vocab_parallel_cross_entropy(logits, target, tp_group=None)`` replaces megatron-core's
``tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target)``: same layout (logits [s, b, V_local],
this rank's vocabulary shard [rank * V_local, (rank + 1) * V_local) of ``tp_group``; target [s, b] int64
global ids; loss [s, b] fp32), same math, without an fp32 copy of the logits.

Forward, ``_ce_stats_kernel``: one program per row (token) streams the row's V_local logits ONCE, in blocks of
BLOCK_V columns, keeping two fp32 scalars (online softmax): the running max M and the sum s of exp(x - M),
rescaled by exp(M_old - M_new) when the max grows (one exp per element, one block max and one block sum per
block); the target's logit is one scalar load when the target falls in this shard. It writes (m, s, x_t), three
fp32 per row. Under TP the host side (``combine_stats``, shared with the reference) all-reduces MAX(m), rescales
s by exp(m_local - m) and all-reduces SUM(s, x_t) in one call; loss = log(s) - (x_t - m).

Backward, ``_ce_grad_kernel``: a [rows, V_local / BLOCK_V] grid; each program reads its block of logits once
and writes the gradient once, (exp(x - m) * (1/s) - [col == target]) * grad_loss, rounded to nearest-even to
the logits' dtype. The model's call (``HybridModel.compute_language_model_loss``) writes it into the logits'
own storage (``inplace_backward``; why that is safe there: ``VocabParallelCrossEntropy`` and the model).

Arithmetic and edge cases: ``kernels/fused/cross_entropy_reference.py`` (the same operations; labels outside
[0, V) as in megatron-core: predicted logit 0, gradient = softmax). Kernel vs reference: near-bitwise, not
bitwise. The max and the target's logit are the same bits; the block order and the fp32 operations are the
same (launched without multiply-add contraction); they differ where the exp implementations differ (``tl.exp``
is ex2.approx(x * log2 e) on the GPU, numpy's exp in the interpreter, torch's exp in the reference) and in the
order of the additions inside one block (``tl.sum`` vs ``torch.sum``). Under the interpreter: s within 4 ulp,
fp32 gradients within 4 ulp, bf16/fp16 gradients within 1 ulp. ``tests/kernels/test_cross_entropy.py`` bounds
every difference (against megatron-core too); the bf16 gradient is bit for bit the fp32-logits kernel's
gradient rounded once.

Bytes moved, and the time at ~4 TB/s on the H200 (prediction; ``1.2b``: V = 131072, N = 8192 tokens per
micro-batch, bf16 logits, TP = 1):
    forward   reads N * V * 2 B = 2.15 GB (+ 20 B per row: target, stats)         -> 0.54 ms
    backward  reads 2.15 GB, writes 2.15 GB (+ 20 B per row)                        -> 1.07 ms
    per micro-batch 1.6 ms, per step (4 micro-batches) 6.4 ms, against ~39 ms today (megatron's fp32 copy,
    max, subtract, exp, sum, divide, and the backward's fp32 passes and bf16 cast). One exp per element and
    direction: 1.07e9 exps, ~0.26 ms of the H200's special-function units, under the memory time.

Memory saved for backward, per token (V_local entries of the row; the logits tensor itself is bf16):
    today (megatron): the fp32 softmax 4 * V_local B + masked target 8 B + target mask 1 B
                      = 524,297 B at V_local = 131072 (4 GiB per 8192-token micro-batch), plus a transient bf16
                      gradient of 2 * V_local B in backward (autograd's cast of megatron's fp32 gradient)
    here:             the bf16 logits 2 * V_local B (not copied) + (m, s, x_t) 12 B + target 8 B
                      = 262,164 B (2 GiB per micro-batch); the gradient overwrites the logits (no new buffer)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fused._elements import KIND, load_f32
from nvfp4_train.kernels.fused.cross_entropy_reference import (
    BLOCK_V,
    VocabParallelCrossEntropy,
    cross_entropy_grad_ref,
    cross_entropy_stats_ref,
)

__all__ = ["cross_entropy_stats", "cross_entropy_grad", "vocab_parallel_cross_entropy"]

NUM_WARPS = 8
# no multiply-add contraction: s * alpha + sum and p - 1 stay separately rounded, as in the reference
_LAUNCH_OPTS = dict(enable_fp_fusion=False)



@triton.jit
def _store_from_f32(ptrs, v, mask, KIND: tl.constexpr):
    """Store fp32 ``v`` rounded to nearest-even into fp32 / bf16 (as int16 bits) / fp16 elements. bf16 by bits:
    the interpreter's fp32 -> bf16 cast truncates; NaN is stored as 0x7FC0."""
    if KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptrs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    elif KIND == 2:
        tl.store(ptrs, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def _ce_stats_kernel(
    x_ptr, t_ptr, stats_ptr, N, V, stride_n, vocab_start,
    KIND: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row ``program_id(0)`` of x [N, V] (row stride ``stride_n``, unit column stride) -> stats[0, row] = m,
    stats[1, row] = s, stats[2, row] = x_t (stats contiguous [3, N])."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_n
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        x = tl.where(mask, load_f32(base + c, mask, KIND), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # a row whose blocks so far are all -inf keeps s = 0 (exp(-inf - -inf) would be NaN)
        c_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - c_sub) + tl.sum(tl.exp(x - c_sub), axis=0)
        m = m_new
    local = tl.load(t_ptr + row) - vocab_start
    hit = (local >= 0) & (local < V)
    xt = load_f32(base + local, hit, KIND)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + N + row, s)
    tl.store(stats_ptr + 2 * N + row, xt)


@triton.jit
def _ce_grad_kernel(
    x_ptr, t_ptr, stats_ptr, g_ptr, out_ptr, N, V, stride_xn, stride_on, vocab_start,
    KIND: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Block ``program_id(1)`` of row ``program_id(0)``: out = (exp(x - m) * (1/s) - onehot) * g. ``out`` may
    be ``x`` itself (each element is read and written by the same program, read first)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = c < V
    m = tl.load(stats_ptr + row)
    # 1/s correctly rounded (fp32 '/' is an approximate division on the GPU); a [1] block, as div_rn takes
    s = tl.load(stats_ptr + N + row + tl.arange(0, 1))
    r = tl.math.div_rn(tl.full([1], 1.0, tl.float32), s)
    g = tl.load(g_ptr + row)
    local = tl.load(t_ptr + row) - vocab_start
    x = load_f32(x_ptr + row * stride_xn + c, mask, KIND)
    p = tl.exp(x - m) * r
    d = tl.where(c == local, p - 1.0, p)
    _store_from_f32(out_ptr + row * stride_on + c, d * g, mask, KIND)


def _kernel_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _block(v: int, block_v: int) -> int:
    return min(block_v, triton.next_power_of_2(v))


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                        block_v: int = BLOCK_V) -> torch.Tensor:
    """``cross_entropy_stats_ref`` in one Triton launch: (m, s, x_t) fp32 [3, N] of logits [N, V_local] (unit
    column stride), target [N] int64."""
    n, v = logits.shape
    stats = torch.empty(3, n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return stats
    _ce_stats_kernel[(n,)](
        _kernel_view(logits), target.contiguous(), stats, n, v, logits.stride(0), vocab_start,
        KIND=KIND[logits.dtype], BLOCK_V=_block(v, block_v), num_warps=NUM_WARPS, **_LAUNCH_OPTS,
    )
    return stats


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, stats: torch.Tensor,
                       grad_loss: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cross_entropy_grad_ref`` in one Triton launch: the gradient [N, V_local] in the logits' dtype, into
    ``out`` (unit column stride; may be ``logits``) when given."""
    n, v = logits.shape
    if out is None:
        out = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n == 0:
        return out
    block = _block(v, BLOCK_V)
    _ce_grad_kernel[(n, triton.cdiv(v, block))](
        _kernel_view(logits), target.contiguous(), stats.contiguous(), grad_loss.float().contiguous(),
        _kernel_view(out), n, v, logits.stride(0), out.stride(0), vocab_start,
        KIND=KIND[logits.dtype], BLOCK_V=block, num_warps=NUM_WARPS, **_LAUNCH_OPTS,
    )
    return out


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp_group: dist.ProcessGroup | None = None, *,
                                 inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy loss [...] fp32 of ``logits`` [..., V_local] (bf16, fp16 or fp32; this rank's shard of the
    vocabulary over ``tp_group``, None for one rank) against global ids ``target`` [...]. Differentiable in
    ``logits``; the gradient has their dtype. ``inplace_backward=True`` writes the gradient into the logits'
    storage: only for logits that nothing reads after this loss's backward (the model's output layer's).

    The Triton kernels run where ``use_triton(logits)`` (CUDA; CPU under ``TRITON_INTERPRET=1``), the reference
    elsewhere."""
    if use_triton(logits):
        stats_fn, grad_fn = cross_entropy_stats, cross_entropy_grad
    else:
        stats_fn, grad_fn = cross_entropy_stats_ref, cross_entropy_grad_ref
    return VocabParallelCrossEntropy.apply(logits, target, tp_group, inplace_backward, stats_fn, grad_fn, BLOCK_V)
