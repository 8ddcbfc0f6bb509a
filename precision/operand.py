"""Casting a tensor into the two GEMM operands a linear layer needs from it, and running a GEMM on them.

Every tensor of a linear layer (x [M,K], W [N,K], dy [M,N]) feeds two GEMMs: once "rowwise" (reduction along
its last dim) and once "columnwise" (its transpose, reduction along its first dim):

    tensor   rowwise operand           columnwise operand
    x        fprop A   (x [M,K])       wgrad B  (xᵀ [K,M])
    W        fprop B   (W [N,K])       dgrad B  (Wᵀ [K,N])
    dy       dgrad A   (dy [M,N])      wgrad A  (dyᵀ [N,M])

``cast_pair`` produces both copies with one fused kernel launch where the two casts allow it (NVFP4 1x16
with the columnwise copy Hadamard-mixed; NVFP4 16x16 tiles, whose transposed copy is the same values) and
falls back to two casts otherwise. ``qgemm(a, b)`` computes ``C = A · Bᵀ`` for two operands of one format.

Tensor-parallel amax: pass ``amax_group`` to all-reduce the NVFP4 amaxes with MAX before quantizing, so a
TP-sharded tensor gets the scales it would have unsharded (RECIPE §3: the per-tensor scale is a property of
the whole tensor).

A given amax: the op that produced a tensor may have computed, in its own pass, the raw amax its consumer's
quantizer would compute (``nvfp4_amax``: max |t| and max |RHT(tᵀ)|, non-finite as +Inf; the squared ReLU of
``fusion.activation``). It travels with the tensor (:func:`attach_amax`, read by :func:`attached_amax`: an
attribute of that tensor object, so a copy, a view or a padded tensor carries none and is measured as before), and
``cast_pair(amax=)`` takes it where its casts read a tensor amax in one fused pass (:func:`pair_amax_rht`): the same
scales, so the same bits, without the quantizer's amax pass over t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# imported here, not in the functions: an import statement costs host time on every call of the hot path
# (nvfp4_train.kernels.nvfp4 itself imports only torch; Triton is imported when a kernel first runs)
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, resolve_gemm_engine
from nvfp4_train.kernels.nvfp4 import nvfp4_amax, nvfp4_gemm, quantize_nvfp4, quantize_nvfp4_rowcol
from nvfp4_train.precision.recipe import OperandCast

__all__ = ["Operand", "cast_pair", "cast_one", "qgemm", "operand_nbytes", "attach_amax", "attached_amax",
           "pair_amax_rht"]


@dataclass
class Operand:
    """One GEMM operand: ``data`` is a bf16 tensor (format bf16) or a quantized container."""

    format: str
    data: Any

    @property
    def shape(self) -> tuple[int, int]:
        d = self.data
        return tuple(d.shape)


def _is_nvfp4_1d(c: OperandCast) -> bool:
    return c.format == "nvfp4" and c.block == (1, 16)


def _swizzled(t: torch.Tensor, engine: str) -> bool:
    """Whether FP4 operands of ``t`` are quantized with their scales in the native GEMM's layout: when the
    layer's GEMM engine (the recipe's ``gemm_engine``) resolves to ``native`` on t's device (a ValueError
    there below sm_100)."""
    return (engine == "native" or engine == "auto") and resolve_gemm_engine(engine, t.device) == "native"


def _hadamard(t: torch.Tensor) -> torch.Tensor:
    """RHT of each 16 consecutive elements of t's last dim, as t.dtype: one Triton kernel where
    ``use_triton(t)``, the reference otherwise (``nvfp4_train.kernels.hadamard``; the same bits as
    ``hadamard16_ref(t).to(t.dtype)``)."""
    from nvfp4_train.kernels.hadamard import hadamard16

    return hadamard16(t)


_AMAX_ATTR = "_nvfp4_train_amax"


def attach_amax(t: torch.Tensor, amax: torch.Tensor, col_rht: bool) -> None:
    """Record on the tensor object ``t`` its raw amax: float32 [2], ``nvfp4_amax(t.reshape(-1, t.shape[-1]),
    col_rht)`` bit for bit (entry 0 is also ``fp8_amax(t)``)."""
    setattr(t, _AMAX_ATTR, (amax, col_rht))


def attached_amax(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``(amax, col_rht)`` recorded on ``t`` by :func:`attach_amax`, or None."""
    return getattr(t, _AMAX_ATTR, None)


