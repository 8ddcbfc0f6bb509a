"""RMSNorm's backward in PyTorch: the arithmetic of ``kernels/fused/rms_norm.py``, operation by operation, and the
error bound that it, the kernel and torch's own backwards meet.

The forward is torch's (``torch.ops.aten._fused_rms_norm(x, [H], w, eps)``, what ``F.rms_norm`` runs): per row of
x [M, H], ``r = rsqrt(mean(x^2) + eps)`` in fp32 (returned as ``rstd``) and ``y = R(fl(fl(x * r) * w))``. Its
gradients for the output gradient dy, at that r (the saved fp32 value), are exactly

    dx = r * (g - xh * S / H)          xh = x * r,  g = dy * w,  S = sum_j g_j * xh_j   (per row)
    dw = sum_i dy_i * xh_i             (over the M rows)

and the reference computes them in fp32 (fl: one fp32 rounding; x, dy, w are read exactly as fp32; R rounds to
nearest-even to the output's dtype, x's for dx and w's for dw):

    xh = fl(x * r)   g = fl(dy * w)   S = torch.sum over the row of fl(g * xh)   c = fl(S / H)
    dx = R(fl(r * fl(g - fl(xh * c))))
    q  = fl(dy * xh);  partial P_(b,k) = (((+0 + q_first) + q_next) + ...) over the rows of band b that are
                       k mod L from the band's start (its lane k), in row order
    dw = R(sum of the P_(b,k))   (torch.sum over dim 0 of the [programs * L, H] fp32 partials)

Row bands (:func:`row_bands`): ``persistent_grid(x, M)`` asks for ``programs0`` programs (4 per multiprocessor of
x's GPU; 4 under the interpreter and on CPU); each takes ``band = ceil(M / programs0)`` consecutive rows, so
``programs = ceil(M / band)`` bands, the last one possibly shorter. A program walks its band L rows per step
(:func:`rows_per_step`: 1 on the GPU; 16 elsewhere: the interpreter pays per operation, not per element), and
each of the L lanes keeps its own partial. The reference pads the rows with +0, which adds nothing: a partial starts
at +0 and is never -0 (``+0 + -0`` and ``a + -a`` are +0 under round-to-nearest), so ``P + (+0)`` is P bit for bit.
The kernel's bands and lanes are the same, so its weight gradient is the reference's bit for bit; its row sum S is a
``tl.sum`` (a tree the compiler shapes), so dx is within the bound of :func:`rms_norm_backward_bound`, not bitwise.

The bound (``docs/numerics.md``, "Fused step"; derived in ``tests/kernels/test_rms_norm.py``): with u = 2^-24,
gamma_n = n u / (1 - n u), every fp32 sum of n terms, in any order, is within gamma_(n-1) * sum |terms| of the exact
sum, and a chain of k roundings multiplies by (1 + theta_k), |theta_k| <= gamma_k. Each implementation computes

    dx = r g (1 + theta_a) - (r xh / H) * sum_j p_j (1 + theta_b,j)          p_j = g_j xh_j
    dw = sum_i q_i (1 + theta_n,i)                                           q_i = dy_i xh_i

with (a, b) counted from its operations (``ROUNDINGS``) and n = M + 1 (two roundings of q_i, then at most M - 1
additions on its path through any summation tree: each one that can round adds another row's term; adding a padded
+0 is exact), so
``|dx_fp32 - dx| <= gamma_a r |g| + gamma_b (r |xh| / H) sum_j |p_j|`` and ``|dw_fp32 - dw| <= gamma_n sum_i |q_i|``;
the rounding to the output's dtype adds at most u_T (|exact| + that) plus half its smallest subnormal. It assumes no
fp32 intermediate underflows or overflows (every one is 0 or a normal number).

The non-finite check (``check``: a :class:`~nonfinite_reference.NonfiniteCheck` of either clock, or None) is of dy,
the norm output's gradient, by :func:`~nonfinite_reference.track_nonfinite_check_ref`: the kept time and the clock
of ``track_nonfinite_ref`` / ``track_nonfinite_clocked_ref`` of dy. The kernel folds the same check into its launch;
it changes no bit of dx or dw.
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels._dispatch import persistent_grid
from nvfp4_train.kernels.fused.nonfinite_reference import NonfiniteCheck, track_nonfinite_check_ref

__all__ = [
    "RMS_NORM_DTYPES",
    "ROUNDINGS",
    "check_rms_norm_backward_args",
    "row_bands",
    "rows_per_step",
    "rms_norm_backward_ref",
    "rms_norm_backward_exact",
    "rms_norm_backward_bound",
]

RMS_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

ROUNDINGS = {
    # (a, b - H): the fp32 roundings on the path of r g, and of each term of r xh S / H (H - 1 of them the row sum's
    # additions)
    "ours": (3, 7),
    # aten's layer_norm_grad_input_kernel(_vectorized) for rms_norm: stats = sum fl(fl(fl(dy w) x) r),
    # dx = fl(fl(fl(fl(H w) dy) - fl(fl(x r) stats)) * fl(fl(1 / H) r))
    "torch_cuda": (6, 8),
    # autograd through the CPU composite (x * rsqrt(mean(x^2) + eps)) * w: fl(g r) + fl(fl(fl(fl(-S'/2) r^3) / H) 2x)
    # with S' = sum fl(g x) and r^3 two roundings
    "torch_cpu": (3, 7),
}
"""The rounding counts of each implementation's dx (``rms_norm_backward_bound``). Every implementation's weight
gradient rounds each term twice (``fl(dy * fl(x * r))``, or torch's ``fl(fl(dy * x) * r)``) before its sum."""

_U32 = 2.0 ** -24
_U64 = 2.0 ** -53
_OUT = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0 ** -8, 2.0 ** -134), torch.float16: (2.0 ** -11, 2.0 ** -25)}
"""Per output dtype: the unit roundoff of rounding an fp32 value to it, and half its smallest subnormal."""


