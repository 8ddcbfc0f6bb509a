"""Triton device functions shared by the FP4 kernels (NVFP4, MXFP4) and the FP8 kernels.

Each function here computes, with explicit fp32 and integer bit arithmetic, exactly what its counterpart in
``kernels/fp4_reference.py`` (or ``torch.Tensor.to(torch.float8_e4m3fn)``) computes. No narrowing float
cast is used for rounding: the CPU interpreter and the GPU round such casts differently.

Kernels that use them must be launched with ``enable_fp_fusion=False`` where a multiply feeds an add with an
inexact product (none of these functions has one: every product that meets an add here is exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_reference import RHT_SIGNS

# bit i set <=> RHT sign i is -1
RHT_NEG_MASK = tl.constexpr(sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0))


@triton.jit
def u32(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def load_as_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """Load fp32, or bf16 passed as raw int16 bits, as fp32. bf16 goes through its bits (``bits << 16``):
    exact for every value, subnormals included (the CPU interpreter's own bf16 conversion is not)."""
    if IS_BF16:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_tile(x_ptr, m0, k0, M, K, stride_m, stride_k, BM: tl.constexpr, BK: tl.constexpr, IS_BF16: tl.constexpr):
    """The [BM, BK] tile of a [M, K] tensor at (m0, k0) as fp32 (zeros outside), with its row and column
    indices and the in-bounds mask."""
    rm = m0 + tl.arange(0, BM)
    rk = k0 + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    return load_as_f32(x_ptr + rm[:, None] * stride_m + rk[None, :] * stride_k, mask, IS_BF16), rm, rk, mask


def as_kernel_input(x):
    """The tensor to hand to a kernel that loads with ``load_as_f32``: bf16 as its int16 bits."""
    import torch

    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@triton.jit
def mix32(x):
    """lowbias32 on uint32 (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grids: ``triton.cdiv`` is a ``constexpr_function`` whose Python wrapper costs
    ~1.5 us a call on the host (the same integer)."""
    return -(-a // b)


def launch_keys(row_key, col_key, row_sr: bool, col_sr: bool):
    """(row key, column key, KEY_PTR) as a quantize kernel takes them: two int keys as ``key_arg``s; seed
    tensors (``nvfp4_train.kernels.fp4_reference.kernel_key``) as they are, for the kernel compiled with ``KEY_PTR`` to load
    (``load_key``). One launch takes both kinds only when the int one is unused (its copy is not rounded
    stochastically): it is then replaced by the tensor."""
    rt, ct = not isinstance(row_key, int), not isinstance(col_key, int)
    if not (rt or ct):
        return key_arg(row_key), key_arg(col_key), False
    if not rt:
        if row_sr:
            raise ValueError("a quantize launch takes its stochastic keys either all as ints or all as seed tensors")
        row_key = col_key
    if not ct:
        if col_sr:
            raise ValueError("a quantize launch takes its stochastic keys either all as ints or all as seed tensors")
        col_key = row_key
    return row_key, col_key, True


@triton.jit
def load_key(key, KEY_PTR: tl.constexpr):
    """The uint32 key of a launch: the int key itself, or with ``KEY_PTR`` ``seed_key`` of the int64 seed
    ``key`` points to (one scalar load and hash per program)."""
    if KEY_PTR:
        return mix32(tl.load(key).to(tl.uint32) ^ 0x9E3779B9)
    else:
        return key.to(tl.uint32)


def key_arg(key: int) -> int:
    """A 32-bit random-number key (``seed_key``, in [0, 2**32)) as the quantize kernels receive it: the same 32
    bits as a signed int32. Triton types a Python int argument by its range (i32 below 2**31, i64 above) and
    compiles one kernel per type; the kernels also declare their keys ``do_not_specialize`` (no variant for
    "divisible by 16" or "== 1"). Together every key, i.e. every step's fresh seed, runs the ONE compiled kernel:
    before this, fresh keys kept compiling new variants for the first dozens of training steps on the GPU."""
    if not 0 <= key < 1 << 32:
        raise ValueError(f"key must be in [0, 2**32), got {key}")
    return key - (1 << 32) if key >= 1 << 31 else key


@triton.jit
def random_bits8(idx, key):
    """8 random bits (int32 in [0, 256)) for linear element indices ``idx`` (int64) under ``key`` (uint32)."""
    c = idx.to(tl.uint32) + key.to(tl.uint32)
    return (mix32(c) >> 24).to(tl.int32)


@triton.jit
def e2m1_round_nearest(v):
    """fp32 -> int32 E2M1 code (0..15), RNE, saturating; NaN -> 0; sign kept (v < 0)."""
    m = tl.abs(v)
    idx = (
        (m > 0.25).to(tl.int32)
        + (m >= 0.75).to(tl.int32)
        + (m > 1.25).to(tl.int32)
        + (m >= 1.75).to(tl.int32)
        + (m > 2.5).to(tl.int32)
        + (m >= 3.5).to(tl.int32)
        + (m > 5.0).to(tl.int32)
    )
    return idx | ((v < 0).to(tl.int32) << 3)


@triton.jit
def e2m1_round_stochastic(v, rbits):
    """fp32 -> int32 E2M1 code with stochastic rounding from 8 random bits (int32 in [0, 256))."""
    m = tl.abs(v)
    li = (
        (m >= 0.5).to(tl.int32)
        + (m >= 1.0).to(tl.int32)
        + (m >= 1.5).to(tl.int32)
        + (m >= 2.0).to(tl.int32)
        + (m >= 3.0).to(tl.int32)
        + (m >= 4.0).to(tl.int32)
        + (m >= 6.0).to(tl.int32)
    )
    lo = tl.where(li <= 4, li.to(tl.float32) * 0.5, (li - 2).to(tl.float32))
    inv_gap_256 = tl.where(li <= 3, 512.0, tl.where(li <= 5, 256.0, 128.0))
    t = (m - lo) * inv_gap_256
    up = (rbits.to(tl.float32) < t) & (li < 7)
    idx = li + up.to(tl.int32)
    return idx | ((v < 0).to(tl.int32) << 3)


@triton.jit
def e4m3_rne_pos(s):
    """Round fp32 ``s`` in [0, 448] (or NaN) to E4M3, nearest-even, subnormals kept.

    Returns (byte as int32, the rounded value as fp32). NaN -> 0x7F / NaN.
    """
    bits = u32(s)
    # normal E4M3 (s >= 2^-6): keep 3 mantissa bits of the fp32 encoding, ties to even
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    byte_n = (((rb >> 23).to(tl.int32) - 120) << 3) | ((rb >> 20) & 7).to(tl.int32)
    val_n = rb.to(tl.float32, bitcast=True)
    # subnormal E4M3: multiples of 2^-9; s * 512 is exact and < 8, the magic add rounds it to an integer
    t = s * 512.0
    r = (t + 8388608.0) - 8388608.0
    byte_s = r.to(tl.int32)
    val_s = r * 0.001953125
    normal = s >= 0.015625
    byte = tl.where(normal, byte_n, byte_s)
    val = tl.where(normal, val_n, val_s)
    isnan = s != s
    byte = tl.where(isnan, 0x7F, byte)
    val = tl.where(isnan, s, val)
    return byte, val


@triton.jit
def e4m3_rne(v):
    """Round fp32 ``v`` to E4M3 (float8_e4m3fn), nearest-even, saturating at +-448, subnormals kept.

    Returns the byte as int32 (0..255). The sign bit is v's sign bit (-0.0 and negative values that round
    to zero give 0x80, as torch's cast does); +-Inf saturates to +-448; NaN gives 0x7F.
    """
    sign = ((u32(v) >> 31) << 7).to(tl.int32)
    m = tl.abs(v)
    m = tl.where(m > 448.0, 448.0, m)  # NaN stays NaN
    byte, _ = e4m3_rne_pos(m)
    return tl.where(v != v, 0x7F, byte | sign)


@triton.jit
def e4m3_byte(v, NATIVE: tl.constexpr):
    """``e4m3_rne(v)`` as uint8. ``NATIVE`` (GPUs of compute capability 8.9+): the hardware's paired conversion
    ``cvt.rn.satfinite.e4m3x2.f32`` (inline PTX, one instruction per two values: nearest-even with subnormals,
    +-Inf saturating to +-448, NaN -> 0x7F, the sign kept for values that round to zero, which is what
    ``e4m3_rne`` computes bit by bit), each byte widened to int32 as the bit arithmetic leaves it. Triton's own
    fp32 -> fp8 cast, bitcast to bytes, is not used: on triton 3.6 its bytes came out wrong where they were
    stored through transposed addresses (the columnwise copies). Else the bit arithmetic (the interpreter)."""
    if NATIVE:
        b = tl.inline_asm_elementwise(
            "{ .reg .b16 t; .reg .b32 w; cvt.rn.satfinite.e4m3x2.f32 t, $3, $2; cvt.u32.u16 w, t; "
            "and.b32 $0, w, 255; shr.b32 $1, w, 8; }",
            "=r,=r,r,r", [v], dtype=tl.int32, is_pure=True, pack=2)
        return b.to(tl.uint8)
    else:
        return e4m3_rne(v).to(tl.uint8)


@triton.jit
def round_to_bf16(y):
    """Round fp32 values to bf16 (nearest-even) and return them as fp32."""
    bits = u32(y)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    # NaN stays NaN (the GPU's canonical NaN 0x7FFFFFFF would otherwise round to -0.0)
    return tl.where(y != y, y, r.to(tl.float32, bitcast=True))


@triton.jit
def _butterfly_stage(t, R: tl.constexpr, H: tl.constexpr):
    t4 = tl.reshape(t, [R, 16 // (2 * H), 2, H])
    t4 = tl.permute(t4, (0, 1, 3, 2))
    a, b = tl.split(t4)
    t4 = tl.join(a + b, a - b)
    t4 = tl.permute(t4, (0, 1, 3, 2))
    return tl.reshape(t4, [R, 16])


@triton.jit
def hadamard16(t, R: tl.constexpr):
    """Fast Walsh-Hadamard transform of each row of ``t`` [R, 16] (fp32, already multiplied by s/4):
    strides 1, 2, 4, 8, in this order (the reference's order)."""
    t = _butterfly_stage(t, R, 1)
    t = _butterfly_stage(t, R, 2)
    t = _butterfly_stage(t, R, 4)
    t = _butterfly_stage(t, R, 8)
    return t


@triton.jit
def rht16_last(x, ROWS: tl.constexpr, COLS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """A [ROWS, COLS] fp32 tile -> each 16 consecutive elements of its last dim Hadamard-mixed (``x * s/4``,
    exact, then ``hadamard16``), rounded to bf16 (and held as fp32) when ``ROUND_BF16``."""
    R: tl.constexpr = ROWS * COLS // 16
    g = tl.reshape(x, [R, 16])
    j = tl.arange(0, 16)
    neg = (tl.full([16], RHT_NEG_MASK, tl.int32) >> j) & 1
    sgn = tl.where(neg == 1, -0.25, 0.25)
    g = hadamard16(g * sgn[None, :], R)
    if ROUND_BF16:
        g = round_to_bf16(g)
    return tl.reshape(g, [ROWS, COLS])


@triton.jit
def pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """[R, C] int32 codes -> [R, C/2] uint8, element 2j in the low nibble."""
    p = tl.reshape(codes, [R, C // 2, 2])
    lo, hi = tl.split(p)
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def round_to_bf16_fast(y, NATIVE: tl.constexpr):
    """``round_to_bf16`` without the NaN guard (NaN may come back as -0.0: callers that can meet NaN handle
    it from the tensor amax). ``NATIVE`` uses the GPU's RNE conversion (one instruction per 2 values); the
    interpreter's conversion differs, so it must be False there."""
    if NATIVE:
        return y.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        bits = u32(y)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return r.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne_pos_native(s, NATIVE: tl.constexpr):
    """``e4m3_rne_pos`` through the GPU's own conversion when ``NATIVE`` (cvt.rn.satfinite to e4m3: the same
    RNE with subnormals, NaN -> 0x7F); the bit arithmetic otherwise (the interpreter rounds differently)."""
    if NATIVE:
        f8 = s.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return f8.to(tl.uint8, bitcast=True).to(tl.int32), f8.to(tl.float32)
    else:
        return e4m3_rne_pos(s)


@triton.jit
def random_bits8_top(c):
    """``mix32(c) >> 24`` as int32 in [0, 256): lowbias32's last xorshift (x ^ x >> 16) leaves the top byte
    unchanged, so it is skipped."""
    x = c ^ (c >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return (x >> 24).to(tl.int32)


@triton.jit
def e2m1_code_rne_lowbyte(y):
    """The E2M1 code (0..15) that ``e2m1_round_nearest`` (RNE, saturating) gives for every non-NaN y, sign
    included, in the LOW NIBBLE of the result: bits 4..22 are zero and bits 23..30 are left over (callers keep
    the low byte when they pack). NaN gives an unspecified code: callers zero the codes of a NaN tensor amax.

    m = min(|y|, 6). The E2M1 step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 8), i.e. 2^(e-1) with
    e = max(floor(log2 m), 0) (at most 2 since m <= 6); adding the magic number 2^(22+e) rounds m to that step
    (RNE, the hardware's own ties) and leaves n = round(m / step) in the low bits of the sum; the code is
    n + 2e. Here the magic number is q = 2^(22+e) + (2e + 8s) ulp (s = 1 for y < 0): adding an even number of
    ulps leaves the rounding unchanged, ties to even included, so the mantissa of m + q is n + 2e + 8s = the
    signed code (at most 15), with no code extraction or sign merge: ~8 instructions."""
    m = tl.minimum(tl.abs(y), 6.0)
    e = tl.maximum(u32(m) & 0x7F800000, 0x3F800000)  # 2^e as bits (e = 0, 1, 2); e >> 22 = 254 + 2e
    sc = tl.where(y < 0, (22 << 23) - 254 + 8, (22 << 23) - 254).to(tl.uint32)
    q = e + (e >> 22) + sc
    return u32(m + q.to(tl.float32, bitcast=True))


@triton.jit
def e2m1_code_sr_lean(y, rbits, NATIVE: tl.constexpr):
    """The E2M1 code that ``e2m1_round_stochastic(y, rbits)`` gives for every non-NaN y (sign included), by
    one add rounded UP.

    m = min(|y|, 6), step = 2^(e-1) (e = max(floor(log2 m), 0) as in ``e2m1_code_rne_lowbyte``). m + 2^(14+e)
    rounded up has ulp step/256, so its low bits are L = ceil(256 m / step) = 256 n + ceil(256 f) (n the
    lower neighbour's index in its binade, f the fraction of the gap). "Up" is r < 256 f, i.e.
    ceil(256 f) + 255 - r >= 256 (r an integer), so the code is (L + 255 - r + 256 (2e + 8s)) >> 8.
    ``NATIVE``: the GPU's add.rp (inline PTX: libdevice's __nv_fadd_ru would flush subnormal m to zero
    under Triton's FTZ reflection); else L = ceil(m * 2^(9-e)) (an exact product; the interpreter's way), as
    truncation plus one where a fraction is left: ``tl.math.ceil`` compiles to cvt.rpi.ftz.f32.f32 on the GPU,
    which flushes a subnormal product (m < 2^-135) to 0 and so drops its 1-in-256 chance of rounding up."""
    m = tl.minimum(tl.abs(y), 6.0)
    e = tl.maximum(u32(m) & 0x7F800000, 0x3F800000)
    if NATIVE:
        q = e + (14 << 23)
        t = tl.inline_asm_elementwise("add.rp.f32 $0, $1, $2;", "=r,r,r", [u32(m), q], dtype=tl.uint32,
                                      is_pure=True, pack=1)
        low = (t - q).to(tl.int32)
    else:
        scale = (0x83800000 - e).to(tl.float32, bitcast=True)  # 2^(9 - e)
        p = m * scale  # exact, in [0, 1024)
        low = p.to(tl.int32)  # truncation (p >= 0)
        low = low + (p > low.to(tl.float32)).to(tl.int32)
    sc = tl.where(y < 0, 255 - 65024 + 2048, 255 - 65024)
    return (low + (e >> 14).to(tl.int32) + sc - rbits) >> 8  # (e >> 14) = 256 (254 + 2e)


@triton.jit
def round_to_bf16_x2(y, ASM: tl.constexpr, NATIVE: tl.constexpr):
    """``round_to_bf16_fast(y, NATIVE)``, with ``ASM`` (GPU only) by the paired conversion cvt.rn.bf16x2.f32:
    one instruction per two values, where Triton's own cast converts one at a time."""
    if ASM:
        b = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [y], dtype=tl.bfloat16,
                                      is_pure=True, pack=2)
        return b.to(tl.float32)
    else:
        return round_to_bf16_fast(y, NATIVE)
