"""Which GPUs run the native FP4 GEMM (``precision.gemm_engine=native``). Imports only torch; the engine choice
itself (``resolve_gemm_engine``) is ``kernels/gemm_engine.py``.

The block-scaled FP4 tensor-core instructions that ``torch.nn.functional.scaled_mm`` uses for
``float4_e2m1fn_x2`` operands exist from compute capability 10.0 (Blackwell: B200/GB200 sm_100, and later);
Hopper (sm_90) and older have none, so there the exact BF16 path (``cublas`` / ``triton``) runs instead.
"""

from __future__ import annotations

import torch

NATIVE_MIN_CAPABILITY = (10, 0)
NATIVE = "native"
AUTO = "auto"

__all__ = ["NATIVE", "AUTO", "NATIVE_MIN_CAPABILITY", "native_fp4_supported", "check_native_fp4"]


def _describe(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """('this GPU is sm_90 (NVIDIA H200)', (9, 0)) for a CUDA device; ('this is a cpu device', None)
    otherwise."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"this is a {device.type} device", None
    major, minor = torch.cuda.get_device_capability(device)
    return f"this GPU is sm_{major}{minor} ({torch.cuda.get_device_name(device)})", (major, minor)


def native_fp4_supported(device: torch.device | str) -> bool:
    """True when ``device`` is a CUDA GPU of compute capability >= 10.0 (FP4 tensor cores)."""
    cap = _describe(torch.device(device))[1]
    return cap is not None and cap >= NATIVE_MIN_CAPABILITY


def check_native_fp4(device: torch.device | str) -> None:
    """ValueError naming the compute capability unless ``device`` runs the native FP4 GEMM."""
    device = torch.device(device)
    if not native_fp4_supported(device):
        what = _describe(device)[0]
        raise ValueError(f"gemm_engine=native needs sm_100+ (Blackwell); {what}: use gemm_engine=auto "
                         f"(the exact BF16 path there)")
