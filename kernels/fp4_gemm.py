"""The block-scaled FP4 GEMM in Triton for GPUs without FP4 tensor cores (Hopper), shared by NVFP4
(``kernels/nvfp4/gemm.py``) and MXFP4 (``kernels/mxfp4/gemm.py``): dequantize each operand once to a 16-bit
tensor, run a 16-bit tensor-core GEMM with fp32 accumulation, apply the tensor scales to the fp32 accumulator.
Written below for NVFP4 (E4M3 scales over 16 elements, an alpha); MXFP4 has E8M0 scales over 32 and no alpha.

    C[M, N] = alpha * sum_k (qa[m, k] * sa[m, k // 16]) * (qb[n, k] * sb[n, k // 16])
    alpha   = (amax_A / 2688) * (amax_B / 2688)          (``nvfp4_alpha``, an fp32 0-d DEVICE tensor)

Layout (both operands blocked along K, as ``NVFP4Tensor``):
    A codes uint8 [M, K/2], A scales E4M3 [M, K/16];  B codes uint8 [N, K/2], B scales E4M3 [N, K/16]
    byte j of a row holds element 2j in its LOW nibble and element 2j+1 in its HIGH nibble.

Why this is exact (RECIPE §3): an E2M1 value (2 significant bits, |v| in {0.5 .. 6}) times an E4M3 scale
(4 significant bits, 2^-9 .. 448) has at most 6 significant bits and lies in [2^-10, 2688], so it is exact
in fp16 (11 bits, subnormals down to 2^-24, max 65504), in bf16 and in fp32; a tensor core multiplies two
such values exactly and accumulates in fp32. The only roundings are the fp32 accumulation (its order is
the hardware's) and the two of the epilogue: ``fl(acc * alpha)`` and the rounding to ``out_dtype``.
Alpha is LOADED from device memory: no host sync, the amax never leaves the GPU.

Dequantization (``_dequant_pair_kernel``: both operands of one GEMM in ONE launch, the row tiles of A, then
those of B, into one [M + N, K] allocation), fewest operations per element (the scales are 1/16 as many):
  * E2M1 -> fp16 by bits: ``((c & 7) << 9) | ((c & 8) << 12)`` puts the 2 exponent bits and the mantissa
    bit of the code at the top of fp16's exponent/mantissa fields; read as fp16 it is value * 2^-14 for
    every code (code 1 becomes the fp16 subnormal 2^-15, exact). One fp16 multiply by 2^14 restores it.
  * E4M3 -> fp16 by bits: ``((s & 0x7F) << 7) | ((s & 0x80) << 8)`` is value * 2^-8 for every finite
    byte (E4M3 subnormals land on fp16 subnormals, exact); times 256. 0x7F / 0xFF decode to NaN.
  * value = e2m1 * scale, one multiply in the dot dtype (exact).
The dot dtype is "fp16", "bf16" (GPU only: the interpreter multiplies raw bf16 bits) or "fp32" (the
interpreter's dtype for bf16 callers and MXFP4; on the GPU ``input_precision="ieee"``).

The two Hopper engines of the 16-bit GEMM (``engine=``, from the run's ``precision.gemm_engine``):
  * "cublas" (the default): on CUDA ONE cuBLASLt GEMM on the bf16 operands with alpha read from device memory
    in its epilogue (``kernels/cublaslt.py``: fp32 accumulation, ``fl32(acc * alpha)``, one RNE rounding to the
    output dtype); the dequantize launch forms ``nvfp4_alpha`` from the two amax device scalars (``div_rn``
    twice, one product: torch's bits) for it. fp16 operands into bf16 output (no such cuBLASLt pair) go through
    its fp32 output and the rounding pass below. Under ``TRITON_INTERPRET=1`` (CPU tensors) the accumulator
    is ``a.float() @ b.float().t()`` (the same exact products, another order), then ONE Triton elementwise pass
    ``_alpha_scale_kernel`` that computes ``fl(acc * alpha)`` rounded to bf16 by ``_bf16_rne`` (fp32 output:
    in place), with the alpha of the same dequantize launch.
  * "triton": ``_gemm16_kernel``, a pipelined 16-bit Triton GEMM (fp16 operands) with the same epilogue
    arithmetic in registers, alpha loaded from its device pointer. Also the MXFP4 GEMM's kernel.
Measured in one run on the H200 (docs/benchmarks.md): "cublas" 1.01-1.06x cuBLAS BF16 (``torch.matmul``) on the
six 12B GEMM shapes with the dequantize launch included, its GEMM 1.04-1.13x faster than the design it replaced
(cuBLAS with fp32 output, then the alpha pass); "triton" 0.81-0.86x. Both engines are exact up to the fp32
summation order.

Split-K: the cuBLASLt GEMM allows only split-K schemes that reduce the partial sums in fp32 (its compute type,
``CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE``), whatever torch's ``allow_bf16_reduced_precision_reduction`` /
``allow_fp16_reduced_precision_reduction`` say (they apply to torch's own GEMM calls). A GPU test with exact
partial sums at K = 20480 (tests/kernels/test_nvfp4_gemm_cublas.py), run with both switches on, would catch a
16-bit reduction.

Other designs measured on the way (a GEMM that dequantizes in its registers, a single-operand dequantize
launch, cuBLAS with fp32 output followed by a separate alpha pass; docs/benchmarks.md) are in git history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import interpret_mode
from nvfp4_train.kernels.cublaslt import matmul_device_alpha, supported_dtypes
from nvfp4_train.kernels.fp4_triton import cdiv, round_to_bf16, u32

# compile-time codes
DOT_FP16 = tl.constexpr(0)
DOT_BF16 = tl.constexpr(1)
DOT_FP32 = tl.constexpr(2)
SCALE_E4M3 = tl.constexpr(0)  # NVFP4
SCALE_E8M0 = tl.constexpr(1)  # MXFP4
_DOT_CODES = {"fp16": 0, "bf16": 1, "fp32": 2}
_DOT_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_DOT_NAME = {v: k for k, v in _DOT_TORCH.items()}
_OUT_DTYPES = (torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# device functions: decoding
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_f16(nib):
    """uint16 E2M1 codes (0..15) -> fp16 values, exact."""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    v = bits.to(tl.float16, bitcast=True)
    v = v * 16384.0
    return v


@triton.jit
def _e4m3_f16(s):
    """uint8 E4M3 bytes -> fp16 values, exact; 0x7F / 0xFF -> NaN."""
    s16 = s.to(tl.uint16)
    bits = ((s16 & 0x7F) << 7) | ((s16 & 0x80) << 8)
    v = bits.to(tl.float16, bitcast=True) * 256.0
    return tl.where((s16 & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _e8m0(s, DOT: tl.constexpr):
    """uint8 E8M0 bytes -> 2^(s - 127) in the dot dtype (bf16 or fp32), exact; 0 -> 2^-127 (subnormal),
    0xFF -> NaN."""
    if DOT == DOT_FP32:
        s32 = s.to(tl.uint32)
        bits = tl.where(s32 == 0, 0x00400000, s32 << 23)
        bits = tl.where(s32 == 255, 0x7FC00000, bits).to(tl.uint32)
        return bits.to(tl.float32, bitcast=True)
    else:
        s16 = s.to(tl.uint16)
        bits = tl.where(s16 == 0, 0x0040, s16 << 7)
        bits = tl.where(s16 == 255, 0x7FC0, bits).to(tl.uint16)
        return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_dot(v, DOT: tl.constexpr):
    """fp16 -> the dot dtype (exact for every value produced here)."""
    if DOT == DOT_BF16:
        return v.to(tl.bfloat16)
    elif DOT == DOT_FP32:
        return v.to(tl.float32)
    else:
        return v


@triton.jit
def _dequant_halves(
    codes, scales, R: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr,
):
    """codes uint8 [R, BK/2], scales uint8 [R, BK/SB] -> (even, odd) elements, each [R, BK/2] in the dot
    dtype: column j of ``even`` is element 2j, of ``odd`` element 2j+1; both in block (2j) // SB."""
    c16 = codes.to(tl.uint16)
    lo = _to_dot(_e2m1_f16(c16 & 0xF), DOT)
    hi = _to_dot(_e2m1_f16(c16 >> 4), DOT)
    if FMT == SCALE_E4M3:
        sc = _to_dot(_e4m3_f16(scales), DOT)
    else:
        sc = _e8m0(scales, DOT)
    scb = tl.reshape(tl.broadcast_to(sc[:, :, None], [R, BK // SB, SB // 2]), [R, BK // 2])
    return lo * scb, hi * scb


@triton.jit
def _dequant_tile(
    codes, scales, R: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr,
):
    """codes uint8 [R, BK/2], scales uint8 [R, BK/SB] -> [R, BK] values in element order (``tl.join`` of the
    low/high nibbles, a register-level interleave)."""
    lo, hi = _dequant_halves(codes, scales, R, BK, SB, FMT, DOT)
    return tl.reshape(tl.join(lo, hi), [R, BK])


# ----------------------------------------------------------------------------------------------------------
# device functions: tile scheduling and epilogue
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row tiles share each column tile's B panel while it is in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_m)
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even, by bits: the high half of the rounded fp32 pattern. (The
    interpreter's fp32->bf16 cast truncates and mishandles bf16 subnormals; this is exact everywhere.)
    NaN is mapped explicitly: the GPU's canonical NaN 0x7FFFFFFF would carry into the sign bit."""
    r = u32(round_to_bf16(x)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _epilogue(
    acc, alpha_ptr, c_ptr, pid_m, pid_n, M, N, s_cm, s_cn,
    HAS_ALPHA: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    if HAS_ALPHA:
        acc = acc * tl.load(alpha_ptr)  # fl(acc * alpha): one fp32 rounding
    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    ptrs = c_ptr + om[:, None].to(tl.int64) * s_cm + on[None, :] * s_cn
    mask = (om[:, None] < M) & (on[None, :] < N)
    if OUT_BF16:
        tl.store(ptrs, _bf16_rne(acc), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    """acc += a @ b with fp32 accumulation; fp32 operands are multiplied exactly (no TF32)."""
    if DOT == DOT_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _dequant_tile_store(
    codes, scales, out, M, K, s_cm, s_ck, s_sm, s_sk, s_om, s_ok, pid_m, pid_k,
    FMT: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """Row tile ``pid_m``, K tile ``pid_k`` of ``q * block_scale`` (no tensor scale) in the dot dtype."""
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rkh = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    rks = pid_k * (BK // SB) + tl.arange(0, BK // SB)
    mrow = rm[:, None] < M
    c = tl.load(codes + rm[:, None] * s_cm + rkh[None, :] * s_ck, mask=mrow & (rkh[None, :] < K // 2), other=0)
    s = tl.load(scales + rm[:, None] * s_sm + rks[None, :] * s_sk, mask=mrow & (rks[None, :] < K // SB), other=0)
    v = _dequant_tile(c, s, BM, BK, SB, FMT, DOT)
    rk = pid_k * BK + tl.arange(0, BK)
    tl.store(out + rm[:, None] * s_om + rk[None, :] * s_ok, v, mask=mrow & (rk[None, :] < K))


@triton.jit
def _dequant_pair_kernel(
    a_codes, a_scales, a_out, M, s_acm, s_ack, s_asm, s_ask, s_aom, s_aok,
    b_codes, b_scales, b_out, N, s_bcm, s_bck, s_bsm, s_bsk, s_bom, s_bok,
    K, amax_a, amax_b, alpha_out,
    FMT: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ALPHA: tl.constexpr,
):
    """Both operands of one GEMM in ONE launch: row tiles 0 .. cdiv(M, BM) - 1 of axis 0 dequantize A, the
    following cdiv(N, BM) ones B (axis 1: the K tiles, shared). Each program takes one branch. ``ALPHA``:
    program (0, 0) also writes ``nvfp4_alpha(amax_a, amax_b) = fl(amax_a / 2688) * fl(amax_b / 2688)``
    (correctly rounded divisions, one product: torch's bits) to ``alpha_out`` for the GEMM's epilogue."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ALPHA:
        if (pid == 0) & (pid_k == 0):
            tl.store(alpha_out, tl.math.div_rn(tl.load(amax_a), 2688.0) * tl.math.div_rn(tl.load(amax_b), 2688.0))
    tiles_a = tl.cdiv(M, BM)
    if pid < tiles_a:
        _dequant_tile_store(a_codes, a_scales, a_out, M, K, s_acm, s_ack, s_asm, s_ask, s_aom, s_aok,
                            pid, pid_k, FMT, SB, DOT, BM, BK)
    else:
        _dequant_tile_store(b_codes, b_scales, b_out, N, K, s_bcm, s_bck, s_bsm, s_bsk, s_bom, s_bok,
                            pid - tiles_a, pid_k, FMT, SB, DOT, BM, BK)


@triton.jit
def _gemm16_kernel(
    a_ptr, b_ptr, alpha_ptr, c_ptr, M, N, K, s_am, s_ak, s_bn, s_bk, s_cm, s_cn,
    HAS_ALPHA: tl.constexpr, DOT: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = alpha * A[M, K] @ B[N, K]^T over already-dequantized 16-bit (or fp32) operands."""
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = ((pid_m * BM + tl.arange(0, BM)) % M).to(tl.int64)
    rn = ((pid_n * BN + tl.arange(0, BN)) % N).to(tl.int64)
    rk = tl.arange(0, BK)
    pa = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
    pb = b_ptr + rn[:, None] * s_bn + rk[None, :] * s_bk
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(pa)
            b = tl.load(pb)
        else:
            kmask = rk[None, :] < K - kt * BK
            a = tl.load(pa, mask=kmask, other=0.0)
            b = tl.load(pb, mask=kmask, other=0.0)
        acc = _dot(a, tl.trans(b), acc, DOT)
        pa += BK * s_ak
        pb += BK * s_bk
    _epilogue(acc, alpha_ptr, c_ptr, pid_m, pid_n, M, N, s_cm, s_cn, HAS_ALPHA, OUT_BF16, BM, BN)


@triton.jit
def _alpha_scale_kernel(
    acc_ptr, alpha_ptr, amax_b_ptr, out_ptr, n,
    HAS_ALPHA: tl.constexpr, FROM_AMAX: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[i] = round_to_out(fl32(acc[i] * alpha)) over a contiguous fp32 accumulator of n elements: the
    epilogue of ``_gemm16_kernel`` (same fp32 multiply, same ``_bf16_rne``) as its own pass. ``out`` may be
    ``acc`` itself (fp32 output): each element is read and written by the same program. ``FROM_AMAX``:
    ``alpha_ptr`` and ``amax_b_ptr`` point at the two operands' fp32 amax and every program forms
    ``alpha = fl(amax_a / 2688) * fl(amax_b / 2688)`` itself (correctly rounded divisions: ``nvfp4_alpha``'s
    arithmetic), which saves the three small torch kernels that would compute it on the device first."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    if FROM_AMAX:
        alpha = tl.math.div_rn(tl.load(alpha_ptr), 2688.0) * tl.math.div_rn(tl.load(amax_b_ptr), 2688.0)
        x = x * alpha
    elif HAS_ALPHA:
        x = x * tl.load(alpha_ptr)  # fl(acc * alpha): one fp32 rounding
    if OUT_BF16:
        tl.store(out_ptr + offs, _bf16_rne(x), mask=mask)
    else:
        tl.store(out_ptr + offs, x, mask=mask)


# ----------------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters. A pure performance choice: on the GPU the bits do not depend on
    it (see the module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# Under the interpreter: small tiles keep the CPU tests fast (warps/stages are ignored there).
INTERPRET_CONFIG = GemmConfig(32, 32, 64, 4, 1)
# the 16-bit GEMM on sm_90 (the usual Triton-on-Hopper bf16 matmul configs; 8 warps = two consumer warpgroups
# for wgmma with a 128-row tile); measured on the H200 (docs/benchmarks.md): 675 TFLOP/s on qkv vs 568 for
# 128x256x64
LARGE_CONFIG = GemmConfig(128, 128, 64, 8, 3)
MEDIUM_CONFIG = GemmConfig(128, 128, 64, 8, 3)
SMALL_CONFIG = GemmConfig(64, 64, 128, 4, 3)


def default_config(M: int, N: int) -> GemmConfig:
    """The config table of the 16-bit GEMM, keyed on shape (deterministic; no autotuning)."""
    if interpret_mode():
        return INTERPRET_CONFIG
    if M >= 1024 and N >= 1024:
        return LARGE_CONFIG
    if M >= 128 and N >= 128:
        return MEDIUM_CONFIG
    return SMALL_CONFIG


def _check_config(cfg: GemmConfig, block: int) -> None:
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
    if cfg.block_k % block:
        raise ValueError(f"GemmConfig.block_k must be a multiple of the scale block {block}, got {cfg.block_k}")


def _check_dot_dtype(dot_dtype: str) -> None:
    if dot_dtype not in _DOT_CODES:
        raise ValueError(f"dot_dtype must be one of {sorted(_DOT_CODES)}, got {dot_dtype!r}")
    if dot_dtype == "bf16" and interpret_mode():
        raise ValueError(
            "dot_dtype='bf16' is wrong under TRITON_INTERPRET=1 (the interpreter multiplies raw bf16 bits); "
            "use 'fp16' or 'fp32' there"
        )


# ----------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------


def _check_operands(
    a_codes, a_scales, b_codes, b_scales, alpha, *, block: int, fmt_name: str,
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[int, int, int]:
    """(M, N, K) of two block-scaled FP4 operands (codes uint8 [., K/2], 1-byte scales [., K/block]), or a
    ValueError/TypeError that names the problem. ``alpha`` and ``amax`` (the
    cublas engine's pair), when given, must be on the codes' device too."""
    if a_codes.dim() != 2 or b_codes.dim() != 2:
        raise ValueError(f"{fmt_name} GEMM takes 2-D operands, got codes {tuple(a_codes.shape)} and "
                         f"{tuple(b_codes.shape)}")
    if a_codes.dtype != torch.uint8 or b_codes.dtype != torch.uint8:
        raise TypeError(f"{fmt_name} codes must be uint8, got {a_codes.dtype} and {b_codes.dtype}")
    M, K = a_codes.shape[0], a_codes.shape[1] * 2
    N, Kb = b_codes.shape[0], b_codes.shape[1] * 2
    if K != Kb:
        raise ValueError(f"{fmt_name} GEMM: reduction dims differ (A is {(M, K)}, B is {(N, Kb)})")
    if K % block != 0:
        raise ValueError(
            f"{fmt_name} GEMM needs K a multiple of the scale block {block}, got K = {K}; pad K to a "
            f"multiple of {block} (zero codes with zero scales contribute nothing)"
        )
    for name, s, rows in (("A", a_scales, M), ("B", b_scales, N)):
        if s.element_size() != 1 or tuple(s.shape) != (rows, K // block):
            raise ValueError(f"{fmt_name} GEMM: {name} scales must be 1-byte [{rows}, {K // block}], got "
                             f"{s.dtype} {tuple(s.shape)}")
    dev = a_codes.device
    tensors = [b_codes, a_scales, b_scales] + ([alpha] if alpha is not None else []) + list(amax or ())
    if any(t.device != dev for t in tensors):
        raise ValueError(f"{fmt_name} GEMM: all operands (codes, scales, amax) must be on {dev}")
    return M, N, K


def _dequant_dtypes(dtype: torch.dtype, scale_format: str) -> tuple[str, str]:
    """(dot, kdot): the dot dtype name of ``dtype`` and the one the dequantize kernel computes in.
    It computes in fp16 then converts; under the interpreter bf16 products are done on raw
    bits, so there the bf16 output goes through fp32 (exact) instead."""
    dot = _DOT_NAME.get(dtype)
    if dot is None:
        raise TypeError(f"dequantized operands are float16, bfloat16 or float32, got {dtype}")
    if dot == "fp16" and scale_format == "e8m0":
        raise ValueError("E8M0-scaled values are not all representable in fp16; use bfloat16 or float32")
    kdot = "fp32" if (dot == "bf16" and interpret_mode()) else dot
    return dot, kdot


# the dequantize launch: 16 rows x 512 columns a program, 4 warps. Swept on the H200 against 8 other tiles on the
# `1.2b` and 12B operand pairs (scripts/bench_fp4_dequant.py, docs/benchmarks.md): 0.79-0.98x the time of the 64 x 128
# tile it replaced on every pair, 83-84% of copy bandwidth on the 12B ones. A pure performance choice: every output
# element depends on its own code and scale only.
DEQUANT_BLOCK_M, DEQUANT_BLOCK_K, DEQUANT_WARPS = 16, 512, 4


def dequantize_fp4_blockwise_pair_triton(
    a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor, *,
    block: int, scale_format: str, dtype: torch.dtype, block_m: int = DEQUANT_BLOCK_M, block_k: int = DEQUANT_BLOCK_K,
    num_warps: int = DEQUANT_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands of one GEMM, ``q * block_scale`` as [M, K] and [N, K] tensors of ``dtype``, in ONE launch
    of ``_dequant_pair_kernel`` (the row tiles of A, then those of B). Both live in one [M + N, K]
    allocation (A its first M rows, B the rest: two contiguous views), one allocator call instead of two."""
    K = a_codes.shape[1] * 2
    if b_codes.shape[1] * 2 != K:
        raise ValueError(f"the two operands' K differ: {K} and {b_codes.shape[1] * 2}")
    if K % block != 0:
        raise ValueError(f"K must be a multiple of the scale block {block}, got K = {K}")
    if b_codes.device != a_codes.device:
        raise ValueError(f"both operands must be on one device, got {a_codes.device} and {b_codes.device}")
    return _dequant_pair(a_codes, a_scales, b_codes, b_scales, block=block, scale_format=scale_format,
                         dtype=dtype, block_m=block_m, block_k=block_k, num_warps=num_warps)[:2]


def _dequant_pair(a_codes, a_scales, b_codes, b_scales, *, block, scale_format, dtype, block_m=DEQUANT_BLOCK_M,
                  block_k=DEQUANT_BLOCK_K, num_warps=DEQUANT_WARPS, amax=None):
    """``dequantize_fp4_blockwise_pair_triton`` without its shape and device checks (for callers that made
    them: ``predequant_fp4_gemm``), returning ``(a, b, alpha)``. ``amax=(amax_a, amax_b)`` (two 1-element fp32
    tensors on the codes' device): the launch also forms ``nvfp4_alpha`` from them, as the 1-element fp32 device
    tensor ``alpha``; without it ``alpha`` is None."""
    dot, kdot = _dequant_dtypes(dtype, scale_format)
    M, K = a_codes.shape[0], a_codes.shape[1] * 2
    N = b_codes.shape[0]
    dev = a_codes.device
    out = torch.empty((M + N, K), dtype=dtype, device=dev)
    alpha = None if amax is None else torch.empty(1, dtype=torch.float32, device=dev)
    if M + N == 0 or K == 0:
        if alpha is not None:
            alpha.copy_(_alpha_of_amax(amax))
        return out[:M], out[M:], alpha
    a_s = a_scales.view(torch.uint8)
    b_s = b_scales.view(torch.uint8)
    block_k = max(block_k, block)
    grid = (cdiv(M, block_m) + cdiv(N, block_m), cdiv(K, block_k))
    tmp = out if kdot == dot else torch.empty((M + N, K), dtype=torch.float32, device=dev)
    ta, tb = tmp.split_with_sizes((M, N))  # = tmp[:M], tmp[M:] in one op
    amax_a, amax_b = amax if amax is not None else (tmp, tmp)
    _dequant_pair_kernel[grid](
        a_codes, a_s, ta, M, a_codes.stride(0), a_codes.stride(1), a_s.stride(0), a_s.stride(1),
        ta.stride(0), ta.stride(1),
        b_codes, b_s, tb, N, b_codes.stride(0), b_codes.stride(1), b_s.stride(0), b_s.stride(1),
        tb.stride(0), tb.stride(1),
        K, amax_a, amax_b, alpha if alpha is not None else tmp,
        FMT=0 if scale_format == "e4m3" else 1, SB=block, DOT=_DOT_CODES[kdot], BM=block_m, BK=block_k,
        ALPHA=alpha is not None, num_warps=num_warps,
    )
    if tmp is not out:
        out.copy_(tmp)
        ta, tb = out.split_with_sizes((M, N))
    return ta, tb, alpha


def _check_gemm16_args(
    name: str, a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor | None, out_dtype: torch.dtype,
    dtypes: tuple[torch.dtype, ...],
) -> torch.Tensor | None:
    """The argument checks of the GEMMs over dequantized operands; returns alpha as a 1-element fp32 tensor
    (or None)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name}: A and B dtypes differ ({a.dtype}, {b.dtype})")
    if a.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} takes {names} operands, got {a.dtype}")
    if b.device != a.device:
        raise ValueError(f"{name}: A and B must be on the same device, got {a.device} and {b.device}")
    return _check_out_and_alpha(out_dtype, alpha, a.device)


def _check_out_and_alpha(out_dtype: torch.dtype, alpha: torch.Tensor | None,
                         device: torch.device) -> torch.Tensor | None:
    """``out_dtype`` is bf16 or fp32, and ``alpha`` (if given) a tensor on ``device``, returned as a 1-element
    contiguous fp32 tensor."""
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return None if alpha is None else _device_scalar(alpha, device, "alpha")


def _device_scalar(t: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """``t`` (on ``device``) as the 1-element contiguous fp32 tensor a kernel loads (``t`` itself when it
    already is one, 0-d included: the kernel loads the element at its address; no torch op); ``name`` in the
    error."""
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.dtype == torch.float32 and t.dim() <= 1 and t.numel() == 1:
        return t
    return t.to(torch.float32).reshape(1).contiguous()


def gemm_alpha_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """C[M, N] = alpha * A[M, K] @ B[N, K]^T for fp16/bf16 (or fp32) A and B of the same dtype, fp32
    accumulation, ``alpha`` a 1-element fp32 device tensor loaded in the epilogue (None: 1)."""
    alpha = _check_gemm16_args("gemm_alpha_triton", a, b, alpha, out_dtype, tuple(_DOT_TORCH.values()))
    dot = _DOT_NAME[a.dtype]
    _check_dot_dtype(dot)
    M, K = a.shape
    N = b.shape[0]
    cfg = config or default_config(M, N)
    _check_config(cfg, 16)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
    _gemm16_kernel[grid](
        a, b, alpha if alpha is not None else c, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_ALPHA=alpha is not None, DOT=_DOT_CODES[dot], OUT_BF16=out_dtype == torch.bfloat16,
        EVEN_K=K % cfg.block_k == 0, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


# the operand dtypes of the "cublas" engine; the default is bf16 (see gemm_alpha_cublas)
_CUBLAS_DTYPES = (torch.bfloat16, torch.float16)
_ALPHA_BLOCK = 4096


# the Hopper engines of predequant_fp4_gemm (``engine=``); nvfp4_train.kernels.gemm_engine.GEMM_ENGINES adds "native", "auto"
HOPPER_ENGINES = ("cublas", "triton")


def check_gemm_engine(engine: str) -> str:
    if engine not in HOPPER_ENGINES:
        raise ValueError(f"Hopper GEMM engine must be one of {HOPPER_ENGINES}, got {engine!r}")
    return engine


def scale_alpha_triton(
    acc: torch.Tensor, alpha: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16,
    *, amax: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``round_to_out_dtype(fl32(acc * alpha))`` for an fp32 accumulator ``acc`` (one Triton elementwise pass,
    alpha a 1-element fp32 DEVICE tensor loaded by the kernel: no host sync; None: 1). bf16 output rounds to
    nearest even by bits (``_bf16_rne``, the same code as the Triton GEMM's epilogue, so the interpreter and
    the GPU give the same bits); NaN -> 0x7FC0. For ``out_dtype=torch.float32`` the result is written IN PLACE
    into ``acc`` (which must then be contiguous) and ``acc`` is returned. ``amax=(amax_a, amax_b)`` instead of
    ``alpha``: the kernel forms ``nvfp4_alpha(amax_a, amax_b)`` itself from the two fp32 device scalars (the
    same bits, three fewer kernel launches)."""
    if acc.dtype != torch.float32:
        raise TypeError(f"scale_alpha_triton: the accumulator must be float32, got {acc.dtype}")
    amax = _amax_pair_scalars("scale_alpha_triton", alpha, amax, acc.device)
    alpha = _check_out_and_alpha(out_dtype, alpha, acc.device)
    if out_dtype == torch.float32 and not acc.is_contiguous():
        raise ValueError("scale_alpha_triton writes fp32 output in place: acc must be contiguous")
    return _scale_alpha(acc, alpha, out_dtype, amax)


def _scale_alpha(acc: torch.Tensor, alpha: torch.Tensor | None, out_dtype: torch.dtype,
                 amax: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``scale_alpha_triton`` without its checks: ``acc`` fp32 (contiguous for fp32 output), ``alpha`` and the
    ``amax`` pair already the 1-element fp32 tensors of ``_device_scalar`` on acc's device."""
    if out_dtype == torch.float32:
        if alpha is None and amax is None:
            return acc
        out = acc
    else:
        acc = acc.contiguous()
        out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    n = acc.numel()
    if n == 0:
        return out
    grid = (cdiv(n, _ALPHA_BLOCK),)
    if amax is not None:
        first, second = amax
    else:
        first, second = (alpha if alpha is not None else acc), acc
    _alpha_scale_kernel[grid](
        acc, first, second, out, n,
        HAS_ALPHA=alpha is not None, FROM_AMAX=amax is not None, OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK=_ALPHA_BLOCK, num_warps=8,
    )
    return out


def _amax_pair_scalars(fname: str, alpha: torch.Tensor | None, amax: tuple[torch.Tensor, torch.Tensor] | None,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``amax=(amax_a, amax_b)`` argument of the alpha pass as two ``_amax_scalar``s on ``device`` (None
    stays None); it excludes ``alpha``. ``fname`` names the caller in the error."""
    if amax is None:
        return None
    if alpha is not None:
        raise ValueError(f"{fname}: give alpha or amax, not both")
    return tuple(_amax_scalar(t, device) for t in amax)


def _amax_scalar(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An amax as the 1-element contiguous fp32 tensor the alpha kernel loads (itself when it already is one)."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise ValueError(f"amax must be a 1-element tensor, got {t if not isinstance(t, torch.Tensor) else t.shape}")
    return _device_scalar(t, device, "amax")


def gemm_alpha_cublas(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The same product as ``gemm_alpha_triton`` by cuBLAS: ``acc = torch.mm(a, b.t(), out_dtype=float32)``
    (fp32 accumulation AND fp32 output: the raw accumulator), then ``scale_alpha_triton(acc, alpha,
    out_dtype)`` (in place for fp32 output). A, B: bf16 or fp16 of the same dtype; CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``, where ``aten::mm.dtype`` does not exist and the accumulator is
    ``a.float() @ b.float().t()`` instead (a product of two 16-bit values is exact in fp32 unless it falls
    below fp32's range, as on the tensor cores; dequantized NVFP4 values, >= 2^-10 in magnitude, never do;
    only the fp32 summation order differs). Needs torch >= 2.8 on CUDA. ``amax=(amax_a, amax_b)`` instead of
    ``alpha``: the alpha pass forms ``nvfp4_alpha`` from the two amaxes itself (``scale_alpha_triton``)."""
    alpha = _check_gemm16_args("gemm_alpha_cublas", a, b, alpha, out_dtype, _CUBLAS_DTYPES)
    amax = _amax_pair_scalars("gemm_alpha_cublas", alpha, amax, a.device)
    return _gemm_alpha_cublas(a, b, alpha, out_dtype, amax)


def _alpha_of_amax(amax: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``nvfp4_alpha`` of an amax pair with torch ops on their device (three small kernels; the dequantize
    launch forms it for free where it runs)."""
    from nvfp4_train.kernels.nvfp4.reference import nvfp4_alpha

    return nvfp4_alpha(amax[0], amax[1]).reshape(1)


def _gemm_alpha_cublas(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor | None, out_dtype: torch.dtype,
                       amax: tuple[torch.Tensor, torch.Tensor] | None,
                       accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``gemm_alpha_cublas`` without its checks (``alpha`` and ``amax`` as ``_scale_alpha`` takes them).
    CUDA: one cuBLASLt GEMM with alpha read from the device in its epilogue (``kernels/cublaslt.py``);
    fp16 operands into bf16, a pair cuBLASLt does not run, go through its fp32 output and the rounding pass.
    CPU (the interpreter): the fp32 product, then the Triton alpha pass. ``accumulate_into`` (CUDA, a
    contiguous [M, N] tensor of ``out_dtype``): the product is added into it in the GEMM's epilogue
    (``matmul_device_alpha(..., accumulate=True)``) and it is returned."""
    if a.is_cuda:
        if amax is not None:
            alpha = _alpha_of_amax(amax)
        if accumulate_into is not None:
            return matmul_device_alpha(a, b, alpha, out_dtype, out=accumulate_into, accumulate=True)
        if supported_dtypes(a.dtype, out_dtype):
            return matmul_device_alpha(a, b, alpha, out_dtype)
        return _scale_alpha(matmul_device_alpha(a, b, alpha, torch.float32), None, out_dtype, None)
    assert accumulate_into is None, "predequant_fp4_gemm refuses accumulate_into off CUDA"
    acc = a.float() @ b.float().t()
    return _scale_alpha(acc, alpha, out_dtype, amax)


def predequant_fp4_gemm(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    *,
    block: int,
    scale_format: str,
    alpha: torch.Tensor | None,
    out_dtype: torch.dtype,
    dot_dtype: str | None,
    config: GemmConfig | None = None,
    fmt_name: str = "FP4",
    engine: str = "triton",
    amax: tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """The NVFP4 and MXFP4 GEMMs on operands given as codes and 1-byte scales (``scale_format`` "e4m3" with
    ``block`` 16, or "e8m0" with 32; ``alpha`` a device scalar or None; ``out_dtype`` bf16 or fp32): each
    operand dequantized once to the dot dtype (``q * block_scale``, exact), then ``gemm_alpha_triton``
    (``engine="triton"``) or ``gemm_alpha_cublas`` (``engine="cublas"``). ``dot_dtype`` None: "fp16" for
    the Triton engine, "bf16" for cuBLAS. ``amax=(amax_a, amax_b)`` (NVFP4, engine "cublas", with
    ``alpha=None``): the dequantize launch forms ``nvfp4_alpha`` from them for the GEMM's epilogue.
    ``accumulate_into`` (engine "cublas" on CUDA: a contiguous [M, N] tensor of ``out_dtype``): the GEMM adds its
    product into that tensor in its epilogue (beta = 1) and returns it (the Wgrad GEMM into fp32 ``main_grad``)."""
    check_gemm_engine(engine)
    if accumulate_into is not None and (engine != "cublas" or not a_codes.is_cuda):
        raise ValueError(f"{fmt_name} GEMM: accumulate_into needs engine 'cublas' on CUDA, got engine {engine!r} "
                         f"on {a_codes.device}")
    if amax is not None and (engine != "cublas" or alpha is not None):
        raise ValueError(f"{fmt_name} GEMM: amax= is for engine 'cublas' without alpha")
    _check_operands(a_codes, a_scales, b_codes, b_scales, alpha, block=block, fmt_name=fmt_name, amax=amax)
    if engine == "cublas":
        # bf16 by default: every dequantized NVFP4 value (|v| in [2^-10, 2688], <= 6 significant bits) is
        # exact in bf16 (8-bit significand, fp32's exponent range), and so is every MXFP4 value (fp16 is
        # exact for NVFP4 too, but not for E8M0 scales); bf16 inputs are also outside the reach of torch's
        # allow_fp16_accumulation switch. The products are then exact in the fp32 accumulator.
        dot_dtype = dot_dtype or "bf16"
        if dot_dtype not in ("bf16", "fp16"):
            raise ValueError(f"{fmt_name} GEMM engine 'cublas' takes 16-bit operands: dot_dtype 'bf16' or "
                             f"'fp16', got {dot_dtype!r}")
        if config is not None:
            raise ValueError(f"{fmt_name} GEMM: config is a Triton tile config; engine 'cublas' takes none")
        # gemm_alpha_cublas's checks hold by construction (da, db: one dtype, one device, [., K]); out_dtype and
        # the amax pair are checked here, once
        alpha = _check_out_and_alpha(out_dtype, alpha, a_codes.device)
        amax = _amax_pair_scalars(fmt_name + " GEMM", alpha, amax, a_codes.device)
    else:
        dot_dtype = dot_dtype or "fp16"
        _check_dot_dtype(dot_dtype)
    # both operands in one dequantize launch (shapes and devices checked above: _check_operands); given the amax
    # pair (engine "cublas", no alpha), the same launch forms alpha for the GEMM's epilogue
    da, db, amax_alpha = _dequant_pair(a_codes, a_scales, b_codes, b_scales, block=block, scale_format=scale_format,
                                       dtype=_DOT_TORCH[dot_dtype], amax=amax)
    if engine == "cublas":
        return _gemm_alpha_cublas(da, db, alpha if amax_alpha is None else amax_alpha, out_dtype, None,
                                  accumulate_into)
    return gemm_alpha_triton(da, db, alpha, out_dtype, config=config)
