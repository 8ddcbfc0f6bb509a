"""Input checks shared by every quantizer's reference and Triton path, and the Hadamard transform (torch only)."""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_DTYPES", "check_2d_float"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def check_2d_float(x: torch.Tensor, what: str) -> tuple[int, int]:
    """``x`` must be a 2-D bf16 or fp32 tensor; returns its shape. ``what`` names the operation in the errors
    ("NVFP4 quantization", ...)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} takes bfloat16 or float32 input, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(
            f"{what} takes a 2-D [M, K] tensor, got shape {tuple(x.shape)}; "
            "flatten leading dims first (x.reshape(-1, x.shape[-1]))"
        )
    return x.shape[0], x.shape[1]
