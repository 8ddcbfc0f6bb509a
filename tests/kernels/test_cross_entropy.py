"""The fused vocab-parallel cross-entropy (``nvfp4_train.kernels.fused.cross_entropy``) against megatron-core's
``tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target)``, against its pure-PyTorch reference,
and both against the exact result (float64).

Error bounds, derived here and evaluated per row / element from the exact float64 values (u = 2^-24):

Let d_i = x_i - m (m = the row max, exact in fp32), t_i = exp(d_i), S = sum_i t_i, p_i = t_i / S,
E = 2^-20 the relative error allowed for one fp32 exp or log implementation (torch's CPU exp/log are within
1 ulp, numpy's float32 exp, which the Triton interpreter uses, within 4 ulp, CUDA's expf/logf within 2 ulp,
the GPU's ex2.approx within 2 ulp; one ulp is at most 2u relative, so E = 16u leaves a factor of 2 over 4 ulp).

1. The sum S. A computed term exp(fl(x_i - M)) has relative error at most u|x_i - M| (the subtraction) +
   2u|x_i - M| (on the GPU tl.exp multiplies by log2(e) first: two more roundings of the argument) + E.
   The online softmax (ours) rescales the running sum by exp(M_old - M_new) at most once per block, and
   under TP once more by exp(m_rank - m): each rescale costs E + u (the exp and the product) plus its
   argument's roundings, 3u|M_old - M_new|; along one term's path these differences add up to |x_i - m|
   (telescoping, all of one sign), so all argument roundings together are at most 3u|d_i|. A sum of
   nonnegative terms in any order carries each term through at most k additions, each adding a relative
   error of at most u; k = (terms per block - 1) + (blocks - 1) + (ranks - 1) for ours, and for megatron
   (torch's sum over V_local in an order we do not rely on) k = (V_local - 1) + (ranks - 1). With
   A = sum_i t_i |d_i| / S and R the number of rescales (blocks (+1 under TP) for ours, 0 for megatron):
       |S^ - S| / S <= eta = 1.01 (3u A + (1 + R) E + R u + k u) + V 2^-126 / S
   (1.01 covers the second-order terms while eta < 1e-2; V 2^-126: exp results the GPU flushes to zero).
2. The loss L = log S - (x_t - m) (no x_t term for labels outside the vocabulary), computed as
   fl(fl(log S^) - fl(x_t - m)): |log(1 + eta)| <= 1.01 eta, the log's own error E |log S| + 2^-22 (an
   absolute term for the GPU's approximate log near S = 1), u |x_t - m| and u |L| for the two subtractions:
       |L^ - L| <= 1.01 eta + 1.01 E |log S| + 2^-22 + u |x_t - m| + 1.01 u |L|
3. The gradient g_i = (p_i - [i = t]) * gl in fp32, before its final rounding: p^_i = exp(fl(x_i - m)) * fl(1/S^)
   (ours) or exp(..) / S^ (megatron) has relative error rho_i <= 1.01 (3u |d_i| + E + eta + 2u); the
   subtraction of the one-hot entry and the product by gl round once each:
       |g^_i - g_i| <= |gl| (p_i rho_i + 2.02 u |p_i - [i = t]|) + 2^-126 (|gl| + 1)
   After rounding to the output dtype (bf16 / fp16; round to nearest even), two such values a, b differ by at
   most |a - b| + ulp(max(|a|, |b|)), with ulp taken at |g_i| + the fp32 bound.
Two implementations differ by at most the sum of their bounds. Kernel vs reference: both use the same block
order and the same operations, so the max, the target's logit and their masks agree bit for bit; given the
same row statistics the gradient kernel differs from the reference only through exp (both round x_i - m
alike; the GPU's tl.exp rounds the argument twice more): per element |gl| (2.02 E p_i + 1.01 * 2u p_i |d_i|)
+ ulp, and it rounds bit for bit as ``.to(dtype)`` rounds its own fp32 result. Measured under the CPU
interpreter (2026-12-04, 6 seeds): s within 4 ulp of the reference, fp32 gradients within 4 ulp, bf16 and
fp16 gradients within 1 ulp.

Non-finite rows (a NaN or +Inf logit, or only -Inf) give NaN loss and gradient in both; a target whose logit
is -Inf gives an infinite loss in both (its gradient is finite).
"""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_train.kernels.fused.cross_entropy import (
    cross_entropy_grad,
    cross_entropy_stats,
    vocab_parallel_cross_entropy,
)
from nvfp4_train.kernels.fused.cross_entropy_reference import (
    BLOCK_V,
    combine_stats,
    cross_entropy_grad_ref,
    cross_entropy_stats_ref,
    vocab_parallel_cross_entropy_ref,
)

