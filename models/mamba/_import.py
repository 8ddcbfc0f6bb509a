"""Optional imports of mamba-ssm's Triton kernels and causal-conv1d's CUDA kernel.

Both packages are optional (the ``gpu`` extra). Each loader returns ``(ops, reason)``: ``ops`` is a small
frozen record of the functions we call, or ``None`` with ``reason`` saying why, so that callers fall back
to the pure-PyTorch paths in :mod:`nvfp4_train.models.mamba.ssd` and :mod:`nvfp4_train.models.mamba.ops`.

mamba-ssm built as a pure-Python wheel (``MAMBA_SKIP_CUDA_BUILD=TRUE``, how ``scripts/wheelhouse.sh`` builds
it) lacks its Mamba-1 CUDA extension ``selective_scan_cuda``, yet the package ``__init__`` imports that
module unconditionally (and also ``transformers``, ``huggingface_hub`` and the Mamba-3 modules), and every
``import mamba_ssm.<submodule>`` runs that ``__init__`` first. Mamba-2 needs none of it: its forward and
backward are the Triton kernels under ``mamba_ssm.ops.triton`` (which need only torch, triton, einops and
packaging). So, unless ``mamba_ssm`` has already been imported by someone else, we register the package
in ``sys.modules`` WITHOUT running its ``__init__`` (the module object comes from the package's own import
spec, so its ``__path__`` is the real one) and import only the Triton submodules through it. No stand-in
for ``selective_scan_cuda`` is created, so a Mamba-1 op still fails with the ordinary ImportError.

The fused training path (``ops.mamba_conv_scan_norm_fused``) composes the launchers that mamba-ssm's own fused
op ``MambaSplitConv1dScanCombinedFn`` is built from -- causal-conv1d's ``cpp_functions`` and mamba-ssm's
``_mamba_chunk_scan_combined_fwd/bwd`` and ``_layer_norm_fwd/bwd`` -- in megatron's sequence-first layout
(:func:`load_fused_mamba`). They are private to mamba-ssm 2.3.2 (the pinned version, ``pyproject.toml``);
a version without them gives ``(None, reason)`` and the unfused path.

Incremental decoding's one-token steps use mamba-ssm's ``selective_state_update`` (a Triton kernel, loaded the
same way: :func:`load_selective_state_update`) and causal-conv1d's ``causal_conv1d_update``
(:func:`load_causal_conv1d_update`), each ``(fn, reason)`` like the loaders above.

The consequence, within one process: after :func:`load_mamba_ssm` has succeeded, ``import mamba_ssm`` gives
that bare package, so ``from mamba_ssm import Mamba2`` raises ImportError (in a pure-Python install it would
raise anyway, for ``selective_scan_cuda``). Code that wants the complete package on a full CUDA build must
import ``mamba_ssm`` before the first call here; we then use the already-imported package as is.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

_MAMBA_PKG = "mamba_ssm"
_MAMBA_SUBMODULES = ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated")
# What mamba_ssm.ops.triton.* import besides torch (always here) and the package itself.
_MAMBA_TRITON_DEPS = ("triton", "einops", "packaging")


@dataclass(frozen=True)
class MambaSSMOps:
    """The mamba-ssm functions we call (signatures as in mamba-ssm 2.3.2)."""

    mamba_chunk_scan_combined: Callable  # (x, dt, A, B, C, chunk_size, D=, z=, dt_bias=, ...)
    rmsnorm_fn: Callable  # (x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True)
    version: str
    bare_package: bool  # True when we registered mamba_ssm without running its __init__


@dataclass(frozen=True)
class FusedMambaOps:
    """The launchers of mamba-ssm's fused conv + scan + gated-norm op (mamba-ssm 2.3.2, causal-conv1d 1.7.0):
    each allocates its outputs or writes into the ``dx=``/``dz=``-style buffers it is given, by their strides."""

    conv_fwd: Callable  # causal_conv1d_fwd_function(x [b,d,l], weight, bias, seq_idx, init, final_out, silu)
    conv_bwd: Callable  # causal_conv1d_bwd_function(x, weight, bias, dout, seq_idx, init, dfinal, dx, ret_dinit, silu)
    scan_fwd: Callable  # _mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size, D=, z=, dt_bias=, ...)
    scan_bwd: Callable  # _mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk_size, ..., dx=, dB=, dC=)
    norm_fwd: Callable  # _layer_norm_fwd(x, weight, bias, eps, z=, out=, group_size=, norm_before_gate=, is_rms_norm=)
    norm_bwd: Callable  # _layer_norm_bwd(dy, x, weight, bias, eps, mean, rstd, z=, group_size=, ..., dz=)


@dataclass(frozen=True)
class CausalConv1dOps:
    """causal-conv1d's CUDA depthwise convolution."""

    causal_conv1d_fn: Callable  # (x [b, d, l], weight [d, w], bias=None, ..., activation=None)
    version: str


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _drop_modules(prefix: str) -> None:
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]


