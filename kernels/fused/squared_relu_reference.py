"""Squared ReLU and its gradient in PyTorch: megatron-core's ``squared_relu`` (``torch.pow(F.relu(x), 2)``) and
torch autograd's backward of it, op by op, each direction with the non-finite check of the tensor it reads; the
reference of ``squared_relu.py`` (the same signatures).

R below rounds an fp32 value to x's dtype, nearest-even (each torch op on bf16/fp16 computes in fp32 and rounds;
for fp32 x, R is fp32's own rounding of the op).

Forward. ``r = relu(x)`` is exact (x, or 0 for x < 0; relu(-0) = -0, and NaN stays NaN: torch's relu propagates
it), then ``y = R(r * r)``. The square of a bf16 value has at most 16 significant bits, of an fp16 value 22: exact
in fp32, so one rounding, except where a bf16 square falls below fp32's normal range (bf16 has fp32's exponent
range): there the fp32 product is rounded once in fp32 (to a subnormal or zero) and once to bf16, and every
implementation that multiplies in fp32 and then rounds (torch eager, Inductor's kernel, ours) rounds the same
two times. fp16 squares never leave fp32's normal range.

Backward. torch's derivative formulas: ``pow(r, 2)`` gives ``pow_backward`` = ``dy * (2 * r.pow(1))``, two ops
in x's dtype: ``t = R(r * 2)``, exact (doubling changes only the exponent) unless it overflows: to +inf, for bf16
and fp32 exactly where fp32 overflows, for fp16 from r >= 32768 on; then ``g = R(dy * t)``, an exact fp32 product
(bf16: rounded twice below fp32's normal range, as above) rounded once. ``relu`` gives
``threshold_backward(g, r, 0)`` = ``where(r <= 0, 0, g)``: +0 where r <= 0, i.e. x <= 0 (-0 included); NaN x
gives r = NaN, which is not <= 0, so g = dy * NaN = NaN passes. So

    dx = where(x <= 0, +0, R(dy * R(2 * r)))        (r = x wherever it is used)

Inductor (megatron's ``squared_relu`` is ``torch.compile``'d on GPUs) computes the same expression in fp32 and
rounds once at the store: for bf16 and fp32 the same bits (``R(2r)`` is ``2r`` or +inf in fp32 alike), for fp16
not where ``R(2r)`` overflows (x >= 32768, whose square is +inf already): eager gives ±inf (NaN for dy = 0),
Inductor the finite ``R(dy * 2r)``. This reference and the kernel are eager's.

The check (``check``, a :class:`~nonfinite_reference.NonfiniteCheck`, or None): forward checks x, backward dy,
exactly as ``track_nonfinite_ref`` / ``track_nonfinite_clocked_ref`` of that tensor would (a -Inf in x is found
although relu makes it 0).

With the amax (``*_amax_ref``): the output as above and the raw amax that the next layer's quantizer reads of it,
``nvfp4_amax_ref`` of the output as a [M, K] matrix (K = x.shape[-1], M the product of the other dims): float32
[2], [0] max|out| and [1] max|RHT(out^T)| (the 16x16 Hadamard transform mixing 16 consecutive rows, M % 16 == 0)
with ``col_rht``, else [0] again; NaN and ±Inf count as +Inf. Forward that is fc2's input, backward fc1's output
gradient. bf16 and fp32 only (the NVFP4 and FP8 quantizers take those).
"""

from __future__ import annotations

import torch

from nvfp4_train.kernels.fused.nonfinite_reference import NonfiniteCheck, track_nonfinite_check_ref
from nvfp4_train.kernels.nvfp4.reference import BLOCK, nvfp4_amax_ref

__all__ = [
    "SQUARED_RELU_DTYPES",
    "SQUARED_RELU_AMAX_DTYPES",
    "check_squared_relu_args",
    "check_squared_relu_amax_args",
    "squared_relu_forward_ref",
    "squared_relu_backward_ref",
    "squared_relu_forward_amax_ref",
    "squared_relu_backward_amax_ref",
]

SQUARED_RELU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SQUARED_RELU_AMAX_DTYPES = (torch.bfloat16, torch.float32)


