"""RMSNorm's backward in one Triton kernel: the input gradient and the weight gradient's partial sums in one pass.

``rms_norm_backward(dy, x, rstd, weight)`` returns ``(dx, dw)`` for the forward ``y = (x * rstd) * weight`` that
torch's ``_fused_rms_norm`` computes (and ``F.rms_norm`` on CUDA runs); rstd is the fp32 per-row value that forward
returns. The arithmetic, operation by operation, is ``rms_norm_reference.py``'s; in fp32, per row:

    xh = x * r    g = dy * w    S = sum_j g_j * xh_j    c = S / H    dx = r * (g - xh * c)  -> x's dtype
    dw = sum over rows of dy * xh  (fp32)                                                  -> the weight's dtype

Layout. x, dy and dx are contiguous [M, H] (the model's [s, b, h] flattened), rstd [M] fp32, weight [H]; a row
is loaded whole as a [BLOCK_H] fp32 vector (BLOCK_H the next power of two >= H, masked to H; bf16 through its int16
bits, ``_elements.py``). A persistent grid (``persistent_grid``: 4 programs per multiprocessor) splits the rows
into contiguous bands (``rms_norm_reference.row_bands``); on the GPU program p walks its band a row at a time:
reads x, dy and r, sums the row's ``g * xh`` (``tl.sum``), writes dx (rounded once, to nearest-even) and adds
``dy * xh`` into its fp32 accumulator [H], written once, as row p of an fp32 [programs, H] buffer. A ``torch.sum``
over the programs and a cast to the weight's dtype finish dw. (Under the interpreter, whose time is per operation,
a program takes 16 rows a step, each row position with its own accumulator: ``rows_per_step``.) No atomics in dx
or dw: the partition depends on M and the GPU's multiprocessor count only, and every sum has one order, so a run
gives the same bits every time.
The launch sets ``enable_fp_fusion=False`` (no product contracted into an add, as the reference rounds each);
``c = S / H`` is a correctly rounded division (``div_rn``; the GPU's fp32 ``/`` approximates). Against the
reference the weight gradient is bitwise (same bands, lanes and row order); dx is within the bound of
``rms_norm_reference.rms_norm_backward_bound``, the row sum's order being the compiler's tree.

Against aten (``aten/src/ATen/native/cuda/layer_norm_kernel.cu``, its ``rms_norm`` instantiations; torch 2.8 and
later): the same exact expression, evaluated with other associations and summation orders, nothing else (both
use the forward's rstd; no approximate division or square root). aten's ``layer_norm_grad_input_kernel``
(``_vectorized``) sums ``fl(fl(fl(dy w) x) r)`` per thread in column order, then across the block (warp shuffles
and shared memory), and writes ``(fl(fl(H w) dy) - fl(fl(x r) S)) * fl(fl(1 / H) r)``; its
``GammaBetaBackwardCUDAKernelTemplate`` sums ``fl(fl(dy x) r)`` down each column in its thread tiles, reduces the
tiles in shared memory and rounds once to the weight's dtype (above 65536 rows it writes partials in the weight's
dtype and sums those: a rounding more). The bound covers every order (``tests/kernels/test_rms_norm.py``).

Bytes and time (prediction, at ~4 TB/s on the H200). Each call reads x and dy and writes dx once (6 bytes per bf16
element), reads rstd (4 B per row), and writes and re-reads the partials (4 B per program and column); aten reads x
and dy twice (once per kernel), and its weight-gradient kernel runs at a fraction of the copy rate:

    1.2b   [8192, 2048] bf16:  3 x 33.5 MB = 100.7 MB + partials 2 x 4.2 MB (512 programs)  -> ~27 us a call
           164 calls per step (4 micro-batches):  ~4.5 ms, against aten's two kernels' 11.8 ms in the profile of
           the graphed BF16 step (H200)
    small  [16384, 768] bf16:  3 x 25.2 MB =  75.5 MB + partials 2 x 1.6 MB (512 programs)  -> ~20 us a call
           108 calls per step:                      ~2.1 ms, against 8.5 ms in that profile

Three launches (the kernel, the partials' sum, the cast) against aten's two.

The non-finite check of dy (optional, ``check``: a ``NonfiniteCheck`` of either clock) is ``nonfinite.py``'s,
folded in as ``squared_relu.py`` folds it. While a program walks its band it keeps, in an int32 register tile
[ROWS, BLOCK_H], the max of the exponent fields (``bits & 0x7F800000``) of the fp32 dy values it loaded: widening
bf16/fp16 to fp32 is exact and maps NaN/±Inf to NaN/±Inf, so the field is all ones exactly for them, and masked
columns and rows past the band load 0. After its last row the program ends with ``nonfinite.track_nonfinite_tail``:
one atomic per program on the check's counter; the last program to arrive updates ``kept`` (and the clock). Every
program runs the tail once, after its loop; no band is empty (``row_bands`` counts only programs that hold a row).
The same times as ``track_nonfinite_triton`` / ``track_nonfinite_clocked_triton`` of dy, for a NaN/±Inf anywhere in
it. What it costs: no byte (dy is read for dx anyway), an AND and an integer max per element (sm_90, bf16: the loop
over rows grows from 175 to 192 instructions at H = 2048, 8 warps, and from 173 to 188 at H = 768, 4 warps; no
register spills either way), one cross-thread max and one atomic per program (512 programs for both shapes above);
dx and dw are the same bits with the check and without it. Without ``check`` the check is compiled out
(``CHECK``): not an instruction of it, no atomic. Nothing is allocated for the check in the device-clock form;
the host-clock form allocates ``kept`` when it is None, as ``track_nonfinite_triton`` does. An empty dy launches no
check (the device clock still advances: it counts checks).

The kernel runs where ``nvfp4_train.kernels._dispatch.use_triton(x)`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``), the reference otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fused._elements import KIND, kernel_bits, load_f32, store_rounded
from nvfp4_train.kernels.fused.nonfinite import (
    NEVER,
    check_folded_check_args,
    count_empty_check,
    folded_check_launch_args,
    track_nonfinite_tail,
)
from nvfp4_train.kernels.fused.nonfinite_reference import NonfiniteCheck
from nvfp4_train.kernels.fused.rms_norm_reference import (
    check_rms_norm_backward_args,
    rms_norm_backward_ref,
    row_bands,
    rows_per_step,
)

__all__ = ["MAX_HIDDEN", "NonfiniteCheck", "rms_norm_backward", "rms_norm_backward_triton", "rms_norm_backward_ref"]

MAX_HIDDEN = 1 << 16
"""A row lives in registers: BLOCK_H fp32 values per tensor spread over the program's threads."""
_EXP32 = tl.constexpr(0x7F800000)  # fp32's exponent field: all ones exactly for NaN and ±Inf


