"""nvfp4-train: Megatron-style pretraining with NVIDIA's NVFP4 recipe (``README.md``, ``docs/architecture.md``)."""

from nvfp4_train.mcore_compat.jit import install as _install_lazy_jit

# before anything imports megatron-core: its fused helpers are compiled at their first call, not at its import
_install_lazy_jit()
