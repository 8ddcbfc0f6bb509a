"""RMSNorm's backward (``kernels/fused/rms_norm.py``, reference ``rms_norm_reference.py``) against the exact gradients,
against torch's own backwards, and kernel against reference.

The bound, derived before the tests (``rms_norm_reference.rms_norm_backward_bound`` evaluates it; docs/numerics.md,
"Fused step", states it). Every implementation gets x, dy, w (read exactly as fp32) and the forward's fp32 rstd r,
and approximates, per row of H columns and over the M rows,

    dx = r g - (r xh / H) sum_j p_j        xh = x r,  g = dy w,  p_j = g_j xh_j
    dw = sum_i q_i                         q_i = dy_i xh_i

With u = 2^-24 and gamma_n = n u / (1 - n u): each fp32 operation is exact times (1 + delta), |delta| <= u, barring
underflow and overflow; a product of k such factors is (1 + theta_k), |theta_k| <= gamma_k; a sum of n terms in any
order puts at most n - 1 roundings on each term, so it is sum_j t_j (1 + theta_(n-1),j). Counting the roundings on
the path of each term:

- ours (kernel and reference): p_j = fl(fl(dy w) fl(x r)) has 3, the row sum H - 1 more, c = fl(S / H) 1, fl(xh c)
  2 (xh's own and the product), fl(g - t) 1, fl(r d) 1: each term of r xh S / H carries theta_(H+7); r g carries
  theta_3 (g, the difference, the product by r). dw: q = fl(dy fl(x r)) has 2; then its partial's additions and the
  sum of the partials.
- torch on CUDA (aten's rms_norm kernels): S = sum fl(fl(fl(dy w) x) r) (3 + H - 1), fl(fl(x r) S) 2,
  the difference 1, the product by fl(fl(1 / H) r) 1 + 2: theta_(H+8); the first term fl(fl(H w) dy) 2, difference 1,
  product 1 + 2: theta_6. dw: fl(fl(dy x) r) then M - 1 additions: theta_(M+1) (up to 65536 rows; above, aten
  rounds partials to the weight's dtype).
- torch on CPU (autograd through the composite ``x * rsqrt(mean(x^2) + eps) * w``): fl(g r) + fl(fl(fl(fl(-S'/2) r^3)
  / H) 2x) with S' = sum fl(g x): theta_3 and theta_(H+7); dw: fl(dy fl(x r)), M - 1 additions: theta_(M+1).

A weight gradient is a summation tree over the M terms q_i, whatever its shape (bands, lanes, partials, their sum;
aten's thread tiles): each addition on a term's path that can round adds at least one other row's term (adding +0,
a padded row's, is exact), so at most M - 1 of them, and n = M + 1 for every implementation. So an implementation's
fp32 dx is within E = gamma_a r |g| + gamma_b (r |xh| / H) sum_j |p_j| of the exact dx, its fp32 dw within
gamma_n sum_i |q_i|; rounding to the output dtype T (nearest-even) adds at most u_T |fp32 value| <= u_T (|exact| + E)
(u_T = 2^-8 bf16, 2^-11 fp16, 0 fp32) plus half T's smallest subnormal. The exact gradients are evaluated in
float64, itself within gamma_(H+8) resp. gamma_(M+1) at u = 2^-53 of the same magnitudes, which the bound adds.
Then |ours - torch's| <= bound_ours + bound_torch, elementwise. The derivation assumes every fp32 intermediate is 0
or normal: ``assert_in_domain`` checks that of each test's inputs.

Tests: the reference against exact (CPU), and torch's CPU backward against exact and against the reference; the
kernel against the reference (``triton``: the interpreter on CPU, natively on a GPU): the weight gradient bit for
bit (same bands, lanes and order), dx within the two bounds, and each within its own bound of exact; zeros, row scales
from 2^-32 to 2^32, H = 784 (768 + 16), 2048, 100, 1, M = 37, 1, 0, programs not dividing M; against aten's CUDA
``_fused_rms_norm_backward`` (``gpu``).

The non-finite check of dy (``check``): the reference's and the kernel's kept times, clocks and counters are those of
``track_nonfinite_ref`` / ``track_nonfinite_clocked_ref`` of dy, bit for bit, for a clean dy and for one NaN, +Inf or
-Inf in the first row, the last row or a drawn row of the last program (at a random column), on both clocks, with
``kept`` None or given; dx and dw are the same bits with the check as without it. dy is the head of a buffer whose
tail holds NaNs, so a masked-out column or a row past M read by mistake would be found. And the kernel compiled for
sm_90 with and without the check: no register spills, one atomic with it, none without.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.bench.sass import have_nvidia_tools
from nvfp4_train.kernels._dispatch import interpret_mode
from nvfp4_train.kernels.fused.nonfinite import NEVER, new_arrivals
from nvfp4_train.kernels.fused.nonfinite_reference import (
    NonfiniteCheck,
    track_nonfinite_clocked_ref,
    track_nonfinite_ref,
)
from nvfp4_train.kernels.fused.rms_norm import rms_norm_backward, rms_norm_backward_triton
from nvfp4_train.kernels.fused.rms_norm_reference import (
    rms_norm_backward_bound,
    rms_norm_backward_exact,
    rms_norm_backward_ref,
    row_bands,
)

EPS = 1e-5
SHAPES = [(37, 784), (16, 2048), (29, 100), (1, 2048), (5, 1)]
SCALE = {torch.bfloat16: 32, torch.float32: 32, torch.float16: 3}
"""Largest |k| of the per-row scales 2^k of x and dy: fp16 keeps its values and gradients inside its range."""


def make_inputs(m: int, h: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"):
    """(dy, x, rstd [M] fp32, w): normals with per-row scales 2^k (|k| <= SCALE), ~3% zeros in each tensor, a zero
    row of x and one of dy (when M > 2), weights of both signs in [0.5, 1.5) x 2^[-2, 2]; rstd from torch's forward."""
    k = SCALE[dtype]

    def rows(shape):
        t = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-k, k + 1, (shape[0], 1), generator=gen))
        return torch.where(torch.rand(shape, generator=gen) < 0.03, 0.0, t)

    x, dy = rows((m, h)), rows((m, h))
    if m > 2:
        x[1], dy[2] = 0.0, 0.0
    sign = torch.where(torch.rand(h, generator=gen) < 0.5, -1.0, 1.0)
    w = sign * (torch.rand(h, generator=gen) + 0.5) * torch.exp2(torch.randint(-2, 3, (h,), generator=gen))
    w = torch.where(torch.rand(h, generator=gen) < 0.03, 0.0, w)
    x, dy, w = x.to(dtype).to(device), dy.to(dtype).to(device), w.to(dtype).to(device)
    _, rstd = torch.ops.aten._fused_rms_norm(x, [h], w, EPS)
    return dy, x, rstd.reshape(-1).float(), w


