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

The kernels run where ``nvfp4_train.kernels._dispatch.use_triton(x)`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``) for bf16, fp16 and fp32 (a non-contiguous x or dy is copied first); the reference
otherwise (:func:`squared_relu_forward`, :func:`squared_relu_backward`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import persistent_grid, use_triton
from nvfp4_train.kernels.fp4_triton import cdiv
from nvfp4_train.kernels.fused._elements import KIND, load_f32, round_to_kind, store_rounded
from nvfp4_train.kernels.fused.nonfinite import NEVER, check_nonfinite_args, track_nonfinite_tail
from nvfp4_train.kernels.fused.nonfinite_reference import NonfiniteCheck
from nvfp4_train.kernels.fused.squared_relu_reference import (
    SQUARED_RELU_DTYPES,
    check_squared_relu_args,
    squared_relu_backward_ref,
    squared_relu_forward_ref,
)

__all__ = [
    "NonfiniteCheck",
    "squared_relu_forward",
    "squared_relu_backward",
    "squared_relu_forward_triton",
    "squared_relu_backward_triton",
    "squared_relu_forward_ref",
    "squared_relu_backward_ref",
]

BLOCK = 2048  # elements per tile: 8 per thread at 8 warps (one 16-byte load of bf16 per tensor and thread)
NUM_WARPS = 8
PER_SM = 8  # programs per multiprocessor, as the non-finite kernel (not tuned on a GPU yet)
_EXP32 = tl.constexpr(0x7F800000)  # fp32's exponent field: all ones exactly for NaN and ±Inf


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
        x = load_f32(x_ptr + offs, mask, KIND)
        if BACKWARD:
            g = load_f32(dy_ptr + offs, mask, KIND)
            seen = g
            two = x * 2.0
            if KIND == 2:
                two = round_to_kind(two, KIND, NATIVE)  # fp16: eager's R(2r), +inf from x >= 32768 on
            out = tl.where(x <= 0.0, 0.0, g * two)  # NaN x: not <= 0, g * NaN = NaN
        else:
            seen = x
            r = tl.where(x < 0.0, 0.0, x)  # relu, NaN and -0 kept (-0 squares to +0)
            out = r * r
        if CHECK:
            acc = tl.maximum(acc, seen.to(tl.int32, bitcast=True) & _EXP32)
        store_rounded(out_ptr + offs, out, mask, KIND, NATIVE)
    if CHECK:
        track_nonfinite_tail(acc, _EXP32, kept_ptr, clock_ptr, arrivals_ptr, now, NEVER_F, CLOCKED, FRESH)


def _check_args(check: NonfiniteCheck, t: torch.Tensor) -> None:
    kept, clock = check.kept, check.clock
    check_nonfinite_args(kept, t, check.arrivals)
    if clock is not None and (clock.dtype != torch.float64 or clock.dim() != 0 or clock.device != t.device
                              or kept is None):
        raise ValueError(f"check.clock is a {clock.dtype} of shape {tuple(clock.shape)} on {clock.device} with "
                         f"kept={None if kept is None else 'a tensor'}: the device clock needs a 0-d float64 clock "
                         f"and kept on {t.device}")


def _launch(x: torch.Tensor, dy: torch.Tensor | None, check: NonfiniteCheck | None, block: int, num_warps: int,
            per_sm: int) -> torch.Tensor:
    seen = x if dy is None else dy
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    if check is not None:
        _check_args(check, seen)
    if n == 0:
        if check is not None and check.clock is not None:
            check.clock.add_(1.0)  # the clock counts checks
        return out
    kind = KIND[x.dtype]
    as_bits = (lambda v: v.view(torch.int16)) if kind == 1 else (lambda v: v)
    clocked = fresh = False
    kept = clock = arrivals = out  # placeholders: never read without CHECK
    now = 0
    if check is not None:
        clocked = check.clock is not None
        fresh = check.kept is None
        if fresh:
            check.kept = torch.empty((), dtype=torch.float64, device=x.device)  # the last program writes it
        kept, arrivals = check.kept, check.arrivals
        clock = check.clock if clocked else check.kept
        now = 0 if clocked else int(check.now)
    grid = persistent_grid(x, cdiv(n, block), per_sm)
    _squared_relu_kernel[grid](
        as_bits(x), as_bits(x if dy is None else dy), as_bits(out), n, kept, clock, arrivals, now,
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