# the interpreter evaluates -Inf - -Inf etc. with numpy, which warns (and its max skips NaN, warning on a NaN row)
pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")]

U = 2.0**-24
E_FN = 2.0**-20
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_MANT = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------


def make_logits(n: int, v: int, dtype: torch.dtype, gen: torch.Generator, first_block: int = 1) -> torch.Tensor:
    """[n, v] logits with per-row scales from 0.05 to ~100 and, for n >= 10, edge rows: 0 exact ties, 1 one
    dominant entry (S ~ 1), 2 its first ``first_block`` + 3 entries -Inf (the online max starts at -Inf),
    3 magnitudes in the thousands, 4 only -Inf, 5 a NaN, 6 a +Inf."""
    scale = 2.0 * torch.exp(1.5 * torch.randn(n, 1, generator=gen))
    x = torch.randn(n, v, generator=gen) * scale
    if n >= 10:
        x[0] = x[0, 0]
        x[1, torch.randint(0, v, (), generator=gen)] += 60.0
        x[2, :first_block + 3] = float("-inf")
        x[3] = (torch.randn(v, generator=gen) * 3000.0).clamp(-6e4, 6e4)
        x[4] = float("-inf")
        x[5, torch.randint(0, v, (), generator=gen)] = float("nan")
        x[6, torch.randint(0, v, (), generator=gen)] = float("inf")
    return x.to(dtype)


def make_target(n: int, v: int, gen: torch.Generator) -> torch.Tensor:
    """Global ids in [0, v), and for n >= 10 labels outside it (-100, v, -1) in rows 7-9; row 2's target is
    one of its -Inf entries (an infinite loss)."""
    t = torch.randint(0, v, (n,), generator=gen)
    if n >= 10:
        t[2], t[7], t[8], t[9] = 0, -100, v, -1
    return t


# ---------------------------------------------------------------------------------------------------------
# the exact result and the bounds of the module docstring
# ---------------------------------------------------------------------------------------------------------


def exact_ce(x: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor | None = None) -> dict:
    """float64 loss, softmax and gradient of logits x [N, V] (the whole vocabulary) and the quantities the
    bounds need; ``ok`` marks the rows without NaN or +Inf and with a finite entry."""
    x64 = x.double().cpu()
    target = target.cpu()
    n, v = x64.shape
    ok = ~(torch.isnan(x64) | (x64 == float("inf"))).any(1) & (x64 > float("-inf")).any(1)
    x64 = torch.where(ok[:, None], x64, 0.0)  # bounds are evaluated on the ok rows only
    m = x64.max(1).values
    d = x64 - m[:, None]
    t = torch.exp(d)
    s = t.sum(1)
    valid = (target >= 0) & (target < v)
    local = target.clamp(0, v - 1)
    xt = x64.gather(1, local[:, None])[:, 0]
    loss = torch.log(s) - torch.where(valid, xt - m, 0.0)
    loss[~ok] = float("nan")
    p = t / s[:, None]
    onehot = torch.zeros(n, v, dtype=torch.float64)
    onehot[valid.nonzero()[:, 0], target[valid]] = 1.0
    td = torch.where(t > 0, t * d.abs(), 0.0)
    out = dict(ok=ok, m=m, s=s, loss=loss, valid=valid, xt_m=torch.where(valid, (xt - m).abs(), 0.0),
               a=td.sum(1) / s, p=p, pd=td / s[:, None], onehot=onehot, v=v)
    if grad_loss is not None:
        gl = grad_loss.double().cpu().reshape(-1)
        out["gl"] = gl
        out["grad"] = torch.where(ok[:, None], (p - onehot) * gl[:, None], float("nan"))
    return out