def assert_in_domain(dy, x, rstd, w) -> None:
    """The bound's assumption: every fp32 intermediate of the three implementations is 0 or has a magnitude in
    [2^-125, 2^125] (normal with room for the relative errors, which stay far below a factor of 2); checked on the
    float64 values."""
    r = rstd.double()[:, None]
    x, dy, w = x.double(), dy.double(), w.double()
    xh, g = x * r, dy * w
    c = (g * xh).sum(-1, keepdim=True) / x.shape[1]
    terms = {"xh": xh, "g": g, "g xh": g * xh, "dy x": dy * x, "dy x r": dy * xh, "xh c": xh * c, "x c": x * c,
             "g - xh c": g - xh * c, "dx": r * (g - xh * c), "H w dy": x.shape[1] * g, "g x": g * x,
             "r^3": r ** 3, "sum g xh": c * x.shape[1], "dw": (dy * xh).sum(0)}
    for name, t in terms.items():
        a = t.abs()
        bad = (a != 0) & ((a < 2.0 ** -125) | (a > 2.0 ** 125))
        assert not bad.any(), f"{name}: {int(bad.sum())} values outside the bound's domain, e.g. {a[bad][0]}"


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|got - want| <= bound elementwise, in float64 (NaN counts as a violation)."""
    err = (got.double() - want.double()).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond the bound; worst "
                           f"{(err / bound)[bad].max().item():.3g} x bound at {bad.nonzero()[0].tolist()}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float tensor (+0 and -0 apart)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def _torch_cpu_backward(dy, x, w):
    """Today's CPU backward: autograd through ``F.rms_norm`` (torch's composite)."""
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.nn.functional.rms_norm(xi, (x.shape[1],), wi, EPS)
    return torch.autograd.grad(y, (xi, wi), dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_and_torch_cpu_within_the_bound_of_exact(shape, dtype, gen):
    dy, x, rstd, w = make_inputs(*shape, dtype, gen)
    assert_in_domain(dy, x, rstd, w)
    ex, ew = rms_norm_backward_exact(dy, x, rstd, w)
    ours = rms_norm_backward_ref(dy, x, rstd, w)
    theirs = _torch_cpu_backward(dy, x, w)
    b_ours = rms_norm_backward_bound(dy, x, rstd, w, "ours")
    b_torch = rms_norm_backward_bound(dy, x, rstd, w, "torch_cpu")
    for i, name in enumerate(("dx", "dw")):
        assert ours[i].dtype == theirs[i].dtype == (x.dtype if i == 0 else w.dtype)
        assert_within(ours[i], (ex, ew)[i], b_ours[i], f"reference {name} vs exact")
        assert_within(theirs[i], (ex, ew)[i], b_torch[i], f"torch's CPU {name} vs exact")
        assert_within(ours[i], theirs[i], b_ours[i] + b_torch[i], f"reference {name} vs torch's CPU")


def test_zero_gradient_and_zero_rows_are_exact(gen):
    dy, x, rstd, w = make_inputs(9, 784, torch.bfloat16, gen)
    dx, dw = rms_norm_backward_ref(torch.zeros_like(dy), x, rstd, w)
    assert not dx.any() and not dw.any()
    # a zero row of x: dx = R(r g), the row adds nothing to dw
    x[:] = 0
    _, rstd = torch.ops.aten._fused_rms_norm(x, [784], w, EPS)
    rstd = rstd.reshape(-1)
    dx, dw = rms_norm_backward_ref(dy, x, rstd, w)
    assert torch.equal(dx, (rstd[:, None] * (dy.float() * w.float())).bfloat16()) and not dw.any()


def test_bad_arguments_are_refused():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    r, w = torch.ones(4), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="flatten the leading dims"):
        rms_norm_backward_ref(x[None], x[None], r, w)
    with pytest.raises(ValueError, match="dy must have"):
        rms_norm_backward_ref(x.float(), x, r, w)
    with pytest.raises(ValueError, match="rstd must be"):
        rms_norm_backward_ref(x, x, r[:, None], w)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_backward_ref(x, x, r, w[:4])
    with pytest.raises(ValueError, match="at least one program"):
        rms_norm_backward_ref(x, x, r, w, programs=0)


# ------------------------------------------------------------------------------------------ the kernel

@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_against_reference(shape, dtype, triton_device, gen):
    dy, x, rstd, w = make_inputs(*shape, dtype, gen, triton_device)
    assert_in_domain(dy, x, rstd, w)
    got, want = rms_norm_backward_triton(dy, x, rstd, w), rms_norm_backward_ref(dy, x, rstd, w)
    assert torch.equal(_bits(got[1]), _bits(want[1])), "dw differs"
    assert torch.equal(rms_norm_backward(dy, x, rstd, w)[1], got[1])  # the dispatch runs the kernel here
    ex, ew = rms_norm_backward_exact(dy, x, rstd, w)
    bx, bw = rms_norm_backward_bound(dy, x, rstd, w, "ours")
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[0].shape == x.shape
    assert_within(got[0], ex, bx, "kernel dx vs exact")
    assert_within(got[1], ew, bw, "kernel dw vs exact")
    assert_within(got[0], want[0], 2 * bx, "kernel dx vs reference")


@pytest.mark.triton
@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("programs", [1, 3, 7, 50])
def test_kernel_bands_follow_the_reference(programs, lanes, triton_device, gen, monkeypatch):
    """Bands that do not divide M (37 rows: 37, 13 + 13 + 11, 6 x 6 + 1, one row each and no empty program), walked
    one row a step (the GPU's launch) or four (lanes that do not divide the bands)."""
    from nvfp4_train.kernels.fused import rms_norm as kernel
    from nvfp4_train.kernels.fused import rms_norm_reference as reference

    for module in (kernel, reference):
        monkeypatch.setattr(module, "rows_per_step", lambda x: lanes)
    dy, x, rstd, w = make_inputs(37, 784, torch.bfloat16, gen, triton_device)
    got = rms_norm_backward_triton(dy, x, rstd, w, programs=programs)
    want = rms_norm_backward_ref(dy, x, rstd, w, programs=programs)
    assert torch.equal(_bits(got[1]), _bits(want[1]))
    bx, bw = rms_norm_backward_bound(dy, x, rstd, w, "ours")
    assert_within(got[0], want[0], 2 * bx, "kernel dx vs reference")
    assert_within(got[1], rms_norm_backward_exact(dy, x, rstd, w)[1], bw, "kernel dw vs exact")


@pytest.mark.triton
def test_kernel_edge_cases(triton_device, gen):
    # no rows: empty dx, zero dw
    x = torch.zeros(0, 784, dtype=torch.bfloat16, device=triton_device)
    w = torch.ones(784, dtype=torch.bfloat16, device=triton_device)
    dx, dw = rms_norm_backward_triton(x, x, torch.zeros(0, device=triton_device), w)
    assert dx.shape == (0, 784) and dw.dtype == torch.bfloat16 and not dw.any()
    # a zero output gradient gives zeros; a weight of another dtype than x
    dy, x, rstd, w = make_inputs(11, 100, torch.bfloat16, gen, triton_device)
    dx, dw = rms_norm_backward_triton(torch.zeros_like(dy), x, rstd, w)
    assert not dx.any() and not dw.any()
    w32 = w.float()
    got, want = rms_norm_backward_triton(dy, x, rstd, w32), rms_norm_backward_ref(dy, x, rstd, w32)
    assert got[1].dtype == torch.float32 and torch.equal(_bits(got[1]), _bits(want[1]))
    assert_within(got[0], want[0], 2 * rms_norm_backward_bound(dy, x, rstd, w32, "ours")[0], "dx, fp32 weight")


# ------------------------------------------------------------------------------------------ against aten on CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 2048), (16384, 768), (37, 784), (512, 5120), (65536, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_against_torch_cuda(shape, dtype, gen):
    """Ours and aten's ``_fused_rms_norm_backward`` (the backward F.rms_norm gets on CUDA), each within its bound of
    the exact gradients, and so within the sum of the two of each other."""
    dy, x, rstd, w = make_inputs(*shape, dtype, gen, "cuda")
    assert_in_domain(dy, x, rstd, w)
    ours = rms_norm_backward_triton(dy, x, rstd, w)
    _, saved = torch.ops.aten._fused_rms_norm(x, [shape[1]], w, EPS)  # rstd in the shape its backward takes
    theirs = torch.ops.aten._fused_rms_norm_backward(dy, x, [shape[1]], saved, w, [True, True])
    ex, ew = rms_norm_backward_exact(dy, x, rstd, w)
    b_ours = rms_norm_backward_bound(dy, x, rstd, w, "ours")
    b_torch = rms_norm_backward_bound(dy, x, rstd, w, "torch_cuda")
    for i, name in enumerate(("dx", "dw")):
        assert ours[i].dtype == theirs[i].dtype
        assert_within(ours[i], (ex, ew)[i], b_ours[i], f"ours {name} vs exact")
        assert_within(theirs[i], (ex, ew)[i], b_torch[i], f"torch's {name} vs exact")
        assert_within(ours[i], theirs[i], b_ours[i] + b_torch[i], f"ours {name} vs torch's")
    again = rms_norm_backward_triton(dy, x, rstd, w)
    assert torch.equal(again[0], ours[0]) and torch.equal(again[1], ours[1])  # the same bits every run


# ------------------------------------------------------------------------------------------ the non-finite check of dy

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
# NaN/±Inf in dy: numpy (the interpreter's arithmetic) warns where IEEE arithmetic gives them
_nonfinite_warnings = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                                 "ignore:overflow encountered:RuntimeWarning")


