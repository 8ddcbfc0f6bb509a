"""The GEMM engines of the FP4 formats: which implementation ``nvfp4_gemm`` / ``mxfp4_gemm`` run on a device.

The run chooses one with ``precision.gemm_engine`` (validated once, in the config); the layers pass it down
to every GEMM call. Pure Python at import (the recipes import the names without torch); torch and the native
engine's module are imported where they are used.

    "cublas"  Hopper: both operands dequantized to bf16 once, one cuBLASLt GEMM with alpha in its epilogue
    "triton"  Hopper: the same operands (fp16), one Triton 16-bit GEMM with alpha in its epilogue
    "native"  sm_100+: the FP4 tensor-core GEMM (``kernels/nvfp4/native.py``, ``kernels/mxfp4/native.py``)
    "auto"    "native" where the device supports it, else ``DEFAULT_GEMM_ENGINE``

"cublas" is the Hopper default: measured in one run on the H200 (docs/benchmarks.md) at 1.01-1.06x cuBLAS BF16
(``torch.matmul``) on the six 12B GEMM shapes with the dequantize launch included, against 0.81-0.86x for
"triton". "triton" keeps the whole GEMM in Triton (no cuBLAS call); it is the
kernel the MXFP4 GEMM runs on Hopper whatever the engine. All engines are exact up to the fp32 summation order;
on the reference path (CPU without ``TRITON_INTERPRET=1``) the engine does not change the result.
"""

from __future__ import annotations

__all__ = ["GEMM_ENGINES", "DEFAULT_GEMM_ENGINE", "check_gemm_engine", "resolve_gemm_engine"]

GEMM_ENGINES = ("cublas", "triton", "native", "auto")
DEFAULT_GEMM_ENGINE = "cublas"


def check_gemm_engine(engine: str) -> str:
    """``engine`` itself when it is one of ``GEMM_ENGINES``; else a ValueError naming the choices."""
    if engine not in GEMM_ENGINES:
        raise ValueError(f"GEMM engine {engine!r} is not one of {GEMM_ENGINES} (precision.gemm_engine; "
                         f"default {DEFAULT_GEMM_ENGINE!r})")
    return engine


_NATIVE_BY_DEVICE: dict = {}


def _native_supported(device) -> bool:
    """Whether ``device`` (a torch.device) runs the native FP4 GEMM: a CUDA device of compute capability 10.0
    or later whose support ``nvfp4_train.kernels.nvfp4.native.native_fp4_supported`` confirms (imported only there).
    Cached per device."""
    if device.type != "cuda":
        return False
    idx = device.index
    if idx not in _NATIVE_BY_DEVICE:
        import torch

        if idx is None:
            return _native_supported(torch.device("cuda", torch.cuda.current_device()))
        ok = torch.cuda.get_device_capability(idx)[0] >= 10
        if ok:
            from nvfp4_train.kernels.nvfp4.native import native_fp4_supported

            ok = bool(native_fp4_supported(torch.device("cuda", idx)))
        _NATIVE_BY_DEVICE[idx] = ok
    return _NATIVE_BY_DEVICE[idx]


def resolve_gemm_engine(engine: str, device) -> str:
    """The engine that runs on ``device`` (a torch.device): "auto" becomes "native" where ``device`` supports
    it, else ``DEFAULT_GEMM_ENGINE``; "native" on a CPU device (the interpreter) becomes ``DEFAULT_GEMM_ENGINE``;
    the others are themselves."""
    if engine == "auto":
        return "native" if _native_supported(device) else DEFAULT_GEMM_ENGINE
    if engine == "native" and device.type != "cuda":
        return DEFAULT_GEMM_ENGINE  # CPU tensors under TRITON_INTERPRET=1: the interpreter runs the Hopper kernels
    return engine
