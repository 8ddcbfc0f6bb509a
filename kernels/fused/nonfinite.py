"""The per-layer non-finite check as ONE Triton launch: read the tensor once, update the kept first time in place.

What is computed is ``nonfinite_reference.py``'s (the same times, the same ``NEVER``, float64 0-d tensors):

    host clock:    kept <- min(kept, now   if t holds a NaN or ±Inf else NEVER)       (now: a host int)
    device clock:  clock <- clock + 1;  kept <- min(kept, clock if ... else NEVER)   (all on the device)

Layout and math. t is read as a flat array of its n elements (any contiguous or dense permuted layout: the
order does not matter), in tiles of ``BLOCK`` elements; a persistent grid of ``PER_SM`` programs per
multiprocessor walks the tiles with a stride of the grid. An element is NaN or ±Inf exactly when its exponent
field is all ones, so each element costs an AND with the exponent mask E of its format (bf16 0x7F80, fp16 0x7C00,
fp32 0x7F800000, fp64 0x7FF0000000000000) and an integer max into a register tile; no float arithmetic, exact for
every payload and sign. After its last tile a program's verdict is ``max(tile) == E``.

One launch does the whole update without a second pass: every program then issues ONE atomic add on a persistent
int32 counter ``arrivals`` (zero between launches), of ``1 + npid·bad``. The returned old value tells a program how
many finished before it (``old % npid``) and how many of those saw a non-finite value (``old // npid``), so the
program that finishes last (``old % npid == npid - 1``) knows the verdict of the whole tensor. Only that program
reads and writes the clock and ``kept`` (so the clock advances once per check however many programs there are,
and ``kept`` needs no float atomics) and puts the counter back to 0 for the next launch. The atomic is
acquire-release at GPU scope (Triton's default), so every program's count is visible to the last one. Nothing
is allocated per call in the device-clock form and no host value changes between calls: CUDA graphs capture it.
In the host-clock form a ``kept`` of None (after a reset) becomes ``torch.empty`` that the last program fills
(no fill launch); ``now`` is a launch argument.

Cost: the tensor is read once (n x its element size) plus a few bytes (the counter, ``kept``, the clock); one
launch per check (before: 4 with the host clock, 5 with the device clock, the first of them the same full read).
On the ``1.2b`` step (bf16; hidden 2048, qkv 4096 wide, ffn 6144, 8192 tokens per micro-batch, 20 attention + 20
MLP blocks, 4 micro-batches) every linear layer checks its output and its input gradient, [8192, width] each:

    attention block  qkv (out 4096, in-grad 2048) + proj (2048, 2048)  = 10,240 columns
    MLP block        fc1 (out 6144, in-grad 2048) + fc2 (2048, 6144)   = 16,384 columns
    per micro-batch  20 x (10,240 + 16,384) x 8192 tokens x 2 B = 8.72 GB in 160 checks
    per step         x 4 micro-batches = 34.9 GB in 640 launches

Predicted at ~4 TB/s: 8.7 ms per step (8.4 us for an [8192, 2048] tensor, 16.8 us for 4096 wide, 25.2 us for
6144 wide), against 15.2 ms measured for the abs-max reductions alone plus 1,920 (host clock) or 2,560 (device
clock) small follow-up launches. A small tensor (the ``small`` model's many checks) costs one launch's latency,
a few microseconds, instead of four or five.

The kernel is used where ``nvfp4_train.kernels._dispatch.use_triton(t)`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``) for bf16, fp16, fp32 and fp64 tensors whose elements fill one contiguous span
(:func:`kernel_takes`); the reference otherwise (a strided view with gaps, another dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._dispatch import persistent_grid, use_triton
from nvfp4_train.kernels.fused.nonfinite_reference import (
    NEVER,
    track_nonfinite_clocked_ref,
    track_nonfinite_ref,
)

__all__ = [
    "NEVER",
    "check_nonfinite_args",
    "check_folded_check_args",
    "folded_check_launch_args",
    "count_empty_check",
    "kernel_takes",
    "new_arrivals",
    "track_nonfinite",
    "track_nonfinite_clocked",
    "track_nonfinite_triton",
    "track_nonfinite_clocked_triton",
]

BLOCK = 4096  # elements per tile: 16 per thread at 8 warps (8 KB of bf16 in flight per program)
NUM_WARPS = 8
PER_SM = 8  # programs per multiprocessor: 64 warps, all resident at the 30-32 registers a thread takes (sm_90;
# fp64 takes 66: fewer resident, the rest run after them, nothing waits on another program)

# dtype -> (bits of an element, the exponent mask: all ones exactly for NaN and ±Inf)
_FORMATS = {
    torch.bfloat16: (16, 0x7F80),
    torch.float16: (16, 0x7C00),
    torch.float32: (32, 0x7F800000),
    torch.float64: (64, 0x7FF0000000000000),
}


@triton.jit
def track_nonfinite_tail(acc, EXP: tl.constexpr, kept_ptr, clock_ptr, arrivals_ptr, now, NEVER_F: tl.constexpr,
                         CLOCKED: tl.constexpr, FRESH: tl.constexpr):
    """The end of one program of a persistent check, after its last tile: ``acc`` is its register tile of
    exponent fields (each ``bits & EXP``), so the program saw a NaN/±Inf exactly when ``max(acc) == EXP``. One
    atomic on ``arrivals``; the last program to arrive updates ``kept`` (and the clock) and zeroes the counter
    (the module docstring). Every program of the grid must call it exactly once; a kernel that reads the tensor
    for another purpose too (``squared_relu.py``) folds the check in by ending with it."""
    npid = tl.num_programs(0)
    bad = (tl.max(acc, axis=0) == EXP).to(tl.int32)
    old = tl.atomic_add(arrivals_ptr, 1 + bad * npid)  # (programs done) + npid * (of them non-finite)
    last = old % npid == npid - 1
    any_bad = (old // npid + bad) > 0
    if CLOCKED:
        when = tl.load(clock_ptr, mask=last, other=0.0) + 1.0
        tl.store(clock_ptr, when, mask=last)
    else:
        when = now.to(tl.float64)
    if FRESH:
        new = tl.where(any_bad, when, NEVER_F)
    else:
        prev = tl.load(kept_ptr, mask=last, other=0.0)
        new = tl.where(any_bad, tl.minimum(prev, when), prev)
    tl.store(kept_ptr, new, mask=last)
    tl.store(arrivals_ptr, 0, mask=last)


@triton.jit(do_not_specialize=["now"])
def _track_nonfinite_kernel(
    t_ptr, n, kept_ptr, clock_ptr, arrivals_ptr, now,
    BITS: tl.constexpr, EXP: tl.constexpr, NEVER_F: tl.constexpr, CLOCKED: tl.constexpr, FRESH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Persistent: fold the tiles pid, pid + npid, ... into a register tile of exponent fields, then one atomic
    on ``arrivals``; the last program to arrive updates ``kept`` (and the clock). See the module docstring."""
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    if BITS == 64:
        acc = tl.zeros([BLOCK], dtype=tl.int64)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid.to(tl.int64) * BLOCK, n, npid * BLOCK):
        offs = start + lanes
        x = tl.load(t_ptr + offs, mask=offs < n, other=0)
        if BITS == 16:
            bits = x.to(tl.int16, bitcast=True).to(tl.int32)
        elif BITS == 32:
            bits = x.to(tl.int32, bitcast=True)
        else:
            bits = x.to(tl.int64, bitcast=True)
        acc = tl.maximum(acc, bits & EXP)  # <= EXP, equal exactly for NaN / ±Inf
    track_nonfinite_tail(acc, EXP, kept_ptr, clock_ptr, arrivals_ptr, now, NEVER_F, CLOCKED, FRESH)