def _dy_cases(dy: torch.Tensor, programs: int | None, gen: torch.Generator):
    """``(what, dy)``: dy as drawn, then with one NaN, +Inf or -Inf in the first row, the last row or a drawn row of
    the last program's band, at a random column: every pair. Each dy is the head of a buffer whose tail, a
    whole [17, H + 32] past its end, holds NaNs: a masked-out column of the last row, or a row past M, read by
    mistake would be a NaN found."""
    m, h = dy.shape
    band, n_prog = row_bands(dy, m, programs)
    last = range((n_prog - 1) * band, m)
    rows = {"first row": 0, "last row": m - 1,
            "last program": last[int(torch.randint(len(last), (), generator=gen))]}
    cases = [("finite", None, None)] + [(f"{bad} in the {name} ({row})", bad, row) for bad in BAD
                                         for name, row in rows.items()]
    for what, bad, row in cases:
        buf = torch.full((m * h + 17 * (h + 32),), float("nan"), dtype=dy.dtype, device=dy.device)
        d = buf[: m * h].view(m, h)
        d.copy_(dy)
        if bad is not None:
            d[row, int(torch.randint(h, (), generator=gen))] = BAD[bad]
        yield what, d


def _three_checks(dev, gen, clocked: bool, fresh: bool) -> list[NonfiniteCheck]:
    """Three copies of one check (to run it by the kernel, the reference and ``track_nonfinite*_ref``): host clock
    at a random ``now`` with kept None or a time before, after it or NEVER; device clock from a random start with
    kept before it, after it or NEVER."""
    if clocked:
        start = float(int(torch.randint(2**20, (), generator=gen)))
        prev = (start - 1, start + 5, float(NEVER))[int(torch.randint(3, (), generator=gen))]
        return [NonfiniteCheck(torch.tensor(prev, dtype=torch.float64, device=dev), new_arrivals(dev),
                               clock=torch.tensor(start, dtype=torch.float64, device=dev)) for _ in range(3)]
    now = int(torch.randint(2**40, (), generator=gen))
    prev = None if fresh else (now - 3, now + 3, NEVER)[int(torch.randint(3, (), generator=gen))]
    return [NonfiniteCheck(None if prev is None else torch.tensor(float(prev), dtype=torch.float64, device=dev),
                           new_arrivals(dev), now=now) for _ in range(3)]


