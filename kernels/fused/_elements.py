"""Element access the fused kernels share: fp32, bf16 and fp16 tensors read as fp32 inside a kernel.

``KIND`` is the ``constexpr`` code a launcher passes for its tensor's dtype; a bf16 tensor reaches the kernel as
its int16 bits (``t.view(torch.int16)``) and is widened by shifting them, exact for every value (subnormals
included), where the Triton interpreter's own bf16 conversion is not."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["KIND", "load_f32"]

KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def load_f32(ptrs, mask, KIND: tl.constexpr):
    """fp32 values of fp32 (KIND 0), bf16 passed as int16 bits (1) or fp16 (2) elements; 0 where masked."""
    if KIND == 1:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
