"""The Mamba-2 mixer's numerics: SSD scan, causal depthwise conv, gated RMSNorm, parameter initialisation.

Each op runs the optional CUDA/Triton kernel when its input is on a CUDA device and the package imports
(see :mod:`nvfp4_train.models.mamba._import`), and otherwise a pure-PyTorch version with the same semantics that
computes in float32 and returns the input's dtype:

==================  ==========================================  ==========================================
op                  CUDA (optional package)                     fallback (any device)
==================  ==========================================  ==========================================
``ssd_scan``        mamba-ssm ``mamba_chunk_scan_combined``     :func:`nvfp4_train.models.mamba.ssd.ssd_chunked_scan`
``causal_conv1d``   causal-conv1d ``causal_conv1d_fn``          :func:`causal_conv1d_ref`
``rmsnorm_gated``   mamba-ssm ``layernorm_gated.rmsnorm_fn``    :func:`rmsnorm_gated_ref`
``ssd_step``        mamba-ssm ``selective_state_update``        :func:`nvfp4_train.models.mamba.ssd.ssd_step_ref`
``causal_conv1d_    causal-conv1d ``causal_conv1d_update``      :func:`causal_conv1d_update_ref`
update``
==================  ==========================================  ==========================================

A CUDA input that falls back warns once per op, naming the reason (the fallbacks are slow at scale).

The mixer's core, in_proj's output to out_proj's input, is one op, :func:`mamba_conv_scan_norm` (conv, scan and
gated norm on megatron's sequence-first ``[s, b, .]`` tensors): on CUDA the fused autograd op
:func:`mamba_conv_scan_norm_fused` (mamba-ssm's fused training op laid out sequence-first, see
:class:`_ConvScanNormFn`), else the three ops above in sequence; :func:`mamba_conv_scan_norm_ref` is its
pure-PyTorch reference.

Incremental decoding (:mod:`nvfp4_train.models.decode`) runs the same core with the layer's recurrent state: a chunk
of positions (the prompt) through :func:`mamba_conv_scan_norm_chunk` (the three ops, starting from and returning
the conv inputs of the last ``width - 1`` positions and the SSM state), then one position at a time through
:func:`mamba_conv_scan_norm_step` (``causal_conv1d_update`` and ``ssd_step``, which update both states in place).

Initialisation (Mamba-2's, as in mamba-ssm's ``Mamba2`` and megatron-core's ``MambaMixer``):
``init_dt_bias`` (dt log-uniform in [dt_min, dt_max], floored, stored as its inverse softplus),
``init_A_log`` (A uniform in ``A_init_range``, stored as log A; the mixer uses A = -exp(A_log)),
``init_D`` (ones). Each returns a new float32 tensor (cast with ``dtype=``) for the mixer to copy into its
parameters under whatever RNG state (e.g. megatron's model-parallel tracker) it chooses.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from nvfp4_train.models.mamba._import import (
    FusedMambaOps,
    load_causal_conv1d,
    load_causal_conv1d_update,
    load_fused_mamba,
    load_mamba_ssm,
    load_selective_state_update,
)
from nvfp4_train.models.mamba.ssd import ssd_chunked_scan, ssd_step_ref

__all__ = [
    "ssd_scan",
    "causal_conv1d",
    "causal_conv1d_ref",
    "rmsnorm_gated",
    "rmsnorm_gated_ref",
    "mamba_conv_scan_norm",
    "mamba_conv_scan_norm_fused",
    "mamba_conv_scan_norm_ref",
    "ssd_step",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "mamba_conv_scan_norm_chunk",
    "mamba_conv_scan_norm_step",
    "init_dt_bias",
    "init_A_log",
    "init_D",
]

_warned: set[str] = set()


def _warn_fallback(op: str, reason: str) -> None:
    if op not in _warned:
        _warned.add(op)
        warnings.warn(f"{op}: CUDA input but using the PyTorch fallback ({reason})", stacklevel=3)


# --------------------------------------------------------------------------------------------- SSD scan


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSD scan: x [b, l, h, p], dt [b, l, h], A [h], B/C [b, l, g, n] -> out [b, l, h, p].

    Semantics in :mod:`nvfp4_train.models.mamba.ssd`; arguments as mamba-ssm's ``mamba_chunk_scan_combined`` (without
    packed-sequence ``seq_idx`` / ``cu_seqlens``). On CUDA with mamba-ssm importable this is mamba-ssm's
    Triton kernel, else the float32 PyTorch chunked scan. The kernel accumulates in fp32 but rounds its
    intermediates (dot operands, passed states) to the inputs' dtype, runs tl.dot on fp32 inputs in TF32,
    and computes softplus as log(exp(s) + 1) in fp32 (relative error ~2^-24 / dt on dt: 6e-5 at dt = 1e-3).
    Returns out [b, l, h, p] in x's dtype (and the float32 final state [b, h, p, n] if asked).
    """
    if x.is_cuda:
        mamba, reason = load_mamba_ssm()
        if mamba is not None:
            return mamba.mamba_chunk_scan_combined(
                x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
            )
        _warn_fallback("ssd_scan", reason)
    return ssd_chunked_scan(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
    )


