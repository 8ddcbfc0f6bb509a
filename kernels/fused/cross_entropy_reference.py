"""Vocab-parallel cross-entropy in pure PyTorch: the reference of ``kernels/fused/cross_entropy.py``.

Layout (megatron's): logits [..., V_local] (bf16, fp16 or fp32), this rank's vocabulary shard
[rank * V_local, (rank + 1) * V_local) of the tensor-parallel group; target [...] int64 global ids; loss [...]
fp32. The functions below work on the rows of logits [N, V_local] (N = number of tokens).

Arithmetic (fp32 throughout; the kernel does the same operations in the same order at block granularity):

    stats   per row, over blocks of ``block_v`` columns in order (online softmax, m0 = -inf, s0 = 0):
                M_b = max(M_{b-1}, max_j x_j)              (exact)
                c   = 0 if M_b == -inf else M_b             (a row that starts with -inf stays 0, not NaN)
                s_b = s_{b-1} * exp(M_{b-1} - c) + sum_j exp(x_j - c)
            and x_t = logits[row, target - vocab_start] if the target is in this shard, else 0.
            -> stats [3, N] = (m, s, x_t)
    combine over the TP group (``combine_stats``): m_g = all-reduce MAX(m);
                s <- s * exp(m - m_g) (unchanged where m == m_g); all-reduce SUM of (s, x_t) in one call;
            loss = log(s) - (x_t - m_g) for a target in [0, V_local * tp), else log(s)
    grad    p = exp(x - m_g) * (1 / s);  grad = (p - [col == target]) * grad_loss, rounded once to the
            logits' dtype (round to nearest even)

Labels outside [0, V_local * tp) are megatron-core's case too (``tensor_parallel.vocab_parallel_cross_entropy``
has no ignore index): it masks them on every rank, so their predicted logit is 0 and their loss is
log(sum_j exp(x_j - max)); their gradient is the softmax alone. The same holds here (no crash, no
out-of-bounds read; the loss mask applied by the caller is what removes such tokens).

Non-finite values follow IEEE arithmetic: a NaN or +Inf logit makes its row's loss and gradient NaN, as in
megatron-core; -Inf logits contribute exp(-Inf) = 0 (a row of only -Inf gives NaN, as in megatron-core).

This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "BLOCK_V",
    "check_cross_entropy_input",
    "cross_entropy_stats_ref",
    "cross_entropy_grad_ref",
    "combine_stats",
    "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy_ref",
]

BLOCK_V = 4096
"""Columns per block of the online softmax (the kernel's tile along the vocabulary)."""

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_cross_entropy_input(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, V_local] with unit column stride, target [N] int64) from logits [..., V_local] and target
    [...]; raises for what the cross-entropy cannot take."""
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"logits and target must be tensors, got {type(logits).__name__}, {type(target).__name__}")
    if logits.dtype not in _DTYPES:
        raise TypeError(f"cross-entropy logits must be bfloat16, float16 or float32, got {logits.dtype}")
    if target.dtype.is_floating_point or target.dtype == torch.bool or target.is_complex():
        raise TypeError(f"cross-entropy target must hold integer token ids, got {target.dtype}; "
                        "pass target.long()")
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be target {tuple(target.shape)} plus a vocabulary "
                         "dim (megatron's layout: logits [s, b, V_local], target [s, b])")
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocabulary dim; each rank needs at least one vocabulary entry")
    if logits.device != target.device:
        raise ValueError(f"logits on {logits.device}, target on {target.device}; move target to the logits' device")
    x = logits.reshape(-1, logits.shape[-1])
    if x.shape[0] > 0 and x.stride(1) != 1:
        x = x.contiguous()
    return x, target.reshape(-1).long()


def cross_entropy_stats_ref(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                            block_v: int = BLOCK_V) -> torch.Tensor:
    """(m, s, x_t) of each row of ``logits`` [N, V_local] over this shard (module docstring), fp32 [3, N]."""
    n, v = logits.shape
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    s = torch.zeros(n, dtype=torch.float32, device=logits.device)
    for v0 in range(0, v, block_v):
        blk = logits[:, v0:v0 + block_v].float()
        m_new = torch.maximum(m, blk.amax(dim=1))
        c = torch.where(m_new == float("-inf"), 0.0, m_new)
        s = s * torch.exp(m - c) + torch.exp(blk - c[:, None]).sum(dim=1)
        m = m_new
    local = target - vocab_start
    hit = (local >= 0) & (local < v)
    xt = logits.gather(1, local.clamp(0, v - 1)[:, None])[:, 0].float()
    xt = torch.where(hit, xt, 0.0)
    return torch.stack([m, s, xt])


def combine_stats(stats: torch.Tensor, target: torch.Tensor, v_local: int,
                  tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The loss [N] fp32 from this shard's ``stats`` [3, N] (``cross_entropy_stats_ref``); ``stats`` becomes
    the global (m, s, x_t) in place, what the gradient needs. Two collectives over ``tp_group`` (none without
    one, or with one rank): MAX of m, then SUM of the rescaled s and x_t together."""
    tp = 1 if tp_group is None else dist.get_world_size(group=tp_group)
    m, s, xt = stats[0], stats[1], stats[2]
    if tp > 1:
        m_local = m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        # m_local == m also covers a shard and a row of only -Inf (exp(-Inf + Inf) would be NaN)
        s.mul_(torch.where(m_local == m, 1.0, torch.exp(m_local - m)))
        dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM, group=tp_group)
    valid = (target >= 0) & (target < v_local * tp)
    loss = torch.log(s) - torch.where(valid, xt - m, 0.0)
    # a row of only -Inf: NaN as in megatron-core (s = 0 here would give -Inf for a label outside V)
    return torch.where(m == float("-inf"), float("nan"), loss)