def _one_span(t: torch.Tensor) -> bool:
    """Whether t's elements fill the n slots from its first one exactly (contiguous, or a permutation of a
    contiguous layout such as a transpose): then the kernel reads them as a flat array."""
    if t.is_contiguous():
        return True
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != span:  # a gap, or two dims over the same slots
            return False
        span *= size
    return True


def kernel_takes(t: torch.Tensor) -> bool:
    """Whether the kernel checks ``t`` (else the reference does): a float dtype it knows, on a device Triton runs
    on, with the elements in one span (:func:`_one_span`)."""
    return t.dtype in _FORMATS and use_triton(t) and _one_span(t)


def new_arrivals(device: torch.device | str) -> torch.Tensor:
    """A counter for :func:`track_nonfinite_triton` / :func:`track_nonfinite_clocked_triton`: int32 [1], zero.
    Keep one per ``kept`` tensor (checks of one counter must not run concurrently on two streams); the kernel
    leaves it zero."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def check_nonfinite_args(kept: torch.Tensor | None, t: torch.Tensor, arrivals: torch.Tensor | None) -> None:
    """What every launch of the check's kernel tail needs (this kernel's, and the kernels that run a check on the
    tensor they read): a dtype it knows, a persistent int32 [1] counter and a 0-d float64 kept time (or None) on
    t's device."""
    if t.dtype not in _FORMATS:
        raise TypeError(f"the non-finite check takes {', '.join(map(str, _FORMATS))}, got {t.dtype}")
    if arrivals is None or arrivals.dtype != torch.int32 or arrivals.device != t.device or arrivals.numel() != 1:
        got = None if arrivals is None else f"{arrivals.dtype} {tuple(arrivals.shape)} on {arrivals.device}"
        raise ValueError(f"arrivals={got}: the kernel needs a persistent int32 counter on {t.device}: pass "
                         f"new_arrivals(t.device), kept between calls")
    if kept is not None and (kept.dtype != torch.float64 or kept.dim() != 0 or kept.device != t.device):
        raise ValueError(f"kept is a {kept.dtype} of shape {tuple(kept.shape)} on {kept.device}: pass the 0-d "
                         f"float64 tensor on {t.device} a previous call returned (or None)")


