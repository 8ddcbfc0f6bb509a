"""The fused residual add + RMSNorm (``kernels/fused/residual_norm.py``): the kernels are the reference bit for
bit; the reference is torch's unfused add + ``F.rms_norm`` (and their autograd) but for the order of the row sums
and the square root, and within the bound derived below of it.

The bound (``docs/numerics.md``, "Fused step"). u = 2^-24, gamma_k = k u / (1 - k u). Inputs are values of the
activation dtype (bf16/fp16), so every square ``v_j^2`` and every product ``dn_j v_j = g_j w_j v_j`` is exact in
fp32 (8 + 8 and 16 + 8 significant bits for bf16; 11 + 11, 22 + 11 > 24 for fp16: there one more u per term). With
exact quantities in float64 (t = ss / N + eps, r = t^-1/2, Y = v r w):

- a sum of n fp32 terms in any order is within gamma_{n-1} sum |terms| of the exact sum; the kernels' tree has
  depth k = log2(W), torch's order is unknown: k = N - 1. For ``ss`` (non-negative terms) that is relative:
  ``t_p = t (1 + tau)``, |tau| <= T_k = (1 + gamma_k)(1 + u)^2 - 1 (the division by N, the add of eps > 0).
- rstd: fused ``fl(1 / fl(sqrt(t_p)))``: |r_p / r - 1| <= R = (1 - T)^-1/2 (1 - u)^-1 (1 + u) - 1; torch's CPU
  ``rsqrt`` is within 1.5 u of t_p^-1/2 (measured, reference module docstring): budget RSQRT_U = 2 u, R = (1 -
  T)^-1/2 (1 + 2u) - 1.
- normed: ``R(fl(fl(v r_p) w))``: |normed - Y| <= |Y| Q + e_D (|Y| (1 + Q)) + tiny_D with Q = (1 + R)(1 + u)^2 - 1,
  e_D = 2^-8 (bf16) or 2^-11 (fp16) relative rounding, tiny_D half the smallest subnormal.
- input gradient (no g_skip): dv = dn r - v r^3 S / N with dn = g w, S = sum_j dn_j v_j; the path computes
  ``fl(fl(dn r_p) + fl(fl(fl(fl(-0.5 S_p) fl(fl(r_p r_p) r_p)) / N) fl(2v)))``:
  E = |dn r| ((1 + R)(1 + u) - 1) + |v| r^3 / N (|S| ((1 + R)^3 (1 + u)^5 - 1) + gamma_k sum|dn v| (1 + R)^3
  (1 + u)^5), then one fp32 and one D rounding: |dx - dv| <= E + u (|dv| + E) + e_D (|dv| + E (1 + u)) + tiny_D.
- weight gradient: sum over rows of g fl(v r_p), any order: |dw - DW| <= sum |g v r| ((1 + R)(1 + u)^2 (1 +
  gamma_{M-1}) - 1) + e_w |DW| (1 + ...) (M rows; e_w the weight dtype's rounding).

Fused and unfused are each within their bound of the exact value, so within the sum of the two of each other.
The tests also require the bound to be tight enough to see a mistake (most of it is the final rounding).
"""

from __future__ import annotations

import math

import pytest
import torch

import nvfp4_train.kernels.fused.residual_norm_reference as ref_module
from nvfp4_train.kernels.fused.residual_norm import (
    residual_norm,
    residual_norm_backward_triton,
    residual_norm_forward_triton,
)
from nvfp4_train.kernels.fused.residual_norm_reference import (
    WGRAD_ROWS,
    residual_norm_backward_ref,
    residual_norm_forward_ref,
    residual_norm_ref,
)
from nvfp4_train.models.layers import rms_norm
from tests.kernels.test_rope import assert_same_bits, edge_values

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