def eta_ours(ex: dict, v_local: int, block_v: int, tp: int = 1) -> torch.Tensor:
    """Bound 1 for the online softmax over blocks of ``block_v`` (per rank of ``tp``)."""
    nb = math.ceil(v_local / min(block_v, 1 << (v_local - 1).bit_length()))
    rescales = nb + (1 if tp > 1 else 0)
    adds = (min(block_v, v_local) - 1) + (nb - 1) + (tp - 1)
    return _eta(ex, rescales, adds)


def eta_megatron(ex: dict, v_local: int, tp: int = 1) -> torch.Tensor:
    """Bound 1 for megatron's max-subtracted sum (any order)."""
    return _eta(ex, 0, (v_local - 1) + (tp - 1))


def _eta(ex: dict, rescales: int, adds: int) -> torch.Tensor:
    return 1.01 * (3 * U * ex["a"] + (1 + rescales) * E_FN + rescales * U + adds * U) + ex["v"] * 2.0**-126 / ex["s"]


def loss_bound(ex: dict, eta: torch.Tensor) -> torch.Tensor:
    """Bound 2 (per row)."""
    return (1.01 * eta + 1.01 * E_FN * torch.log(ex["s"]).abs() + 2.0**-22 + U * ex["xt_m"]
            + 1.01 * U * ex["loss"].abs())


