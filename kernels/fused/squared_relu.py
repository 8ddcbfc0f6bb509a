"""Squared ReLU in one Triton kernel per direction, with the non-finite check of the tensor it reads in the same launch.

What is computed is ``squared_relu_reference.py``'s, bit for bit (the derivation from torch's ops is there):

    forward   y  = R(r * r)                              r = relu(x), NaN kept; checks x
    backward  dx = where(x <= 0, +0, R(dy * R(2 * x)))   checks dy

R rounds fp32 to x's dtype, nearest-even: the GPU's paired conversion (cvt.rn.bf16x2.f32) for bf16, the bit
arithmetic of ``_elements.py`` under the interpreter; the RNE cast for fp16; nothing for fp32. The inner
``R(2 * x)`` is the identity for bf16 and fp32 (2x is exact, or +inf where fp32 overflows) and is computed only
for fp16, where it overflows from x >= 32768 on as eager torch's fp16 op does. bf16 is read through its bits
(``load_f32``: exact, subnormals included); the products are plain fp32 multiplies (subnormal results kept, as
Inductor's kernels and torch's CPU ops keep them), no sum, so no contraction into an FMA can change a bit.
Compiled for sm_90 (``test_kernel_compiles_for_sm90_with_wide_accesses_and_one_atomic``, on any machine): 16-byte
loads and stores, no flush-to-zero multiply or add, one atomic per program with the check and none without; the
compiler turns the bf16 ``2 * x`` into ``x + x`` and the fp16 backward into fp16 adds and multiplies, the same bits
(2x is exact or +inf; an fp16 product is exact in fp32, so rounding it once to fp16 is the fp16 multiply's result).

The check (optional, ``check``: a ``NonfiniteCheck`` of either clock) is ``nonfinite.py``'s, folded in: while
a program walks its tiles it keeps the exponent field of every fp32 value it loaded of the checked tensor (x
forward, dy backward; widening bf16/fp16 to fp32 is exact and maps NaN/±Inf to NaN/±Inf, so the fp32 mask
0x7F800000 is all ones exactly for them), and it ends with ``nonfinite.track_nonfinite_tail``: one atomic per
program, the last one updates ``kept`` (and the clock). The same times as ``track_nonfinite_triton`` /
``track_nonfinite_clocked_triton`` of that tensor, for every value: a -Inf in x is found although relu makes it
0. Nothing is allocated for the check in the device-clock form (CUDA graphs capture the launch); the host-clock
form allocates ``kept`` when it is None, as ``track_nonfinite_triton`` does.

Layout. x, dy and the output are read and written as flat arrays of their n elements (contiguous; the output is a
new contiguous tensor of x's shape), in tiles of ``BLOCK`` elements; a persistent grid of ``PER_SM`` programs per
multiprocessor (``persistent_grid``) walks the tiles with a stride of the grid, as ``nonfinite.py`` does (the
check needs every program to arrive once).

Bytes and time (prediction, ~4 TB/s). The ``1.2b`` step (bf16; ffn 6144, 8192 tokens per micro-batch, 20 MLP
blocks, 4 micro-batches): the activation's input is fc1's output [8192, 6144], 100.7 MB.

    forward   reads x, writes y            201.3 MB -> 50.3 us    (checks x:  fc1's output)
    backward  reads x and dy, writes dx    302.0 MB -> 75.5 us    (checks dy: fc2's input gradient)
    per step  x 80 launches each way       16.1 + 24.2 = 40.3 GB  -> 10.1 ms

Inductor's two kernels (``triton_poi_fused_pow_relu``, ``..._mul_pow_relu_threshold_backward``) move the same
40.3 GB; what the fold removes is the non-finite kernel's own reads of those two tensors, 2 x 80 x 100.7 MB =
16.1 GB and 160 launches per step (4.0 ms at 4 TB/s; 5.3 ms at the ~3 TB/s the check kernel reaches,
``docs/benchmarks.md``), when these kernels run at the rate of the ones they replace.

With the amax (:func:`squared_relu_forward_amax`, :func:`squared_relu_backward_amax`; bf16 and fp32). The output
feeds a quantizer whose first pass is ``nvfp4_amax(t, col_rht)`` of it as t [M, K] (K = x.shape[-1]): fc2's input
forward, fc1's output gradient backward. The same launch returns that float32 [2] bit for bit (the reference:
``nvfp4_amax_ref`` of the output), so the quantizer skips its pass:

    amax[0] = max |out|                    NaN and ±Inf as +Inf; also ``fp8_amax(out)``
    amax[1] = max |RHT(out^T)|  (col_rht)  16x16 Hadamard of 16 consecutive rows, M % 16 == 0; else amax[0]

The maxima are of the ROUNDED outputs (``round_to_kind``: the values stored, as fp32), so ``_squared_relu_value``
runs as in the flat kernel (the same bits) and the transform and maxima are ``quantize.py``'s own helpers
(``_rht16``, ``_max16``, NaN-propagating) on the same fp32 values in the same order, with fp contraction off (a
multiply by ±1/4 then adds: an FMA would skip a rounding). The tail is ``_amax_grouped_kernel``'s (NaN -> +Inf,
then its ``publish_amax_pair``): the transform's amax rounded to bf16 once after the max for bf16 input (rounding
is monotonic and symmetric, so the max of the rounded values is the rounded max) and +Inf wherever amax[0] is (a
non-finite output mixes into Inf or NaN), one ``tl.atomic_max`` per entry and program into a zeroed buffer (without
col_rht the same value into both). The check folds in as above, over the checked tensor's loaded values.

Layout of the amax kernel. x (and dy, out) as [M, K] row-major; tiles of [BM, BK] = [16 G, BK]
(``AMAX_BLOCK_M`` x ``AMAX_BLOCK_K``), each program walking tiles pid, pid + npid, ... (``AMAX_PER_SM`` per
multiprocessor). A tile is 16 tensors [G, BK]: tensor i holds row i of each of the G groups of 16 rows, so the
transform along M is elementwise arithmetic between the 16 tensors, in registers, as in ``quantize.py``. All 16
rows are loaded before the first is stored: the compiler keeps a store ahead of any later load it cannot prove
disjoint (out could alias x), so storing row by row would wait out 16 memory latencies per tile. Rows past M and
columns past K load 0 (whose output, 0, moves no maximum) and are not stored; with M % 16 == 0 a group is wholly
inside or outside. Offsets inside a tile are 32-bit ((BM - 1) K + BK < 2^31), the tile's corner 64-bit.

SASS (sm_90, 64x128 on 4 warps, bf16, tile inside the tensor; instructions per element of the loop body, one tile:
from the loop's label to its backward branch; ~166 registers, no local loads or stores in any variant;
``test_amax_kernel_compiles_for_sm90_without_spills``):

    forward  with the check and col_rht   18.3   (16.4 without the check; 10.1 without col_rht; 8.3 neither)
    backward with the check and col_rht   21.8   (19.7; 13.7; 11.8)
    (fp32: 13.6 forward, 15.6 backward with both; the flat kernel: 9.6 and 13.1 with the check)

Of the forward's 18.3: the transform 5 (a multiply and four adds per element), the two maxima 2, relu and
square 3, the check 2, the rest bf16 unpacking and packing (the loaded values, the rounded ones) and addresses.
sm_90 issues ~29.6 T thread-instructions/s (132 multiprocessors, 4 warp-instructions a clock, ~1.75 GHz); at
4 TB/s forward streams 1.0 T elements/s (4 B each) and needs 62% of that, backward 0.67 T (6 B) and 49%: the
kernel should stay bound by memory (the amax pass it replaces ran at 54% of issue, ``docs/benchmarks.md``).

Bytes and time of the amax variants (prediction, ~4 TB/s, ``1.2b`` as above): the same bytes as the flat kernel
plus 8 (the amax), so the same 50.3 us forward and 75.5 us backward; what they save is the quantizer's amax pass
reading the output again:

    forward   fc2's amax pass over y    100.7 MB -> 25.2 us a call
    backward  fc1's amax pass over dx   100.7 MB -> 25.2 us a call
    per step  x 80 each way             16.1 GB and 160 launches -> 4.0 ms (4.5 ms at the 3.56 TB/s the amax
                                        pass measured, ``docs/benchmarks.md``)

The kernels run where ``nvfp4_train.kernels._dispatch.use_triton(x)`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``) for bf16, fp16 and fp32 (the amax variants bf16 and fp32; a non-contiguous x or dy is
copied first); the reference otherwise (:func:`squared_relu_forward`, :func:`squared_relu_backward`,
:func:`squared_relu_forward_amax`, :func:`squared_relu_backward_amax`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import persistent_grid, use_triton
from nvfp4_train.kernels.fp4_triton import cdiv
from nvfp4_train.kernels.fused._elements import KIND, kernel_bits, load_f32, round_to_kind, store_rounded
from nvfp4_train.kernels.fused.nonfinite import (
    NEVER,
    check_folded_check_args,
    count_empty_check,
    folded_check_launch_args,
    track_nonfinite_tail,
)
from nvfp4_train.kernels.fused.nonfinite_reference import NonfiniteCheck
from nvfp4_train.kernels.fused.squared_relu_reference import (
    SQUARED_RELU_DTYPES,
    check_squared_relu_amax_args,
    check_squared_relu_args,
    squared_relu_backward_amax_ref,
    squared_relu_backward_ref,
    squared_relu_forward_amax_ref,
    squared_relu_forward_ref,
)
from nvfp4_train.kernels.nvfp4.quantize import _max16, _rht16, publish_amax_pair

__all__ = [
    "NonfiniteCheck",
    "squared_relu_forward",
    "squared_relu_backward",
    "squared_relu_forward_triton",
    "squared_relu_backward_triton",
    "squared_relu_forward_ref",
    "squared_relu_backward_ref",
    "squared_relu_forward_amax",
    "squared_relu_backward_amax",
    "squared_relu_forward_amax_triton",
    "squared_relu_backward_amax_triton",
    "squared_relu_forward_amax_ref",
    "squared_relu_backward_amax_ref",
]

BLOCK = 2048  # elements per tile: 8 per thread at 8 warps (one 16-byte load of bf16 per tensor and thread)
NUM_WARPS = 8
PER_SM = 8  # programs per multiprocessor, as the non-finite kernel (not tuned on a GPU yet)
_EXP32 = tl.constexpr(0x7F800000)  # fp32's exponent field: all ones exactly for NaN and ±Inf
# The kernel with the amax (module docstring): [AMAX_BLOCK_M, AMAX_BLOCK_K] tiles, AMAX_BLOCK_M / 16 row groups of
# 16 rows. 64x128 on 4 warps: ~166 registers a thread on sm_90 without spills, so 3 programs fit a multiprocessor
# (65,536 registers), hence AMAX_PER_SM; 32x128 takes ~110-140 and ~10% more instructions per element, 32x512 spills
# for fp32 (not tuned on a GPU yet)
AMAX_BLOCK_M = 64
AMAX_BLOCK_K = 128
AMAX_NUM_WARPS = 4
AMAX_PER_SM = 3


@triton.jit
def _squared_relu_value(x, g, KIND: tl.constexpr, NATIVE: tl.constexpr, BACKWARD: tl.constexpr):
    """fp32 x (and dy = g) -> the output before its rounding R: r * r forward, where(x <= 0, 0, g * R(2x))
    backward (R(2x) computed for fp16 only; the module docstring). Both kernels compute their elements here."""
    if BACKWARD:
        two = x * 2.0
        if KIND == 2:
            two = round_to_kind(two, KIND, NATIVE)  # fp16: eager's R(2r), +inf from x >= 32768 on
        return tl.where(x <= 0.0, 0.0, g * two)  # NaN x: not <= 0, g * NaN = NaN
    else:
        r = tl.where(x < 0.0, 0.0, x)  # relu, NaN and -0 kept (-0 squares to +0)
        return r * r


@triton.jit
def _ld(ptrs, mask, KIND: tl.constexpr, EVEN: tl.constexpr):
    """``load_f32`` of a tile inside the tensor (``EVEN``: no mask) or at its edge (0 where masked)."""
    if EVEN:
        raw = tl.load(ptrs)
        if KIND == 1:
            return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return raw.to(tl.float32)
    else:
        return load_f32(ptrs, mask, KIND)


@triton.jit
def _sq_elements(x_ptrs, dy_ptrs, mask, chk, KIND: tl.constexpr, NATIVE: tl.constexpr, BACKWARD: tl.constexpr,
                 CHECK: tl.constexpr, EVEN: tl.constexpr):
    """The elements at ``x_ptrs`` (and ``dy_ptrs``): (the output of ``_squared_relu_value``, before its rounding;
    ``chk`` with the exponent fields of the checked tensor's loaded values, under CHECK). ``EVEN``: unmasked."""
    x = _ld(x_ptrs, mask, KIND, EVEN)
    if BACKWARD:
        g = _ld(dy_ptrs, mask, KIND, EVEN)
        seen = g
    else:
        g = x
        seen = x
    out = _squared_relu_value(x, g, KIND, NATIVE, BACKWARD)
    if CHECK:
        chk = tl.maximum(chk, seen.to(tl.int32, bitcast=True) & _EXP32)
    return out, chk


@triton.jit(do_not_specialize=["now"])
def _squared_relu_kernel(
    x_ptr, dy_ptr, out_ptr, n, kept_ptr, clock_ptr, arrivals_ptr, now,
    KIND: tl.constexpr, NATIVE: tl.constexpr, BACKWARD: tl.constexpr, CHECK: tl.constexpr, CLOCKED: tl.constexpr,
    FRESH: tl.constexpr, NEVER_F: tl.constexpr, BLOCK: tl.constexpr,
):
    """Persistent: tiles pid, pid + npid, ... of x (and dy) -> out; with CHECK, every program ends with the
    non-finite check's tail over the exponent fields of the checked tensor (module docstring)."""
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid.to(tl.int64) * BLOCK, n, npid * BLOCK):
        offs = start + lanes
        mask = offs < n
        out, acc = _sq_elements(x_ptr + offs, dy_ptr + offs, mask, acc, KIND, NATIVE, BACKWARD, CHECK, False)
        store_rounded(out_ptr + offs, out, mask, KIND, NATIVE)
    if CHECK:
        track_nonfinite_tail(acc, _EXP32, kept_ptr, clock_ptr, arrivals_ptr, now, NEVER_F, CLOCKED, FRESH)