def check_squared_relu_args(x: torch.Tensor, dy: torch.Tensor | None = None) -> None:
    """x (and dy: the same shape, dtype and device) floating tensors of bf16, fp16 or fp32."""
    if not isinstance(x, torch.Tensor) or (dy is not None and not isinstance(dy, torch.Tensor)):
        raise TypeError(f"squared relu takes tensors, got {type(x).__name__}"
                        + ("" if dy is None else f" and {type(dy).__name__}"))
    if x.dtype not in SQUARED_RELU_DTYPES:
        raise ValueError(f"squared relu takes a bfloat16, float16 or float32 x, got {x.dtype}")
    if dy is not None and (dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device):
        raise ValueError(f"dy must be x's shape, dtype and device: x is {x.dtype} {tuple(x.shape)} on {x.device}, "
                         f"dy {dy.dtype} {tuple(dy.shape)} on {dy.device}")


def squared_relu_forward_ref(x: torch.Tensor, check: NonfiniteCheck | None = None) -> torch.Tensor:
    """``torch.pow(relu(x), 2)``, megatron's ``squared_relu`` op for op; with ``check``, x checked."""
    check_squared_relu_args(x)
    if check is not None:
        track_nonfinite_check_ref(check, x)
    return torch.pow(torch.relu(x), 2)


def squared_relu_backward_ref(x: torch.Tensor, dy: torch.Tensor,
                              check: NonfiniteCheck | None = None) -> torch.Tensor:
    """The gradient w.r.t. x for the output gradient dy, autograd's ops of ``pow(relu(x), 2)``: pow's
    ``dy * (r * 2)``, then relu's ``threshold_backward``; with ``check``, dy checked."""
    check_squared_relu_args(x, dy)
    if check is not None:
        track_nonfinite_check_ref(check, dy)
    r = torch.relu(x)
    return torch.ops.aten.threshold_backward(dy * (r * 2), r, 0)


def check_squared_relu_amax_args(x: torch.Tensor, col_rht: bool) -> None:
    """What the amax variants take besides ``check_squared_relu_args``: a bf16 or fp32 x with a last dim (the
    amax is of the output as [M, K], K = x.shape[-1]) and, for the Hadamard-mixed amax, M % 16 == 0."""
    if x.dtype not in SQUARED_RELU_AMAX_DTYPES:
        raise ValueError(f"the squared relu amax takes a bfloat16 or float32 x (what NVFP4 and FP8 quantize), got "
                         f"{x.dtype}: use squared_relu_forward / squared_relu_backward and nvfp4_amax")
    if x.dim() == 0:
        raise ValueError("the squared relu amax is of the output as [M, K] with K = x.shape[-1]; x is 0-d: pass "
                         "it as shape (1,)")
    if col_rht and _rows(x) % BLOCK != 0:
        raise ValueError(f"the Hadamard-mixed amax mixes {BLOCK} consecutive rows of the output as [M, K]; x of shape "
                         f"{tuple(x.shape)} has M = {_rows(x)} rows: pad them to a multiple of {BLOCK} or pass "
                         f"col_rht=False")


def _rows(x: torch.Tensor) -> int:
    """M of x as [M, K]: the product of all dims but the last (also when K = 0)."""
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m


def _amax(out: torch.Tensor, col_rht: bool) -> torch.Tensor:
    return nvfp4_amax_ref(out.reshape(_rows(out), out.shape[-1]), col_rht)


def squared_relu_forward_amax_ref(x: torch.Tensor, check: NonfiniteCheck | None = None, *,
                                  col_rht: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, amax): ``squared_relu_forward_ref(x, check)`` and ``nvfp4_amax_ref`` of y as [M, K]."""
    check_squared_relu_args(x)
    check_squared_relu_amax_args(x, col_rht)
    y = squared_relu_forward_ref(x, check)
    return y, _amax(y, col_rht)


def squared_relu_backward_amax_ref(x: torch.Tensor, dy: torch.Tensor, check: NonfiniteCheck | None = None, *,
                                   col_rht: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, amax): ``squared_relu_backward_ref(x, dy, check)`` and ``nvfp4_amax_ref`` of dx as [M, K]."""
    check_squared_relu_args(x, dy)
    check_squared_relu_amax_args(x, col_rht)
    dx = squared_relu_backward_ref(x, dy, check)
    return dx, _amax(dx, col_rht)
