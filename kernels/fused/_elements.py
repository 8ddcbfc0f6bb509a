"""Element access the fused kernels share: fp32, bf16 and fp16 tensors read as fp32 inside a kernel.

``KIND`` is the ``constexpr`` code a launcher passes for its tensor's dtype; a bf16 tensor reaches the kernel as
its int16 bits (``t.view(torch.int16)``) and is widened by shifting them, exact for every value (subnormals
included), where the Triton interpreter's own bf16 conversion is not. The way back, fp32 rounded to nearest-even in
the element type: ``round_to_kind`` (as fp32) and ``store_rounded`` (``kernels/fused/rope.py`` states the
conversions: the GPU's paired cvt.rn.bf16x2.f32 with ``NATIVE``, exact bit arithmetic under the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_triton import round_to_bf16, round_to_bf16_x2

__all__ = ["KIND", "kernel_bits", "load_f32", "round_to_kind", "store_rounded"]

KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def kernel_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel takes it: a bf16 tensor as its int16 bits (``load_f32`` widens them), others as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@triton.jit
def load_f32(ptrs, mask, KIND: tl.constexpr):
    """fp32 values of fp32 (KIND 0), bf16 passed as int16 bits (1) or fp16 (2) elements; 0 where masked."""
    if KIND == 1:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def round_to_kind(y, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 ``y`` rounded (nearest-even) to the element type, returned as fp32."""
    if KIND == 1:
        if NATIVE:
            return round_to_bf16_x2(y, True, True)
        else:
            return round_to_bf16(y)
    elif KIND == 2:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def store_rounded(ptrs, y, mask, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """Round fp32 ``y`` (nearest-even) to the element type and store it (bf16 as int16 bits). On the GPU the
    paired conversion's bf16 result is stored as it is (its bits), with no round trip through fp32."""
    if KIND == 1:
        if NATIVE:
            b = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [y], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
            tl.store(ptrs, b.to(tl.int16, bitcast=True), mask=mask)
        else:
            r = round_to_bf16(y)
            tl.store(ptrs, (r.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    elif KIND == 2:
        tl.store(ptrs, y.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, y, mask=mask)
