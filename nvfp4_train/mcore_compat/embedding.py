"""The word embedding's weight gradient added into its fp32 ``main_grad`` row by row (``fusion.wgrad_accumulation``).

Unfused, the embedding's backward (``F.embedding``'s, ``aten.embedding_dense_backward``) writes a bf16 gradient of
the WHOLE table, ``[vocab, hidden]``, zeroed first, and megatron's DDP hook then adds all of it into the fp32
``main_grad``: on ``1.2b`` (131072 x 2048) that is a 536 MB fill and a pass reading 0.5 + 1.1 GB and writing
1.1 GB per micro-batch (~1.3 ms at the 2.4-4 TB/s these kernels reach; 4 per step), for the <= 8192 rows a
micro-batch touches.

Here the same per-token sums land in the rows they belong to, and nothing else is read or written:

    sorted, perm = sort(ids)                 (stable)
    rank[perm[i]] = (number of distinct ids in sorted[0..i]) - 1          the dense rank of each token's id
    rows = embedding_dense_backward(grad, rank, num_weights = n)          [n, hidden], row r = the r-th id's sum
    main_grad[ids[p]] = main_grad[ids[p]] + rows[rank[p]]                 every position p of one id writes
                                                                          the same value, so duplicates agree

Bitwise the unfused result. The rank map is strictly increasing in the id, so torch's sort-based kernel (a stable
radix sort of (index, position) pairs, segments of equal indices summed in fp32 in sorted order, each rounded
once to the gradient's dtype) sorts the positions into the same order and forms the same segments and sums as
with the ids themselves; only the number of rows it writes changes. The add is the DDP hook's
``main_grad.add_(grad)`` restricted to the touched rows: every other row would receive +0, which leaves an fp32
value unchanged (``main_grad`` never holds -0: it starts at +0 and x + y = 0 rounds to +0). Static shapes, no host
synchronisation: CUDA graphs capture it. Cost per micro-batch of n tokens: a sort of n ids, an [n, hidden]
gradient (zeroed and written), and n rows of ``main_grad`` read and written (8192 x 2048 on ``1.2b``: ~0.3 GB,
~0.1 ms predicted).

The embedding then returns megatron's dummy gradient with ``grad_added_to_main_grad`` set, as its fused linear
layers do (``nvfp4_train.precision.linear._dummy_wgrad``). :func:`rows_into_main_grad` switches a built
``VocabParallelEmbedding`` to this path where its forward is a plain lookup (tensor parallel size 1, no
sequence-parallel scatter, megatron's non-deterministic-mode lookup); anything else keeps megatron's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["embedding_rows_into_main_grad", "add_embedding_grad_rows", "rows_into_main_grad"]


def add_embedding_grad_rows(main_grad: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor) -> None:
    """``main_grad += embedding_dense_backward(grad, ids)`` on the rows ``ids`` names only, bitwise the full add
    (module docstring). ``grad`` [..., hidden] (the lookup's output gradient), ``ids`` [...] int64 in
    ``[0, main_grad.shape[0])``, ``main_grad`` [vocab, hidden] contiguous."""
    flat = ids.reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    g = grad.reshape(n, grad.shape[-1])
    sorted_ids, perm = torch.sort(flat, stable=True)
    new_id = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_id[1:] = sorted_ids[1:] != sorted_ids[:-1]
    rank = torch.empty_like(flat).scatter_(0, perm, torch.cumsum(new_id, 0) - 1)
    rows = torch.ops.aten.embedding_dense_backward(g, rank, n, -1, False)
    updated = main_grad.index_select(0, flat).add_(rows.index_select(0, rank))
    main_grad.index_copy_(0, flat, updated)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)``; backward adds the weight's gradient rows into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the parameter itself: backward reads its main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from nvfp4_train.precision.linear import _dummy_wgrad

        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None or main_grad.shape != weight.shape or not main_grad.is_contiguous():
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], -1, False)
        add_embedding_grad_rows(main_grad, grad, ids)
        return None, _dummy_wgrad(weight)


def embedding_rows_into_main_grad(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose backward adds into ``weight.main_grad`` where the weight has one (else
    it returns the dense gradient as ``F.embedding`` does)."""
    return _EmbeddingIntoMainGrad.apply(ids, weight)


def _plain_lookup(emb: torch.nn.Module) -> bool:
    """Whether megatron's ``VocabParallelEmbedding.forward`` (0.16.1 ... 0.19.x) is ``F.embedding(ids, weight)``
    for this module: one tensor-parallel rank, no sequence-parallel scatter, no deterministic-mode indexing, no
    0.19's generalized-TP weight wrapper."""
    return (emb.tp_group.size() == 1 and not emb.deterministic_mode
            and not getattr(emb, "reduce_scatter_embeddings", False) and getattr(emb, "gtp_remat_size", 1) <= 1)


def _forward(self, input_: torch.Tensor) -> torch.Tensor:
    if _plain_lookup(self):
        return embedding_rows_into_main_grad(input_, self.weight)
    return type(self).forward(self, input_)


def rows_into_main_grad(emb: torch.nn.Module) -> None:
    """Run the word embedding ``emb`` (megatron's ``VocabParallelEmbedding``) through
    :func:`embedding_rows_into_main_grad` where its forward is a plain lookup (checked at every call)."""
    emb.forward = _forward.__get__(emb)