def pair_amax_rht(rows: int, row: OperandCast | None, col: OperandCast | None) -> bool | None:
    """Whether ``cast_pair`` of a [rows, .] tensor with these casts reads a given amax, and which: True for
    ``nvfp4_amax(t, col_rht=True)`` (the fused NVFP4 1x16 pass with a Hadamard-mixed columnwise copy), False for
    ``nvfp4_amax(t)`` (the fused NVFP4 pass without it; FP8 per-tensor scaling, which reads entry 0), None where
    its casts take no tensor amax in one pass (block scales, 16x16 tiles, one copy only, bf16)."""
    if row is None or col is None:
        return None
    if row.format == col.format == "nvfp4":
        if _is_nvfp4_1d(row) and _is_nvfp4_1d(col) and not row.hadamard and rows % 16 == 0:
            return col.hadamard
        return None
    if row.format == col.format == "fp8_e4m3" and row.block is None and col.block is None:
        return False
    return None


def cast_one(t: torch.Tensor, cast: OperandCast, seed, amax_group: dist.ProcessGroup | None = None,
             engine: str = DEFAULT_GEMM_ENGINE) -> Operand:
    """Cast a 2-D tensor (reduction along its last dim) to one operand. ``engine``: the GEMM engine that
    will consume it (the recipe's ``gemm_engine``); FP4 scales are written swizzled when it resolves to native."""
    sr = cast.rounding == "stochastic"
    if cast.format == "bf16":
        return Operand("bf16", t)
    if cast.format == "nvfp4":
        amax = None
        if amax_group is not None:
            # the amax of what gets quantized: RHT(t) along its last dim is the columnwise copy of t^T
            amax = nvfp4_amax(t.t(), col_rht=True)[1] if cast.hadamard else nvfp4_amax(t)[0]
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
        return Operand("nvfp4", quantize_nvfp4(t, block_2d=cast.block == (16, 16), rht=cast.hadamard,
                                               stochastic=sr, seed=seed, amax=amax, swizzled=_swizzled(t, engine)))
    if cast.format == "mxfp4":
        from nvfp4_train.kernels.mxfp4 import quantize_mxfp4

        src = _hadamard(t) if cast.hadamard else t
        kwargs = {"block_2d": True} if cast.block == (32, 32) else {}
        return Operand("mxfp4", quantize_mxfp4(src, stochastic=sr, seed=seed, swizzled=_swizzled(t, engine),
                                               **kwargs))
    if cast.format == "fp8_e4m3":
        from nvfp4_train.kernels.fp8 import quantize_fp8

        return Operand("fp8_e4m3", quantize_fp8(t, block=cast.block, amax_group=amax_group))
    raise ValueError(f"unknown operand format {cast.format!r}")