# ------------------------------------------------------------------------------------------------------------
# With the amax: 2-D tiles whose 16 row tensors hold 16 consecutive rows of every group (module docstring)
# ------------------------------------------------------------------------------------------------------------


@triton.jit
def _row_mask(i: tl.constexpr, rows, M, kmask):
    """Where row i of each group ([G, BK]) lies inside the tensor (for a tile that may reach past it; a tile inside
    it is read and written unmasked: ``EVEN``)."""
    return ((rows + i) < M) & kmask


@triton.jit
def _sq_row(x_ptr, dy_ptr, offs, i: tl.constexpr, K, rows, M, kmask, chk, KIND: tl.constexpr, NATIVE: tl.constexpr,
            BACKWARD: tl.constexpr, CHECK: tl.constexpr, EVEN: tl.constexpr):
    """Row i of each of the tile's row groups, [G, BK] (the pointers at the tile's corner, ``offs`` the offsets of
    the groups' first rows, ``rows`` their indices): (the output of ``_squared_relu_value``, the same rounded to
    the element type as fp32: what is stored and what the amax reads, ``chk`` with the exponent fields of the
    checked row)."""
    p = i * K + offs
    # EVEN: _ld ignores the mask (Triton 3.6 cannot return None from a jitted function, so no None mask is made)
    out, chk = _sq_elements(x_ptr + p, dy_ptr + p, kmask if EVEN else _row_mask(i, rows, M, kmask), chk, KIND,
                            NATIVE, BACKWARD, CHECK, EVEN)
    return out, round_to_kind(out, KIND, NATIVE), chk


