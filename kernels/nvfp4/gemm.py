"""NVFP4 x NVFP4 GEMM in Triton for GPUs without FP4 tensor cores (Hopper): dequantize in registers, run a
16-bit tensor-core GEMM with fp32 accumulation, apply the tensor scales in the epilogue.

    C[M, N] = alpha * sum_k (qa[m, k] * sa[m, k // 16]) * (qb[n, k] * sb[n, k // 16])
    alpha   = (amax_A / 2688) * (amax_B / 2688)          (``nvfp4_alpha``, an fp32 0-d DEVICE tensor)

Layout (both operands blocked along K, as ``NVFP4Tensor``):
    A codes uint8 [M, K/2], A scales E4M3 [M, K/16];  B codes uint8 [N, K/2], B scales E4M3 [N, K/16]
    byte j of a row holds element 2j in its LOW nibble and element 2j+1 in its HIGH nibble.

Why this is exact (RECIPE §3): an E2M1 value (2 significant bits, |v| in {0.5 .. 6}) times an E4M3 scale
(4 significant bits, 2^-9 .. 448) has at most 6 significant bits and lies in [2^-10, 2688], so it is exact
in fp16 (11 bits, subnormals down to 2^-24, max 65504), in bf16 and in fp32; a tensor core multiplies two
such values exactly and accumulates in fp32. The only roundings are the fp32 accumulation (its order is
the hardware's) and the two in the epilogue: ``fl(acc * alpha)`` and the rounding to ``out_dtype``.
Alpha is LOADED from device memory in the epilogue: no host sync, the amax never leaves the GPU.

Dequantization in registers, fewest operations per element (the scales are 1/16 as many):
  * E2M1 -> fp16 by bits: ``((c & 7) << 9) | ((c & 8) << 12)`` puts the 2 exponent bits and the mantissa
    bit of the code at the top of fp16's exponent/mantissa fields; read as fp16 it is value * 2^-14 for
    every code (code 1 becomes the fp16 subnormal 2^-15, exact). One fp16 multiply by 2^14 restores it.
  * E4M3 -> fp16 by bits: ``((s & 0x7F) << 7) | ((s & 0x80) << 8)`` is value * 2^-8 for every finite
    byte (E4M3 subnormals land on fp16 subnormals, exact); times 256. 0x7F / 0xFF decode to NaN.
  * value = e2m1 * scale, one multiply in the dot dtype (exact).
  ``fold_pow2=True`` (fp16 only) drops the 2^14 multiply: the operand is value * 2^-14 (exact in fp16:
  a multiple of 2^-24 below 0.17, fp16 subnormals included), the fp32 accumulator then holds the sum *
  2^-28 exactly (every product of such values is >= 2^-48 in magnitude, far from fp32 underflow) and the
  epilogue multiplies by 2^28 (exact) before alpha. It relies on the tensor cores taking fp16 subnormal
  inputs, which is why it is a measured option and not the default.

The dot dtype is a compile-time switch (``dot_dtype``): "fp16" (default everywhere: exact, and the
interpreter's fp16 dot is right, so ``TRITON_INTERPRET=1`` tests run the very kernel the GPU runs), "bf16"
(GPU only: the interpreter multiplies raw bf16 bits), "fp32" (interpreter cross-check; on the GPU it runs
with ``input_precision="ieee"``, slowly). On sm_90 the 16-bit ``tl.dot`` lowers to wgmma when tiles have
>= 64 rows and num_warps is a multiple of 4; the E2M1 -> 16-bit unpack keeps the original element order
(``tl.join`` of the low/high nibbles, a register-level interleave) so there is ONE dot per K step.
``split_nibbles=True`` instead runs two dots per K step, one over the even and one over the odd elements
(the same products, in a different fp32 summation order), which avoids the interleave.

Summation order: tl.dot of a [BM, BK] x [BK, BN] tile issues the K=16 tensor-core steps in increasing k
into the same accumulator, so on the GPU the result should not depend on BM/BN/BK/warps/stages (checked
by a GPU test), only on ``split_nibbles``. Under the interpreter each tile dot is a numpy fp32 matmul.

The pre-dequantized design (GPU.md design notes) is here too: ``dequantize_nvfp4_blockwise_triton`` writes
``q * sdec_b`` as a 16-bit [M, K] tensor once, and ``gemm_alpha_triton`` is a plain 16-bit Triton GEMM
with the same alpha epilogue; ``nvfp4_gemm_predequant`` chains them. Both designs give the same bits as
the fused kernel on the GPU (same dot dtype, same k order) and are benchmarked side by side. A GEMM of this
design dequantizes BOTH operands in ONE launch (``dequantize_fp4_blockwise_pair_triton``,
``_dequant_pair_kernel``: the row tiles of A, then those of B, into one [M + N, K] allocation; the tile code
of the single-operand ``_dequant_kernel``, so the same bits), which saves a launch per GEMM (three per
quantized linear layer's fwd+bwd) where the GPU is host-bound; the single-operand launcher stays for
callers that dequantize one tensor.

A third design, the "cublas" ENGINE of the pre-dequantized path (``nvfp4_gemm_predequant(...,
engine="cublas")``, ``gemm_alpha_cublas``; ``kernels.nvfp4.nvfp4_gemm`` picks the engine from the
``NVFP4_GEMM_ENGINE`` environment variable, "cublas" by default): the same dequantized operands (bf16 by
default, exact as above), then ``acc = torch.mm(a, b.t(), out_dtype=torch.float32)`` (cuBLAS, fp32
accumulation and fp32 output: the raw accumulator, torch >= 2.8), then ONE Triton elementwise pass
``_alpha_scale_kernel`` that loads alpha from its device pointer and computes ``fl(acc * alpha)`` rounded
to bf16 by ``_bf16_rne`` (fp32 output: in place). That is the same arithmetic as the Triton epilogue; only
the fp32 summation order of the accumulation is cuBLAS's (on the GPU the tensor cores again, with cuBLAS's
own K blocking and possibly split-K), which the tests allow: bit-exact on inputs whose partial sums are
exact, within the derived bound of the float64 product otherwise. It costs one extra pass over an fp32
[M, N] tensor (write by cuBLAS, read + write by the alpha pass) against cuBLAS's GEMM speed. Measured in
one run on the H200 (2026-11-29, docs/benchmarks.md): 0.91-0.98x cuBLAS BF16 on the six 12B shapes with both
dequantize passes, against 0.81-0.84x for the Triton engine, so it is the default of ``kernels.nvfp4.nvfp4_gemm``
(``scripts/bench_kernels.py`` and ``scripts/bench_linear.py --gemm-engine`` measure both). Since that
measurement ``nvfp4_gemm_predequant(engine="cublas")`` hands the alpha pass the two amax tensors and the
kernel forms ``nvfp4_alpha`` itself (``div_rn`` twice, one product: the same bits, checked against torch
under the interpreter and, in ``make test-gpu``, on CUDA), which removes three small torch kernels per GEMM
from the host's work; not yet measured on the GPU. Under ``TRITON_INTERPRET=1`` (CPU tensors) ``aten::mm.dtype`` does
not exist: the accumulator is ``a.float() @ b.float().t()`` (the same exact products, another order), and
the alpha pass is the same kernel.
Split-K and 16-bit reductions: torch's ``allow_bf16_reduced_precision_reduction`` /
``allow_fp16_reduced_precision_reduction`` only let cuBLAS reduce split-K partials in the OUTPUT type when
that is narrower than the fp32 compute type (cuBLAS's CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
"forces any reductions ... to use the accumulator type rather than the output type ... where output type
precision is less than compute type precision"); here the output type IS fp32, so every partial sum is
fp32 whatever those switches say. ``allow_fp16_accumulation`` makes torch REFUSE fp16 x fp16 -> fp32 (an
error, not a silent change); bf16 operands are not affected by it. A GPU test with exact partial sums at
K = 20480 (tests/kernels/test_nvfp4_gemm_cublas.py), run with both reduced-precision switches on, would
catch a 16-bit reduction if that reading of the documentation were wrong.

The MXFP4 GEMM (``kernels/mxfp4/gemm.py``) launches the same kernel with E8M0 scales over 32 elements and
no alpha: ``blockscaled_fp4_gemm`` below is the shared launcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._dispatch import interpret_mode
from kernels.fp4_triton import round_to_bf16, u32
from kernels.nvfp4 import GEMM_ENGINES
from kernels.nvfp4.quantize import cdiv
from kernels.nvfp4.reference import BLOCK, NVFP4Tensor, nvfp4_alpha

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
_TWO_POW_28 = tl.constexpr(268435456.0)


# ----------------------------------------------------------------------------------------------------------
# device functions: decoding
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_f16(nib, FOLD: tl.constexpr):
    """uint16 E2M1 codes (0..15) -> fp16 values, exact (times 2^-14 when FOLD)."""
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    v = bits.to(tl.float16, bitcast=True)
    if not FOLD:
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
    codes, scales, R: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr,
    FMT: tl.constexpr, DOT: tl.constexpr, FOLD: tl.constexpr,
):
    """codes uint8 [R, BK/2], scales uint8 [R, BK/SB] -> (even, odd) elements, each [R, BK/2] in the dot
    dtype: column j of ``even`` is element 2j, of ``odd`` element 2j+1; both in block (2j) // SB."""
    c16 = codes.to(tl.uint16)
    lo = _to_dot(_e2m1_f16(c16 & 0xF, FOLD), DOT)
    hi = _to_dot(_e2m1_f16(c16 >> 4, FOLD), DOT)
    if FMT == SCALE_E4M3:
        sc = _to_dot(_e4m3_f16(scales), DOT)
    else:
        sc = _e8m0(scales, DOT)
    scb = tl.reshape(tl.broadcast_to(sc[:, :, None], [R, BK // SB, SB // 2]), [R, BK // 2])
    return lo * scb, hi * scb


@triton.jit
def _dequant_tile(
    codes, scales, R: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr,
    FMT: tl.constexpr, DOT: tl.constexpr, FOLD: tl.constexpr,
):
    """codes uint8 [R, BK/2], scales uint8 [R, BK/SB] -> [R, BK] values in element order."""
    lo, hi = _dequant_halves(codes, scales, R, BK, SB, FMT, DOT, FOLD)
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
    HAS_ALPHA: tl.constexpr, FOLD: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    if FOLD:
        acc = acc * _TWO_POW_28  # exact: undoes the 2^-14 of each operand
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
def _fp4_gemm_kernel(
    a_codes, a_scales, b_codes, b_scales, alpha_ptr, c_ptr,
    M, N, K,
    s_acm, s_ack, s_asm, s_ask, s_bcn, s_bck, s_bsn, s_bsk, s_cm, s_cn,
    FMT: tl.constexpr, SB: tl.constexpr, HAS_ALPHA: tl.constexpr, DOT: tl.constexpr,
    FOLD: tl.constexpr, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BM, BN] output tile; K in steps of BK elements (BK/2 code bytes, BK/SB scale bytes)."""
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    # rows past M / N wrap around (valid addresses, no mask in the loop); the store masks them out
    rm = ((pid_m * BM + tl.arange(0, BM)) % M).to(tl.int64)
    rn = ((pid_n * BN + tl.arange(0, BN)) % N).to(tl.int64)
    rkh = tl.arange(0, BK // 2)
    rks = tl.arange(0, BK // SB)
    pa_c = a_codes + rm[:, None] * s_acm + rkh[None, :] * s_ack
    pa_s = a_scales + rm[:, None] * s_asm + rks[None, :] * s_ask
    pb_c = b_codes + rn[:, None] * s_bcn + rkh[None, :] * s_bck
    pb_s = b_scales + rn[:, None] * s_bsn + rks[None, :] * s_bsk
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            ac = tl.load(pa_c)
            asc = tl.load(pa_s)
            bc = tl.load(pb_c)
            bsc = tl.load(pb_s)
        else:
            # the K tail: code 0 (value 0) and scale 0 in both operands contribute exact zeros
            k_left = K - kt * BK
            cmask = rkh[None, :] < k_left // 2
            smask = rks[None, :] < k_left // SB
            ac = tl.load(pa_c, mask=cmask, other=0)
            asc = tl.load(pa_s, mask=smask, other=0)
            bc = tl.load(pb_c, mask=cmask, other=0)
            bsc = tl.load(pb_s, mask=smask, other=0)
        if SPLIT:
            a_even, a_odd = _dequant_halves(ac, asc, BM, BK, SB, FMT, DOT, FOLD)
            b_even, b_odd = _dequant_halves(bc, bsc, BN, BK, SB, FMT, DOT, FOLD)
            acc = _dot(a_even, tl.trans(b_even), acc, DOT)
            acc = _dot(a_odd, tl.trans(b_odd), acc, DOT)
        else:
            a = _dequant_tile(ac, asc, BM, BK, SB, FMT, DOT, FOLD)
            b = _dequant_tile(bc, bsc, BN, BK, SB, FMT, DOT, FOLD)
            acc = _dot(a, tl.trans(b), acc, DOT)
        pa_c += (BK // 2) * s_ack
        pa_s += (BK // SB) * s_ask
        pb_c += (BK // 2) * s_bck
        pb_s += (BK // SB) * s_bsk
    _epilogue(acc, alpha_ptr, c_ptr, pid_m, pid_n, M, N, s_cm, s_cn, HAS_ALPHA, FOLD, OUT_BF16, BM, BN)


@triton.jit
def _dequant_tile_store(
    codes, scales, out, M, K, s_cm, s_ck, s_sm, s_sk, s_om, s_ok, pid_m, pid_k,
    FMT: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """Row tile ``pid_m``, K tile ``pid_k`` of ``q * block_scale`` (no tensor scale) in the dot dtype: the
    body of both dequantize kernels (one operand, or the pair), so they compute the very same bits."""
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rkh = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    rks = pid_k * (BK // SB) + tl.arange(0, BK // SB)
    mrow = rm[:, None] < M
    c = tl.load(codes + rm[:, None] * s_cm + rkh[None, :] * s_ck, mask=mrow & (rkh[None, :] < K // 2), other=0)
    s = tl.load(scales + rm[:, None] * s_sm + rks[None, :] * s_sk, mask=mrow & (rks[None, :] < K // SB), other=0)
    v = _dequant_tile(c, s, BM, BK, SB, FMT, DOT, False)
    rk = pid_k * BK + tl.arange(0, BK)
    tl.store(out + rm[:, None] * s_om + rk[None, :] * s_ok, v, mask=mrow & (rk[None, :] < K))


@triton.jit
def _dequant_kernel(
    codes, scales, out, M, K, s_cm, s_ck, s_sm, s_sk, s_om, s_ok,
    FMT: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """[BM, BK] tile of ``q * block_scale`` (no tensor scale) in the dot dtype."""
    _dequant_tile_store(codes, scales, out, M, K, s_cm, s_ck, s_sm, s_sk, s_om, s_ok,
                        tl.program_id(0), tl.program_id(1), FMT, SB, DOT, BM, BK)


@triton.jit
def _dequant_pair_kernel(
    a_codes, a_scales, a_out, M, s_acm, s_ack, s_asm, s_ask, s_aom, s_aok,
    b_codes, b_scales, b_out, N, s_bcm, s_bck, s_bsm, s_bsk, s_bom, s_bok,
    K, FMT: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """Both operands of one GEMM in ONE launch: row tiles 0 .. cdiv(M, BM) - 1 of axis 0 dequantize A, the
    following cdiv(N, BM) ones B (axis 1: the K tiles, shared). Each program takes one branch; the tile
    body is ``_dequant_kernel``'s (``_dequant_tile_store``)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
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
    _epilogue(acc, alpha_ptr, c_ptr, pid_m, pid_n, M, N, s_cm, s_cn, HAS_ALPHA, False, OUT_BF16, BM, BN)


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
# Starting points for sm_90, to be tuned on the H200 (``scripts/bench_kernels.py --sweep`` times all of
# CANDIDATE_CONFIGS per shape). 8 warps = two consumer warpgroups for wgmma with a 128-row tile.
LARGE_CONFIG = GemmConfig(128, 256, 64, 8, 3)
MEDIUM_CONFIG = GemmConfig(128, 128, 64, 8, 3)
SMALL_CONFIG = GemmConfig(64, 64, 128, 4, 3)
CANDIDATE_CONFIGS = (
    GemmConfig(128, 256, 64, 8, 3),
    GemmConfig(128, 256, 64, 8, 4),
    GemmConfig(128, 256, 128, 8, 3),
    GemmConfig(128, 256, 128, 8, 2),
    GemmConfig(256, 128, 64, 8, 3),
    GemmConfig(128, 128, 64, 8, 3),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 4, 3),
    GemmConfig(128, 128, 256, 8, 2),
    GemmConfig(64, 256, 128, 4, 3),
)
# the 16-bit GEMM over pre-dequantized operands (the usual Triton-on-Hopper bf16 matmul configs)
# measured on the H200 (docs/benchmarks.md, --sweep): 675 TFLOP/s on qkv vs 568 for 128x256x64
GEMM16_LARGE_CONFIG = GemmConfig(128, 128, 64, 8, 3)


def default_config(M: int, N: int, K: int, *, interpret: bool | None = None) -> GemmConfig:
    """The config table, keyed on shape (deterministic; no autotuning)."""
    if interpret if interpret is not None else interpret_mode():
        return INTERPRET_CONFIG
    if M >= 1024 and N >= 1024:
        return LARGE_CONFIG
    if M >= 128 and N >= 128:
        return MEDIUM_CONFIG
    return SMALL_CONFIG


def _check_config(cfg: GemmConfig, block: int, split: bool) -> None:
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
    if cfg.block_k % block:
        raise ValueError(f"GemmConfig.block_k must be a multiple of the scale block {block}, got {cfg.block_k}")
    if split and cfg.block_k < 32:
        raise ValueError(f"split_nibbles needs block_k >= 32 (two dots of block_k/2 >= 16), got {cfg.block_k}")


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
    ValueError/TypeError that names the problem. Shared by both GEMM designs. ``alpha`` and ``amax`` (the
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


def blockscaled_fp4_gemm(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    *,
    block: int,
    scale_format: str,
    alpha: torch.Tensor | None,
    out_dtype: torch.dtype,
    dot_dtype: str,
    split_nibbles: bool = False,
    fold_pow2: bool = False,
    config: GemmConfig | None = None,
    fmt_name: str = "FP4",
) -> torch.Tensor:
    """Shared launcher of the NVFP4 (``scale_format='e4m3'``, block 16) and MXFP4 (``'e8m0'``, block 32)
    GEMMs. Scales are uint8 (or a 1-byte float dtype, read as bytes). Validates its inputs."""
    M, N, K = _check_operands(a_codes, a_scales, b_codes, b_scales, alpha, block=block, fmt_name=fmt_name)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{fmt_name} GEMM out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    _check_dot_dtype(dot_dtype)
    if fold_pow2 and (dot_dtype != "fp16" or scale_format != "e4m3"):
        raise ValueError("fold_pow2 is an NVFP4 option of the fp16 dot (dot_dtype='fp16')")
    dev = a_codes.device
    cfg = config or default_config(M, N, K)
    _check_config(cfg, block, split_nibbles)

    c = torch.empty((M, N), dtype=out_dtype, device=dev)
    if M == 0 or N == 0:
        return c
    a_s = a_scales.view(torch.uint8)
    b_s = b_scales.view(torch.uint8)
    grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
    _fp4_gemm_kernel[grid](
        a_codes, a_s, b_codes, b_s, alpha if alpha is not None else c, c,
        M, N, K,
        a_codes.stride(0), a_codes.stride(1), a_s.stride(0), a_s.stride(1),
        b_codes.stride(0), b_codes.stride(1), b_s.stride(0), b_s.stride(1),
        c.stride(0), c.stride(1),
        FMT=0 if scale_format == "e4m3" else 1, SB=block, HAS_ALPHA=alpha is not None,
        DOT=_DOT_CODES[dot_dtype], FOLD=fold_pow2, SPLIT=split_nibbles, OUT_BF16=out_dtype == torch.bfloat16,
        EVEN_K=K % cfg.block_k == 0, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def _alpha(a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
    """nvfp4_alpha with torch ops on the operands' device (no .item(), no host sync)."""
    dev = a.codes.device
    if a.amax.device != dev or b.amax.device != dev:
        raise ValueError(f"NVFP4 GEMM: amax tensors must be on the codes' device {dev}, got "
                         f"{a.amax.device} and {b.amax.device}")
    return nvfp4_alpha(a.amax, b.amax).reshape(1).contiguous()


def nvfp4_gemm_triton(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    dot_dtype: str = "fp16",
    split_nibbles: bool = False,
    fold_pow2: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """C[M, N] = alpha * A[M, K] . B[N, K]^T, both NVFP4 blocked along K (1x16 or 2-D scales alike),
    dequantized in registers. ``out_dtype``: torch.bfloat16 or torch.float32. See the module docstring for
    ``dot_dtype``, ``split_nibbles``, ``fold_pow2`` and ``config``."""
    return blockscaled_fp4_gemm(
        a.codes, a.scales, b.codes, b.scales, block=BLOCK, scale_format="e4m3", alpha=_alpha(a, b),
        out_dtype=out_dtype, dot_dtype=dot_dtype, split_nibbles=split_nibbles, fold_pow2=fold_pow2,
        config=config, fmt_name="NVFP4",
    )


def _dequant_dtypes(dtype: torch.dtype, scale_format: str) -> tuple[str, str]:
    """(dot, kdot): the dot dtype name of ``dtype`` and the one the dequantize kernels compute in.
    ``_dequant_kernel`` computes in fp16 then converts; under the interpreter bf16 products are done on raw
    bits, so there the bf16 output goes through fp32 (exact) instead."""
    dot = _DOT_NAME.get(dtype)
    if dot is None:
        raise TypeError(f"dequantized operands are float16, bfloat16 or float32, got {dtype}")
    if dot == "fp16" and scale_format == "e8m0":
        raise ValueError("E8M0-scaled values are not all representable in fp16; use bfloat16 or float32")
    kdot = "fp32" if (dot == "bf16" and interpret_mode()) else dot
    return dot, kdot


def dequantize_fp4_blockwise_triton(
    codes: torch.Tensor, scales: torch.Tensor, *, block: int, scale_format: str, dtype: torch.dtype,
    block_m: int = 64, block_k: int = 128, num_warps: int = 4,
) -> torch.Tensor:
    """``q * block_scale`` (no tensor scale) as a [M, K] tensor of ``dtype`` (fp16, bf16 or fp32)."""
    dot, kdot = _dequant_dtypes(dtype, scale_format)
    M, K = codes.shape[0], codes.shape[1] * 2
    if K % block != 0:
        raise ValueError(f"K must be a multiple of the scale block {block}, got K = {K}")
    out = torch.empty((M, K), dtype=dtype, device=codes.device)
    if M == 0 or K == 0:
        return out
    s = scales.view(torch.uint8)
    block_k = max(block_k, block)
    grid = (cdiv(M, block_m), cdiv(K, block_k))
    tmp = out if kdot == dot else torch.empty((M, K), dtype=torch.float32, device=codes.device)
    _dequant_kernel[grid](
        codes, s, tmp, M, K, codes.stride(0), codes.stride(1), s.stride(0), s.stride(1),
        tmp.stride(0), tmp.stride(1),
        FMT=0 if scale_format == "e4m3" else 1, SB=block, DOT=_DOT_CODES[kdot], BM=block_m, BK=block_k,
        num_warps=num_warps,
    )
    if tmp is not out:
        out.copy_(tmp)
    return out


def dequantize_fp4_blockwise_pair_triton(
    a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor, b_scales: torch.Tensor, *,
    block: int, scale_format: str, dtype: torch.dtype, block_m: int = 64, block_k: int = 128, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands of one GEMM, ``q * block_scale`` as [M, K] and [N, K] tensors of ``dtype``, in ONE launch
    of ``_dequant_pair_kernel`` (the row tiles of A, then those of B; the same tile code as
    ``dequantize_fp4_blockwise_triton``, so the same bits as two single launches). Both live in one [M + N, K]
    allocation (A its first M rows, B the rest: two contiguous views), one allocator call instead of two."""
    K = a_codes.shape[1] * 2
    if b_codes.shape[1] * 2 != K:
        raise ValueError(f"the two operands' K differ: {K} and {b_codes.shape[1] * 2}")
    if K % block != 0:
        raise ValueError(f"K must be a multiple of the scale block {block}, got K = {K}")
    if b_codes.device != a_codes.device:
        raise ValueError(f"both operands must be on one device, got {a_codes.device} and {b_codes.device}")
    return _dequant_pair(a_codes, a_scales, b_codes, b_scales, block=block, scale_format=scale_format,
                         dtype=dtype, block_m=block_m, block_k=block_k, num_warps=num_warps)


def _dequant_pair(a_codes, a_scales, b_codes, b_scales, *, block, scale_format, dtype, block_m=64, block_k=128,
                  num_warps=4):
    """``dequantize_fp4_blockwise_pair_triton`` without its shape and device checks (for callers that made
    them: ``predequant_fp4_gemm``)."""
    dot, kdot = _dequant_dtypes(dtype, scale_format)
    M, K = a_codes.shape[0], a_codes.shape[1] * 2
    N = b_codes.shape[0]
    dev = a_codes.device
    out = torch.empty((M + N, K), dtype=dtype, device=dev)
    if M + N == 0 or K == 0:
        return out[:M], out[M:]
    a_s = a_scales.view(torch.uint8)
    b_s = b_scales.view(torch.uint8)
    block_k = max(block_k, block)
    grid = (cdiv(M, block_m) + cdiv(N, block_m), cdiv(K, block_k))
    tmp = out if kdot == dot else torch.empty((M + N, K), dtype=torch.float32, device=dev)
    ta, tb = tmp.split_with_sizes((M, N))  # = tmp[:M], tmp[M:] in one op
    _dequant_pair_kernel[grid](
        a_codes, a_s, ta, M, a_codes.stride(0), a_codes.stride(1), a_s.stride(0), a_s.stride(1),
        ta.stride(0), ta.stride(1),
        b_codes, b_s, tb, N, b_codes.stride(0), b_codes.stride(1), b_s.stride(0), b_s.stride(1),
        tb.stride(0), tb.stride(1),
        K, FMT=0 if scale_format == "e4m3" else 1, SB=block, DOT=_DOT_CODES[kdot], BM=block_m, BK=block_k,
        num_warps=num_warps,
    )
    if tmp is not out:
        out.copy_(tmp)
        return out.split_with_sizes((M, N))
    return ta, tb


def dequantize_nvfp4_blockwise_triton(q: NVFP4Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``q * fp32(sdec_b)`` (NO tensor scale: it lives in the GEMM's alpha) as [M, K] ``dtype``; exact."""
    return dequantize_fp4_blockwise_triton(q.codes, q.scales, block=BLOCK, scale_format="e4m3", dtype=dtype)


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
    cfg = config or (GEMM16_LARGE_CONFIG if (not interpret_mode() and M >= 1024 and N >= 1024)
                     else default_config(M, N, K))
    _check_config(cfg, 16, False)
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


# the GEMM engines of the pre-dequantized design (``engine=`` of nvfp4_gemm_predequant / predequant_fp4_gemm):
# GEMM_ENGINES, defined in kernels.nvfp4 (which reads the default engine from the environment without Triton)
# the operand dtypes of the "cublas" engine; the default is bf16 (see gemm_alpha_cublas)
_CUBLAS_DTYPES = (torch.bfloat16, torch.float16)
_ALPHA_BLOCK = 4096


def check_gemm_engine(engine: str) -> str:
    if engine not in GEMM_ENGINES:
        raise ValueError(f"GEMM engine must be one of {GEMM_ENGINES}, got {engine!r}")
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


def _gemm_alpha_cublas(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor | None, out_dtype: torch.dtype,
                       amax: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``gemm_alpha_cublas`` without its checks (``alpha`` and ``amax`` as ``_scale_alpha`` takes them)."""
    if a.is_cuda:
        try:
            acc = torch.mm(a, b.t(), out_dtype=torch.float32)
        except TypeError as e:  # torch < 2.8: no aten::mm.dtype
            raise RuntimeError(f"gemm_alpha_cublas needs torch.mm(..., out_dtype=torch.float32) (torch >= 2.8), "
                               f"torch {torch.__version__}: {e}") from e
    else:
        acc = a.float() @ b.float().t()
    return _scale_alpha(acc, alpha, out_dtype, amax)


def nvfp4_gemm_predequant(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    dot_dtype: str | None = None,
    config: GemmConfig | None = None,
    engine: str = "triton",
) -> torch.Tensor:
    """The same product as ``nvfp4_gemm_triton`` by the other design: dequantize each operand once to a
    16-bit [., K] tensor (``q * sdec_b``, exact), then a 16-bit GEMM with fp32 accumulation and the alpha
    epilogue. ``engine``: "triton" (``gemm_alpha_triton``; ``dot_dtype`` default "fp16") or "cublas"
    (``gemm_alpha_cublas``: cuBLAS with fp32 output, then the alpha pass; ``dot_dtype`` default "bf16", the
    dtype of the dequantized operands, "fp16" or "bf16"; no ``config``)."""
    # engine "cublas": alpha formed inside its alpha pass from the two amaxes (the same bits as _alpha)
    cublas = check_gemm_engine(engine) == "cublas"
    return predequant_fp4_gemm(
        a.codes, a.scales, b.codes, b.scales, block=BLOCK, scale_format="e4m3",
        alpha=None if cublas else _alpha(a, b), out_dtype=out_dtype, dot_dtype=dot_dtype, config=config,
        fmt_name="NVFP4", engine=engine, amax=(a.amax, b.amax) if cublas else None,
    )


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
) -> torch.Tensor:
    """The pre-dequantized design of the NVFP4 and MXFP4 GEMMs (arguments as ``blockscaled_fp4_gemm``): each
    operand dequantized once to the dot dtype (``q * block_scale``, exact), then ``gemm_alpha_triton``
    (``engine="triton"``) or ``gemm_alpha_cublas`` (``engine="cublas"``). ``dot_dtype`` None: "fp16" for
    the Triton engine, "bf16" for cuBLAS. ``amax=(amax_a, amax_b)`` (NVFP4, engine "cublas", with
    ``alpha=None``): the alpha pass forms ``nvfp4_alpha`` from them."""
    check_gemm_engine(engine)
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
    else:
        dot_dtype = dot_dtype or "fp16"
        _check_dot_dtype(dot_dtype)
    # both operands in one dequantize launch (shapes and devices checked above: _check_operands)
    da, db = _dequant_pair(a_codes, a_scales, b_codes, b_scales, block=block, scale_format=scale_format,
                           dtype=_DOT_TORCH[dot_dtype])
    if engine == "cublas":
        # gemm_alpha_cublas's checks hold by construction (da, db: one dtype, one device, [., K]); out_dtype and
        # the amax pair are checked here, once
        alpha = _check_out_and_alpha(out_dtype, alpha, da.device)
        amax = _amax_pair_scalars(fmt_name + " GEMM", alpha, amax, da.device)
        return _gemm_alpha_cublas(da, db, alpha, out_dtype, amax)
    return gemm_alpha_triton(da, db, alpha, out_dtype, config=config)