def _plain_check(c: NonfiniteCheck, t: torch.Tensor) -> None:
    """``c`` of t by ``track_nonfinite_ref`` / ``track_nonfinite_clocked_ref`` themselves."""
    if c.clock is None:
        c.kept = track_nonfinite_ref(c.kept, t, c.now)
    else:
        track_nonfinite_clocked_ref(c.kept, t, c.clock)


def _f64_bits(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.cpu().view(torch.int64))


def _assert_same_check(got: NonfiniteCheck, want: NonfiniteCheck, what: str) -> None:
    """The same kept time and clock, bit for bit (a kept tensor where ``want`` has one: 0-d float64), and the counter
    left zero."""
    assert _f64_bits(got.kept) == _f64_bits(want.kept), (what, got.kept, want.kept)
    assert _f64_bits(got.clock) == _f64_bits(want.clock), (what, got.clock, want.clock)
    if got.kept is not None:
        assert got.kept.dtype == torch.float64 and got.kept.dim() == 0, what
    assert int(got.arrivals.cpu()) == 0, what


def _same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(_bits(p), _bits(q)) for p, q in zip(a, b))


CLOCKS = [("host clock, kept None", False, True), ("host clock, kept given", False, False),
          ("device clock", True, False)]


@_nonfinite_warnings
def test_reference_check_is_the_non_finite_reference(gen):
    """``rms_norm_backward_ref(..., check=c)``: c as ``track_nonfinite*_ref`` of dy leave it; dx and dw unchanged."""
    dy0, x, rstd, w = make_inputs(37, 100, torch.bfloat16, gen)
    for what, dy in _dy_cases(dy0, None, gen):
        plain = rms_norm_backward_ref(dy, x, rstd, w)
        for clock_name, clocked, fresh in CLOCKS:
            c, want, _ = _three_checks("cpu", gen, clocked, fresh)
            assert _same_bits(rms_norm_backward_ref(dy, x, rstd, w, check=c), plain), (what, clock_name)
            _plain_check(want, dy)
            _assert_same_check(c, want, f"{what}, {clock_name}")