@triton.jit
def _st_row(out_ptr, offs, i: tl.constexpr, K, rows, M, kmask, out, KIND: tl.constexpr, NATIVE: tl.constexpr,
            EVEN: tl.constexpr):
    """Store row i of each group of the output (``store_rounded``: the rounding ``round_to_kind`` made of it)."""
    if EVEN:
        store_rounded(out_ptr + (i * K + offs), out, None, KIND, NATIVE)
    else:
        store_rounded(out_ptr + (i * K + offs), out, _row_mask(i, rows, M, kmask), KIND, NATIVE)


@triton.jit(do_not_specialize=["now"])
def _squared_relu_amax_kernel(
    x_ptr, dy_ptr, out_ptr, amax_ptr, M, K, kept_ptr, clock_ptr, arrivals_ptr, now,
    KIND: tl.constexpr, NATIVE: tl.constexpr, BACKWARD: tl.constexpr, CHECK: tl.constexpr, CLOCKED: tl.constexpr,
    FRESH: tl.constexpr, NEVER_F: tl.constexpr, COL_RHT: tl.constexpr, EVEN: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr,
):
    """Persistent: tiles pid, pid + npid, ... ([BM, BK] of x as [M, K], row-major order) -> out, folding max|out|
    (and with COL_RHT max|RHT(out^T)|) of the rounded outputs into two register tiles; every program ends with
    one atomic max into amax[0] and one into amax[1], then (CHECK) the non-finite check's tail."""
    G: tl.constexpr = BM // 16
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    n_k = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(M, BM) * n_k
    grp = 16 * tl.arange(0, G)[:, None]  # [G, 1]: the first row of each group, in the tile
    col = tl.arange(0, BK)[None, :]  # [1, BK]
    offs = grp * K + col  # [G, BK]: row 0 of each group from the tile's corner (int32 with row i's i K added)
    acc = tl.zeros([G, BK], dtype=tl.float32)
    acc_t = tl.zeros([G, BK], dtype=tl.float32)
    chk = tl.zeros([G, BK], dtype=tl.int32)
    nan: tl.constexpr = tl.PropagateNan.ALL
    for tile in range(pid, n_tiles, npid):
        m0 = (tile // n_k) * BM
        k0 = (tile % n_k) * BK
        corner = m0.to(tl.int64) * K + k0
        xt = x_ptr + corner
        dt = dy_ptr + corner
        ot = out_ptr + corner
        rows = m0 + grp
        kmask = (k0 + col) < K
        # all 16 loads before the first store: the compiler keeps a store ahead of every later load it cannot
        # prove disjoint from it (out might alias x), so row-by-row stores would wait out 16 memory latencies
        o0, y0, chk = _sq_row(xt, dt, offs, 0, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o1, y1, chk = _sq_row(xt, dt, offs, 1, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o2, y2, chk = _sq_row(xt, dt, offs, 2, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o3, y3, chk = _sq_row(xt, dt, offs, 3, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o4, y4, chk = _sq_row(xt, dt, offs, 4, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o5, y5, chk = _sq_row(xt, dt, offs, 5, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o6, y6, chk = _sq_row(xt, dt, offs, 6, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o7, y7, chk = _sq_row(xt, dt, offs, 7, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o8, y8, chk = _sq_row(xt, dt, offs, 8, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o9, y9, chk = _sq_row(xt, dt, offs, 9, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o10, y10, chk = _sq_row(xt, dt, offs, 10, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o11, y11, chk = _sq_row(xt, dt, offs, 11, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o12, y12, chk = _sq_row(xt, dt, offs, 12, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o13, y13, chk = _sq_row(xt, dt, offs, 13, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o14, y14, chk = _sq_row(xt, dt, offs, 14, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        o15, y15, chk = _sq_row(xt, dt, offs, 15, K, rows, M, kmask, chk, KIND, NATIVE, BACKWARD, CHECK, EVEN)
        _st_row(ot, offs, 0, K, rows, M, kmask, o0, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 1, K, rows, M, kmask, o1, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 2, K, rows, M, kmask, o2, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 3, K, rows, M, kmask, o3, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 4, K, rows, M, kmask, o4, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 5, K, rows, M, kmask, o5, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 6, K, rows, M, kmask, o6, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 7, K, rows, M, kmask, o7, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 8, K, rows, M, kmask, o8, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 9, K, rows, M, kmask, o9, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 10, K, rows, M, kmask, o10, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 11, K, rows, M, kmask, o11, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 12, K, rows, M, kmask, o12, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 13, K, rows, M, kmask, o13, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 14, K, rows, M, kmask, o14, KIND, NATIVE, EVEN)
        _st_row(ot, offs, 15, K, rows, M, kmask, o15, KIND, NATIVE, EVEN)
        acc = tl.maximum(acc, _max16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15), nan)
        if COL_RHT:
            y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht16(
                y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
            acc_t = tl.maximum(acc_t, _max16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15),
                               nan)
    # _amax_grouped_kernel's tail: NaN counts as +Inf (tl.max skips NaN), then its publish_amax_pair
    acc = tl.where(acc == acc, acc, float("inf"))
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    amax_t = amax
    if COL_RHT:
        acc_t = tl.where(acc_t == acc_t, acc_t, float("inf"))
        amax_t = tl.max(tl.max(acc_t, axis=1), axis=0)
    publish_amax_pair(amax_ptr, amax, amax_t, COL_RHT, KIND == 1)
    if not COL_RHT:
        tl.atomic_max(amax_ptr + 1, amax)  # the columnwise copy out^T has out's amax
    if CHECK:
        track_nonfinite_tail(tl.max(chk, axis=0), _EXP32, kept_ptr, clock_ptr, arrivals_ptr, now, NEVER_F, CLOCKED,
                             FRESH)


def _launch(x: torch.Tensor, dy: torch.Tensor | None, check: NonfiniteCheck | None, block: int, num_warps: int,
            per_sm: int) -> torch.Tensor:
    seen = x if dy is None else dy
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    if check is not None:
        check_folded_check_args(check, seen)
    if n == 0:
        count_empty_check(check)
        return out
    kind = KIND[x.dtype]
    kept, clock, arrivals, now, clocked, fresh = folded_check_launch_args(check, x.device, out)
    grid = persistent_grid(x, cdiv(n, block), per_sm)
    _squared_relu_kernel[grid](
        kernel_bits(x), kernel_bits(x if dy is None else dy), kernel_bits(out), n, kept, clock, arrivals, now,
        KIND=kind, NATIVE=x.is_cuda, BACKWARD=dy is not None, CHECK=check is not None, CLOCKED=clocked, FRESH=fresh,
        NEVER_F=float(NEVER), BLOCK=block, num_warps=num_warps,
    )
    return out


def squared_relu_forward_triton(x: torch.Tensor, check: NonfiniteCheck | None = None, *, block: int = BLOCK,
                                num_warps: int = NUM_WARPS, per_sm: int = PER_SM) -> torch.Tensor:
    """``squared_relu_forward_ref(x, check)`` in one launch: x contiguous, bf16/fp16/fp32; with ``check``, x
    checked in the same launch (``check.kept`` updated in place or set; the clock advanced by one)."""
    check_squared_relu_args(x)
    if not x.is_contiguous():
        raise ValueError(f"the squared relu kernel reads x as one contiguous span, got strides {x.stride()}: use "
                         f"squared_relu_forward (it copies)")
    return _launch(x, None, check, block, num_warps, per_sm)


def squared_relu_backward_triton(x: torch.Tensor, dy: torch.Tensor, check: NonfiniteCheck | None = None, *,
                                 block: int = BLOCK, num_warps: int = NUM_WARPS,
                                 per_sm: int = PER_SM) -> torch.Tensor:
    """``squared_relu_backward_ref(x, dy, check)`` in one launch: x and dy contiguous; with ``check``, dy
    checked in the same launch."""
    check_squared_relu_args(x, dy)
    if not (x.is_contiguous() and dy.is_contiguous()):
        raise ValueError(f"the squared relu kernel reads x and dy as contiguous spans, got strides {x.stride()} and "
                         f"{dy.stride()}: use squared_relu_backward (it copies)")
    return _launch(x, dy, check, block, num_warps, per_sm)


def _kernel_takes(x: torch.Tensor) -> bool:
    return x.dtype in SQUARED_RELU_DTYPES and use_triton(x)


def squared_relu_forward(x: torch.Tensor, check: NonfiniteCheck | None = None) -> torch.Tensor:
    """y = relu(x)^2 (and the check of x): the kernel where Triton runs (x made contiguous first), else the
    reference; the same bits and the same check either way."""
    if not _kernel_takes(x):
        return squared_relu_forward_ref(x, check)
    return squared_relu_forward_triton(x.contiguous(), check)


def squared_relu_backward(x: torch.Tensor, dy: torch.Tensor, check: NonfiniteCheck | None = None) -> torch.Tensor:
    """dx for the output gradient dy (and the check of dy): the kernel where Triton runs, else the reference."""
    if not _kernel_takes(x):
        return squared_relu_backward_ref(x, dy, check)
    return squared_relu_backward_triton(x.contiguous(), dy.contiguous(), check)


def _launch_amax(x: torch.Tensor, dy: torch.Tensor | None, check: NonfiniteCheck | None, col_rht: bool,
                 block_m: int, block_k: int, num_warps: int, per_sm: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert block_m % 16 == 0 and triton.next_power_of_2(block_m // 16) == block_m // 16, block_m
    assert triton.next_power_of_2(block_k) == block_k, block_k
    seen = x if dy is None else dy
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)  # the programs' atomic maxima start from 0
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if check is not None:
        check_folded_check_args(check, seen)
    if m == 0 or k == 0:
        count_empty_check(check)
        return out, amax
    if (block_m - 1) * k + block_k > 2**31:
        raise ValueError(f"the squared relu amax kernel addresses a [{block_m}, {block_k}] tile with 32-bit offsets; "
                         f"x has {k} columns: use squared_relu_forward / squared_relu_backward and nvfp4_amax")
    kind = KIND[x.dtype]
    kept, clock, arrivals, now, clocked, fresh = folded_check_launch_args(check, x.device, out)
    grid = persistent_grid(x, cdiv(m, block_m) * cdiv(k, block_k), per_sm)
    _squared_relu_amax_kernel[grid](
        kernel_bits(x), kernel_bits(x if dy is None else dy), kernel_bits(out), amax, m, k, kept, clock, arrivals, now,
        KIND=kind, NATIVE=x.is_cuda, BACKWARD=dy is not None, CHECK=check is not None, CLOCKED=clocked, FRESH=fresh,
        NEVER_F=float(NEVER), COL_RHT=col_rht, EVEN=m % block_m == 0 and k % block_k == 0, BM=block_m, BK=block_k,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return out, amax


def squared_relu_forward_amax_triton(x: torch.Tensor, check: NonfiniteCheck | None = None, *, col_rht: bool,
                                     block_m: int = AMAX_BLOCK_M, block_k: int = AMAX_BLOCK_K,
                                     num_warps: int = AMAX_NUM_WARPS,
                                     per_sm: int = AMAX_PER_SM) -> tuple[torch.Tensor, torch.Tensor]:
    """``squared_relu_forward_amax_ref(x, check, col_rht=col_rht)`` in one launch: x contiguous, bf16/fp32."""
    check_squared_relu_args(x)
    check_squared_relu_amax_args(x, col_rht)
    if not x.is_contiguous():
        raise ValueError(f"the squared relu amax kernel reads x as one contiguous [M, K], got strides {x.stride()}: "
                         f"use squared_relu_forward_amax (it copies)")
    return _launch_amax(x, None, check, col_rht, block_m, block_k, num_warps, per_sm)


def squared_relu_backward_amax_triton(x: torch.Tensor, dy: torch.Tensor, check: NonfiniteCheck | None = None, *,
                                      col_rht: bool, block_m: int = AMAX_BLOCK_M, block_k: int = AMAX_BLOCK_K,
                                      num_warps: int = AMAX_NUM_WARPS,
                                      per_sm: int = AMAX_PER_SM) -> tuple[torch.Tensor, torch.Tensor]:
    """``squared_relu_backward_amax_ref(x, dy, check, col_rht=col_rht)`` in one launch: x and dy contiguous."""
    check_squared_relu_args(x, dy)
    check_squared_relu_amax_args(x, col_rht)
    if not (x.is_contiguous() and dy.is_contiguous()):
        raise ValueError(f"the squared relu amax kernel reads x and dy as contiguous [M, K], got strides "
                         f"{x.stride()} and {dy.stride()}: use squared_relu_backward_amax (it copies)")
    return _launch_amax(x, dy, check, col_rht, block_m, block_k, num_warps, per_sm)


def squared_relu_forward_amax(x: torch.Tensor, check: NonfiniteCheck | None = None, *,
                              col_rht: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, amax): ``squared_relu_forward``'s y (and check) and the raw amax of y as [M, K] that fc2's quantizer
    reads (``nvfp4_amax(y.reshape(-1, K), col_rht)`` bit for bit): the kernel where Triton runs, else the
    reference."""
    if not _kernel_takes(x):
        return squared_relu_forward_amax_ref(x, check, col_rht=col_rht)
    return squared_relu_forward_amax_triton(x.contiguous(), check, col_rht=col_rht)


def squared_relu_backward_amax(x: torch.Tensor, dy: torch.Tensor, check: NonfiniteCheck | None = None, *,
                               col_rht: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, amax): ``squared_relu_backward``'s dx (and check) and the raw amax of dx as [M, K] that fc1's
    quantizer reads: the kernel where Triton runs, else the reference."""
    if not _kernel_takes(x):
        return squared_relu_backward_amax_ref(x, dy, check, col_rht=col_rht)
    return squared_relu_backward_amax_triton(x.contiguous(), dy.contiguous(), check, col_rht=col_rht)
