"""Error bounds for the Mamba mixer's core (conv + SSD scan + gated RMSNorm, ``ops.mamba_conv_scan_norm``) and the
two GEMMs around it, forward and backward: a running error analysis in float64, for the fused-path tests.

Both the fused op and the unfused ops run the same kernels with the same rounding points (the conv output, the
scan output, the norm output and, backward, the norm's, the scan's and the conv's gradients are stored in the
activations' format; everything inside a kernel is fp32, plus the scan kernel's own lower-precision operands).
So each is within the same bound ``E`` of the exact result computed from the same inputs, and the two differ
by at most ``2 E``. ``E`` is derived stage by stage, every quantity carrying the exact value ``v`` (float64 on
the test's inputs) and a bound ``E_v`` on the computed value's error, ``v^ = |v| + E_v`` bounding both:

- units: ``u = 2^-24`` (fp32 arithmetic), ``u_s`` the format between kernels (bf16 2^-8, fp32 2^-24); storing
  a value whose error before rounding is ``e`` gives ``e + u_s (|v| + e)`` (:func:`rounded`);
- conv: ``pre = bias + sum_k w_k xBC_k`` in fp32 is off by ``(width + 3) u P``, ``P`` the same sum of
  ``|terms|`` (``test_causal_conv1d_cuda_kernel_matches_ref``); silu has slope ``<= 1.1`` and its fp32
  evaluation adds ``4 u |c|``;
- scan: its own error is ``test_mamba_ssd._bound`` (``alpha u mag + beta u seg + k_f u_f mag``, the scan
  kernel's ``k_f`` roundings to ``u_f``: 8 forward, 16 for gradients) on magnitudes taken with every operand at
  its bound ``v^``; its operands' errors enter to first order through the same magnitudes: the output and
  every gradient are sums of products with one factor each of x, B and C (at most), so with ``E_x <= eps_x
  x'``, ``x' = max(x^, E_x / eps_x)`` for any ``eps_x`` (:func:`_relative_unit`), and likewise for B and C,
  they add ``(eps_x + eps_B + eps_C) mag(x', B', C')``; every gradient is linear in the upstream gradient
  g, which adds ``mag`` with g replaced by its error bound (both in one ``mag``: it is linear in g);
- gated norm, per token and group of G channels: ``v = s silu(z)``, ``r = sqrt(mean(v^2) + eps)``,
  ``n = v / r``, ``y = n w``. With ``rho = (sum |v| E_v + sum E_v^2 / 2) / (G r^2)`` the computed ``r~^2``
  is within ``2 rho r^2`` of ``r^2``, so ``|r / r~ - 1| <= kappa = (1 - 2 rho)^(-1/2) - 1`` (+ the fp32
  mean of G squares and the rsqrt, ``(G + 8) u``), and ``|n~ - n| <= (E_v / r)(1 + kappa) + |n| kappa``.
  Backward ``dv = (a - n c1) / r``, ``a = w dy``, ``c1 = mean(n a)``, the same way; ``ds = dv silu(z)``,
  ``dz = dv s silu'(z)``, ``dw = sum over tokens of dy n``;
- conv backward: ``dpre = dc silu'(pre)`` (|silu''| <= 0.5 carries pre's error), then the transposed
  convolution (width terms) and the weight and bias sums over the b l positions: ``K u sum |terms|`` each;
- GEMMs (bf16 operands, fp32 accumulation, no reduced-precision split-K: the tests turn it off): ``out = y Wᵀ``
  is off by ``E_y |W|ᵀ + (K + 2) u y^ |W|ᵀ`` before its rounding, and likewise for the weight and input
  gradients.

The analysis is first order in the operand errors of the conv and the scan (their products, relative
``u_s^2``, are covered by a final slack of 1/16); the norm's is not (it divides by r). It needs ``rho < 1/4``
(:func:`core_bounds` checks). The bound is loose (worst-case signs, ``K u`` rather than ``sqrt(K) u``): in bf16 it
allows ~10% of the core's output and input gradient, far below the O(1) error of a mistake in the plumbing (a
wrong layout, shard, group, gate or eps); the gradients of dt_bias, A and D, sums over every position with much
cancellation, it bounds only loosely in bf16 and to ~1% in fp32 (the tests' Triton tier checks those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nvfp4_train.models.mamba.ops import causal_conv1d_ref
from nvfp4_train.models.mamba.ssd import ssd_chunked_scan
from tests.models.mamba.test_mamba_ssd import _bound, _magnitudes

U = 2.0**-24
SLACK = 1 + 2.0**-4  # the neglected products of two operand errors (relative u_s^2 to the first-order terms)


@dataclass(frozen=True)
class Formats:
    """The rounding units of one implementation of the core."""

    u_s: float  # the format of the tensors between kernels (the activations' dtype)
    u_f: float  # the scan kernel's internal operand format (test_mamba_ssd: bf16 2^-8, TF32 2^-11; fp32 on CPU)
    k_f_fwd: int  # its roundings per term: 8 forward, 16 for gradients (Triton); 0 for the PyTorch chunked scan
    k_f_bwd: int
    triton_softplus: bool  # the Triton kernel's softplus log(exp(s) + 1), relative error u / dt on dt


TRITON_BF16 = Formats(u_s=2.0**-8, u_f=2.0**-8, k_f_fwd=8, k_f_bwd=16, triton_softplus=True)
TRITON_FP32_CUDA = Formats(u_s=U, u_f=2.0**-11, k_f_fwd=8, k_f_bwd=16, triton_softplus=True)  # tl.dot in TF32
TRITON_FP32_INTERPRETER = Formats(u_s=U, u_f=U, k_f_fwd=8, k_f_bwd=16, triton_softplus=True)  # fp32 dots
TORCH_BF16 = Formats(u_s=2.0**-8, u_f=0.0, k_f_fwd=0, k_f_bwd=0, triton_softplus=False)


def rounded(err: torch.Tensor, value: torch.Tensor, u_s: float) -> torch.Tensor:
    """The error bound after storing a value that was off by ``err`` in a format of unit ``u_s``."""
    return err + u_s * (value.abs() + err)


def _silu_slope(v: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(v)
    return sig * (1 + v * (1 - sig))


def _conv_vjp(x, weight, grad):
    """(dx, dweight, dbias) of <causal_conv1d(x, weight, bias), grad> in float64 (x [b, c, l], no activation)."""
    x = x.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device, requires_grad=True)
    out = causal_conv1d_ref(x, w, b, None)
    return torch.autograd.grad(out, (x, w, b), grad.double())


def _relative_unit(err: torch.Tensor, hat: torch.Tensor) -> float:
    """A relative unit eps for an operand's error: then err <= eps * max(hat, err / eps) elementwise, whatever
    eps is; the 90th percentile of err / hat keeps most entries at hat (a tight magnitude)."""
    ratio = torch.where(hat > 0, err / hat, 0.0).flatten()
    return max(ratio.kthvalue(max(1, int(0.9 * ratio.numel()))).values.item(), 2.0**-60)


def _groups(t: torch.Tensor, G: int) -> torch.Tensor:
    return t.unflatten(-1, (-1, G))


def gate_input_mean_square(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, *, headdim: int, ngroups: int,
                           chunk_size: int) -> float:
    """mean((scan output * silu(z))^2): the norm's input's mean square. A test's eps near it keeps the norm
    far from scale invariance (which makes the gradient of D cancel, sum ds x ~ 0) and makes eps matter."""
    f64 = lambda t: None if t is None else t.detach().to(torch.float64)  # noqa: E731
    Z, W, Bc, dtb, A64, D64 = map(f64, (zxbcdt, conv_weight, conv_bias, dt_bias, A, D))
    h, cd = A64.shape[0], W.shape[0]
    d = h * headdim
    z, xbc, dt = torch.split(Z, [d, cd, h], dim=-1)
    c = F.silu(causal_conv1d_ref(xbc.permute(1, 2, 0), W, Bc, None))
    x, B, C = torch.split(c.transpose(1, 2), [d, (cd - d) // 2, (cd - d) // 2], dim=-1)
    y = ssd_chunked_scan(x.unflatten(-1, (h, headdim)), dt.transpose(0, 1), A64, B.unflatten(-1, (ngroups, -1)),
                         C.unflatten(-1, (ngroups, -1)), chunk_size, D=D64, dt_bias=dtb, dt_softplus=True)
    return (y.flatten(-2).transpose(0, 1) * F.silu(z)).square().mean().item()


def core_bounds(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, dy, *, headdim: int, ngroups: int,
                chunk_size: int, eps: float, fmt: Formats) -> tuple[dict, dict]:
    """(exact, bound): the exact output ``"y"`` [s, b, d] and gradients (``"zxbcdt"``, ``"conv_weight"``,
    ``"conv_bias"``, ``"dt_bias"``, ``"A"``, ``"D"``, ``"norm_weight"``) of <y, dy>, in float64 from the given
    (rounded) inputs, and bounds of the same shapes on any implementation's error with formats ``fmt``
    (module docstring). Gradients of dt_bias, A and D are bounded as fp32 results (their casts to the
    parameters' dtype are the caller's)."""
    u_s, dev = fmt.u_s, zxbcdt.device
    f64 = lambda t: None if t is None else t.detach().to(torch.float64)  # noqa: E731
    Z, W, Bc, dtb, A64, D64, NW, DY = map(f64, (zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, dy))
    s, b, _ = Z.shape
    h, width, cd = A64.shape[0], W.shape[1], W.shape[0]
    d = h * headdim
    G, M = d // ngroups, s * b
    n_state = (cd - d) // (2 * ngroups)
    shape = (b, s, h, headdim, ngroups, n_state)

    # ---- the exact forward and backward, float64 autograd with the intermediates kept
    leaves = {k: t.clone().requires_grad_() for k, t in
              dict(zxbcdt=Z, conv_weight=W, dt_bias=dtb, A=A64, D=D64, norm_weight=NW).items()}
    if Bc is not None:
        leaves["conv_bias"] = Bc.clone().requires_grad_()
    z, xbc, dt = torch.split(leaves["zxbcdt"], [d, cd, h], dim=-1)
    xbc_t = xbc.permute(1, 2, 0)  # [b, cd, s]
    pre = causal_conv1d_ref(xbc_t, leaves["conv_weight"], leaves.get("conv_bias"), None)
    pre.retain_grad()
    c = F.silu(pre)
    c.retain_grad()
    x, B, C = torch.split(c.transpose(1, 2), [d, (cd - d) // 2, (cd - d) // 2], dim=-1)
    x4, B4, C4 = x.unflatten(-1, (h, headdim)), B.unflatten(-1, (ngroups, -1)), C.unflatten(-1, (ngroups, -1))
    y_scan = ssd_chunked_scan(x4, dt.transpose(0, 1), leaves["A"], B4, C4, chunk_size, D=leaves["D"],
                              dt_bias=leaves["dt_bias"], dt_softplus=True)
    y_scan.retain_grad()
    sv = y_scan.flatten(-2).transpose(0, 1)  # [s, b, d]
    g = F.silu(z)
    v = sv * g
    r = torch.sqrt(_groups(v, G).square().mean(-1, keepdim=True) + eps)  # [s, b, ngroups, 1]
    n = (_groups(v, G) / r).flatten(-2)
    y = n * leaves["norm_weight"]
    grads = torch.autograd.grad(y, list(leaves.values()), DY, retain_graph=True)
    exact = {"y": y.detach(), **{k: gr for k, gr in zip(leaves, grads)}}
    # the intermediates' gradients (d loss / d scan output, d loss / d conv output and pre-activation)
    ds_scan, dc, dpre = torch.autograd.grad(y, (y_scan, c, pre), DY)
    s_, g_, v_, r_, n_ = (t.detach() for t in (sv, g, v, r, n))
    z_, pre_, xbc_ = z.detach(), pre.detach(), xbc_t.detach()

    # ---- forward: conv + silu
    P = causal_conv1d_ref(xbc_.abs(), W.abs(), None if Bc is None else Bc.abs(), None)
    c_ = c.detach()
    E_c = rounded(1.1 * (width + 3) * U * P + 4 * U * c_.abs(), c_, u_s)  # [b, cd, s]
    c_hat = c_.abs() + E_c
    parts = lambda t: torch.split(t.transpose(1, 2), [d, (cd - d) // 2, (cd - d) // 2], dim=-1)  # noqa: E731
    eps_xBC = [_relative_unit(e, v) for e, v in zip(parts(E_c), parts(c_hat))]
    c_chk = torch.cat([torch.maximum(v, e / r) for e, v, r in zip(parts(E_c), parts(c_hat), eps_xBC)],
                      dim=-1).transpose(1, 2)

    def scan_mags(cv, gout):
        xx, BB, CC = parts(cv)
        inp = dict(x=xx.unflatten(-1, (h, headdim)), dt=dt.detach().transpose(0, 1), A=A64,
                   B=BB.unflatten(-1, (ngroups, -1)), C=CC.unflatten(-1, (ngroups, -1)), D=D64, z=None,
                   dt_bias=dtb, initial_states=None)
        return _magnitudes(inp, gout, torch.zeros(b, h, headdim, n_state, dtype=torch.float64, device=dev), dev)

    # ---- forward: the scan (own error with operands at their bounds; operand errors to first order)
    def own(m, key, k_f):
        return _bound(m, key, shape, chunk_size, U, k_f=k_f, u_f=fmt.u_f, log_exp_softplus=fmt.triton_softplus)

    m_fwd = scan_mags(c_chk, ds_scan.abs())  # (the gradient magnitudes are not used: gout is not known yet)
    E_s_scan = rounded(own(m_fwd, "out", fmt.k_f_fwd) + sum(eps_xBC) * m_fwd.mag["out"], y_scan.detach(), u_s)
    E_s = E_s_scan.flatten(-2).transpose(0, 1)  # [s, b, d]
    s_hat = s_.abs() + E_s

    # ---- forward: gated RMSNorm
    E_g = 4 * U * g_.abs()
    E_v = g_.abs() * E_s + 6 * U * s_hat * g_.abs()
    vg, Evg = _groups(v_, G), _groups(E_v, G)
    rho = ((vg.abs() * Evg).sum(-1, keepdim=True) + Evg.square().sum(-1, keepdim=True) / 2) / (G * r_.square())
    if rho.max() >= 0.25:
        raise AssertionError(f"the norm's linearisation needs rho < 1/4, got {rho.max().item():.3g}: the scan's "
                             f"bound is too large against the group's rms")
    kappa = (1 - 2 * rho).rsqrt() - 1 + (G + 8) * U
    E_n = ((Evg / r_) * (1 + kappa) + _groups(n_.abs(), G) * kappa).flatten(-2) + U * n_.abs()
    n_hat = n_.abs() + E_n
    E_y = rounded(NW.abs() * E_n + U * (n_ * NW).abs(), exact["y"], u_s)

    # ---- backward: gated RMSNorm
    a = NW * DY
    c1 = (_groups(n_, G) * _groups(a, G)).mean(-1, keepdim=True)
    E_c1 = (_groups(E_n * a.abs(), G).mean(-1, keepdim=True)
            + (G + 4) * U * (_groups(n_hat * a.abs(), G)).mean(-1, keepdim=True))
    dv = ((_groups(a, G) - _groups(n_, G) * c1) / r_).flatten(-2)
    E_num = (_groups(E_n, G) * c1.abs() + _groups(n_hat, G) * E_c1
             + 2 * U * (_groups(a.abs(), G) + _groups(n_hat, G) * (c1.abs() + E_c1)))
    E_dv = ((E_num / r_) * (1 + kappa) + _groups(dv.abs(), G) * kappa).flatten(-2) + U * dv.abs()
    dv_hat = dv.abs() + E_dv
    ds = dv * g_
    E_ds = rounded(g_.abs() * E_dv + (E_g + U * g_.abs()) * dv_hat, ds, u_s)
    sp = _silu_slope(z_)
    sig = torch.sigmoid(z_)
    E_sp = 8 * U * sig * (1 + z_.abs() * (1 - sig))
    dz = dv * s_ * sp
    E_dz = rounded((s_.abs() * sp.abs()) * E_dv + dv_hat * sp.abs() * E_s + dv_hat * s_hat * (E_sp + 2 * U * sp.abs()),
                    dz, u_s)
    E_dnw = rounded((DY.abs() * E_n).sum((0, 1)) + (M + 2) * U * (DY.abs() * n_hat).sum((0, 1)),
                     exact["norm_weight"], u_s)

    # ---- backward: the scan
    ds4 = ds.transpose(0, 1).unflatten(-1, (h, headdim))
    E_ds4 = E_ds.transpose(0, 1).unflatten(-1, (h, headdim))
    g_hat = ds4.abs() + E_ds4
    m_own = scan_mags(c_hat, g_hat)
    # every gradient term is linear in the upstream gradient: x, B, C's errors (sum(eps) |ds|) and ds's own
    # error (E_ds) enter through one set of magnitudes
    m_prop = scan_mags(c_chk, sum(eps_xBC) * g_hat + E_ds4)
    E_grad = {k: SLACK * (own(m_own, k, fmt.k_f_bwd) + m_prop.mag[k])
              for k in ("x", "B", "C", "dt", "A", "D", "dt_bias")}
    E_dc = torch.cat([E_grad["x"].flatten(-2), E_grad["B"].flatten(-2), E_grad["C"].flatten(-2)], dim=-1)
    E_dc = rounded(E_dc.transpose(1, 2), dc, u_s)  # [b, cd, s], stored in the activations' format
    E_ddt = rounded(E_grad["dt"], exact["zxbcdt"][..., d + cd:].transpose(0, 1), u_s).transpose(0, 1)

    # ---- backward: conv (silu' carries pre's error with |silu''| <= 1/2)
    sp_pre = _silu_slope(pre_)
    sig_pre = torch.sigmoid(pre_)
    E_sp_pre = 0.5 * (width + 3) * U * P + 8 * U * sig_pre * (1 + pre_.abs() * (1 - sig_pre))
    E_dpre = sp_pre.abs() * E_dc + (dc.abs() + E_dc) * (E_sp_pre + U * sp_pre.abs())
    dpre_hat = dpre.abs() + E_dpre
    prop = _conv_vjp(xbc_.abs(), W.abs(), E_dpre)
    arith = _conv_vjp(xbc_.abs(), W.abs(), dpre_hat)
    E_dxbc = rounded(prop[0] + (width + 2) * U * arith[0], exact["zxbcdt"][..., d:d + cd].permute(1, 2, 0), u_s)
    E_dw = rounded(prop[1] + (M + 2) * U * arith[1], exact["conv_weight"], u_s)

    bound = {
        "y": SLACK * E_y,
        "zxbcdt": SLACK * torch.cat([E_dz, E_dxbc.permute(2, 0, 1), E_ddt], dim=-1),
        "conv_weight": SLACK * E_dw,
        "norm_weight": SLACK * E_dnw,
        **{k: rounded(E_grad[k], exact[k], U) for k in ("dt_bias", "A", "D")},
    }
    if Bc is not None:
        bound["conv_bias"] = SLACK * rounded(prop[2] + (M + 2) * U * arith[2], exact["conv_bias"], u_s)
    return exact, bound


def gemm_bound(a, E_a, b, *, u_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) for ``a @ b`` computed from an ``a`` off by ``E_a`` and an exact ``b`` (fp32 accumulation
    over K, stored with unit ``u_s``): ``E_a |b| + (K + 2) u a^ |b|``, then the rounding."""
    a, E_a, b = a.double(), E_a.double(), b.double()
    exact = a @ b
    err = E_a @ b.abs() + (a.shape[-1] + 2) * U * ((a.abs() + E_a) @ b.abs())
    return exact, rounded(err, exact, u_s)


def bound_used(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest |got - want| / bound (0 where the two agree exactly, also where the bound is 0)."""
    err = (got.double() - want.double()).abs()
    return torch.where(err == 0, 0.0, err / bound).max().item()


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """|got - want| <= bound elementwise; returns the largest fraction of the bound used."""
    used = bound_used(got, want, bound)
    err = (got.double() - want.double()).abs()
    assert used <= 1.0, (f"{name}: error exceeds its bound by {used:.3g}x (max error {err.max().item():.3g}, "
                         f"max |value| {want.double().abs().max().item():.3g})")
    return used


def median_relative_bound(bound: torch.Tensor, value: torch.Tensor) -> float:
    """The median of bound / |value| over entries with |value| above 1/100 of the largest: how much of a value
    the bound allows (a mistake in the plumbing changes values by O(1))."""
    v = value.double().abs()
    keep = v > 0.01 * v.max()
    return (bound.double()[keep] / v[keep]).median().item() if keep.any() else math.inf