@pytest.mark.triton
@_nonfinite_warnings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_kernel_check_is_the_references(dtype, triton_device, gen):
    """37 rows of H = 100 (128 columns loaded, 28 masked) in the interpreter's 4 bands of 10 rows, or bands of a
    drawn program count (1, 3 or 7: bands not dividing M): the kernel's check of dy, on both clocks, kept None or
    given, equals the reference's and ``track_nonfinite*_ref``'s; its dx and dw are the same bits with the check and
    without it, and its dw the reference's."""
    dev = triton_device
    programs = (None, 1, 3, 7)[int(torch.randint(4, (), generator=gen))]
    dy0, x, rstd, w = make_inputs(37, 100, dtype, gen, dev)
    for what, dy in _dy_cases(dy0, programs, gen):
        plain = rms_norm_backward_triton(dy, x, rstd, w, programs=programs)
        assert torch.equal(_bits(plain[1]), _bits(rms_norm_backward_ref(dy, x, rstd, w, programs=programs)[1]))
        for clock_name, clocked, fresh in CLOCKS:
            kc, rc, pc = _three_checks(dev, gen, clocked, fresh)
            got = rms_norm_backward_triton(dy, x, rstd, w, programs=programs, check=kc)
            assert _same_bits(got, plain), f"{what}, {clock_name}: dx or dw changed by the check"
            rms_norm_backward_ref(dy, x, rstd, w, programs=programs, check=rc)
            _plain_check(pc, dy)
            _assert_same_check(kc, rc, f"{what}, {clock_name}, programs={programs}: kernel vs reference")
            _assert_same_check(kc, pc, f"{what}, {clock_name}, programs={programs}: kernel vs track_nonfinite")