def grad_bound(ex: dict, eta: torch.Tensor) -> torch.Tensor:
    """Bound 3 before the final rounding (per element)."""
    gl = ex["gl"].abs()[:, None]
    rho = 1.01 * (E_FN + eta[:, None] + 2 * U)
    return (gl * (ex["p"] * rho + 1.01 * 3 * U * ex["pd"] + 2.02 * U * (ex["p"] - ex["onehot"]).abs())
            + 2.0**-126 * (gl + 1))


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |v| (float64; the subnormal spacing below the normal range)."""
    mant, emin = _MANT[dtype]
    _, e = torch.frexp(v.abs())
    return torch.pow(2.0, (e - 1).clamp(min=emin).double() - mant)


def rounded(bound: torch.Tensor, ex: dict, dtype: torch.dtype) -> torch.Tensor:
    """A bound between two fp32 values, after each is rounded to ``dtype`` (nothing to add for fp32)."""
    if dtype == torch.float32:
        return bound
    return bound + ulp(ex["grad"].abs() + bound, dtype)


def assert_loss_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, ex: dict, what: str) -> None:
    """Rows of non-finite input: both NaN. An infinite exact loss: both that Inf. Else |got - want| <= bound."""
    got, want = got.double().cpu().reshape(-1), want.double().cpu().reshape(-1)
    ok = ex["ok"]
    assert torch.isnan(got[~ok]).all() and torch.isnan(want[~ok]).all(), f"{what}: non-finite rows"
    inf = ok & torch.isinf(ex["loss"])
    assert (got[inf] == ex["loss"][inf]).all() and (want[inf] == ex["loss"][inf]).all(), f"{what}: Inf loss"
    fin = ok & ~inf
    err = (got[fin] - want[fin]).abs()
    assert (err <= bound[fin]).all(), f"{what}: max err {err.max():.3g}, worst err/bound {(err / bound[fin]).max():.3g}"


def assert_grad_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, ex: dict, what: str) -> None:
    """Rows of non-finite input: both all NaN. Else |got - want| <= bound elementwise."""
    n = ex["ok"].shape[0]
    got, want = got.double().cpu().reshape(n, -1), want.double().cpu().reshape(n, -1)
    ok = ex["ok"]
    assert torch.isnan(got[~ok]).all() and torch.isnan(want[~ok]).all(), f"{what}: non-finite rows"
    err = (got[ok] - want[ok]).abs()
    b = bound[ok]
    assert torch.isfinite(err).all() and (err <= b).all(), (
        f"{what}: max err {err.max():.3g}, worst err/bound {(err / b).max():.3g}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same bits except NaN, whose positions must agree (its payload is not specified)."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    same = torch.where(nan, 0, bits(got)) == torch.where(nan, 0, bits(want))
    assert same.all(), f"{what}: {int((~same).sum())} elements differ, first at {(~same).nonzero()[0].tolist()}"


# ---------------------------------------------------------------------------------------------------------
# CPU: the reference path against megatron-core
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def megatron_tp1():
    from tests.precision.mcore_util import megatron_single_rank

    with megatron_single_rank():
        yield


def megatron_ce(logits: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor):
    """megatron-core's loss and fp32 gradient for ``logits`` (it takes ``logits.float()``, as today's model
    call does) and its gradient in the logits' dtype (autograd's cast of the fp32 one)."""
    from megatron.core import tensor_parallel

    xf = logits.detach().float().clone().requires_grad_()
    loss = tensor_parallel.vocab_parallel_cross_entropy(xf.clone(), target)
    loss.backward(grad_loss)
    return loss.detach(), xf.grad, xf.grad.to(logits.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3, 9001), (4, 3, 1), (11, 1, 4096)], ids=["v9001", "v1", "v4096"])
def test_reference_matches_megatron(megatron_tp1, gen, dtype, shape):
    s, b, v = shape
    x = make_logits(s * b, v, dtype, gen, first_block=BLOCK_V).reshape(s, b, v)
    target = make_target(s * b, v, gen).reshape(s, b)
    gl = torch.randn(s, b, generator=gen)
    gl[0, 0] = 0.0
    ex = exact_ce(x.reshape(-1, v), target.reshape(-1), gl)
    eta_o, eta_m = eta_ours(ex, v, BLOCK_V), eta_megatron(ex, v)

    mloss, mgrad32, mgrad = megatron_ce(x, target, gl)
    # the GPU test's stand-in for megatron's function: the same static steps, bit for bit
    nloss, ngrad32 = megatron_ce_no_group(x.reshape(-1, v).float(), target.reshape(-1), gl.reshape(-1))
    assert_same_bits(nloss, mloss.reshape(-1), "megatron's steps: loss")
    assert_same_bits(ngrad32, mgrad32.reshape(-1, v), "megatron's steps: grad")
    xo = x.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy_ref(xo, target)
    loss.backward(gl)
    assert loss.dtype == torch.float32 and loss.shape == target.shape and xo.grad.dtype == dtype
    # fp32 gradient of ours: the same arithmetic on the fp32 values, before the final rounding
    x32 = x.float().clone().requires_grad_()
    vocab_parallel_cross_entropy_ref(x32, target).backward(gl)
    assert_same_bits(xo.grad, x32.grad.to(dtype), "ours = ours in fp32, rounded once")

    assert_loss_within(loss, ex["loss"], loss_bound(ex, eta_o), ex, "ours vs exact")
    assert_loss_within(mloss, ex["loss"], loss_bound(ex, eta_m), ex, "megatron vs exact")
    assert_loss_within(loss, mloss, loss_bound(ex, eta_o) + loss_bound(ex, eta_m), ex, "ours vs megatron")
    gb = grad_bound(ex, eta_o) + grad_bound(ex, eta_m)
    assert_grad_within(x32.grad, ex["grad"], grad_bound(ex, eta_o), ex, "ours fp32 vs exact")
    assert_grad_within(mgrad32, ex["grad"], grad_bound(ex, eta_m), ex, "megatron fp32 vs exact")
    assert_grad_within(x32.grad, mgrad32, gb, ex, "ours vs megatron, fp32")
    assert_grad_within(xo.grad, mgrad, rounded(gb, ex, dtype), ex, f"ours vs megatron, {dtype}")


def test_inplace_backward_writes_the_logits_and_refuses_a_second_backward(gen):
    x = make_logits(6, 333, torch.bfloat16, gen).reshape(2, 3, 333)
    target = make_target(6, 333, gen).reshape(2, 3)
    gl = torch.randn(2, 3, generator=gen)
    a = x.clone().requires_grad_()
    vocab_parallel_cross_entropy_ref(a, target).backward(gl)

    h = x.clone().requires_grad_()
    logits = h * 1  # a non-leaf, as the output layer's logits
    seen = []
    logits.register_hook(lambda g: seen.append(g))
    loss = vocab_parallel_cross_entropy_ref(logits, target, inplace_backward=True)
    loss.backward(gl, retain_graph=True)
    assert torch.equal(h.grad, a.grad) and torch.equal(seen[0], a.grad)
    assert seen[0].data_ptr() == logits.data_ptr()  # the gradient lives in the logits' storage
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(gl)


def test_noncontiguous_logits_are_copied_not_overwritten(gen):
    base = make_logits(7, 50, torch.float32, gen)  # [rows, V] stored transposed: column stride != 1
    x = base.t().contiguous().t()
    target = make_target(7, 50, gen)
    gl = torch.randn(7, generator=gen)
    xc = base.clone().requires_grad_()
    want = vocab_parallel_cross_entropy_ref(xc, target)
    want.backward(gl)
    xn = x.clone().t().contiguous().t().requires_grad_()
    saved = xn.detach().clone()
    got = vocab_parallel_cross_entropy_ref(xn, target, inplace_backward=True)
    got.backward(gl)
    assert_same_bits(got.detach(), want.detach(), "loss")
    assert_same_bits(xn.grad, xc.grad, "grad")
    assert_same_bits(xn.detach(), saved, "logits untouched")


def test_empty_batch():
    x = torch.zeros(0, 4, 17, dtype=torch.bfloat16, requires_grad=True)
    loss = vocab_parallel_cross_entropy(x, torch.zeros(0, 4, dtype=torch.long))
    assert loss.shape == (0, 4)
    loss.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("logits, target, err, match", [
    (torch.zeros(2, 3, 5, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.long), TypeError, "float64"),
    (torch.zeros(2, 3, 5), torch.zeros(2, 3), TypeError, "target.long"),
    (torch.zeros(2, 3, 5), torch.zeros(3, 2, dtype=torch.long), ValueError, r"\[s, b, V_local\]"),
    (torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.long), ValueError, "at least one vocabulary entry"),
])
def test_input_errors_name_the_fix(logits, target, err, match):
    with pytest.raises(err, match=match):
        vocab_parallel_cross_entropy(logits, target)


# ---------------------------------------------------------------------------------------------------------
# Triton: the kernels against the reference and the exact result (interpreter on CPU, natively on CUDA)
# ---------------------------------------------------------------------------------------------------------

KERNEL_CASES = [(1, 16), (300, 64), (1999, 256)]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v, block_v", KERNEL_CASES, ids=[f"v{v}-b{b}" for v, b in KERNEL_CASES])
def test_stats_kernel_matches_reference(triton_device, gen, dtype, v, block_v):
    n = 13
    x = make_logits(n, v, dtype, gen, first_block=block_v).to(triton_device)
    target = make_target(n, v, gen).to(triton_device)
    start = 5 if v > 1 else 0  # targets in [5, v + 5) fall in this shard
    got = cross_entropy_stats(x, target + start, start, block_v)
    want = cross_entropy_stats_ref(x, target + start, start, block_v)
    ex = exact_ce(x, target)
    ok = ex["ok"].to(triton_device)
    # the max and the target's logit are exact: bit for bit (rows with NaN: the GPU's max ignores NaN)
    assert_same_bits(got[0][ok], want[0][ok], "m")
    assert_same_bits(got[2], want[2], "x_t")
    assert torch.equal(torch.isnan(got[1]), torch.isnan(want[1])), "s: NaN rows"
    sb = eta_ours(ex, v, block_v) * ex["s"]
    for s_, what in ((got[1], "kernel"), (want[1], "reference")):
        s_ = s_.double().cpu()
        err = (s_[ex["ok"]] - ex["s"][ex["ok"]]).abs()
        assert (err <= sb[ex["ok"]]).all(), f"{what} s: worst err/bound {(err / sb[ex['ok']]).max():.3g}"


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 300, 1999])
def test_grad_kernel_matches_reference(triton_device, gen, dtype, v):
    n = 13
    x = make_logits(n, v, dtype, gen).to(triton_device)
    target = make_target(n, v, gen).to(triton_device)
    gl = torch.randn(n, generator=gen).to(triton_device)
    gl[3] = 0.0
    stats = cross_entropy_stats_ref(x, target, 0, BLOCK_V)
    combine_stats(stats, target, v, None)
    got = cross_entropy_grad(x, target, 0, stats, gl)
    want = cross_entropy_grad_ref(x, target, 0, stats, gl)
    got32 = cross_entropy_grad(x.float(), target, 0, stats, gl)
    # one rounding of the kernel's own fp32 result
    assert_same_bits(got, got32.to(dtype), "kernel = kernel in fp32, rounded once")
    ex = exact_ce(x, target, gl)
    gla = ex["gl"].abs()[:, None]
    bound = gla * (ex["p"] * 2.02 * E_FN + 1.01 * 2 * U * ex["pd"]) + 2.0**-126 * (gla + 1)
    assert_grad_within(got, want, rounded(bound, ex, dtype), ex, "kernel vs reference, same stats")
    # in place: the same bits in the logits' storage
    xi = x.clone()
    out = cross_entropy_grad(xi, target, 0, stats, gl, out=xi)
    assert out.data_ptr() == xi.data_ptr()
    assert_same_bits(xi, got, "in place")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_loss_and_grad_against_exact(triton_device, gen, dtype):
    """The public function on the kernels (two blocks of BLOCK_V per row), through autograd, in place."""
    s, b, v = 4, 3, BLOCK_V + 905
    x = make_logits(s * b, v, dtype, gen, first_block=BLOCK_V).reshape(s, b, v).to(triton_device)
    target = make_target(s * b, v, gen).reshape(s, b).to(triton_device)
    gl = torch.randn(s, b, generator=gen).to(triton_device)
    ex = exact_ce(x.reshape(-1, v), target.reshape(-1), gl)
    eta = eta_ours(ex, v, BLOCK_V)

    xo = x.clone().requires_grad_()
    logits = xo * 1
    loss = vocab_parallel_cross_entropy(logits, target, inplace_backward=True)
    loss.backward(gl)
    ref = x.clone().requires_grad_()
    loss_ref = vocab_parallel_cross_entropy_ref(ref, target)
    loss_ref.backward(gl)
    assert_loss_within(loss, ex["loss"], loss_bound(ex, eta), ex, "kernel vs exact")
    assert_loss_within(loss, loss_ref, 2 * loss_bound(ex, eta), ex, "kernel vs reference")
    gb = grad_bound(ex, eta)
    assert_grad_within(xo.grad, ex["grad"], rounded(gb, ex, dtype), ex, "kernel vs exact")
    assert_grad_within(xo.grad, ref.grad, rounded(2 * gb, ex, dtype), ex, "kernel vs reference")


# ---------------------------------------------------------------------------------------------------------
# GPU: production row lengths against megatron-core's arithmetic
# ---------------------------------------------------------------------------------------------------------


def megatron_ce_no_group(x32: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor):
    """megatron-core's vocab-parallel cross-entropy arithmetic at one rank (its own static steps, no process
    group): loss and fp32 gradient of fp32 logits [N, V]."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as M

    v = x32.shape[-1]
    logits, logits_max = M.calculate_logits_max(x32.clone())
    mask, masked_1d, predicted, sum_exp, exp_logits = M.calculate_predicted_logits(logits, target, logits_max, 0, v)
    softmax, loss = M.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    grad_2d, arange_1d, update, grad_input = M.prepare_gradient_calculation_operands(softmax, mask)
    grad = M.calculate_gradients(grad_2d, arange_1d, masked_1d, update, grad_input, grad_loss)
    return loss, grad


@pytest.mark.gpu
@pytest.mark.parametrize("v", [65536, 131072])
def test_gpu_production_rows_match_megatron(gen, v):
    n = 24
    x = make_logits(n, v, torch.bfloat16, gen, first_block=BLOCK_V).cuda()
    target = make_target(n, v, gen).cuda()
    gl = torch.randn(n, generator=gen).cuda()
    ex = exact_ce(x, target, gl)
    eta_o, eta_m = eta_ours(ex, v, BLOCK_V), eta_megatron(ex, v)
    mloss, mgrad32 = megatron_ce_no_group(x.float(), target, gl)
    xo = x.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(xo * 1, target, inplace_backward=True)
    loss.backward(gl)
    assert_loss_within(loss, mloss, loss_bound(ex, eta_o) + loss_bound(ex, eta_m), ex, "kernel vs megatron")
    gb = rounded(grad_bound(ex, eta_o) + grad_bound(ex, eta_m), ex, torch.bfloat16)
    assert_grad_within(xo.grad, mgrad32.to(torch.bfloat16), gb, ex, "kernel vs megatron, bf16")