# ------------------------------------------------------------------------------------ causal conv1d

_ACTIVATIONS = (None, "silu", "swish")
_CONV_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_conv(x, weight, bias, activation) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"expected x [batch, dim, seqlen] and weight [dim, width] with the same dim, got "
                         f"x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [dim] = ({weight.shape[0]},), got {tuple(bias.shape)}")


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """Depthwise causal convolution: out[:, d, t] = act(bias[d] + sum_k weight[d, k] x[:, d, t - (w-1) + k]).

    x [batch, dim, seqlen] (zeros before the start), weight [dim, width], bias [dim]; computed in float32
    (as causal-conv1d's kernel accumulates), returned in x's dtype. ``activation`` None, "silu" or "swish".
    Written as ``width`` shifted multiply-adds on the left-padded input rather than ``F.conv1d``: the same
    depthwise convolution, but exact fp32 arithmetic on every device (cuDNN may run fp32 convolutions in
    TF32 by default) with the same summation order everywhere; width is 4 in Mamba-2.
    """
    _check_conv(x, weight, bias, activation)
    cdt = torch.promote_types(x.dtype, torch.float32)
    length, width = x.shape[-1], weight.shape[1]
    xp = F.pad(x.to(cdt), (width - 1, 0))
    w = weight.to(cdt)
    out = w[:, 0, None] * xp[..., :length]
    for k in range(1, width):
        out = out + w[:, k, None] * xp[..., k:k + length]
    if bias is not None:
        out = out + bias.to(cdt)[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """:func:`causal_conv1d_ref`'s convolution; causal-conv1d's CUDA kernel when installed and usable
    (CUDA input, width 2..4, fp32/fp16/bf16), else the PyTorch version."""
    _check_conv(x, weight, bias, activation)
    if x.is_cuda:
        conv, reason = load_causal_conv1d()
        usable = (2 <= weight.shape[1] <= 4 and x.dtype in _CONV_KERNEL_DTYPES
                  and weight.dtype in _CONV_KERNEL_DTYPES and (bias is None or bias.dtype == weight.dtype))
        if conv is not None and usable:
            if x.stride(2) != 1 and (x.shape[1] % 8 or x.stride(0) % 8 or x.stride(2) % 8):
                x = x.contiguous()  # its channel-last path needs dim and strides divisible by 8
            return conv.causal_conv1d_fn(x, weight, bias, activation=activation)
        _warn_fallback("causal_conv1d", reason if conv is None else
                       f"kernel needs width 2..4 and fp32/fp16/bf16 with bias in weight's dtype; got width "
                       f"{weight.shape[1]}, x {x.dtype}, weight {weight.dtype}")
    return causal_conv1d_ref(x, weight, bias, activation)


# --------------------------------------------------------------------------------- gated RMSNorm


def _check_norm(x, z, weight, group_size) -> int:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}] (x's last dim), got {tuple(weight.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    group_size = d if group_size is None else group_size
    if group_size < 1 or d % group_size != 0:
        raise ValueError(f"group_size ({group_size}) must divide the last dim ({d}); Mamba-2 uses "
                         f"d_inner // ngroups")
    return group_size


def rmsnorm_gated_ref(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm over the last dim, in float32, returned in x's dtype.

    norm_before_gate=False (Mamba-2's and megatron's setting): out = rmsnorm(x * silu(z)) * weight;
    norm_before_gate=True: out = rmsnorm(x) * weight * silu(z). rmsnorm divides by sqrt(mean(v^2) + eps)
    taken over each block of ``group_size`` consecutive channels (None: the whole last dim); Mamba-2 uses
    group_size = d_inner / ngroups so that the norm never mixes B/C groups (and so is unchanged by tensor
    parallelism, which shards whole groups). z=None: no gate.
    """
    group_size = _check_norm(x, z, weight, group_size)
    cdt = torch.promote_types(x.dtype, torch.float32)
    v = x.to(cdt)
    gate = None if z is None else F.silu(z.to(cdt))
    if gate is not None and not norm_before_gate:
        v = v * gate
    vg = v.unflatten(-1, (-1, group_size))
    out = (vg * torch.rsqrt(vg.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(cdt)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


def rmsnorm_gated(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """:func:`rmsnorm_gated_ref`'s norm; mamba-ssm's Triton kernel (same formula, float32 inside) on CUDA."""
    _check_norm(x, z, weight, group_size)
    if x.is_cuda:
        mamba, reason = load_mamba_ssm()
        if mamba is not None:
            return mamba.rmsnorm_fn(x, weight, None, z=z, eps=eps, group_size=group_size,
                                    norm_before_gate=norm_before_gate)
        _warn_fallback("rmsnorm_gated", reason)
    return rmsnorm_gated_ref(x, z, weight, eps, group_size, norm_before_gate)


# ------------------------------------------------------- conv + scan + gated norm (the mixer's core)


def _core_sizes(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups) -> tuple[int, int, int]:
    """(d, cd, h): d = h * headdim channels of x (and z), cd = d + 2 * ngroups * dstate conv channels, h heads."""
    h = A.shape[0] if A.dim() == 1 else -1
    if h < 1 or dt_bias.shape != (h,) or D.shape != (h,):
        raise ValueError(f"A, dt_bias and D must be [nheads], got {tuple(A.shape)}, {tuple(dt_bias.shape)}, "
                         f"{tuple(D.shape)}")
    d = h * headdim
    if ngroups < 1 or h % ngroups:
        raise ValueError(f"ngroups={ngroups} must divide nheads={h}")
    cd = conv_weight.shape[0] if conv_weight.dim() == 2 else -1
    if cd <= d or (cd - d) % (2 * ngroups):
        raise ValueError(f"conv_weight must be [d_inner + 2 * ngroups * dstate, width] = [{d} + {2 * ngroups} * "
                         f"dstate, width], got {tuple(conv_weight.shape)}")
    if conv_bias is not None and conv_bias.shape != (cd,):
        raise ValueError(f"conv_bias must be [{cd}], got {tuple(conv_bias.shape)}")
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [d_inner] = [{d}], got {tuple(norm_weight.shape)}")
    if zxbcdt.dim() != 3 or zxbcdt.shape[-1] != d + cd + h:
        raise ValueError(f"zxbcdt must be [seq, batch, 2 * d_inner + 2 * ngroups * dstate + nheads] = [s, b, "
                         f"{d + cd + h}] (in_proj's output: z, x, B, C, dt), got {tuple(zxbcdt.shape)}")
    return d, cd, h


def _xbc_parts(xbc: torch.Tensor, d: int, h: int, headdim: int, ngroups: int):
    """The conv's output (or its gradient) [b, cd, s] as the scan's x [b, s, h, p], B and C [b, s, g, n] (views)."""
    x, B, C = torch.split(xbc.transpose(1, 2), [d, (xbc.shape[1] - d) // 2, (xbc.shape[1] - d) // 2], dim=-1)
    return x.unflatten(-1, (h, headdim)), B.unflatten(-1, (ngroups, -1)), C.unflatten(-1, (ngroups, -1))


def _conv_scan_norm(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups, chunk_size, eps,
                    dt_limit, conv, scan, norm) -> torch.Tensor:
    """The core as three ops (``conv``, ``scan``, ``norm``: the dispatching ops or their references)."""
    d, cd, h = _core_sizes(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups)
    z, xbc, dt = torch.split(zxbcdt, [d, cd, h], dim=-1)  # [s, b, .] views
    # [b, cd, s] with the channels innermost: causal-conv1d's channel-last layout, read in place
    xbc = conv(xbc.permute(1, 2, 0), conv_weight, conv_bias, activation="silu")
    x, B, C = _xbc_parts(xbc, d, h, headdim, ngroups)
    y = scan(x, dt.transpose(0, 1), A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)
    # the scan writes [b, s, h, p]: ONE transpose to [s, b, d]; the norm is per token, so it runs after it and
    # reads z in place (before it, z would be copied forward and dy backward)
    y = y.flatten(-2).transpose(0, 1).contiguous()
    return norm(y, z, norm_weight, eps, group_size=d // ngroups)


def mamba_conv_scan_norm_ref(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    headdim: int,
    ngroups: int,
    chunk_size: int,
    eps: float = 1e-5,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Mamba-2's core from in_proj's output to out_proj's input, sequence-first, in pure PyTorch::

        z, xBC, dt = split(zxbcdt)                            zxbcdt [s, b, 2d + 2gn + h] (this TP rank's heads)
        x, B, C    = split(silu(causal_conv1d(xBC)))          :func:`causal_conv1d_ref`
        y          = ssd(x, dt, A, B, C, D, dt_bias, softplus)  :func:`~nvfp4_train.models.mamba.ssd.ssd_chunked_scan`
        out        = rmsnorm(y * silu(z)) * norm_weight       :func:`rmsnorm_gated_ref`, per group of d / ngroups
                                                              channels (norm_before_gate=False, as mamba-ssm's
                                                              Mamba2 and megatron's mixer)

    conv_weight [d + 2gn, width], conv_bias [d + 2gn] or None, dt_bias/A/D [h] (D per head), norm_weight [d];
    d = h * headdim. Returns out [s, b, d] in zxbcdt's dtype (each op computes in float32 and rounds its result
    to it, as the CUDA kernels do).
    """
    return _conv_scan_norm(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups, chunk_size,
                           eps, dt_limit, causal_conv1d_ref, ssd_chunked_scan, rmsnorm_gated_ref)


def _fused_unusable(zxbcdt, conv_weight, conv_bias, d: int, cd: int) -> str | None:
    """Why the fused op cannot run these tensors, or None (causal-conv1d's channel-last conditions)."""
    ops, reason = load_fused_mamba()
    if ops is None:
        return reason
    width = conv_weight.shape[1]
    if not 2 <= width <= 4:
        return f"causal-conv1d needs conv width 2..4, got {width}"
    if (zxbcdt.dtype not in _CONV_KERNEL_DTYPES or conv_weight.dtype not in _CONV_KERNEL_DTYPES
            or (conv_bias is not None and conv_bias.dtype != conv_weight.dtype)):
        return (f"causal-conv1d needs fp32/fp16/bf16 with the bias in the weight's dtype, got zxbcdt "
                f"{zxbcdt.dtype}, weight {conv_weight.dtype}, bias {None if conv_bias is None else conv_bias.dtype}")
    w = zxbcdt.shape[-1]
    if d % 8 or cd % 8 or w % 8:
        return (f"causal-conv1d reads channel-last slices of in_proj's output: d_inner ({d}), conv channels ({cd}) "
                f"and in_proj's width ({w}) must be multiples of 8")
    return None


class _ConvScanNormFn(torch.autograd.Function):
    """mamba-ssm's ``MambaSplitConv1dScanCombinedFn`` (conv + SSD scan + gated RMSNorm, no out_proj) for
    megatron's sequence-first tensors: the same launchers in the same order, on strided views.

    mamba-ssm's op takes zxbcdt batch-first and contiguous: its backward hands the norm ``dz`` through a
    reshape that copies for any other layout (so a transposed view would leave dz unwritten), so megatron
    copies zxbcdt to [b, s, w] and the output back (one transpose of w and one of d channels each way, plus
    the conv recomputed in backward). Every launcher underneath takes strides, and the norm is per token, so
    here::

        forward   conv:  xBC [b, cd, s] = strided view of zxbcdt [s, b, w]   -> xc (memory [s, b, cd])
                  scan:  x, B, C views of xc, dt view of zxbcdt          -> y [b, s, h, p]
                  copy:  y -> ys [s, b, d]                                 the one transpose
                  norm:  ys, z (view of zxbcdt, row stride w), rows in (s, b) order -> out [s, b, d]
        backward  norm:  writes dz into dzxbcdt [s, b, w] (row stride w); dys [s, b, d]
                  scan:  reads dys as [b, s, h, p]; writes dx, dB, dC into dxc [s, b, cd], ddt into dzxbcdt
                  conv:  reads dxc channel-last; writes dxBC into dzxbcdt

    Saved for backward: zxbcdt, the conv output xc and ys (mamba-ssm recomputes xc instead: it saves
    memory, costs a conv forward). Numerics are mamba-ssm's kernels' (the same as the unfused ops on CUDA).
    """

    @staticmethod
    def forward(ctx, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups, chunk_size, eps,
                dt_limit, ops: FusedMambaOps):
        s, b, _ = zxbcdt.shape
        h, cd = A.shape[0], conv_weight.shape[0]
        d = h * headdim
        zxbcdt = zxbcdt.contiguous()  # in_proj's output already is: (s, b) must merge into rows for the norm
        z, xbc, dt = torch.split(zxbcdt, [d, cd, h], dim=-1)
        xc = ops.conv_fwd(xbc.permute(1, 2, 0), conv_weight, conv_bias, None, None, None, True)  # silu
        x, B, C = _xbc_parts(xc, d, h, headdim, ngroups)
        y, *_ = ops.scan_fwd(x, dt.transpose(0, 1), A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias,
                             dt_softplus=True, dt_limit=dt_limit)
        ys = y.transpose(0, 1).reshape(s * b, d)  # the copy to [s, b, d]
        out, _, rstd = ops.norm_fwd(ys, norm_weight, None, eps, z=z.view(s * b, d), group_size=d // ngroups,
                                    norm_before_gate=False, is_rms_norm=True)
        ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, xc, ys, dt_bias, A, D, norm_weight, rstd)
        ctx.args = (headdim, ngroups, chunk_size, eps, dt_limit, ops)
        return out.view(s, b, d)

    @staticmethod
    def backward(ctx, dout):
        zxbcdt, conv_weight, conv_bias, xc, ys, dt_bias, A, D, norm_weight, rstd = ctx.saved_tensors
        headdim, ngroups, chunk_size, eps, dt_limit, ops = ctx.args
        s, b, _ = zxbcdt.shape
        h, cd = A.shape[0], conv_weight.shape[0]
        d = h * headdim
        z, xbc, dt = torch.split(zxbcdt, [d, cd, h], dim=-1)
        dzxbcdt = torch.empty_like(zxbcdt)
        dz, dxbc, ddt = torch.split(dzxbcdt, [d, cd, h], dim=-1)
        dys, dnorm_weight, _, _ = ops.norm_bwd(
            dout.contiguous().view(s * b, d), ys, norm_weight, None, eps, None, rstd, z=z.view(s * b, d),
            group_size=d // ngroups, norm_before_gate=False, is_rms_norm=True, dz=dz.view(s * b, d))
        dxc = torch.empty(s, b, cd, dtype=xc.dtype, device=xc.device).permute(1, 2, 0)  # d loss / d xc, [b, cd, s]
        x, B, C = _xbc_parts(xc, d, h, headdim, ngroups)
        dx, dB, dC = _xbc_parts(dxc, d, h, headdim, ngroups)
        _, _, dA, _, _, dD, _, ddt_bias, _ = ops.scan_bwd(
            dys.view(s, b, h, headdim).transpose(0, 1), x, dt.transpose(0, 1), A, B, C,
            ys.view(s, b, h, headdim).transpose(0, 1), chunk_size, D=D, z=None, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=dt_limit, dx=dx, ddt=ddt.transpose(0, 1), dB=dB, dC=dC)
        _, dconv_weight, dconv_bias, _ = ops.conv_bwd(xbc.permute(1, 2, 0), conv_weight, conv_bias, dxc, None, None,
                                                      None, dxbc.permute(1, 2, 0), False, True)
        return (dzxbcdt, dconv_weight, dconv_bias, ddt_bias, dA, dD, dnorm_weight) + (None,) * 6


def mamba_conv_scan_norm_fused(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    headdim: int,
    ngroups: int,
    chunk_size: int,
    eps: float = 1e-5,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """:func:`mamba_conv_scan_norm_ref`'s core as one autograd op on CUDA (:class:`_ConvScanNormFn`): mamba-ssm's
    Triton scan and gated norm and causal-conv1d's kernel, with no copy but the scan output's transpose.
    Raises RuntimeError where it cannot run (see :func:`mamba_conv_scan_norm` for the dispatch)."""
    d, cd, _ = _core_sizes(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups)
    reason = _fused_unusable(zxbcdt, conv_weight, conv_bias, d, cd)
    if reason is not None:
        raise RuntimeError(f"mamba_conv_scan_norm_fused cannot run: {reason}")
    return _ConvScanNormFn.apply(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups,
                                 chunk_size, eps, tuple(dt_limit), load_fused_mamba()[0])


def mamba_conv_scan_norm(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    headdim: int,
    ngroups: int,
    chunk_size: int,
    eps: float = 1e-5,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    fused: bool = True,
) -> torch.Tensor:
    """:func:`mamba_conv_scan_norm_ref`'s core. With ``fused`` and a CUDA input that the fused op can run (mamba-ssm
    and causal-conv1d's CUDA extension installed, widths multiples of 8): :func:`mamba_conv_scan_norm_fused`;
    otherwise :func:`causal_conv1d`, :func:`ssd_scan` and :func:`rmsnorm_gated` in sequence (each its kernel on
    CUDA, its reference on CPU: there this is :func:`mamba_conv_scan_norm_ref`). A CUDA input that asked for the
    fused op and cannot have it warns once, naming the reason."""
    d, cd, _ = _core_sizes(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups)
    if fused and zxbcdt.is_cuda:
        reason = _fused_unusable(zxbcdt, conv_weight, conv_bias, d, cd)
        if reason is None:
            return _ConvScanNormFn.apply(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim,
                                         ngroups, chunk_size, eps, tuple(dt_limit), load_fused_mamba()[0])
        if "mamba_conv_scan_norm" not in _warned:
            _warned.add("mamba_conv_scan_norm")
            warnings.warn(f"mamba_conv_scan_norm: fused=True but running the unfused ops ({reason})", stacklevel=2)
    return _conv_scan_norm(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups, chunk_size,
                           eps, dt_limit, causal_conv1d, ssd_scan, rmsnorm_gated)


# ------------------------------------------------------------ incremental decoding: chunk and one-token step


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """One position of the SSD recurrence, ``state`` [b, h, p, n] updated in place (arguments and result as
    :func:`~nvfp4_train.models.mamba.ssd.ssd_step_ref`). On CUDA with mamba-ssm: its ``selective_state_update``
    kernel (fp32 inside, the output rounded to x's dtype; it applies no ``dt_limit`` clamp, so a limit other than
    the default (0, inf), which softplus already meets, runs the PyTorch step)."""
    # mamba-ssm 2.3.2's kernel wrapper needs D and dt_bias (it reads their strides): without them, the PyTorch step
    if x.is_cuda and tuple(dt_limit) == (0.0, float("inf")) and D is not None and D.dim() == 1 \
            and dt_bias is not None:
        fn, reason = load_selective_state_update()
        if fn is not None:
            h, p, n = x.shape[1], x.shape[2], state.shape[-1]
            # per-head values broadcast over the head's channels (stride 0): the kernel's one-dt-per-head path
            return fn(state, x, dt[..., None].expand(-1, -1, p), A.float()[:, None, None].expand(h, p, n), B, C,
                      D=D[:, None].expand(h, p), z=None, dt_bias=dt_bias[:, None].expand(h, p),
                      dt_softplus=dt_softplus)
        _warn_fallback("ssd_step", reason)
    return ssd_step_ref(state, x, dt, A, B, C, D, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)


def causal_conv1d_update_ref(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """The convolution's output at one new position: x [batch, dim] (the new input), ``conv_state``
    [batch, dim, width - 1] (the inputs of the positions before it, oldest first; zeros before the start), updated in
    place to end with x. The arithmetic of :func:`causal_conv1d_ref` at that position (float32, the same order of
    multiply-adds), returned in x's dtype."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    width = weight.shape[1]
    if x.dim() != 2 or conv_state.shape != (*x.shape, width - 1) or weight.shape[0] != x.shape[1]:
        raise ValueError(f"expected x [batch, dim], conv_state [batch, dim, width - 1] and weight [dim, width], got "
                         f"x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, weight {tuple(weight.shape)}")
    cdt = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat([conv_state, x[..., None].to(conv_state.dtype)], dim=-1)  # [b, dim, width]
    conv_state.copy_(window[..., 1:])
    win, w = window.to(cdt), weight.to(cdt)
    out = w[:, 0] * win[..., 0]
    for k in range(1, width):
        out = out + w[:, k] * win[..., k]
    if bias is not None:
        out = out + bias.to(cdt)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """:func:`causal_conv1d_update_ref`'s step; causal-conv1d's CUDA kernel when installed and usable (CUDA input,
    width 2..4, fp32/fp16/bf16, the state in x's dtype)."""
    if x.is_cuda:
        fn, reason = load_causal_conv1d_update()
        usable = (2 <= weight.shape[1] <= 4 and x.dtype in _CONV_KERNEL_DTYPES and conv_state.dtype == x.dtype
                  and weight.dtype in _CONV_KERNEL_DTYPES and (bias is None or bias.dtype == weight.dtype))
        if fn is not None and usable:
            return fn(x.contiguous(), conv_state, weight, bias, activation=activation)
        _warn_fallback("causal_conv1d_update", reason if fn is None else
                       f"kernel needs width 2..4 and fp32/fp16/bf16 with the state in x's dtype; got width "
                       f"{weight.shape[1]}, x {x.dtype}, state {conv_state.dtype}, weight {weight.dtype}")
    return causal_conv1d_update_ref(x, conv_state, weight, bias, activation)


def mamba_conv_scan_norm_chunk(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    headdim: int,
    ngroups: int,
    chunk_size: int,
    eps: float = 1e-5,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    conv_state: torch.Tensor | None = None,
    ssm_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core (:func:`mamba_conv_scan_norm`'s arguments) over the positions of ``zxbcdt`` [s, b, .] that follow a
    sequence whose conv inputs and SSM state are ``conv_state`` [b, d + 2gn, width - 1] and ``ssm_state``
    [b, h, headdim, n] (None, None: the start of a sequence). Returns (out [s, b, d], the new conv state, the new
    SSM state: float32, float64 for float64 inputs). From the start this is the unfused path's three ops, so on
    CPU the output is bitwise :func:`mamba_conv_scan_norm`'s."""
    d, cd, h = _core_sizes(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups)
    if (conv_state is None) != (ssm_state is None):
        raise ValueError("conv_state and ssm_state go together: both None (the start of a sequence) or both given")
    keep = conv_weight.shape[1] - 1  # positions of conv input the next position's window needs
    z, xbc, dt = torch.split(zxbcdt, [d, cd, h], dim=-1)
    xbc = xbc.permute(1, 2, 0)  # [b, cd, s], read in place as the unfused path does
    if conv_state is None:
        conv = causal_conv1d(xbc, conv_weight, conv_bias, activation="silu")
        inputs = F.pad(xbc, (keep, 0))  # zeros before the start
    else:
        inputs = torch.cat([conv_state.to(xbc.dtype), xbc], dim=-1)
        conv = causal_conv1d(inputs, conv_weight, conv_bias, activation="silu")[..., keep:]
    x, B, C = _xbc_parts(conv, d, h, headdim, ngroups)
    y, final = ssd_scan(x, dt.transpose(0, 1), A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=ssm_state,
                        dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
    y = y.flatten(-2).transpose(0, 1).contiguous()
    out = rmsnorm_gated(y, z, norm_weight, eps, group_size=d // ngroups)
    return out, inputs[..., inputs.shape[-1] - keep:].contiguous(), final


def mamba_conv_scan_norm_step(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    headdim: int,
    ngroups: int,
    eps: float = 1e-5,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """The core at ONE new position, ``zxbcdt`` [1, b, .], after the positions whose states ``conv_state`` and
    ``ssm_state`` hold (as :func:`mamba_conv_scan_norm_chunk` returns them); both are updated in place. Returns out
    [1, b, d]: :func:`causal_conv1d_update`, :func:`ssd_step` and :func:`rmsnorm_gated`, each rounding its result to
    zxbcdt's dtype where the full-sequence ops do."""
    d, cd, h = _core_sizes(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, headdim, ngroups)
    if zxbcdt.shape[0] != 1:
        raise ValueError(f"mamba_conv_scan_norm_step takes one position, got zxbcdt {tuple(zxbcdt.shape)}")
    z, xbc, dt = torch.split(zxbcdt[0], [d, cd, h], dim=-1)  # [b, .]
    xbc = causal_conv1d_update(xbc, conv_state, conv_weight, conv_bias, activation="silu")
    x, B, C = torch.split(xbc, [d, (cd - d) // 2, (cd - d) // 2], dim=-1)
    y = ssd_step(ssm_state, x.unflatten(-1, (h, headdim)), dt, A, B.unflatten(-1, (ngroups, -1)),
                 C.unflatten(-1, (ngroups, -1)), D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)
    return rmsnorm_gated(y.flatten(-2)[None], z[None], norm_weight, eps, group_size=d // ngroups)


# ------------------------------------------------------------------------------- initialisation


def init_dt_bias(
    nheads: int,
    dt_min: float = 1e-3,
    dt_max: float = 0.1,
    dt_init_floor: float = 1e-4,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """dt_bias [nheads] such that softplus(dt_bias) = dt, dt = max(exp(U(log dt_min, log dt_max)), floor)."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
    if dt_init_floor <= 0:
        raise ValueError(f"dt_init_floor must be > 0 (softplus never reaches 0), got {dt_init_floor}")
    u = torch.rand(nheads, generator=generator, device=device, dtype=torch.float32)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_init_floor)
    # inverse softplus: softplus(v) = dt  <=>  v = dt + log(1 - exp(-dt)), written stably with expm1
    return (dt + torch.log(-torch.expm1(-dt))).to(dtype)


def init_A_log(
    nheads: int,
    A_init_range: tuple[float, float] = (1.0, 16.0),
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A_log [nheads] = log(U(A_init_range)); the mixer's A = -exp(A_log) (keep A_log in float32)."""
    lo, hi = A_init_range
    if not 0 < lo <= hi:
        raise ValueError(f"A_init_range must satisfy 0 < low <= high, got {A_init_range}")
    A = torch.empty(nheads, device=device, dtype=torch.float32).uniform_(lo, hi, generator=generator)
    return torch.log(A).to(dtype)


def init_D(
    size: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """D skip weights: ones, [nheads] (or [nheads * headdim] for a per-channel D)."""
    return torch.ones(size, device=device, dtype=dtype)