@pytest.mark.triton
@_nonfinite_warnings
def test_kernel_check_every_program_arrives(triton_device, gen, monkeypatch):
    """One row per program (37 programs) and one row a step, the GPU's launch: every program's tail arrives once
    (the counter back at 0, the verdict of the last program's row found); a NaN in each program's row in turn
    would be too many launches, so three drawn rows and the last."""
    from nvfp4_train.kernels.fused import rms_norm as kernel
    from nvfp4_train.kernels.fused import rms_norm_reference as reference

    for module in (kernel, reference):
        monkeypatch.setattr(module, "rows_per_step", lambda x: 1)
    dev = triton_device
    dy0, x, rstd, w = make_inputs(37, 16, torch.bfloat16, gen, dev)
    rows = torch.randperm(36, generator=gen)[:3].tolist() + [36]
    for row in rows:
        dy = dy0.clone()
        dy[row, int(torch.randint(16, (), generator=gen))] = BAD[list(BAD)[int(torch.randint(3, (), generator=gen))]]
        for clock_name, clocked, fresh in CLOCKS:
            kc, rc, _ = _three_checks(dev, gen, clocked, fresh)
            got = rms_norm_backward_triton(dy, x, rstd, w, programs=37, check=kc)
            want = rms_norm_backward_ref(dy, x, rstd, w, programs=37, check=rc)
            assert torch.equal(_bits(got[1]), _bits(want[1]))
            _assert_same_check(kc, rc, f"row {row}, {clock_name}")


