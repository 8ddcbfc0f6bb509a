"""Vocab-parallel cross-entropy over two gloo ranks equals the one-rank result within the derived bound.

Both ranks hold the same full logits x [N, V] (V = 2 * V_local), targets and loss gradient. Each computes the
one-rank loss and gradient of x (``tp_group=None``) and the TP=2 loss and gradient of its shard
x[:, rank * V_local : (rank + 1) * V_local] over an explicit two-rank group, the gradient written in place.

What is exactly equal: the TP=2 loss on the two ranks (both combine the same all-reduced statistics).
What is equal within a bound: TP=2 vs one rank, for the loss and the gradient shard. Each is within its bound
of ``tests/kernels/test_cross_entropy.py`` from the exact (float64) result, so they differ by at most the sum;
TP=2 has blocks of V_local per rank, one more rescale (exp(m_rank - m)) and one more addition (the all-reduce)
than a single rank of V_local columns: ``eta_ours(.., tp=2)``. Edge rows (``make_logits``): rank 0's whole shard
of row 2 is -Inf (its local max is -Inf: the rescale must give 0, not NaN); labels outside [0, V) in rows 7-9
(megatron's masking: no predicted logit on any rank); rows with NaN / +Inf / only -Inf give NaN on both paths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.precision.mcore_util import assert_ranks_ok, record_outcome

pytestmark = pytest.mark.dist

N, V_LOCAL = 14, 4099  # two blocks of BLOCK_V per rank
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _check(rank: int, dtype: torch.dtype, seed: int, group) -> None:
    from nvfp4_train.kernels.fused.cross_entropy import vocab_parallel_cross_entropy
    from nvfp4_train.kernels.fused.cross_entropy_reference import BLOCK_V
    from tests.kernels.test_cross_entropy import (
        assert_grad_within,
        assert_loss_within,
        eta_ours,
        exact_ce,
        grad_bound,
        loss_bound,
        make_logits,
        make_target,
        rounded,
    )

    v = 2 * V_LOCAL
    g = torch.Generator().manual_seed(seed)
    x = make_logits(N, v, dtype, g, first_block=V_LOCAL)
    target = make_target(N, v, g)
    gl = torch.randn(N, generator=g)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)

    x1 = x.clone().requires_grad_()
    loss1 = vocab_parallel_cross_entropy(x1, target)
    loss1.backward(gl)
    xs = x[:, cols].clone().requires_grad_()
    logits = xs * 1  # a non-leaf, as the output layer's
    loss2 = vocab_parallel_cross_entropy(logits, target, group, inplace_backward=True)
    loss2.backward(gl)
    both = [torch.empty_like(loss2) for _ in range(2)]
    dist.all_gather(both, loss2.detach(), group=group)  # the case's last collective

    nan = torch.isnan(both[0])
    assert torch.equal(nan, torch.isnan(both[1])) and torch.equal(both[0][~nan], both[1][~nan]), "ranks' losses"
    ex = exact_ce(x, target, gl)
    eta1, eta2 = eta_ours(ex, v, BLOCK_V), eta_ours(ex, V_LOCAL, BLOCK_V, tp=2)
    assert_loss_within(loss2, ex["loss"], loss_bound(ex, eta2), ex, "TP=2 vs exact")
    assert_loss_within(loss2, loss1, loss_bound(ex, eta1) + loss_bound(ex, eta2), ex, "TP=2 vs one rank")
    gb = rounded(grad_bound(ex, eta1) + grad_bound(ex, eta2), ex, dtype)[:, cols]
    assert xs.grad.dtype == dtype
    assert_grad_within(xs.grad, x1.grad[:, cols], gb, ex, "TP=2 vs one rank, gradient")


def run_two_rank_cases(rank: int, out_dir: str) -> None:
    """Runs both cases on this rank of the shared gloo group (``tests/two_rank_cases.py``), recording each as
    ``ce-<dtype>``; rank 0 draws the seed (TEST_GEN_SEED replays one) and records it as ``ce-seed``."""
    group = dist.new_group([0, 1])  # passed explicitly, not the default group
    fixed = os.environ.get("TEST_GEN_SEED")
    seed = torch.tensor([int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")])
    dist.broadcast(seed, src=0)
    if rank == 0:
        Path(out_dir, "ce-seed").write_text(str(seed.item()))
    for name, dtype in DTYPES.items():
        dist.barrier()
        record_outcome(out_dir, f"ce-{name}", rank, lambda: _check(rank, dtype, seed.item(), group))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from tests.two_rank_cases import two_rank_outcomes

    return two_rank_outcomes(tmp_path_factory)


@pytest.mark.parametrize("name", list(DTYPES))
def test_tp2_equals_one_rank(outcomes, name):
    print(f"[gen seed {(outcomes / 'ce-seed').read_text()}]")  # TEST_GEN_SEED=<seed> replays the draw
    assert_ranks_ok(outcomes, f"ce-{name}")
