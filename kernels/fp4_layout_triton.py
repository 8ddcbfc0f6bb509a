"""The native FP4 GEMM's scale layout (``kernels/fp4_layout.py``) for the Triton quantizers: where a scale byte
is stored, and the buffer it is stored into. The quantizers compute their scales as before and only the store
address changes, so a swizzled quantization costs no extra pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_layout import blocked_numel


@triton.jit
def scale_offset(r, c, cols, SWIZZLE: tl.constexpr):
    """Where scale (r, c) of a [rows, cols] scale matrix goes: row-major, or (``SWIZZLE``) the native GEMM's
    128x4-tile layout (``nvfp4_train.kernels.fp4_layout.blocked_offset``, the same expression)."""
    if SWIZZLE:
        rr = r % 128
        return ((r // 128) * ((cols + 3) // 4) + c // 4) * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4
    else:
        return r * cols + c


def scale_buffer(rows: int, cols: int, swizzled: bool, dev: torch.device) -> torch.Tensor:
    """The uint8 output of a [rows, cols] scale matrix: row-major [rows, cols], or (``swizzled``) the 1-D buffer
    of the 128x4-tile layout, zero-filled only when the tiles pad the matrix (no fill otherwise)."""
    if not swizzled:
        return torch.empty((rows, cols), dtype=torch.uint8, device=dev)
    n = blocked_numel(rows, cols)
    if n != rows * cols:
        return torch.zeros(n, dtype=torch.uint8, device=dev)
    return torch.empty(n, dtype=torch.uint8, device=dev)
