"""Residual add + RMSNorm in PyTorch, operation by operation as ``residual_norm.py``'s kernels compute them.

Block i of the stack ends with megatron's bias-dropout-add (no bias, dropout 0): ``x = residual + delta``; block
i + 1 starts with ``RMSNorm(x)``. The fused op takes ``(residual, delta, weight, eps)`` and returns
``(x, normed)``. Rows are the tokens (all leading dims), N the hidden size; ``D`` is the activation dtype (bf16,
fp16 or fp32; ``residual`` and ``delta`` share it), ``fl`` rounds to fp32, ``R`` rounds an fp32 value to D
(nearest-even; the identity for fp32).

Forward, per row (``residual_norm_forward_ref``):

    x      = R(fl(residual + delta))        torch's D add, bit for bit (fp32 add, one rounding to D: for bf16 and
                                            fp16 the fp32 sum's double rounding is innocuous, 24 >= 2p + 2)
    v      = fp32(x)                        exact
    ss     = T(fl(v_j * v_j))               T: the pairwise tree below (the squares of bf16/fp16 are exact)
    rstd   = fl(1 / fl(sqrt(fl(fl(ss / N) + eps))))
    normed = R(fl(fl(v * rstd) * fp32(w)))

``T`` sums the row zero-padded to W = the next power of two >= N, halving: ``v[:W/2] + v[W/2:]`` until one value
is left (depth log2 W, every partial sum rounded once in fp32). It is the one summation order both the kernel and
this reference have (a ``tl.sum`` leaves the order to the compiler). The square root and the divisions are IEEE's,
correctly rounded (``sqrt_rn``, ``div_rn``: the GPU kernel's ``sqrt_rn``/``div_rn``; torch's own fp32 CPU
``sqrt``, ``rsqrt`` and ``1 / t`` are vectorised approximations).

torch's CPU ``F.rms_norm`` (``models/layers.py: rms_norm_composite``, which it equals bit for bit) computes the same
expression with two differences: the row sum ``ss`` in torch's own vectorised order (``v.square().mean(-1)`` is
``fl(ss / N)`` of a torch sum), and ``rstd`` by torch's vectorised CPU ``rsqrt``, which is neither
``fl(1 / fl(sqrt))`` nor correctly rounded (within 1.5 * 2^-24 relative of the exact value, measured over 2e6
arguments); autograd's backward (below) has its own orders of the two reductions. So the fused forward differs
from the unfused one only through ``ss`` and ``rstd`` (``x`` is bitwise): ``docs/numerics.md`` ("Fused step")
derives the bound. ``tests/kernels/test_residual_norm.py`` checks that these are the only differences (this
module with torch's sums and rsqrt put in is the composite and its autograd, bit for bit).

Backward, per row, for the gradients ``g_normed`` (of normed) and ``g_skip`` (of x, from the next residual add;
None when x is not used again), with ``r`` the saved rstd (``residual_norm_backward_ref``): autograd's backward of
the composite, op for op,

    g      = fp32(g_normed),  n = fl(v * r),  dn = fl(g * fp32(w))
    s      = T(fl(dn_j * v_j))                          the gradient of rstd
    gsq    = fl(fl(fl(-0.5 * s) * fl(fl(r * r) * r)) / N)   rsqrt's and mean's backward
    dx     = R(fl(fl(dn * r) + fl(gsq * fl(2 * v))))     the norm's input gradient, rounded to D as autograd does
    dsum   = R(fl(fp32(g_skip) + fp32(dx)))             autograd's sum of the two gradients of x (dx if no g_skip)
    dw     = Rw(sum over programs of P_p),  P_p = the sum over program p's rows, in row order, of fl(g * n)

``d residual = d delta = dsum`` (the add passes its gradient to both). The weight gradient is the two-stage
reduction of Liger-Kernel/Apex: program p owns the ``WGRAD_ROWS`` consecutive rows from ``p * WGRAD_ROWS`` (the
last one fewer) and accumulates their fp32 terms in row order, starting from +0; the ``ceil(rows / WGRAD_ROWS)``
partials [programs, N] are summed by ``torch.sum(dim=0)`` on their device and rounded to the weight's dtype
(Rw). The partition depends on the row count only, not on the device, so the kernel and this reference sum in one
order. Against the composite: the orders of ``s`` and of the weight-gradient sum differ; everything else is the
same sequence of roundings.

Non-finite values follow IEEE arithmetic (NaN in, NaN out; a NaN's sign and payload are not specified).
"""