def cast_pair(
    t: torch.Tensor,
    row: OperandCast | None,
    col: OperandCast | None,
    seeds: tuple,
    amax_group: dist.ProcessGroup | None = None,
    engine: str = DEFAULT_GEMM_ENGINE,
    amax: tuple[torch.Tensor, bool] | None = None,
) -> tuple[Operand | None, Operand | None]:
    """The rowwise operand of ``t`` [R, C] (reduction along C) and the columnwise one (of ``tᵀ``).

    ``None`` for a cast skips that copy. ``seeds``: the stochastic-rounding seeds of the two copies
    (``nvfp4_train.kernels.sr_key.operand_seed``): ints, or 0-d int64 device tensors holding them (the quantizers' ``seed``).
    ``engine``: as for ``cast_one``. ``amax``: t's raw amax as :func:`attached_amax` gives it, used where
    :func:`pair_amax_rht` says these casts read that one (all-reduced over ``amax_group`` first, as a computed one
    is); else ignored.
    """
    row_seed, col_seed = seeds
    if amax is not None and pair_amax_rht(t.shape[0], row, col) != amax[1]:
        amax = None
    if row is not None and col is not None and row.format == col.format == "nvfp4":
        fused = None  # (block_2d, col_rht) of the fused row + column kernel, when the two casts allow it
        if _is_nvfp4_1d(row) and _is_nvfp4_1d(col) and not row.hadamard and t.shape[0] % 16 == 0:
            fused = (False, col.hadamard)
        elif row.block == col.block == (16, 16) and not row.hadamard and not col.hadamard and row.rounding == col.rounding:
            fused = (True, False)
        if fused is not None:
            block_2d, col_rht = fused
            row_amax = col_amax = None
            if amax is not None or amax_group is not None:
                am = amax[0] if amax is not None else nvfp4_amax(t, col_rht=col_rht)
                if amax_group is not None:
                    if amax is not None:
                        am = am.clone()  # the producer's record stays the local amax
                    dist.all_reduce(am, op=dist.ReduceOp.MAX, group=amax_group)
                # two views of one buffer (one op): the quantizer reads them in place, no copy
                row_amax, col_amax = am.unbind()
            r, c = quantize_nvfp4_rowcol(
                t, block_2d=block_2d, col_rht=col_rht, row_stochastic=row.rounding == "stochastic",
                col_stochastic=col.rounding == "stochastic", row_seed=row_seed, col_seed=col_seed,
                row_amax=row_amax, col_amax=None if block_2d else col_amax, swizzled=_swizzled(t, engine),
            )
            return Operand("nvfp4", r), Operand("nvfp4", c)
    if row is not None and col is not None and row.format == col.format == "fp8_e4m3" and row.block == col.block:
        # one read of t for both copies (1x128: x^T requantized in blocks along M; 128x128 and per tensor: the
        # same values transposed), the same bits as the two casts below (quantize_fp8_rowcol_ref)
        from nvfp4_train.kernels.fp8 import quantize_fp8_rowcol

        r, c = quantize_fp8_rowcol(t, block=row.block, amax=None if amax is None else amax[0][0],
                                   amax_group=amax_group)
        return Operand("fp8_e4m3", r), Operand("fp8_e4m3", c)
    r = cast_one(t, row, row_seed, amax_group, engine) if row is not None else None
    c = cast_one(t.t(), col, col_seed, amax_group, engine) if col is not None else None
    return r, c


def qgemm(a: Operand, b: Operand, out_dtype: torch.dtype, engine: str = DEFAULT_GEMM_ENGINE) -> torch.Tensor:
    """``C = A · Bᵀ`` for two operands of the same format (fp32 accumulation), as ``out_dtype``. ``engine``:
    the fp4 GEMM engine (``kernels/gemm_engine.py``; the recipe's ``gemm_engine``)."""
    if a.format != b.format:
        raise ValueError(f"GEMM operands must share a format, got {a.format} and {b.format}")
    if a.format == "bf16":
        return torch.matmul(a.data, b.data.t()).to(out_dtype)
    if a.format == "nvfp4":
        return nvfp4_gemm(a.data, b.data, out_dtype=out_dtype, engine=engine)
    if a.format == "mxfp4":
        from nvfp4_train.kernels.mxfp4 import mxfp4_gemm

        return mxfp4_gemm(a.data, b.data, out_dtype=out_dtype, engine=engine)
    if a.format == "fp8_e4m3":
        from nvfp4_train.kernels.fp8 import fp8_gemm

        return fp8_gemm(a.data, b.data, out_dtype=out_dtype)
    raise ValueError(f"unknown operand format {a.format!r}")


def operand_nbytes(op: Operand | None) -> int:
    """Bytes held by an operand (for the memory accounting of saved activations)."""
    if op is None:
        return 0
    if op.format == "bf16":
        return op.data.numel() * op.data.element_size()
    return sum(v.numel() * v.element_size() for v in vars(op.data).values() if isinstance(v, torch.Tensor))
