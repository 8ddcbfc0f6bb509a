"""Mamba-2's selective state-space scan (SSD) in pure PyTorch: a chunked scan and a sequential reference.

The recurrence, per batch row and head h (state S_t is p x n; x_t has p entries, B_t and C_t have n)::

    dt_t  = clamp(softplus(dt_t + dt_bias_h), *dt_limit)     softplus only with dt_softplus=True
    S_t   = exp(dt_t * A_h) * S_{t-1} + dt_t * outer(x_t, B_t)
    y_t   = S_t @ C_t + D_h * x_t                              D per head [h] or per channel [h, p]
    out_t = y_t * silu(z_t)                                    only when z is given

Shapes follow mamba-ssm's ``mamba_chunk_scan_combined``: x [b, l, h, p], dt [b, l, h], A [h], B and C
[b, l, g, n], z like x, initial_states / final states [b, h, p, n]. The h heads form g contiguous groups
of h/g heads; head i reads B and C of group i // (h/g). The clamp is applied always, as mamba's kernel does
(the default (0, inf) only zeroes a negative dt). The decays are exp(dt*A) <= 1 for Mamba-2's A = -exp(A_log)
< 0 and dt >= 0; mamba's kernel additionally clamps the intra-chunk decay exponents at 0, which only
matters for A > 0 or dt < 0, cases Mamba-2 never produces.

The chunked form (state space duality, Dao & Gu 2024, "Transformers are SSMs") cuts the sequence into
chunks of Q positions; within a chunk the recurrence unrolls into a masked matrix product, and only the
states at chunk boundaries travel from chunk to chunk. With dA_k = dt_k * A and, inside one chunk,

    a(i, j) = exp(dA_{j+1} + ... + dA_i)      for j <= i   (a lower-triangular Q x Q decay matrix)

    1. diagonal blocks   y_i  = sum_{j<=i} (C_i . B_j) a(i, j) dt_j x_j
    2. chunk states      s_c  = sum_j a(Q-1, j) dt_j outer(x_j, B_j)          (the chunk's own inputs)
    3. state passing     S_c  = state entering chunk c, with T_k the sum of dA over chunk k,
                              = sum_{c'<c} exp(T_{c'+1} + ... + T_{c-1}) s_{c'}
                                + exp(T_0 + ... + T_{c-1}) S_init
    4. off-diagonal      y_i += exp(dA_0 + ... + dA_i) S_c @ C_i   (i in chunk c; sums from the chunk start)

Every decay exponent is a segment sum formed by a masked cumulative sum over exactly that segment (never the
difference of two long prefix sums), so its rounding error is relative to the segment itself. The cost is
O(L Q) work and O(L Q) memory per head (the Q x Q decay blocks) plus O((L/Q)^2) for state passing: this path
serves CPU runs, tests and small models; large GPU runs use mamba-ssm's Triton kernels (``ops.ssd_scan``).

Everything is computed in float32 (inputs upcast; float64 inputs compute in float64) and differentiated by
autograd; the output has x's dtype, final states are in the compute dtype (float32 as in mamba-ssm).
A sequence length that is not a multiple of the chunk is padded with dt = 0 (no decay, no input), which
leaves the outputs and the final state unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["ssd_chunked_scan", "ssd_sequential_ref", "ssd_step_ref"]


def _check_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states) -> tuple[int, int, int, int, int, int]:
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seqlen, nheads, headdim], got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    if B.dim() != 4 or B.shape[:2] != (b, l):
        raise ValueError(f"B must be [batch, seqlen, ngroups, dstate] = [{b}, {l}, g, n], "
                         f"got {tuple(B.shape)}")
    g, n = B.shape[2], B.shape[3]
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if g == 0 or h % g != 0:
        raise ValueError(f"nheads ({h}) must be a multiple of ngroups ({g})")
    if dt.shape != (b, l, h):
        raise ValueError(f"dt must be [batch, seqlen, nheads] = {(b, l, h)}, got {tuple(dt.shape)}")
    if A.shape != (h,):
        raise ValueError(f"A must be [nheads] = ({h},), got {tuple(A.shape)}")
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"D must be [nheads] or [nheads, headdim] = ({h},) or {(h, p)}, "
                         f"got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None and dt_bias.shape != (h,):
        raise ValueError(f"dt_bias must be [nheads] = ({h},), got {tuple(dt_bias.shape)}")
    if initial_states is not None and initial_states.shape != (b, h, p, n):
        raise ValueError(f"initial_states must be [batch, nheads, headdim, dstate] = {(b, h, p, n)}, "
                         f"got {tuple(initial_states.shape)}")
    return b, l, h, p, g, n


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _discretize_dt(dt, dt_bias, dt_softplus: bool, dt_limit: tuple[float, float], cdt) -> torch.Tensor:
    """dt as the recurrence uses it: bias, softplus (linear above 20, like mamba's kernel), clamp."""
    dt = dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdt)
    if dt_softplus:
        dt = F.softplus(dt)  # threshold=20: returns dt itself above 20, as mamba's kernel does
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _skip_and_gate(y, x, D, z, cdt) -> torch.Tensor:
    """y + D x, then the optional silu(z) gate; y, x, z are [b, l, h, p]."""
    if D is not None:
        Dc = D.to(cdt)
        y = y + x.to(cdt) * (Dc[:, None] if Dc.dim() == 1 else Dc)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """Segment sums of a [..., T]: out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf for j > i.

    Formed as a cumulative sum down each column of the strictly-lower-masked matrix a[..., i] (one column per
    segment start j), so each entry sums exactly its own segment; exp() of the result is the decay matrix.
    """
    T = a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    rows = a.unsqueeze(-1).expand(*a.shape, T)  # rows[..., i, j] = a[..., i]
    seg = torch.cumsum(rows.masked_fill(~torch.tril(ones, diagonal=-1), 0.0), dim=-2)
    return seg.masked_fill(~torch.tril(ones), -math.inf)


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    *,  # mamba-ssm has seq_idx and cu_seqlens here: the rest by keyword only
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan by chunks (see the module docstring); same arguments and results as mamba-ssm's
    ``mamba_chunk_scan_combined`` without ``seq_idx`` / ``cu_seqlens`` (packed sequences).

    Returns ``out`` [b, l, h, p] in x's dtype, and with ``return_final_states`` also the state after the
    last position, [b, h, p, n] in float32 (float64 for float64 x).
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    b, l, h, p, g, n = _check_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states)
    r = h // g  # heads per group
    cdt = _compute_dtype(x)

    dtd = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)  # [b, l, h]
    # x is converted ONCE and both uses (the scan, the D skip) take that copy, so that its two gradient
    # contributions are summed in the compute dtype and rounded to x's dtype once
    x_cdt = x.to(cdt)
    xc, Bc, Cc = x_cdt, B.to(cdt), C.to(cdt)
    pad = (-l) % chunk_size
    if pad:  # dt = 0 on the padding: decay exp(0) = 1 and no input, so nothing it touches changes
        dtd = F.pad(dtd, (0, 0, 0, pad))
        xc, Bc, Cc = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xc, Bc, Cc))
    nc, Q = (l + pad) // chunk_size, chunk_size

    xc = xc.reshape(b, nc, Q, g, r, p)
    Bc = Bc.reshape(b, nc, Q, g, n)
    Cc = Cc.reshape(b, nc, Q, g, n)
    dtc = dtd.reshape(b, nc, Q, g, r).permute(0, 1, 3, 4, 2)  # [b, c, g, r, Q]
    dA = dtc * A.to(cdt).reshape(g, r, 1)

    # 1. diagonal blocks: y_i = sum_{j<=i} (C_i . B_j) a(i, j) dt_j x_j
    seg = _segsum(dA)  # [b, c, g, r, Q(i), Q(j)]
    CB = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)
    W = CB.unsqueeze(3) * torch.exp(seg) * dtc.unsqueeze(-2)  # [b, c, g, r, i, j]
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", W, xc)

    # 2. chunk states from each chunk's own inputs: s_c = sum_j a(Q-1, j) dt_j outer(x_j, B_j)
    to_end = torch.exp(seg[..., -1, :]) * dtc  # [b, c, g, r, Q(j)]
    states = torch.einsum("bcjgrp,bcjgn->bcgrpn", xc * to_end.permute(0, 1, 4, 2, 3).unsqueeze(-1), Bc)

    # 3. state passing across chunks; index 0 of `carried` is the initial state
    if initial_states is None:
        init = states.new_zeros(b, 1, g, r, p, n)
    else:
        init = initial_states.to(cdt).reshape(b, 1, g, r, p, n)
    chunk_totals = F.pad(dA.sum(-1).permute(0, 2, 3, 1), (1, 0))  # T_k, [b, g, r, 1 + c] with a leading 0
    chunk_decay = torch.exp(_segsum(chunk_totals))  # [b, g, r, 1+c (to), 1+c (from)]
    carried = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, torch.cat([init, states], dim=1))
    entering, final = carried[:, :-1], carried[:, -1]  # S_c for c = 0..nc-1, and the state after the end

    # 4. off-diagonal: y_i += exp(dA_0 + ... + dA_i) S_c @ C_i
    from_start = torch.exp(torch.cumsum(dA, dim=-1)).permute(0, 1, 4, 2, 3).unsqueeze(-1)  # [b,c,Q,g,r,1]
    y = y + torch.einsum("bcign,bcgrpn->bcigrp", Cc, entering) * from_start

    y = y.reshape(b, nc * Q, h, p)[:, :l]
    out = _skip_and_gate(y, x_cdt, D, z, cdt).to(x.dtype)
    if return_final_states:
        return out, final.reshape(b, h, p, n)
    return out


