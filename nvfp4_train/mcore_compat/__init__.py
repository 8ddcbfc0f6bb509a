"""Every megatron-core / torch workaround, each with the version it is for.

The project runs on megatron-core 0.16.1 (the last release for Python 3.11: the CPU machines and CI) up to
0.19.x (Python 3.12, as NGC containers have it): ``SUPPORTED_MEGATRON_CORE`` is the range ``pyproject.toml``
declares. Everything that differs between those releases, or that works around one of them, lives in this
package, one module per concern, each function naming the release it is for:

    cuda_on_cpu      megatron-core's hard-coded CUDA calls, made to run on a machine without CUDA (all releases)
    transformer      ``TransformerConfig`` fields renamed between releases
    linear           the arguments megatron passes to a linear layer's ``_forward_impl``
    optimizer        the gradients of the norm (renamed in 0.19), the inner AdamW's fused form and the Adam
                     ``step`` of the distributed optimizer on load (0.16.1 ... 0.19.2)
    dist_ckpt        the dist-checkpoint writer's results queue (a module global of every release)
    rope             megatron's ``apply_rope_fusion`` and ``fused_single_qkv_rope`` served by our fused rotary
                     embedding, and the rotary frequencies kept on the model's device (0.16.1 ... 0.19.x)
    wgrad            megatron's ``gradient_accumulation_fusion`` without APEX: the Wgrad GEMM adds into
                     ``main_grad`` in cuBLASLt's epilogue (0.16.1 ... 0.19.x)
    jit              ``megatron.core.jit``, its fused helpers compiled at their first call rather than at import
                     (installed by ``nvfp4_train/__init__.py``; 0.16.1 ... 0.19.x)

Where an attribute or argument tells the releases apart, the code tests for it (``hasattr``, the dataclass
fields) rather than comparing version numbers: a patch release that back-ports a change then works too.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["SUPPORTED_MEGATRON_CORE", "megatron_core_version", "check_megatron_core_version"]

SUPPORTED_MEGATRON_CORE = ">=0.16.1,<0.20"
"""The megatron-core releases this project is tested with (``pyproject.toml`` declares the same range)."""


def megatron_core_version() -> str:
    """The installed megatron-core release (from the package metadata: no import of megatron, which takes
    seconds)."""
    try:
        return version("megatron-core")
    except PackageNotFoundError as e:
        raise ValueError("megatron-core is not installed: `pip install 'megatron-core"
                         f"{SUPPORTED_MEGATRON_CORE}'`") from e


def check_megatron_core_version(installed: str | None = None) -> str:
    """``installed`` (default: the installed release) if it is in :data:`SUPPORTED_MEGATRON_CORE`, else a
    ``ValueError`` naming it and the range."""
    from packaging.specifiers import SpecifierSet

    installed = installed or megatron_core_version()
    if installed not in SpecifierSet(SUPPORTED_MEGATRON_CORE, prereleases=True):
        raise ValueError(f"megatron-core {installed} is installed; this project supports "
                         f"megatron-core{SUPPORTED_MEGATRON_CORE}: `pip install 'megatron-core"
                         f"{SUPPORTED_MEGATRON_CORE}'`")
    return installed