@pytest.mark.triton
@_nonfinite_warnings  # H = 0: the kernel's c = 0 / 0, never stored
def test_kernel_check_of_an_empty_dy(triton_device):
    """No rows (and no columns): nothing launched for the check; kept None stays None, a kept time stays, the device
    clock still advances by one, as the reference's."""
    dev = triton_device
    for m, h in ((0, 784), (3, 0)):
        dy = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
        w = torch.ones(h, dtype=torch.bfloat16, device=dev)
        rstd = torch.ones(m, device=dev)
        for kept in (None, 5.0):
            checks = [NonfiniteCheck(None if kept is None else torch.tensor(kept, dtype=torch.float64, device=dev),
                                     new_arrivals(dev), now=9) for _ in range(2)]
            dx, dw = rms_norm_backward_triton(dy, dy, rstd, w, check=checks[0])
            rms_norm_backward_ref(dy, dy, rstd, w, check=checks[1])
            assert dx.shape == (m, h) and not dw.any()
            _assert_same_check(checks[0], checks[1], f"[{m}, {h}], host clock, kept {kept}")
            assert _f64_bits(checks[0].kept) == (None if kept is None else _f64_bits(torch.tensor(kept).double()))
        clocks = [torch.tensor(1.0, dtype=torch.float64, device=dev) for _ in range(2)]
        checks = [NonfiniteCheck(torch.tensor(5.0, dtype=torch.float64, device=dev), new_arrivals(dev), clock=c)
                  for c in clocks]
        rms_norm_backward_triton(dy, dy, rstd, w, check=checks[0])
        rms_norm_backward_ref(dy, dy, rstd, w, check=checks[1])
        _assert_same_check(checks[0], checks[1], f"[{m}, {h}], device clock")
        assert float(clocks[0]) == 2.0 and float(checks[0].kept) == 5.0


def test_check_arguments_are_refused():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    r, w = torch.ones(4), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="new_arrivals"):
        rms_norm_backward_triton(x, x, r, w, check=NonfiniteCheck(None, now=1))
    with pytest.raises(ValueError, match="kept is a torch.float32"):
        rms_norm_backward_triton(x, x, r, w, check=NonfiniteCheck(torch.zeros(()), new_arrivals("cpu")))
    with pytest.raises(ValueError, match="the device clock needs"):
        rms_norm_backward_triton(x, x, r, w, check=NonfiniteCheck(None, new_arrivals("cpu"),
                                                                  clock=torch.zeros((), dtype=torch.float64)))


@pytest.mark.skipif(not have_nvidia_tools() or interpret_mode(),
                    reason="compiling for sm_90 needs ptxas / nvdisasm and Triton's compiler, not its interpreter")
def test_kernel_compiles_for_sm90_without_spills_with_and_without_the_check():
    """bf16 at the two models' widths, as launched on the GPU (one row a step; H = 2048 at 8 warps, 768 at 4), on
    any machine: no local-memory loads or stores (spilled registers) with the check or without it, one atomic with
    it (either clock), none without."""
    from nvfp4_train.bench import sass
    from nvfp4_train.kernels.fused import rms_norm as kernel

    signature = dict(dy_ptr="*i16", x_ptr="*i16", rstd_ptr="*fp32", w_ptr="*i16", dx_ptr="*i16", part_ptr="*fp32",
                     M="i32", H="i32", band="i32", kept_ptr="*fp64", clock_ptr="*fp64", arrivals_ptr="*i32",
                     now="i64")
    for h, block_h, num_warps in ((2048, 2048, 8), (768, 1024, 4)):
        for check, clocked in ((False, False), (True, False), (True, True)):
            listing = sass.compile_sass(
                kernel._rms_norm_bwd_kernel, signature,
                dict(BLOCK_H=block_h, ROWS=1, KIND=1, W_KIND=1, NATIVE=True, CHECK=check, CLOCKED=clocked,
                     FRESH=False, NEVER_F=float(NEVER)),
                divisible=[*(k for k in signature if k.endswith("_ptr")), "M", "H"], num_warps=num_warps,
                options=dict(enable_fp_fusion=False))
            ops = sass.count_opcodes(listing)
            assert ops.get("STL", 0) == ops.get("LDL", 0) == 0, (h, check, clocked, "register spills")
            assert ops.get("ATOMG", 0) == int(check), (h, check, clocked)
