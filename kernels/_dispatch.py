"""Which implementation a public kernel call runs.

The public functions (``quantize_nvfp4`` and friends) run the Triton kernel when the input lives on a CUDA
device, or on CPU when ``TRITON_INTERPRET=1`` is set (the interpreter reads the flag at import, so it must
be set before the process imports triton); otherwise they run the pure-PyTorch reference. Both give the
same bits.
"""

from __future__ import annotations

import os

import torch


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` should be processed by a Triton kernel (CUDA tensor, or CPU under the interpreter)."""
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpret_mode()