def check_folded_check_args(check, t: torch.Tensor) -> None:
    """What a kernel that folds ``check`` (a ``NonfiniteCheck``) into its own pass over ``t`` needs: the counter
    and kept time of :func:`check_nonfinite_args`, and a device clock that is a 0-d float64 tensor on t's device
    with a kept time to update."""
    kept, clock = check.kept, check.clock
    check_nonfinite_args(kept, t, check.arrivals)
    if clock is not None and (clock.dtype != torch.float64 or clock.dim() != 0 or clock.device != t.device
                              or kept is None):
        raise ValueError(f"check.clock is a {clock.dtype} of shape {tuple(clock.shape)} on {clock.device} with "
                         f"kept={None if kept is None else 'a tensor'}: the device clock needs a 0-d float64 clock "
                         f"and kept on {t.device}")


def folded_check_launch_args(check, device: torch.device, placeholder: torch.Tensor) -> tuple:
    """(kept, clock, arrivals, now, CLOCKED, FRESH) of a launch that folds ``check`` (a ``NonfiniteCheck``, or None):
    the check's tensors (``kept`` made on ``device`` when None: the last program writes it), or ``placeholder`` for
    each (never read without CHECK)."""
    if check is None:
        return placeholder, placeholder, placeholder, 0, False, False
    clocked = check.clock is not None
    fresh = check.kept is None
    if fresh:
        check.kept = torch.empty((), dtype=torch.float64, device=device)
    clock = check.clock if clocked else check.kept
    return check.kept, clock, check.arrivals, 0 if clocked else int(check.now), clocked, fresh


def count_empty_check(check) -> None:
    """A folded ``check`` of an empty tensor, where nothing is launched: nothing to find, but the device clock
    counts every check."""
    if check is not None and check.clock is not None:
        check.clock.add_(1.0)


