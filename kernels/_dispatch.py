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


def _cuda_index(x: torch.Tensor) -> int:
    """The index of the CUDA device ``x`` lives on."""
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


_NUM_SMS: dict[int, int] = {}


def persistent_grid(x: torch.Tensor, n_tiles: int, per_sm: int = 4) -> tuple[int]:
    """The grid of a persistent kernel over ``n_tiles`` tiles of ``x``: ``per_sm`` programs per
    multiprocessor of x's GPU (at most one per tile; 4 programs under the interpreter)."""
    if x.is_cuda:
        dev = _cuda_index(x)
        if dev not in _NUM_SMS:
            _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        return (max(1, min(n_tiles, per_sm * _NUM_SMS[dev])),)
    return (max(1, min(n_tiles, 4)),)


_E4M3_CVT: dict[int, bool] = {}


def has_e4m3_convert(x: torch.Tensor) -> bool:
    """True when ``x`` lives on a GPU with the paired fp32 -> E4M3 conversion instruction
    (``cvt.rn.satfinite.e4m3x2.f32``: compute capability 8.9 and later); the FP8 casts use it there and the bit
    arithmetic elsewhere (older GPUs, the interpreter)."""
    if not x.is_cuda:
        return False
    dev = _cuda_index(x)
    if dev not in _E4M3_CVT:
        _E4M3_CVT[dev] = torch.cuda.get_device_capability(dev) >= (8, 9)
    return _E4M3_CVT[dev]