def cross_entropy_grad_ref(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, stats: torch.Tensor,
                           grad_loss: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d logits [N, V_local] in the logits' dtype, from the global ``stats`` (after ``combine_stats``)
    and ``grad_loss`` [N]; written into ``out`` (may be ``logits`` itself) when given."""
    n, v = logits.shape
    m, s = stats[0], stats[1]
    r = 1.0 / s
    p = torch.exp(logits.float() - m[:, None]) * r[:, None]
    local = target - vocab_start
    cols = torch.arange(v, device=logits.device)
    p = torch.where(cols[None, :] == local[:, None], p - 1.0, p)
    g = p * grad_loss.float()[:, None]
    if out is None:
        return g.to(logits.dtype)
    out.copy_(g)
    return out


class VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = cross-entropy(logits, target) over the vocabulary sharded on ``tp_group``, with ``stats_fn`` and
    ``grad_fn`` computing the per-row statistics and the gradient (the kernel's or the reference's).

    Saved for backward: the logits (their dtype, not copied), the target and the global (m, s, x_t) rows.
    ``inplace_backward`` writes the gradient into the saved logits' storage (the caller promises the logits
    are read by nothing after this loss's backward); the logits' version counter is bumped, so an autograd
    node that saved them and runs later, or a second backward through this graph, raises instead of reading
    gradients as logits. Logits that had to be copied (a column stride != 1) are overwritten only in the copy."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, inplace_backward, stats_fn, grad_fn, block_v):
        x, t = check_cross_entropy_input(logits, target)
        n, v_local = x.shape
        rank = 0 if tp_group is None else dist.get_rank(group=tp_group)
        vocab_start = rank * v_local
        if n == 0:
            stats = torch.zeros(3, 0, dtype=torch.float32, device=x.device)
            loss = torch.zeros(0, dtype=torch.float32, device=x.device)
        else:
            stats = stats_fn(x, t, vocab_start, block_v)
            loss = combine_stats(stats, t, v_local, tp_group)
        copied = x.data_ptr() != logits.data_ptr()
        # the logits themselves, not a view made here: autograd's version check then names the logits
        ctx.save_for_backward(x if copied else logits, t, stats)
        ctx.vocab_start, ctx.grad_fn, ctx.logits_shape = vocab_start, grad_fn, logits.shape
        # a contiguous copy made above is ours: writing into it is always safe
        ctx.inplace = inplace_backward or copied
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        saved, t, stats = ctx.saved_tensors
        x = saved.reshape(-1, ctx.logits_shape[-1])
        if x.shape[0] == 0:
            return torch.zeros(ctx.logits_shape, dtype=x.dtype, device=x.device), None, None, None, None, None, None
        g = grad_loss.reshape(-1).float()
        out = x if ctx.inplace else None
        grad = ctx.grad_fn(x, t, ctx.vocab_start, stats, g, out)
        if ctx.inplace:
            torch.autograd.graph.increment_version(saved)
        return grad.view(ctx.logits_shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy_ref(logits: torch.Tensor, target: torch.Tensor,
                                     tp_group: dist.ProcessGroup | None = None, *,
                                     inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy loss [...] fp32 of ``logits`` [..., V_local] (this rank's vocabulary shard of ``tp_group``;
    None: the whole vocabulary on one rank) against global ids ``target`` [...]; differentiable in ``logits``.
    ``inplace_backward``: see ``VocabParallelCrossEntropy``."""
    return VocabParallelCrossEntropy.apply(logits, target, tp_group, inplace_backward, cross_entropy_stats_ref,
                                           cross_entropy_grad_ref, BLOCK_V)