def _launch(t: torch.Tensor, kept: torch.Tensor, clock: torch.Tensor, arrivals: torch.Tensor, now: int,
            clocked: bool, fresh: bool, block: int, num_warps: int, per_sm: int) -> None:
    n = t.numel()
    bits, exp = _FORMATS[t.dtype]
    grid = persistent_grid(t, -(-n // block), per_sm)
    _track_nonfinite_kernel[grid](t, n, kept, clock, arrivals, now, BITS=bits, EXP=exp, NEVER_F=float(NEVER),
                                  CLOCKED=clocked, FRESH=fresh, BLOCK=block, num_warps=num_warps)


def track_nonfinite_triton(kept: torch.Tensor | None, t: torch.Tensor, now: int, arrivals: torch.Tensor | None,
                           *, block: int = BLOCK, num_warps: int = NUM_WARPS,
                           per_sm: int = PER_SM) -> torch.Tensor | None:
    """The kernel, host clock: ``track_nonfinite_ref``'s result (``kept`` updated in place and returned; a new
    float64 0-d tensor when ``kept`` is None; an empty t launches nothing) in one launch. ``t`` must satisfy
    :func:`kernel_takes` (but for the device)."""
    if t.numel() == 0:
        return kept
    check_nonfinite_args(kept, t, arrivals)
    if not _one_span(t):
        raise ValueError(f"the non-finite kernel reads t's elements as one span; t of shape {tuple(t.shape)} "
                         f"and strides {t.stride()} has gaps: use track_nonfinite (the reference takes it)")
    fresh = kept is None
    if fresh:
        kept = torch.empty((), dtype=torch.float64, device=t.device)  # the last program writes it
    _launch(t, kept, kept, arrivals, int(now), False, fresh, block, num_warps, per_sm)
    return kept


def track_nonfinite_clocked_triton(kept: torch.Tensor, t: torch.Tensor, clock: torch.Tensor,
                                   arrivals: torch.Tensor | None, *, block: int = BLOCK,
                                   num_warps: int = NUM_WARPS, per_sm: int = PER_SM) -> None:
    """The kernel, device clock: ``track_nonfinite_clocked_ref``'s update of ``clock`` and ``kept`` in place, in
    one launch (an empty t: ``clock += 1`` only)."""
    if t.numel() == 0:
        clock.add_(1.0)
        return
    check_nonfinite_args(kept, t, arrivals)
    if clock.dtype != torch.float64 or clock.dim() != 0 or clock.device != t.device:
        raise ValueError(f"clock is a {clock.dtype} of shape {tuple(clock.shape)} on {clock.device}: pass a 0-d "
                         f"float64 tensor on {t.device}")
    if not _one_span(t):
        raise ValueError(f"the non-finite kernel reads t's elements as one span; t of shape {tuple(t.shape)} "
                         f"and strides {t.stride()} has gaps: use track_nonfinite_clocked (the reference takes it)")
    _launch(t, kept, clock, arrivals, 0, True, False, block, num_warps, per_sm)


def track_nonfinite(kept: torch.Tensor | None, t: torch.Tensor, now: int,
                    arrivals: torch.Tensor | None = None) -> torch.Tensor | None:
    """Host clock: the kernel where :func:`kernel_takes` t (``arrivals`` then required), else the reference."""
    if kernel_takes(t):
        return track_nonfinite_triton(kept, t, now, arrivals)
    return track_nonfinite_ref(kept, t, now, arrivals)


def track_nonfinite_clocked(kept: torch.Tensor, t: torch.Tensor, clock: torch.Tensor,
                            arrivals: torch.Tensor | None = None) -> None:
    """Device clock: the kernel where :func:`kernel_takes` t (``arrivals`` then required), else the reference."""
    if kernel_takes(t):
        track_nonfinite_clocked_triton(kept, t, clock, arrivals)
    else:
        track_nonfinite_clocked_ref(kept, t, clock, arrivals)
