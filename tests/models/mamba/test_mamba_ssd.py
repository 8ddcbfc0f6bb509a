"""The SSD scan: the PyTorch chunked scan against the sequential recurrence (CPU), and mamba-ssm's Triton
kernels against both (under the Triton interpreter, and natively on a GPU).

Error bounds (one derivation serves every comparison here). In the standard model of floating-point
arithmetic (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 2-3) each operation is exact up to
a factor (1 + d), |d| <= u (u = 2^-24 in float32, 2^-53 in float64), and a computed sum of K terms, each a
product carrying m such factors, is off by at most gamma_{K+m} * sum|terms|, gamma_k = k u / (1 - k u).
Every output and every gradient entry of the scan is such a sum, so the error is measured not against the
value but against ``mag``: the same recurrence in float64 with every factor (and, for gradients, every
partial derivative) replaced by its absolute value -- ``_magnitudes`` below. Counting for the chunked scan
with chunk Q, nc chunks, state n, head dim p, r heads per group:
  - sums: over the state (n), over the chunk's positions (Q), over chunks in state passing (nc + 1);
  - elementwise: bias add, softplus (relative condition <= kappa = 1 + max|dt + dt_bias|), x A, exp, x dt,
    x (C.B), x x, x decay, + D x, silu, x gate: <= 12 + kappa;
  - decay exponents: a segment sum of dA over <= Q positions, then over <= nc chunk totals, plus the
    chunk-local prefix (<= Q): absolute error <= (2Q + nc) u sigma, sigma = the sum of |dA| over the
    decay's segment, which is the relative error it puts on that term. ``seg`` = sum |terms| sigma.
  => |y - y_ref| <= alpha u mag + beta u seg,  alpha = n + Q + nc + 13 + kappa,  beta = 2Q + nc.
Autograd's backward forms the same products again and contracts over the same ranges plus p (dt, A), r
(B, C shared by a group) and the batch x time reductions of A, D and dt_bias:
  => for gradients alpha_grad = 2 alpha + p + r + b l, beta_grad = 2 beta.
The bounds are loose (errors grow like sqrt(K) u in practice, not K u: the chunked scan used <= 10% of
them, Triton under the interpreter <= 10%, over 30 and 12 seeds), yet they stay within a few % of mag,
far below the O(1) relative error of a bug; the float64 run of the same test (u = 2^-53) checks the
algorithm itself to ~1e-13.
mamba-ssm's kernels add, per term, k_f roundings to a lower format of unit u_f (TF32 tl.dot operands on
CUDA for fp32 inputs, u_f = 2^-11; bf16 intermediates for bf16 inputs, u_f = 2^-8): the (C.B) decay dt
tile and x for the diagonal dot, x and B decay dt for the chunk states, the passed states, C and the state
for the off-diagonal dot, and the output: k_f = 8 forward, 16 for gradients (the backward kernels also
re-round dout, the states and their own dot operands). Their fp32 softplus log(exp(s) + 1) also has a
relative error u / dt on dt (see ``_bound``).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from nvfp4_train.models.mamba.ops import init_A_log, init_dt_bias, ssd_scan
from nvfp4_train.models.mamba.ssd import ssd_chunked_scan, ssd_sequential_ref

U = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8}
GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _inputs(gen, b, l, h, p, g, n, *, dtype=torch.float32, D_hdim=False, with_z=True, with_init=False):
    """Mamba-2-like draws: dt_bias from Mamba-2's init (softplus in [1e-3, 0.1]), A = -exp(A_log) in
    [-16, -1], dt noise around it, unit-variance x, B, C, z."""
    pdt = torch.float64 if dtype == torch.float64 else torch.float32  # A, D, dt_bias: fp32 as in the mixer

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return dict(
        x=randn(b, l, h, p),
        dt=(0.7 * torch.randn(b, l, h, generator=gen)).to(dtype),
        A=-torch.exp(init_A_log(h, generator=gen)).to(pdt),
        B=randn(b, l, g, n),
        C=randn(b, l, g, n),
        D=(1 + 0.5 * torch.randn(*((h, p) if D_hdim else (h,)), generator=gen)).to(pdt),
        z=randn(b, l, h, p) if with_z else None,
        dt_bias=init_dt_bias(h, generator=gen).to(pdt),
        initial_states=torch.randn(b, h, p, n, generator=gen).to(pdt) if with_init else None,
    )


def _leaves(inp, dtype=None, device=None):
    """Fresh leaf copies (optionally converted) that require grad."""
    return {k: None if v is None else v.detach().to(device=device, dtype=dtype or v.dtype).requires_grad_()
            for k, v in inp.items()}


def _run(fn, inp, gout, gfinal, **kw):
    """Output, final state and the gradients of <out, gout> + <final, gfinal> for the given scan."""
    out, final = fn(**inp, dt_softplus=True, return_final_states=True, **kw)
    keys = [k for k in GRAD_NAMES if inp.get(k) is not None]
    loss = (out.double() * gout).sum() + (final.double() * gfinal).sum()
    grads = torch.autograd.grad(loss, [inp[k] for k in keys])
    return out.detach(), final.detach(), dict(zip(keys, (g.detach() for g in grads)))


@dataclass
class _Mag:
    """Magnitudes for the error bounds (module docstring), keyed "out", "final" and by gradient name."""

    mag: dict  # sum |terms|
    seg: dict  # sum |terms| * (sum of |dA| over the term's decay segment)
    kappa: float  # 1 + max |dt + dt_bias|: softplus's relative condition
    inv_dt: float  # 1 / min dt
    A_l: float  # l * max |A|


def _magnitudes(inp, gout, gfinal, device="cpu") -> _Mag:
    """float64 sums of |terms| for the output, the final state and each gradient (module docstring).

    The recurrence with |x|, |B|, |C|, |D|, |initial state|, |silu(z)| and |upstream gradients|; dt enters
    twice, as the input factor dt_t (leaf ``dt_in``) and in the decay exp(dt_t A), written exp(-A w_t) with
    the leaf w = -dt, so that both partial derivatives |A| decay and dt decay come out non-negative.
    Alongside the state S runs N = sum_j decay(t, j) sigma(t, j) (input j), sigma(t, j) = |dA_{j+1}| + ... +
    |dA_t| (the decay's segment), by N_t = a_t (N_{t-1} + |dA_t| S_{t-1}); sigma is held constant under
    differentiation, so the gradients of the N-weighted loss are the gradient terms' magnitudes times sigma.
    """
    d = {k: None if v is None else v.detach().to(device, torch.float64) for k, v in inp.items()}
    gout, gfinal = gout.to(device).abs(), gfinal.to(device).abs()
    b, l, h, p = d["x"].shape
    r = h // d["B"].shape[2]
    s = d["dt"] + d["dt_bias"]
    dt = F.softplus(s)
    abs_dA = (dt * d["A"].abs()).detach()
    leaf = {
        "x": d["x"].abs(), "B": d["B"].abs(), "C": d["C"].abs(), "D": d["D"].abs(), "A": d["A"].clone(),
        "dt_in": dt.clone(), "w": -dt,
        "initial_states": None if d["initial_states"] is None else d["initial_states"].abs(),
    }
    for v in leaf.values():
        if v is not None:
            v.requires_grad_()
    Bh, Ch = leaf["B"].repeat_interleave(r, 2), leaf["C"].repeat_interleave(r, 2)
    S = leaf["initial_states"]
    if S is None:
        S = Bh.new_zeros(b, h, p, Bh.shape[-1])
    N = torch.zeros_like(S)
    ys, ns = [], []
    for t in range(l):
        decay = torch.exp(-leaf["A"] * leaf["w"][:, t])[..., None, None]
        N = decay * (N + abs_dA[:, t, :, None, None] * S)
        S = decay * S + (leaf["dt_in"][:, t, :, None] * leaf["x"][:, t]).unsqueeze(-1) * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
        ns.append(torch.einsum("bhpn,bhn->bhp", N, Ch[:, t]))
    Dx = leaf["D"][:, None] if leaf["D"].dim() == 1 else leaf["D"]
    y, yN = torch.stack(ys, 1) + Dx * leaf["x"], torch.stack(ns, 1)  # D x has no decay: sigma = 0
    gate = dgate = 1.0
    if d["z"] is not None:
        sig = torch.sigmoid(d["z"])
        gate = (d["z"] * sig).abs()
        dgate = sig * (1 + d["z"].abs() * (1 - sig))  # silu' = sig (1 + z (1 - sig)), which cancels at z = -1.28
    names = [k for k, v in leaf.items() if v is not None]
    result = []
    for pre, fin in ((y, S), (yN, N)):
        out_ = pre * gate
        loss = (out_ * gout).sum() + (fin * gfinal).sum()
        grads = torch.autograd.grad(loss, [leaf[k] for k in names], retain_graph=True, allow_unused=True)
        grads = {k: torch.zeros_like(leaf[k]) if g_ is None else g_ for k, g_ in zip(names, grads)}  # D in N
        ddt = (grads.pop("dt_in") + grads.pop("w")) * torch.sigmoid(s)  # through softplus: sigmoid > 0
        m = dict(grads, out=out_.detach(), final=fin.detach(), dt=ddt, dt_bias=ddt.sum((0, 1)))
        if d["z"] is not None:
            m["z"] = pre.detach() * dgate * gout  # not out_ / gate: randn draws exact zeros of z
        result.append(m)
    return _Mag(*result, kappa=1 + s.abs().max().item(), inv_dt=1 / dt.min().item(),
                A_l=l * d["A"].abs().max().item())


def _bound(m: _Mag, key, shape, Q, u, *, k_f=0, u_f=0.0, log_exp_softplus=False):
    """The bound on |computed - exact| for m's entry ``key`` (module docstring): ``alpha u mag +
    beta u seg + k_f u_f mag``. ``log_exp_softplus``: mamba-ssm's kernel computes softplus as
    log(exp(s) + 1) in fp32, whose rounding of exp(s) + 1 is an absolute error u in the log, i.e. a relative
    error u / dt on dt: on the input factor dt_j (<= 1 / min dt) and summed along a segment in the exponent
    (|A| dt_k * u / dt_k per position: <= l max|A|)."""
    b, l, h, p, g, n = shape
    nc = -(-l // Q)
    alpha = n + Q + nc + 13 + m.kappa + (m.inv_dt + m.A_l if log_exp_softplus else 0.0)
    beta = 2 * Q + nc
    if key not in ("out", "final"):
        alpha, beta = 2 * alpha + p + h // g + b * l, 2 * beta
    return (alpha * u + k_f * u_f) * m.mag[key] + beta * u * m.seg[key]


def _assert_within(name, got, ref, bound):
    err = (got.double() - ref.double()).abs()
    # an exact result where the bound is 0 (e.g. out = 0 where z = 0 exactly: randn does draw exact zeros)
    worst = torch.where(err == 0, 0.0, err / bound).max().item()
    assert worst <= 1.0, f"{name}: error exceeds its bound by {worst:.3g}x (max error {err.max().item():.3g})"
    return worst


# ------------------------------------------------------------------------------------------ CPU tier

SHAPES = {  # (b, l, h, p, g, n): odd sizes, seq not a multiple of the chunk, groups < heads
    "odd": (2, 37, 6, 5, 2, 7),
    "one_group": (1, 50, 4, 3, 1, 9),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape_name,Q,D_hdim,with_z,with_init",
    [("odd", 16, False, True, False), ("odd", 8, True, False, True), ("one_group", 16, True, True, True),
     ("odd", 64, False, True, True)],  # Q = 64 > l: a single padded chunk
)
def test_chunked_matches_sequential_fp64(gen, dtype, shape_name, Q, D_hdim, with_z, with_init):
    shape = SHAPES[shape_name]
    inp = _inputs(gen, *shape, dtype=dtype, D_hdim=D_hdim, with_z=with_z, with_init=with_init)
    b, l, h, p, g, n = shape
    gout = torch.randn(b, l, h, p, generator=gen, dtype=torch.float64)
    gfinal = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)

    out, final, grads = _run(ssd_chunked_scan, _leaves(inp), gout, gfinal, chunk_size=Q)
    ref_out, ref_final, ref_grads = _run(ssd_sequential_ref, _leaves(inp, torch.float64), gout, gfinal)
    m = _magnitudes(inp, gout, gfinal)

    assert out.dtype == dtype and final.dtype == dtype and grads["x"].dtype == dtype
    u = U[dtype]
    _assert_within("out", out, ref_out, _bound(m, "out", shape, Q, u))
    _assert_within("final state", final, ref_final, _bound(m, "final", shape, Q, u))
    assert set(grads) == set(ref_grads)
    for k in grads:
        _assert_within(f"d{k}", grads[k], ref_grads[k], _bound(m, k, shape, Q, u))


def test_chunked_bf16_inputs_compute_in_fp32(gen):
    """bf16 in, bf16 out: only the final rounding of the output (2^-8 |y|) on top of the fp32 bound."""
    shape = SHAPES["odd"]
    inp = _inputs(gen, *shape, dtype=torch.bfloat16)
    out = ssd_chunked_scan(**inp, chunk_size=16, dt_softplus=True)
    ref = ssd_sequential_ref(**{k: v if v is None else v.double() for k, v in inp.items()}, dt_softplus=True)
    b, l, h, p, g, n = shape
    zeros = (torch.zeros(b, l, h, p, dtype=torch.float64), torch.zeros(b, h, p, n, dtype=torch.float64))
    m = _magnitudes(inp, *zeros)
    assert out.dtype == torch.bfloat16
    _assert_within("out", out, ref, U[torch.bfloat16] * ref.abs() + _bound(m, "out", shape, 16, U[torch.float32]))


def test_sequential_ref_two_steps_by_hand(gen):
    """The reference itself, at l = 2, against the recurrence written out (head i reads group i // (h/g))."""
    b, l, h, p, g, n = 1, 2, 4, 3, 2, 5
    inp = _inputs(gen, b, l, h, p, g, n, dtype=torch.float64, with_z=False)
    x, dt, A, B, C, D = (inp[k] for k in ("x", "dt", "A", "B", "C", "D"))
    y = ssd_sequential_ref(x, dt, A, B, C, D=D)  # no softplus: dt used as given, clamped at 0
    dtc = dt.clamp(min=0)
    for i in range(h):
        gi = i // (h // g)
        cb = lambda s, t: (C[0, s, gi] @ B[0, t, gi])  # noqa: E731
        y0 = dtc[0, 0, i] * cb(0, 0) * x[0, 0, i] + D[i] * x[0, 0, i]
        y1 = (torch.exp(dtc[0, 1, i] * A[i]) * dtc[0, 0, i] * cb(1, 0) * x[0, 0, i]
              + dtc[0, 1, i] * cb(1, 1) * x[0, 1, i] + D[i] * x[0, 1, i])
        torch.testing.assert_close(y[0, 0, i], y0, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(y[0, 1, i], y1, rtol=1e-14, atol=1e-14)


def test_dt_processing_is_bias_softplus_clamp(gen):
    """dt_bias, dt_softplus and dt_limit mean clamp(softplus(dt + dt_bias), *dt_limit), and the default
    limit (0, inf) clamps a raw negative dt to 0 (as mamba's kernel does)."""
    inp = _inputs(gen, *SHAPES["odd"], dtype=torch.float64)
    dt, bias = inp.pop("dt"), inp.pop("dt_bias")
    lim = (0.02, 0.08)
    got = ssd_chunked_scan(**inp, dt=dt, dt_bias=bias, chunk_size=16, dt_softplus=True, dt_limit=lim)
    want = ssd_chunked_scan(**inp, dt=F.softplus(dt + bias).clamp(*lim), chunk_size=16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = ssd_chunked_scan(**inp, dt=dt, chunk_size=16)
    want = ssd_chunked_scan(**inp, dt=dt.clamp(min=0), chunk_size=16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("l,Q", [(1, 16), (16, 16), (32, 16), (5, 1)])
def test_chunked_edge_lengths(gen, l, Q):
    """One position, exact multiples of the chunk, chunk size 1."""
    inp = _inputs(gen, 2, l, 4, 3, 2, 5, dtype=torch.float64, with_init=True)
    out, fin = ssd_chunked_scan(**inp, chunk_size=Q, dt_softplus=True, return_final_states=True)
    ref, ref_fin = ssd_sequential_ref(**inp, dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fin, ref_fin, rtol=1e-12, atol=1e-12)


def test_zero_input_gives_exact_zero(gen):
    inp = _inputs(gen, *SHAPES["odd"])
    inp["x"] = torch.zeros_like(inp["x"])
    out = ssd_chunked_scan(**inp, chunk_size=16, dt_softplus=True)
    assert torch.equal(out, torch.zeros_like(out))


def test_shape_errors_name_the_shapes(gen):
    inp = _inputs(gen, *SHAPES["odd"])
    five_heads = dict(x=inp["x"][:, :, :5], dt=inp["dt"][..., :5], A=inp["A"][:5], B=inp["B"], C=inp["C"])
    with pytest.raises(ValueError, match=r"nheads \(5\) must be a multiple of ngroups \(2\)"):
        ssd_chunked_scan(**five_heads, chunk_size=16)
    with pytest.raises(ValueError, match="dt must be"):
        ssd_chunked_scan(**{**inp, "dt": inp["dt"][:, :-1]}, chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked_scan(**inp, chunk_size=0)


def test_ssd_scan_dispatch_on_cpu_is_the_chunked_scan(gen):
    inp = _inputs(gen, *SHAPES["odd"])
    got = ssd_scan(**inp, chunk_size=16, dt_softplus=True)
    want = ssd_chunked_scan(**inp, chunk_size=16, dt_softplus=True)
    assert torch.equal(got, want)


# ----------------------------------------------------------------- mamba-ssm's Triton kernels

def _mamba_scan():
    from nvfp4_train.models.mamba._import import load_mamba_ssm

    ops, reason = load_mamba_ssm()
    if ops is None:
        pytest.skip(reason)
    return lambda **kw: ops.mamba_chunk_scan_combined(**kw)


def _interpreter_cuda_standins(monkeypatch):
    """mamba-ssm's launchers enter ``torch.cuda.device(t.device.index)`` and read the SM count; on CPU under
    TRITON_INTERPRET=1 those become a no-op context and a made-up count (4), for this test only."""
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev=None: types.SimpleNamespace(multi_processor_count=4))


def _compare_triton(gen, device, shape, Q, dtype, u_fmt, *, report=None):
    """Triton kernel and PyTorch chunked scan on ``device`` vs the sequential float64 reference."""
    b, l, h, p, g, n = shape
    inp = _inputs(gen, *shape, dtype=dtype, D_hdim=False, with_z=True, with_init=True)
    inp["initial_states"] = inp["initial_states"].to(dtype)
    gout = torch.randn(b, l, h, p, generator=gen, dtype=torch.float64).to(device)
    gfinal = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64).to(device)
    mamba = _mamba_scan()
    m = _magnitudes(inp, gout, gfinal, device)
    ref_out, ref_final, ref_grads = _run(ssd_sequential_ref, _leaves(inp, torch.float64, device), gout, gfinal)
    u32 = U[torch.float32]
    round_out = U[torch.bfloat16] if dtype == torch.bfloat16 else 0.0  # rounding of bf16 results
    # with bf16 inputs the output is bf16, so autograd hands the scan gout rounded to bf16: every term of a
    # gradient carries that relative error, |error| <= u_bf16 * (sum of |terms|) = u_bf16 * mag
    round_gout = U[torch.bfloat16] if dtype == torch.bfloat16 else 0.0
    worst = {}
    for name, fn, k_f in (("triton", mamba, 8), ("torch", ssd_chunked_scan, 0)):
        out, final, grads = _run(fn, _leaves(inp, None, device), gout, gfinal, chunk_size=Q)
        # Triton: k_f roundings to the format (TF32 dot operands / bf16 intermediates), twice as many for
        # gradients, and its softplus; both paths: the fp32 arithmetic and the rounding of bf16 results
        for key, got, ref in [("out", out, ref_out), ("final", final, ref_final)] + [
                (k, grads[k], ref_grads[k]) for k in grads]:
            bound = _bound(m, key, shape, Q, u32, k_f=k_f if key in ("out", "final") else 2 * k_f, u_f=u_fmt,
                           log_exp_softplus=name == "triton")
            if key not in ("out", "final"):
                bound = bound + round_gout * m.mag[key]
            worst[name, key] = _assert_within(f"{name} {key}", got, ref, bound + round_out * ref.double().abs())
    if report is not None:
        report.update(worst)
    return worst


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:Deterministic mode")
def test_mamba_triton_scan_fp32(gen, triton_device, monkeypatch):
    """mamba-ssm's Triton SSD forward and backward (skipped without mamba-ssm). Under the interpreter (CPU)
    in float32 only, its bf16 tl.dot being wrong there; natively on CUDA, tl.dot on fp32 runs in TF32."""
    # pick the cheapest autotune config instead of benchmarking them all (read when mamba-ssm is imported)
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    u_fmt = U[torch.float32] if triton_device == "cpu" else 2.0**-11
    if triton_device == "cpu":
        _interpreter_cuda_standins(monkeypatch)
    _compare_triton(gen, triton_device, (1, 40, 4, 8, 2, 16), 16, torch.float32, u_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,Q", [((2, 300, 8, 64, 2, 64), 64), ((1, 1000, 16, 80, 1, 128), 256)],
                         ids=["small", "12b_heads"])
def test_mamba_triton_scan_matches_torch_on_gpu(gen, dtype, shape, Q):
    """On CUDA: Triton (TF32 dots for fp32, bf16 intermediates for bf16) and the PyTorch chunked scan both
    within their bounds of the float64 sequential recurrence; 12b_heads has the 12B's head dim 80, state
    128 and 16 heads per group, with l not a multiple of the chunk."""
    u_fmt = 2.0**-11 if dtype == torch.float32 else U[torch.bfloat16]
    report = {}
    _compare_triton(gen, "cuda", shape, Q, dtype, u_fmt, report=report)
    print({f"{a}:{b}": round(v, 4) for (a, b), v in report.items()})  # fraction of the bound used
    # the dispatch picks the Triton kernel for CUDA tensors
    inp = {k: v if v is None else v.cuda() for k, v in _inputs(gen, *shape, dtype=dtype).items()}
    mamba = _mamba_scan()
    assert torch.equal(ssd_scan(**inp, chunk_size=Q, dt_softplus=True),
                       mamba(**inp, chunk_size=Q, dt_softplus=True))
