"""TP=2 equals TP=1: a column layer then a row layer (an MLP, squared ReLU between), two gloo ranks.

Both ranks hold the same full weights W1 [F,H], W2 [H,F], input x [S,B,H] and output gradient dy. The TP=1
layers (a one-rank group per rank) get the full weights; the TP=2 layers get megatron's split (column: rows
of W1, row: columns of W2), with and without sequence parallelism (then each rank feeds its half of the
sequence and receives its half of y and dx). Notation: fs = this rank's feature slice of F, ss = this rank's
sequence slice (all of it without SP).

What is exactly equal, and why:
- h = x W1ᵀ (column output, no reduction): every element is the same dot product of the same operands.
  bf16: the same GEMM on a column slice (CPU matmul gives per-element identical results; checked below).
  nvfp4: x is the same full tensor on both ranks; the W1 shard's 16x16 tiles are tiles of W1 (F/2 is a
  multiple of 16) and its amax is all-reduced (MAX) to the amax of W1, so the codes and scales are those of
  TP=1, and the reference GEMM of the same operands gives the same bits.
- dh = ∂L/∂h (row layer's dgrad, no reduction; under SP megatron all-gathers dy): the row layer sees the
  full dy on both ranks; its dgrad copy is quantized with the same seed (same layer name and seed, same
  call count) at the same element indices, so even the stochastic rounding draws the same bits: bitwise.
- ∂L/∂W2[:, fs] (row wgrad): dy columnwise (same bits as above) times the columnwise copy of a[:, fs]
  (RHT along M, its own amax all-reduced, round-to-nearest): bitwise.
- ∂L/∂W1[fs] (column wgrad): bitwise for bf16 and for nvfp4 without stochastic rounding. With stochastic
  rounding the dhᵀ shard is rounded with bits indexed by the position in the SHARD (row·M + col), which
  differ from TP=1's on rank 1: equal only within the derived bound below.
- y (row output) and dx (column dgrad) are sums over F that megatron reduces across ranks in bf16:
  y_tp2 = bf16(bf16(p0) + bf16(p1)) with p_r the partial GEMM over shard r. For nvfp4 (y; dx without SR)
  the partials are the TP=1 operands restricted to the shard (1x16 blocks along F and 16x16 tiles align,
  amaxes all-reduced), so that formula is checked bit for bit against the reference GEMM.
  TP=1 vs TP=2 differ by rounding. Bound, with T = Σ_f |A_f||B_f| over the (dequantized) operands:
  |p0| + |p1| <= T; bf16 rounding (unit roundoff 2^-9) of p0, p1, their sum and TP=1's result, plus fp32
  accumulation (<= 64·2^-24·T per path) give |y_tp1 - y_tp2| <= 3·2^-9·T(1 + 2^-8) + 3·2^-18·T < 2^-7·T.
- With stochastic rounding (nvfp4 dx and ∂L/∂W1): two SR draws of the same scaled value v land on the same
  or adjacent E2M1 points (gap <= 2, saturation at 6 included), so per element |Q_tp1 - Q_tp2| <= 2·d with d
  the block's decode scale (the scales do not depend on the draw). Bound: Σ_f 2·d_f·|B_f| + 2^-7·T', with
  T' = Σ_f (|a_f| + 2·d_f)|B_f| bounding both draws' |A_f||B_f|.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.precision.mcore_util import assert_ranks_ok, record_outcome

pytestmark = pytest.mark.dist

S, B, H, F = 16, 2, 32, 64


def _recipe(name: str):
    from nvfp4_train.precision.recipe import Ablations, apply_ablations, named_recipe

    if name == "nvfp4+no_sr":
        return apply_ablations(named_recipe("nvfp4"), Ablations(stochastic_rounding=False))
    return named_recipe(name)


def _slice_k(q, lo: int, hi: int):
    """An NVFP4 operand restricted to reduction indices [lo, hi) (block-aligned): same codes, scales, amax."""
    from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor

    return NVFP4Tensor(codes=q.codes[:, lo // 2:hi // 2], scales=q.scales[:, lo // 16:hi // 16], amax=q.amax,
                       block_2d=q.block_2d)


def _deq(q) -> torch.Tensor:
    from nvfp4_train.kernels.nvfp4.reference import dequantize_nvfp4_ref

    return dequantize_nvfp4_ref(q).double()


def _decode_scales(q) -> torch.Tensor:
    """Per element: the decode scale sdec·(amax/2688) of its block, float64 [rows, cols]."""
    t = q.amax.double() / 2688.0
    return (q.scales.to(torch.float32).double() * t).repeat_interleave(16, dim=1)


def _bound(a_abs: torch.Tensor, b_abs: torch.Tensor) -> torch.Tensor:
    """2^-7 · Σ_f |A[m,f]| |B[n,f]| (see the module docstring)."""
    return 2.0**-7 * (a_abs @ b_abs.t())


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{what}: max err {err.max():.3g}, worst err/bound {(err / bound).max():.3g}"


def _check(rank: int, recipe_name: str, sp: bool, solo) -> None:
    from megatron.core import parallel_state

    from nvfp4_train.kernels.nvfp4.reference import (
        hadamard16_ref,
        nvfp4_gemm_ref,
        quantize_nvfp4_ref,
        transpose_nvfp4_ref,
    )
    from nvfp4_train.precision.megatron_linear import QuantColumnParallelLinear, QuantRowParallelLinear
    from tests.precision.mcore_util import column, config, row

    recipe = _recipe(recipe_name)
    g = torch.Generator().manual_seed(20260)
    w1 = (torch.randn(F, H, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(H, F, generator=g) * 0.2).bfloat16()
    x = torch.randn(S, B, H, generator=g).bfloat16()
    dy = torch.randn(S, B, H, generator=g).bfloat16()
    tp = parallel_state.get_tensor_model_parallel_group()
    fs = slice(rank * F // 2, (rank + 1) * F // 2)
    ss = slice(rank * S // 2, (rank + 1) * S // 2) if sp else slice(0, S)

    def build(cfg, group):
        kw = dict(recipe=recipe, seed=11, tp_group=group)
        return (column(QuantColumnParallelLinear, H, F, cfg, layer_name="fc1", **kw),
                row(QuantRowParallelLinear, F, H, cfg, layer_name="fc2", **kw))

    c1, r1 = build(config(hidden=H, tp=1), solo)
    c2, r2 = build(config(hidden=H, tp=2, sp=sp), tp)
    with torch.no_grad():
        c1.weight.copy_(w1)
        r1.weight.copy_(w2)
        c2.weight.copy_(w1[fs])
        r2.weight.copy_(w2[:, fs])

    def run(col, rw, x_in, dy_in):
        x_in = x_in.clone().requires_grad_()
        h, _ = col(x_in)
        h.retain_grad()
        a = torch.relu(h).square()
        y, _ = rw(a)
        y.backward(dy_in)
        return x_in, h, a, y

    x1, h1, a1, y1 = run(c1, r1, x, dy)
    x2, h2, a2, y2 = run(c2, r2, x[ss], dy[ss])

    # exact: no reduction, same operands
    assert torch.equal(h2, h1[..., fs]), "column output"
    assert torch.equal(h2.grad, h1.grad[..., fs]), "row dgrad (dh)"
    assert torch.equal(r2.weight.grad, r1.weight.grad[:, fs]), "row wgrad"
    sr = any(c.rounding == "stochastic" for c in (recipe.dgrad.a, recipe.wgrad.a))
    if not sr:
        assert torch.equal(c2.weight.grad, c1.weight.grad[fs]), "column wgrad"

    m = S * B
    a_full, dh_full, x_full = a1.detach().reshape(m, F), h1.grad.reshape(m, F), x.reshape(m, H)
    rows = slice(ss.start * B, ss.stop * B)
    y1_2d, y2_2d = y1.detach().reshape(m, H)[rows], y2.detach().reshape(-1, H)
    dx1_2d, dx2_2d = x1.grad.reshape(m, H)[rows], x2.grad.reshape(-1, H)
    if recipe.is_bf16:
        _within(y2_2d, y1_2d, _bound(a_full[rows].double().abs(), w2.double().abs()), "y")
        _within(dx2_2d, dx1_2d, _bound(dh_full[rows].double().abs(), w1.t().double().abs()), "dx")
        return

    # nvfp4: the TP=1 operands of the row layer's fprop, and the TP=2 output from their shard partials
    qa = quantize_nvfp4_ref(a_full)
    qw2 = quantize_nvfp4_ref(w2, block_2d=True)
    parts = [nvfp4_gemm_ref(_slice_k(qa, r * F // 2, (r + 1) * F // 2),
                            _slice_k(qw2, r * F // 2, (r + 1) * F // 2)) for r in range(2)]
    assert torch.equal(y2_2d, (parts[0].float() + parts[1].float()).bfloat16()[rows]), "y = bf16(p0 + p1)"
    _within(y2_2d, y1_2d, _bound(_deq(qa)[rows].abs(), _deq(qw2).abs()), "y")

    # column dgrad: dx = dh W1 (A = dh rowwise along F, B = W1ᵀ: fprop's tiles transposed)
    qw1t = transpose_nvfp4_ref(quantize_nvfp4_ref(w1, block_2d=True))
    w1q = _deq(qw1t).abs()
    qdh = quantize_nvfp4_ref(dh_full)  # round-to-nearest: the scales (and, without SR, the codes) of dgrad
    if not sr:
        parts = [nvfp4_gemm_ref(_slice_k(qdh, r * F // 2, (r + 1) * F // 2),
                                _slice_k(qw1t, r * F // 2, (r + 1) * F // 2)) for r in range(2)]
        assert torch.equal(dx2_2d, (parts[0].float() + parts[1].float()).bfloat16()[rows]), "dx = bf16(q0 + q1)"
        _within(dx2_2d, dx1_2d, _bound(_deq(qdh)[rows].abs(), w1q), "dx")
        return
    d = _decode_scales(qdh)[rows]
    sr_bound = (2 * d) @ w1q.t() + _bound(dh_full[rows].double().abs() + 2 * d, w1q)
    _within(dx2_2d, dx1_2d, sr_bound, "dx (stochastic rounding)")
    # column wgrad: dW1 = (H dhᵀ)(H xᵀ)ᵀ, dhᵀ stochastically rounded
    qu = quantize_nvfp4_ref(dh_full.t(), rht=True)
    u = hadamard16_ref(dh_full.t()).double()
    xq = _deq(quantize_nvfp4_ref(x_full.t(), rht=True)).abs()
    du = _decode_scales(qu)
    wb = (2 * du) @ xq.t() + _bound(u.abs() + 2 * du, xq)
    _within(c2.weight.grad, c1.weight.grad[fs], wb[fs], "column wgrad (stochastic rounding)")


CASES = [(r, sp) for r in ("bf16", "nvfp4", "nvfp4+no_sr") for sp in (False, True)]


def _case_id(recipe_name: str, sp: bool) -> str:
    return f"{recipe_name}-{'sp' if sp else 'no_sp'}"


def run_two_rank_cases(rank: int, out_dir: str) -> None:
    """Runs every case on this rank of the shared gloo group (``tests/two_rank_cases.py``) and records each
    one's outcome in ``out_dir`` as ``linear-<case>``. The comparisons come after the case's last collective,
    so a failed case leaves the two ranks in step for the next one."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        solo = [dist.new_group([0]), dist.new_group([1])][rank]
        for recipe_name, sp in CASES:
            dist.barrier()
            record_outcome(out_dir, "linear-" + _case_id(recipe_name, sp), rank,
                           lambda: _check(rank, recipe_name, sp, solo))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from tests.two_rank_cases import two_rank_outcomes

    return two_rank_outcomes(tmp_path_factory)


@pytest.mark.parametrize("recipe_name, sp", CASES, ids=[_case_id(*c) for c in CASES])
def test_tp2_equals_tp1(outcomes, recipe_name, sp):
    assert_ranks_ok(outcomes, "linear-" + _case_id(recipe_name, sp))
