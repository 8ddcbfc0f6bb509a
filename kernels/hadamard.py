"""The Random Hadamard Transform of each 16 consecutive elements of the last dim, as one Triton kernel.

``hadamard16(x)`` computes ``hadamard16_ref(x).to(x.dtype)`` (``kernels/nvfp4/reference.py``) for a 2-D
bf16 or fp32 tensor of any strides (a transposed view included), with the same bits. Per group of 16
consecutive elements ``x[r, 16g : 16g + 16]``, in fp32:

    y_j = fp32(x_j) * (s_j / 4)                  (s = RHT_SIGNS; s_j / 4 = +-0.25)
    four butterfly stages, stride h = 1, 2, 4, 8 in this order: for each pair (a, b) = (y_i, y_{i+h}) with
        i & h == 0:  y_i <- a + b,  y_{i+h} <- a - b
    out_j = y_j rounded to x.dtype (bf16: nearest-even, Inf on overflow; fp32: y_j itself)

The kernel is ``fp4_triton.rht16_last`` (the sign mask of RHT_SIGNS, ``fp4_triton.hadamard16`` and
``fp4_triton.round_to_bf16``) applied to [BLOCK_R, BLOCK_C] tiles
of x, launched with ``enable_fp_fusion=False`` (no multiply-add fusion: the products by +-0.25 are rounded on
their own, as in the reference, also where they are subnormal).

Non-finite values follow IEEE arithmetic in both: a NaN or an Inf in a group makes every output of that
group NaN or +-Inf (Inf - Inf = NaN), and finite values can overflow to +-Inf in the sums or in the bf16
rounding. A NaN's sign and payload are not specified (torch's own fp32 -> bf16 cast gives 0xFFFF on its
vectorised CPU path, 0x7FC0 in scalar code, 0x7FFF on CUDA; the kernel keeps the top half of the fp32 NaN):
the NaN positions are the same.

The kernel is used where ``nvfp4_train.kernels._dispatch.use_triton(x)`` (CUDA tensors; CPU under ``TRITON_INTERPRET=1``),
the reference otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels._checks import check_2d_float
from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fp4_triton import as_kernel_input, load_tile, rht16_last, u32
from nvfp4_train.kernels.nvfp4.reference import BLOCK, hadamard16_ref

__all__ = ["hadamard16", "hadamard16_triton", "check_hadamard_input"]

# Tile of one program: BLOCK_R rows x BLOCK_C columns (BLOCK_C a multiple of 16; narrowed for narrow x).
BLOCK_R = 64
BLOCK_C = 64
NUM_WARPS = 4


def check_hadamard_input(x: torch.Tensor) -> None:
    """What ``hadamard16`` accepts: a 2-D bf16 or fp32 tensor whose last dim is a multiple of 16."""
    check_2d_float(x, "the Hadamard transform")
    if x.shape[-1] % BLOCK != 0:
        # the reference's message
        raise ValueError(f"the Hadamard transform mixes groups of {BLOCK}; last dim is {x.shape[-1]}")


@triton.jit
def _hadamard16_kernel(
    x_ptr, out_ptr, M, K, stride_m, stride_k,
    IS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One [BLOCK_R, BLOCK_C] tile of x [M, K] (strides stride_m, stride_k; bf16 passed as int16 bits) ->
    the contiguous out [M, K] (bf16 as int16 bits, or fp32). Masked elements load as 0 and are not stored;
    a group of 16 never straddles the mask (K and BLOCK_C are multiples of 16)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    x, rm, rk, mask = load_tile(x_ptr, pid_r * BLOCK_R, pid_c * BLOCK_C, M, K, stride_m, stride_k,
                                BLOCK_R, BLOCK_C, IS_BF16)
    y = rht16_last(x, BLOCK_R, BLOCK_C, IS_BF16)  # x * (s/4), butterflies 1, 2, 4, 8, bf16 RNE if IS_BF16
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    if IS_BF16:
        # y holds bf16 values (low 16 bits zero; a NaN keeps its quiet bit in the top half): store the top half
        tl.store(out_ptr + offs, (u32(y) >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + offs, y, mask=mask)


def hadamard16_triton(
    x: torch.Tensor, block_r: int = BLOCK_R, block_c: int = BLOCK_C, num_warps: int = NUM_WARPS
) -> torch.Tensor:
    """The Triton kernel: a new contiguous tensor of x's shape and dtype, bitwise ``hadamard16_ref(x)``
    rounded to x.dtype (NaN positions equal, NaN bits unspecified). ``block_c`` is narrowed to the next
    power of two >= K (at least 16)."""
    check_hadamard_input(x)
    if block_c % BLOCK != 0 or block_c & (block_c - 1) or block_r & (block_r - 1):
        raise ValueError(f"block_r must be a power of two, block_c a power of two >= {BLOCK}: {block_r}, {block_c}")
    M, K = x.shape
    out = torch.empty((M, K), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bc = min(block_c, max(BLOCK, triton.next_power_of_2(K)))
    grid = (triton.cdiv(M, block_r), triton.cdiv(K, bc))
    is_bf16 = x.dtype == torch.bfloat16
    _hadamard16_kernel[grid](
        as_kernel_input(x), as_kernel_input(out), M, K, x.stride(0), x.stride(1),
        IS_BF16=is_bf16, BLOCK_R=block_r, BLOCK_C=bc, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


def hadamard16(x: torch.Tensor) -> torch.Tensor:
    """RHT of each 16 consecutive elements of x's last dim (2-D bf16/fp32, any strides), rounded to and
    returned as x.dtype: the Triton kernel where ``use_triton(x)``, ``hadamard16_ref(x).to(x.dtype)``
    otherwise (the same bits; see the module docstring)."""
    check_hadamard_input(x)
    if use_triton(x):
        return hadamard16_triton(x)
    return hadamard16_ref(x).to(x.dtype)