U = 2.0**-24
RSQRT_U = 2 * U  # torch's CPU rsqrt: measured within 1.5 u (residual_norm_reference.py)
ROUND = {torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25), torch.float32: (U, 2.0**-150)}
# (rows shape, hidden): odd row counts, hidden sizes that are not powers of two, one row, a row of one element
SHAPES = [((37, 3), 96), ((5,), 1000), ((33,), 48), ((70,), 17), ((2, 1), 2048)]


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _inputs(gen, rows: tuple[int, ...], n: int, dtype: torch.dtype, *, eps_near_ms: bool = False):
    """residual, delta ~ N(0, 1) and N(0, 0.5) (a sum that cancels in places), weight around 1 with a few
    negatives, the two output gradients, and eps: 1e-5, or near the rows' mean square (so that a misplaced eps
    moves the result by O(1))."""
    res = torch.randn(*rows, n, generator=gen).to(dtype)
    delta = (0.5 * torch.randn(*rows, n, generator=gen)).to(dtype)
    w = (1 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    g_normed = torch.randn(*rows, n, generator=gen).to(dtype)
    g_skip = torch.randn(*rows, n, generator=gen).to(dtype)
    eps = float((res.float() + delta.float()).square().mean()) if eps_near_ms else 1e-5
    return res, delta, w, g_normed, g_skip, eps


def _unfused(res, delta, w, eps, g_normed, g_skip):
    """torch's add, ``F.rms_norm`` and autograd through both: (x, normed, d residual, d delta, dw)."""
    r, d, wl = (t.detach().clone().requires_grad_() for t in (res, delta, w))
    x = r + d
    y = rms_norm(x, wl, eps)
    outs, grads_in = ((x, y), (g_skip, g_normed)) if g_skip is not None else ((y,), (g_normed,))
    grads = torch.autograd.grad(outs, (r, d, wl), grads_in)
    return x.detach(), y.detach(), *grads


def _fused(fn, res, delta, w, eps, g_normed, g_skip):
    r, d, wl = (t.detach().clone().requires_grad_() for t in (res, delta, w))
    x, y = fn(r, d, wl, eps)
    outs, grads_in = ((x, y), (g_skip, g_normed)) if g_skip is not None else ((y,), (g_normed,))
    grads = torch.autograd.grad(outs, (r, d, wl), grads_in)
    return x.detach(), y.detach(), *grads


def _bounds(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, eps: float, k_sum: int, rsqrt_u: float,
            rsqrt_div: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    """(normed exact, its bound, dx exact, its bound, dw exact, its bound) of one path (module docstring): row sums
    of error gamma_{k_sum}; rstd by fl(1/fl(sqrt)) (``rsqrt_div``) or a rsqrt within ``rsqrt_u``."""
    n = x.shape[-1]
    e_d, tiny = ROUND[x.dtype]
    e_w, _ = ROUND[w.dtype]
    v = x.reshape(-1, n).double()
    w64 = w.double()
    g64 = g.reshape(-1, n).double()
    t = v.square().sum(-1, keepdim=True) / n + eps
    r = t.rsqrt()
    gk = _gamma(k_sum)
    tau = (1 + gk) * (1 + U) ** 2 - 1
    rel_r = (1 - tau) ** -0.5 * ((1 + U) / (1 - U) if rsqrt_div else (1 + rsqrt_u)) - 1
    y = v * r * w64
    q = (1 + rel_r) * (1 + U) ** 2 - 1
    y_bound = y.abs() * q + e_d * y.abs() * (1 + q) + tiny
    dn = g64 * w64
    s = (dn * v).sum(-1, keepdim=True)
    s_abs = (dn * v).abs().sum(-1, keepdim=True)
    dv = dn * r - v * r**3 * s / n
    c3 = (1 + rel_r) ** 3 * (1 + U) ** 5
    e = (dn * r).abs() * ((1 + rel_r) * (1 + U) - 1) + v.abs() * r**3 / n * (s.abs() * (c3 - 1) + gk * s_abs * c3)
    dx_bound = e + U * (dv.abs() + e) + e_d * (dv.abs() + e * (1 + U)) + tiny
    dw = (g64 * v * r).sum(0)
    rows = v.shape[0]
    dw_err = (g64 * v * r).abs().sum(0) * ((1 + rel_r) * (1 + U) ** 2 * (1 + _gamma(max(rows - 1, 1))) - 1)
    dw_bound = dw_err + e_w * (dw.abs() + dw_err) + ROUND[w.dtype][1]
    return y, y_bound, dv, dx_bound, dw, dw_bound


def _within(name: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    err = (got.double().reshape(exact.shape) - exact).abs()
    assert (err <= bound).all(), f"{name}: {int((err > bound).sum())} elements outside the bound, worst " \
                                 f"{float((err / bound).max()):.3f} of it"
    return float((err / bound).max())


# ------------------------------------------------------------------------------------------------------------
# CPU tier: the reference against torch's unfused path
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n", SHAPES[:3])
def test_reference_is_the_unfused_arithmetic_but_for_the_sums_and_rsqrt(gen, monkeypatch, dtype, rows, n):
    """With torch's two row sums, torch's weight-gradient sum and torch's rsqrt put in, the reference IS the
    unfused add + ``F.rms_norm`` and autograd's backward, bit for bit: these are the only differences. (fp32: the
    gradient of x is autograd's sum of three fp32 terms in its own order, not rounded between: the sum and the
    norm bitwise, the input gradient not compared.)"""
    monkeypatch.setattr(ref_module, "tree_row_sum", lambda v: v.sum(-1, keepdim=True))
    monkeypatch.setattr(ref_module, "weight_grad_sum", lambda terms: terms.sum(0))
    monkeypatch.setattr(ref_module, "rstd_of", lambda ss, n_, eps: torch.rsqrt(ss / n_ + eps))
    res, delta, w, g_normed, g_skip, eps = _inputs(gen, rows, n, dtype)
    got = _fused(residual_norm_ref, res, delta, w, eps, g_normed, g_skip)
    want = _unfused(res, delta, w, eps, g_normed, g_skip)
    names = ("x", "normed", "d residual", "d delta", "dw")
    for name, a, b in zip(names, got, want):
        if dtype == torch.float32 and name.startswith("d "):
            continue
        assert_same_bits(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,n", SHAPES)
@pytest.mark.parametrize("eps_near_ms", [False, True], ids=["eps1e-5", "eps~ms"])
def test_reference_within_the_bound_of_the_unfused_path(gen, dtype, rows, n, eps_near_ms):
    """x bitwise; normed, the input gradient and the weight gradient of each path within its derived bound of the
    exact value (module docstring), so the two within the sum of the bounds of each other; and the bound tight: the
    normed output's median bound under 1.25 roundings of the output dtype."""
    res, delta, w, g_normed, _, eps = _inputs(gen, rows, n, dtype, eps_near_ms=eps_near_ms)
    fused = _fused(residual_norm_ref, res, delta, w, eps, g_normed, None)
    unfused = _unfused(res, delta, w, eps, g_normed, None)
    assert_same_bits(fused[0], unfused[0])
    assert_same_bits(fused[2], fused[3])
    w_prod = 1 if dtype == torch.bfloat16 else 2  # fp16 squares and products are not exact in fp32: one more u
    k_tree = math.ceil(math.log2(n)) + w_prod
    for path, out, k, rsqrt_div in (("fused", fused, k_tree, True), ("unfused", unfused, n - 1 + w_prod, False)):
        y, yb, dv, dxb, dw, dwb = _bounds(out[0], w, g_normed, eps, k, RSQRT_U, rsqrt_div)
        _within(f"{path} normed", out[1], y, yb)
        _within(f"{path} dx", out[2], dv, dxb)
        _within(f"{path} dw", out[4], dw, dwb)
    e_d, _ = ROUND[dtype]
    assert float((yb / y.abs().clamp_min(1e-30)).median()) < 1.25 * e_d


def test_reference_in_the_model_dtype_is_within_one_ulp_of_the_unfused_norm(gen):
    """bf16 at ``1.2b``'s hidden size: before the last rounding the two normed values are within
    (Q_fused + Q_unfused) |Y| << 2^-8 |Y|, so after it they are at most one bf16 ulp apart."""
    res, delta, w, *_ = _inputs(gen, (64,), 2048, torch.bfloat16)
    _, y_f, _ = residual_norm_forward_ref(res, delta, w, 1e-5)
    y_u = rms_norm(res + delta, w, 1e-5)
    ulp = torch.maximum(y_f.float().abs(), y_u.float().abs())
    ulp = torch.where(ulp > 0, 2.0 ** (torch.floor(torch.log2(ulp)) - 7), 2.0**-133)
    assert ((y_f.float() - y_u.float()).abs() <= ulp).all()


def test_check_input_names_the_problem():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    cases = [
        (x.to(torch.int32), x, w, "bfloat16, float16 or float32"),
        (x, x.float(), w, "one shape and dtype"),
        (x, x[:, :4], w, "one shape and dtype"),
        (x, x, torch.ones(7), r"weight must be \[hidden\] = \[8\]"),
        (x[:, :0], x[:, :0], torch.ones(0), "weight must be"),
    ]
    for a, b, ww, match in cases:
        with pytest.raises(ValueError, match=match):
            residual_norm(a, b, ww, 1e-5)
    with pytest.raises(TypeError, match="tensors"):
        residual_norm(x, 1.0, w, 1e-5)


def test_reference_on_empty_and_mixed_weight():
    """No rows: empty outputs and a zero weight gradient; an fp32 weight with bf16 activations (the composite path
    of models.layers.rms_norm): the weight read in fp32, its gradient fp32."""
    x = torch.zeros(0, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    s, y = residual_norm_ref(x, x, w, 1e-5)
    (y.float().sum() + s.float().sum()).backward()
    assert s.shape == y.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    w32 = 1 + 0.1 * torch.randn(16, generator=g)
    _, y, _ = residual_norm_forward_ref(a, a, w32, 1e-5)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), rms_norm(a + a, w32, 1e-5).float(), rtol=2**-7, atol=0)


# ------------------------------------------------------------------------------------------------------------
# Triton tier: the kernels are the reference, bit for bit
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n", [SHAPES[0], SHAPES[3], ((WGRAD_ROWS + 3,), 200)])
def test_kernels_match_reference_forward_and_backward(gen, triton_device, dtype, rows, n):
    """Edge values (signed zeros, subnormals, near-max sums that overflow, +-Inf, NaN) in every input; forward,
    backward with and without g_skip, the autograd op against the reference's."""
    res, delta = (edge_values((*rows, n), dtype, gen).to(triton_device) for _ in range(2))
    g_normed, g_skip = (edge_values((*rows, n), dtype, gen).to(triton_device) for _ in range(2))
    w = (1 + 0.3 * torch.randn(n, generator=gen)).to(dtype).to(triton_device)
    w[:3] = torch.tensor([0.0, -0.0, -2.5])
    got = residual_norm_forward_triton(res, delta, w, 1e-5)
    want = residual_norm_forward_ref(res, delta, w, 1e-5)
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    x, _, rstd = want
    for skip in (g_skip, None):
        for a, b in zip(residual_norm_backward_triton(g_normed, skip, x, w, rstd),
                        residual_norm_backward_ref(g_normed, skip, x, w, rstd)):
            assert_same_bits(a, b)
    # finite inputs through the autograd ops (a NaN anywhere would make every weight-gradient sum NaN)
    res, delta, w, g_normed, g_skip, eps = (t.to(triton_device) if isinstance(t, torch.Tensor) else t
                                            for t in _inputs(gen, rows, n, dtype, eps_near_ms=True))
    for a, b in zip(_fused(residual_norm, res, delta, w, eps, g_normed, g_skip),
                    _fused(residual_norm_ref, res, delta, w, eps, g_normed, g_skip)):
        assert_same_bits(a, b)


@pytest.mark.triton
def test_kernels_on_edge_shapes(gen, triton_device):
    """A row of one element, no rows, a strided (non-contiguous) delta and gradient, an fp32 weight with bf16
    activations."""
    for rows, n in (((3,), 1), ((0,), 64)):
        res, delta, g = (torch.randn(*rows, n, generator=gen).to(torch.bfloat16).to(triton_device) for _ in range(3))
        w = torch.rand(n, generator=gen).to(torch.bfloat16).to(triton_device)
        got, want = residual_norm_forward_triton(res, delta, w, 1e-5), residual_norm_forward_ref(res, delta, w, 1e-5)
        for a, b in zip(got, want):
            assert_same_bits(a, b)
        for a, b in zip(residual_norm_backward_triton(g, g, want[0], w, want[2]),
                        residual_norm_backward_ref(g, g, want[0], w, want[2])):
            assert_same_bits(a, b)
    base = torch.randn(9, 2, 40, generator=gen).to(torch.bfloat16).to(triton_device)
    res, delta = base[:, 0, :33].contiguous(), base[:, 1, 3:36]
    w32 = (1 + 0.1 * torch.randn(33, generator=gen)).to(triton_device)
    for a, b in zip(_fused(residual_norm, res, delta, w32, 1e-5, delta, None),
                    _fused(residual_norm_ref, res, delta, w32, 1e-5, delta, None)):
        assert_same_bits(a, b)


# ------------------------------------------------------------------------------------------------------------
# GPU: the kernels bitwise the reference on CUDA (the same operations, the same orders), and under graph capture
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_1p2b_shape_matches_reference_and_stays_near_torch(gen):
    """``1.2b``'s boundary ([4096, 2, 2048] bf16): kernel and reference on the GPU bit for bit; against torch's CUDA
    add + ``F.rms_norm`` the sum bitwise and the norm within one bf16 ulp."""
    res, delta, w, g_normed, g_skip, eps = (t.cuda() if isinstance(t, torch.Tensor) else t
                                            for t in _inputs(gen, (4096, 2), 2048, torch.bfloat16))
    got = _fused(residual_norm, res, delta, w, eps, g_normed, g_skip)
    for a, b in zip(got, _fused(residual_norm_ref, res, delta, w, eps, g_normed, g_skip)):
        assert_same_bits(a, b)
    x, y = got[0], got[1]
    assert_same_bits(x, res + delta)
    y_t = rms_norm(x, w, eps)
    big = torch.maximum(y.float().abs(), y_t.float().abs()).clamp_min(2.0**-126)
    assert ((y.float() - y_t.float()).abs() <= 2.0 ** (torch.floor(torch.log2(big)) - 7)).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_eager_bits(gen):
    """Forward and backward captured after an eager warm-up and replayed on new inputs: the eager bits."""
    shape, n = (256, 2), 768
    res = torch.zeros(*shape, n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    delta = torch.zeros_like(res, requires_grad=True)
    w = torch.ones(n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.zeros_like(res)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x, y = residual_norm(res, delta, w, 1e-5)
            torch.autograd.grad((x, y), (res, delta, w), (g, g))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, y = residual_norm(res, delta, w, 1e-5)
        grads = torch.autograd.grad((x, y), (res, delta, w), (g, g))
    for _ in range(2):
        new = [torch.randn(*shape, n, generator=gen).to(torch.bfloat16).cuda() for _ in range(3)]
        with torch.no_grad():
            res.copy_(new[0])
            delta.copy_(new[1])
        g.copy_(new[2])
        graph.replay()
        torch.cuda.synchronize()
        want = _fused(residual_norm, new[0], new[1], w.detach(), 1e-5, new[2], new[2])
        for a, b in zip((x, y, *grads), want):
            assert_same_bits(a, b)