@triton.jit(do_not_specialize=["now"])
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, rstd_ptr, w_ptr, dx_ptr, part_ptr, M, H, band, kept_ptr, clock_ptr, arrivals_ptr, now,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr, W_KIND: tl.constexpr, NATIVE: tl.constexpr,
    CHECK: tl.constexpr, CLOCKED: tl.constexpr, FRESH: tl.constexpr, NEVER_F: tl.constexpr,
):
    """Rows [program_id(0) * band, +band) of M, ROWS at a time: dx of each, and ROWS weight-gradient partials
    (lane k: the rows k mod ROWS from the band's start, in row order; rows program_id(0) * ROWS + k of part
    [programs * ROWS, H] fp32). A row past the band loads zeros and adds +0 (the reference's padding). With CHECK,
    the program ends with the non-finite check's tail over the exponent fields of the dy it loaded (module
    docstring)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)[None, :]
    cmask = cols < H
    lanes = tl.arange(0, ROWS)[:, None]
    w = load_f32(w_ptr + cols, cmask, W_KIND)
    h = tl.full([ROWS], H, tl.float32)
    acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    seen = tl.zeros([ROWS, BLOCK_H], dtype=tl.int32)  # CHECK: max of dy's exponent fields (0 where masked)
    start = pid.to(tl.int64) * band
    end = tl.minimum(start + band, M)
    for i in range(0, (end - start + ROWS - 1) // ROWS):
        rows = start + i * ROWS + lanes  # [ROWS, 1]
        live = rows < end
        m = live & cmask
        offs = rows * H + cols
        x = load_f32(x_ptr + offs, m, KIND)
        dy = load_f32(dy_ptr + offs, m, KIND)
        r = tl.load(rstd_ptr + rows, mask=live, other=0.0)
        xh = x * r
        g = dy * w
        c = tl.math.div_rn(tl.sum(g * xh, axis=1), h)  # [ROWS]; masked columns add +0
        store_rounded(dx_ptr + offs, r * (g - xh * c[:, None]), m, KIND, NATIVE)
        acc = acc + dy * xh
        if CHECK:
            seen = tl.maximum(seen, dy.to(tl.int32, bitcast=True) & _EXP32)
    tl.store(part_ptr + (pid.to(tl.int64) * ROWS + lanes) * H + cols, acc, mask=cmask)
    if CHECK:  # once per program, after the loop: every program of the grid arrives exactly once
        track_nonfinite_tail(tl.max(seen, axis=0), _EXP32, kept_ptr, clock_ptr, arrivals_ptr, now, NEVER_F, CLOCKED,
                             FRESH)


def rms_norm_backward_triton(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, *,
                             programs: int | None = None,
                             check: NonfiniteCheck | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_backward_ref(dy, x, rstd, weight, programs=programs, check=check)`` in one launch and a sum over
    the partials: ``(dx [M, H] in x's dtype, dw [H] in the weight's)``; with ``check``, dy checked in the same launch
    (``check.kept`` updated in place, or set when None; the device clock advanced by one)."""
    check_rms_norm_backward_args(dy, x, rstd, weight)
    m, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"the RMSNorm backward kernel keeps a row in registers: hidden size {h} > {MAX_HIDDEN}; "
                         f"set fusion.rms_norm=false")
    if check is not None:
        check_folded_check_args(check, dy)
    dy, x, rstd, weight = dy.contiguous(), x.contiguous(), rstd.contiguous(), weight.contiguous()
    band, n_prog = row_bands(x, m, programs)
    lanes = rows_per_step(x)
    if check is not None and dy.numel() == 0:  # no launch for M = 0
        count_empty_check(check)
        check = None
    dx = torch.empty_like(x)
    if m == 0:
        return dx, torch.zeros(h, dtype=weight.dtype, device=x.device)
    part = torch.empty(n_prog * lanes, h, dtype=torch.float32, device=x.device)
    block_h = max(16, triton.next_power_of_2(h))
    num_warps = 4 if block_h <= 1024 else 8 if block_h <= 4096 else 16
    kept, clock, arrivals, now, clocked, fresh = folded_check_launch_args(check, x.device, part)
    _rms_norm_bwd_kernel[(n_prog,)](
        kernel_bits(dy), kernel_bits(x), rstd, kernel_bits(weight), kernel_bits(dx), part, m, h, band, kept, clock, arrivals, now,
        BLOCK_H=block_h, ROWS=lanes, KIND=KIND[x.dtype], W_KIND=KIND[weight.dtype], NATIVE=x.is_cuda,
        CHECK=check is not None, CLOCKED=clocked, FRESH=fresh, NEVER_F=float(NEVER),
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return dx, part.sum(0).to(weight.dtype)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, *,
                      programs: int | None = None,
                      check: NonfiniteCheck | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's ``(dx, dw)`` for x and dy [M, H] (bf16/fp16/fp32, one dtype), the forward's fp32 rstd [M] and the
    weight [H], and with ``check`` the non-finite check of dy: the kernel where ``use_triton(x)``, else the reference
    (module docstring)."""
    if use_triton(x):
        return rms_norm_backward_triton(dy, x, rstd, weight, programs=programs, check=check)
    return rms_norm_backward_ref(dy, x, rstd, weight, programs=programs, check=check)
