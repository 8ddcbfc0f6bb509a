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
==================  ==========================================  ==========================================

A CUDA input that falls back warns once per op, naming the reason (the fallbacks are slow at scale).

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

from nvfp4_train.models.mamba._import import load_causal_conv1d, load_mamba_ssm
from nvfp4_train.models.mamba.ssd import ssd_chunked_scan

__all__ = [
    "ssd_scan",
    "causal_conv1d",
    "causal_conv1d_ref",
    "rmsnorm_gated",
    "rmsnorm_gated_ref",
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