from __future__ import annotations

import torch

__all__ = [
    "RESIDUAL_NORM_DTYPES",
    "WGRAD_ROWS",
    "check_residual_norm_input",
    "tree_row_sum",
    "residual_norm_forward_ref",
    "residual_norm_backward_ref",
    "residual_norm_ref",
    "residual_norm_function",
]

RESIDUAL_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WGRAD_ROWS = 32  # rows per weight-gradient partial sum (8192 rows: 256 partials, ~2 programs per H200 SM)


def check_residual_norm_input(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> None:
    """``residual`` and ``delta`` of one shape [..., N] (N >= 1) and one dtype (bf16/fp16/fp32), ``weight`` [N]
    (bf16/fp16/fp32), all on one device."""
    for name, t in (("residual", residual), ("delta", delta), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"the fused residual add + RMSNorm takes tensors, got {name} of type {type(t).__name__}")
        if t.dtype not in RESIDUAL_NORM_DTYPES:
            raise ValueError(f"the fused residual add + RMSNorm takes bfloat16, float16 or float32 tensors, got "
                             f"{name} of {t.dtype}")
    if residual.shape != delta.shape or residual.dtype != delta.dtype:
        raise ValueError(f"residual and delta must have one shape and dtype, got {residual.dtype} "
                         f"{tuple(residual.shape)} and {delta.dtype} {tuple(delta.shape)}")
    if residual.dim() < 1 or residual.shape[-1] == 0 or weight.shape != (residual.shape[-1],):
        raise ValueError(f"weight must be [hidden] = [{residual.shape[-1] if residual.dim() else '?'}] for inputs "
                         f"of shape {tuple(residual.shape)}, got {tuple(weight.shape)}")
    if not (residual.device == delta.device == weight.device):
        raise ValueError(f"residual, delta and weight are on {residual.device}, {delta.device} and {weight.device}: "
                         f"move them to one device")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def tree_row_sum(v: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim of fp32 ``v`` [rows, N] in the kernels' order: zero-padded to a power of two,
    then ``v[:, :W/2] + v[:, W/2:]`` until one column is left; [rows, 1]."""
    w = next_pow2(v.shape[-1])
    if w != v.shape[-1]:
        v = torch.nn.functional.pad(v, (0, w - v.shape[-1]))
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[:, :h] + v[:, h:]
    return v


def weight_grad_sum(terms: torch.Tensor) -> torch.Tensor:
    """The two-stage sum over the rows of fp32 ``terms`` [rows, N]: each block of ``WGRAD_ROWS`` rows summed in
    row order from +0, then ``torch.sum`` over the blocks' partials; [N]."""
    rows, n = terms.shape
    programs = -(-rows // WGRAD_ROWS)
    padded = torch.nn.functional.pad(terms, (0, 0, 0, programs * WGRAD_ROWS - rows)).view(programs, WGRAD_ROWS, n)
    acc = torch.zeros(programs, n, dtype=torch.float32, device=terms.device)
    for k in range(WGRAD_ROWS):  # a zero-padded row adds +0: no change (acc starts at +0, so no -0 survives)
        acc = acc + padded[:, k]
    return acc.sum(0)


def div_rn(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE's fp32 division ``fl(a / b)``: computed in fp64 and rounded once to fp32 (exact: 53 >= 2 * 24 + 2 makes
    the double rounding innocuous), where torch's own fp32 ops need not be (``1.0 / t`` is a vectorised
    ``reciprocal`` on the CPU)."""
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    return torch.div(a64, b64).float()


def sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    """IEEE's fp32 square root: in fp64, rounded once (innocuous, as ``div_rn``); torch's vectorised CPU fp32
    ``sqrt`` is not correctly rounded (1 in 6 results of uniform draws off by an ulp with torch 2.13)."""
    return torch.sqrt(a.double()).float()


def rstd_of(ss: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """``fl(1 / fl(sqrt(fl(fl(ss / n) + eps))))`` of the fp32 row sums of squares."""
    return div_rn(1.0, sqrt_rn(div_rn(ss, n) + eps))


def residual_norm_forward_ref(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, normed, rstd)``: x = residual + delta and normed = RMSNorm(x) in the dtype of residual (fresh
    contiguous tensors of its shape), rstd the fp32 [rows] the backward takes (module docstring)."""
    check_residual_norm_input(residual, delta, weight)
    n = residual.shape[-1]
    x = residual + delta
    v = x.reshape(-1, n).float()
    ss = tree_row_sum(v * v)
    rstd = rstd_of(ss, n, eps)
    normed = ((v * rstd) * weight.float()).to(x.dtype)
    return x.contiguous(), normed.view(x.shape), rstd.view(-1)


def residual_norm_backward_ref(g_normed: torch.Tensor, g_skip: torch.Tensor | None, x: torch.Tensor,
                               weight: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dsum, dw)``: the gradient of x = residual + delta (= of residual and of delta), in x's dtype and shape,
    and of the weight in its dtype, for the gradients ``g_normed`` of normed and ``g_skip`` of x (None: x has no
    other use), with the forward's ``x`` and ``rstd`` (module docstring)."""
    n = x.shape[-1]
    v = x.reshape(-1, n).float()
    g = g_normed.reshape(-1, n).float()
    r = rstd.view(-1, 1)
    dw = weight_grad_sum(g * (v * r)).to(weight.dtype)
    dn = g * weight.float()
    s = tree_row_sum(dn * v)
    gsq = div_rn((-0.5 * s) * (r * r * r), n)
    dx = ((dn * r) + (gsq * (2 * v))).to(x.dtype).view(x.shape)
    dsum = dx if g_skip is None else g_skip + dx
    return dsum.contiguous(), dw


def residual_norm_function(forward_fn, backward_fn) -> type[torch.autograd.Function]:
    """The autograd op of a forward ``(residual, delta, weight, eps) -> (x, normed, rstd)`` and a backward
    ``(g_normed, g_skip, x, weight, rstd) -> (dsum, dw)`` with the signatures of ``residual_norm_forward_ref`` and
    ``residual_norm_backward_ref`` (the reference's pair, or the kernels'): it saves x, the weight and rstd, and
    passes dsum to both residual and delta (the add hands its gradient to both)."""

    class _ResidualNormOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, residual, delta, weight, eps):
            x, normed, rstd = forward_fn(residual, delta, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            ctx.set_materialize_grads(False)
            return x, normed

        @staticmethod
        def backward(ctx, g_skip, g_normed):
            x, weight, rstd = ctx.saved_tensors
            if g_normed is None:
                g_normed = torch.zeros_like(x)
            dsum, dw = backward_fn(g_normed, g_skip, x, weight, rstd)
            return dsum, dsum, dw, None

    return _ResidualNormOp


_ResidualNormRef = residual_norm_function(residual_norm_forward_ref, residual_norm_backward_ref)


def residual_norm_ref(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, RMSNorm(residual + delta) * weight)``, differentiable w.r.t. the three tensors, by the
    reference's forward and backward (its forward checks the inputs)."""
    return _ResidualNormRef.apply(residual, delta, weight, eps)