def _recurrence_step(S, dtd, decay, x, Bh, Ch):
    """One position of the recurrence in the compute dtype: S [b, h, p, n], dtd and decay [b, h], x [b, h, p],
    Bh and Ch [b, h, n] (B and C per head). Returns (S_t = decay S + dt x B^T, y_t = S_t C_t)."""
    inp = (dtd[..., None] * x).unsqueeze(-1) * Bh[:, :, None, :]  # dt_t outer(x_t, B_t)
    S = decay[..., None, None] * S + inp
    return S, torch.einsum("bhpn,bhn->bhp", S, Ch)


def ssd_sequential_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    *,  # mamba-ssm has seq_idx and cu_seqlens here: the rest by keyword only
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The recurrence stepped one position at a time (the module docstring's first formula), for tests.

    Same arguments and results as :func:`ssd_chunked_scan` minus ``chunk_size``; computes in float32, or in
    float64 when given float64 inputs (the tests' reference). O(l) Python steps: use short sequences.
    """
    b, l, h, p, g, n = _check_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states)
    cdt = _compute_dtype(x)
    dtd = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)  # [b, l, h]
    decay = torch.exp(dtd * A.to(cdt))  # [b, l, h]
    xc = x.to(cdt)
    Bh = B.to(cdt).repeat_interleave(h // g, dim=2)  # [b, l, h, n]: head i reads group i // (h / g)
    Ch = C.to(cdt).repeat_interleave(h // g, dim=2)
    S = x.new_zeros(b, h, p, n, dtype=cdt) if initial_states is None else initial_states.to(cdt)
    ys = []
    for t in range(l):
        S, y_t = _recurrence_step(S, dtd[:, t], decay[:, t], xc[:, t], Bh[:, t], Ch[:, t])
        ys.append(y_t)
    y = torch.stack(ys, dim=1) if ys else xc.new_zeros(b, 0, h, p)
    out = _skip_and_gate(y, x, D, z, cdt).to(x.dtype)
    if return_final_states:
        return out, S
    return out


def ssd_step_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    *,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """One position of the recurrence (incremental decoding): ``state`` [b, h, p, n] (float32, or float64 for
    float64 inputs; the scans' final state) is updated in place to S_t; x [b, h, p], dt [b, h], A [h], B and C
    [b, g, n], D [h] or [h, p], dt_bias [h]. Returns y_t = S_t @ C_t + D x_t, [b, h, p] in x's dtype: the
    arithmetic of one step of :func:`ssd_sequential_ref`."""
    b, h, p = x.shape
    if B.dim() != 3 or B.shape[0] != b or C.shape != B.shape or h % B.shape[1]:
        raise ValueError(f"B and C must be [batch, ngroups, dstate] with ngroups dividing nheads={h}, got "
                         f"{tuple(B.shape)} and {tuple(C.shape)}")
    if state.shape != (b, h, p, B.shape[2]) or dt.shape != (b, h):
        raise ValueError(f"state must be [b, h, p, n] = {(b, h, p, B.shape[2])} and dt [b, h] = {(b, h)}, got "
                         f"{tuple(state.shape)} and {tuple(dt.shape)}")
    cdt = state.dtype
    dtd = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)  # [b, h]
    decay = torch.exp(dtd * A.to(cdt))
    Bh = B.to(cdt).repeat_interleave(h // B.shape[1], dim=1)  # [b, h, n]: head i reads group i // (h / g)
    Ch = C.to(cdt).repeat_interleave(h // B.shape[1], dim=1)
    new, y = _recurrence_step(state, dtd, decay, x.to(cdt), Bh, Ch)
    state.copy_(new)
    return _skip_and_gate(y[:, None], x[:, None], D, None, cdt)[:, 0].to(x.dtype)