@functools.cache
def load_mamba_ssm() -> tuple[MambaSSMOps | None, str]:
    """mamba-ssm's Triton SSD scan and gated RMSNorm, or ``(None, reason)`` when they cannot be imported.

    Cached: the import is attempted once per process (``load_mamba_ssm.cache_clear()`` retries).
    """
    spec = importlib.util.find_spec(_MAMBA_PKG)
    if spec is None:
        return None, "mamba-ssm is not installed"
    if spec.submodule_search_locations is None:
        return None, f"{_MAMBA_PKG} at {spec.origin} is a module, not the mamba-ssm package"
    missing = [d for d in _MAMBA_TRITON_DEPS if importlib.util.find_spec(d) is None]
    if missing:
        return None, f"mamba-ssm is installed but its Triton kernels need {', '.join(missing)} (pip install them)"

    bare = sys.modules.get(_MAMBA_PKG) is None
    if bare:
        pkg = importlib.util.module_from_spec(spec)  # the real package object, its __init__ not executed
        pkg.__version__ = _version("mamba-ssm")  # megatron-core's version check reads it
        pkg.__doc__ = (
            "mamba-ssm registered by nvfp4_train.models.mamba._import without running its __init__ (which needs the "
            "Mamba-1 CUDA extension); only submodules such as mamba_ssm.ops.triton.* are usable."
        )
        sys.modules[_MAMBA_PKG] = pkg
    try:
        ssd = importlib.import_module(_MAMBA_SUBMODULES[0])
        norm = importlib.import_module(_MAMBA_SUBMODULES[1])
    except Exception as e:  # noqa: BLE001 - any failure means "use the PyTorch path", with the reason
        if bare:
            _drop_modules(_MAMBA_PKG)  # leave no half-imported package behind
        return None, f"importing mamba-ssm's Triton kernels failed: {type(e).__name__}: {e}"
    ops = MambaSSMOps(
        mamba_chunk_scan_combined=ssd.mamba_chunk_scan_combined,
        rmsnorm_fn=norm.rmsnorm_fn,
        version=_version("mamba-ssm"),
        bare_package=bare,
    )
    how = "without its package __init__" if bare else "through the already-imported package"
    return ops, f"mamba-ssm {ops.version} Triton kernels imported {how}"


@functools.cache
def load_causal_conv1d() -> tuple[CausalConv1dOps | None, str]:
    """causal-conv1d's CUDA kernel, or ``(None, reason)``.

    ``import causal_conv1d`` imports its compiled module ``causal_conv1d_cuda`` at once, so a successful
    import means the kernel is there (a CPU-only build fails here with ImportError).
    """
    if importlib.util.find_spec("causal_conv1d") is None:
        return None, "causal-conv1d is not installed"
    try:
        mod = importlib.import_module("causal_conv1d")
        fn = mod.causal_conv1d_fn
    except Exception as e:  # noqa: BLE001
        return None, f"causal-conv1d is installed but failed to import: {type(e).__name__}: {e}"
    version = getattr(mod, "__version__", None) or _version("causal-conv1d")
    return CausalConv1dOps(causal_conv1d_fn=fn, version=version), f"causal-conv1d {version} CUDA kernel"


@functools.cache
def load_fused_mamba() -> tuple[FusedMambaOps | None, str]:
    """The fused path's launchers (:class:`FusedMambaOps`), or ``(None, reason)``: needs mamba-ssm's Triton
    kernels (:func:`load_mamba_ssm`) and causal-conv1d's CUDA extension (:func:`load_causal_conv1d`)."""
    mamba, reason = load_mamba_ssm()
    if mamba is None:
        return None, reason
    conv, reason = load_causal_conv1d()
    if conv is None:
        return None, reason
    try:
        cpp = importlib.import_module("causal_conv1d.cpp_functions")
        ssd = importlib.import_module(_MAMBA_SUBMODULES[0])
        norm = importlib.import_module(_MAMBA_SUBMODULES[1])
        ops = FusedMambaOps(
            conv_fwd=cpp.causal_conv1d_fwd_function, conv_bwd=cpp.causal_conv1d_bwd_function,
            scan_fwd=ssd._mamba_chunk_scan_combined_fwd, scan_bwd=ssd._mamba_chunk_scan_combined_bwd,
            norm_fwd=norm._layer_norm_fwd, norm_bwd=norm._layer_norm_bwd,
        )
    except (ImportError, AttributeError) as e:
        return None, (f"mamba-ssm {mamba.version} / causal-conv1d {conv.version} lack the fused op's launchers "
                      f"(pin mamba-ssm==2.3.2.post1, causal-conv1d==1.7.0): {type(e).__name__}: {e}")
    return ops, f"fused conv + scan + gated norm from mamba-ssm {mamba.version} and causal-conv1d {conv.version}"


@functools.cache
def load_selective_state_update() -> tuple[Callable | None, str]:
    """mamba-ssm's one-token SSM step ``selective_state_update(state, x, dt, A, B, C, D=, z=, dt_bias=,
    dt_softplus=)`` (Triton), or ``(None, reason)``."""
    mamba, reason = load_mamba_ssm()
    if mamba is None:
        return None, reason
    try:
        mod = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
        fn = mod.selective_state_update
    except Exception as e:  # noqa: BLE001 - any failure means "use the PyTorch step", with the reason
        return None, f"mamba-ssm {mamba.version} has no usable selective_state_update: {type(e).__name__}: {e}"
    return fn, f"mamba-ssm {mamba.version} selective_state_update"


@functools.cache
def load_causal_conv1d_update() -> tuple[Callable | None, str]:
    """causal-conv1d's one-token convolution step ``causal_conv1d_update(x, conv_state, weight, bias=,
    activation=)`` (CUDA), or ``(None, reason)``."""
    conv, reason = load_causal_conv1d()
    if conv is None:
        return None, reason
    try:
        fn = importlib.import_module("causal_conv1d").causal_conv1d_update
    except Exception as e:  # noqa: BLE001
        return None, f"causal-conv1d {conv.version} has no causal_conv1d_update: {type(e).__name__}: {e}"
    return fn, f"causal-conv1d {conv.version} causal_conv1d_update"