def check_rms_norm_backward_args(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> None:
    """x and dy [M, H] of one dtype (bf16/fp16/fp32), rstd [M] fp32, weight [H] (bf16/fp16/fp32), one device."""
    if x.dim() != 2 or x.dtype not in RMS_NORM_DTYPES:
        raise ValueError(f"the RMSNorm backward takes x as an [M, H] bfloat16, float16 or float32 tensor, got "
                         f"{x.dtype} {tuple(x.shape)}: flatten the leading dims (x.reshape(-1, H))")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy must have x's shape and dtype {x.dtype} {tuple(x.shape)}, got {dy.dtype} "
                         f"{tuple(dy.shape)}")
    if rstd.shape != (x.shape[0],) or rstd.dtype != torch.float32:
        raise ValueError(f"rstd must be the forward's fp32 [M] = [{x.shape[0]}] (rstd.reshape(-1)), got "
                         f"{rstd.dtype} {tuple(rstd.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype not in RMS_NORM_DTYPES:
        raise ValueError(f"weight must be [H] = [{x.shape[1]}] of bfloat16, float16 or float32, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if not (dy.device == x.device == rstd.device == weight.device):
        raise ValueError(f"dy, x, rstd and weight must share a device, got {dy.device}, {x.device}, {rstd.device}, "
                         f"{weight.device}")


def row_bands(x: torch.Tensor, rows: int, programs: int | None = None) -> tuple[int, int]:
    """``(band, programs)``: the rows per program and the programs that hold at least one row, for ``programs``
    asked for (default: ``persistent_grid(x, rows)``, 4 per multiprocessor of x's GPU)."""
    want = persistent_grid(x, rows)[0] if programs is None else programs
    if want < 1:
        raise ValueError(f"programs={programs}: give at least one program")
    band = max(1, -(-rows // want))
    return band, max(1, -(-rows // band))


def rows_per_step(x: torch.Tensor) -> int:
    """The rows a program takes per step, each lane with its own weight-gradient partial: 1 on the GPU (the fewest
    partials to write and sum), 16 elsewhere (the interpreter's time is per operation)."""
    return 1 if x.is_cuda else 16


def rms_norm_backward_ref(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, *,
                          programs: int | None = None,
                          check: NonfiniteCheck | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``: dx [M, H] in x's dtype, dw [H] in the weight's, for x and dy [M, H], the forward's fp32 rstd [M]
    and the weight [H] (module docstring); ``programs``: as :func:`row_bands`; with ``check``, dy checked
    (``check.kept`` updated in place, or set when None; the device clock advanced by one)."""
    check_rms_norm_backward_args(dy, x, rstd, weight)
    m, h = x.shape
    r = rstd[:, None]
    xh = x.float() * r
    g = dy.float() * weight.float()
    c = (g * xh).sum(-1, keepdim=True) / h
    dx = (r * (g - xh * c)).to(x.dtype)
    band, programs = row_bands(x, m, programs)
    lanes = rows_per_step(x)
    steps = -(-band // lanes)
    q = torch.zeros(programs * band, h, dtype=torch.float32, device=x.device)
    q[:m] = dy.float() * xh
    q = torch.nn.functional.pad(q.view(programs, band, h), (0, 0, 0, steps * lanes - band))
    q = q.view(programs, steps, lanes, h)
    part = torch.zeros(programs, lanes, h, dtype=torch.float32, device=x.device)
    for i in range(steps):
        part = part + q[:, i]
    if check is not None:
        track_nonfinite_check_ref(check, dy)
    return dx, part.view(programs * lanes, h).sum(0).to(weight.dtype)


def _gamma(n: int, u: float) -> float:
    assert n * u < 1, (n, u)
    return n * u / (1 - n * u)


def rms_norm_backward_exact(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` of the forward at the given fp32 rstd, in float64 (module docstring)."""
    check_rms_norm_backward_args(dy, x, rstd, weight)
    r = rstd.double()[:, None]
    xh = x.double() * r
    g = dy.double() * weight.double()
    dx = r * (g - xh * (g * xh).sum(-1, keepdim=True) / x.shape[1])
    return dx, (dy.double() * xh).sum(0)


def rms_norm_backward_bound(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                            impl: str | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(bound_dx [M, H], bound_dw [H])`` on ``|impl's result - rms_norm_backward_exact(...)|``, for
    ``impl`` in ``ROUNDINGS`` (``ours``: this reference and the kernel; torch's own backwards: ``torch_cuda`` for
    M <= 65536 rows (above, aten rounds its weight-gradient partials to the weight's dtype), ``torch_cpu``) or another
    implementation's ``(a, b - H)`` whose weight gradient rounds each term twice before a sum in any order; in the
    outputs' dtypes (module docstring; the float64 evaluation of the exact gradients is itself within gamma_k at
    u = 2^-53 of the same magnitudes, k the same counts, included)."""
    a, b = ROUNDINGS[impl] if isinstance(impl, str) else impl
    m, h = x.shape
    r = rstd.double()[:, None]
    xh = (x.double() * r).abs()
    g = (dy.double() * weight.double()).abs()
    rg = r * g
    rxp = r * xh * (g * xh).sum(-1, keepdim=True) / h
    q = (dy.double() * xh).abs().sum(0)
    n = 2 + max(m - 1, 0)  # two roundings of each term; any summation tree puts at most M - 1 additions on its path
    e_dx = _gamma(a, _U32) * rg + _gamma(h + b, _U32) * rxp
    e_dw = _gamma(n, _U32) * q
    f_dx = _gamma(h + 8, _U64) * (rg + rxp)  # the float64 evaluation: at most H + 5 roundings on a term
    f_dw = _gamma(m + 1, _U64) * q
    dx, dw = rms_norm_backward_exact(dy, x, rstd, weight)
    u_x, t_x = _OUT[x.dtype]
    u_w, t_w = _OUT[weight.dtype]
    bound_dx = e_dx + f_dx + u_x * (dx.abs() + f_dx + e_dx) + t_x
    bound_dw = e_dw + f_dw + u_w * (dw.abs() + f_dw + e_dw) + t_w
    return bound_dx, bound_dw
