"""Mamba-2 numerics for the hybrid model's mixer: the SSD scan, causal conv, gated RMSNorm, initialisation.

The ops (``nvfp4_train.models.mamba.ops``) run mamba-ssm's / causal-conv1d's kernels on CUDA when those optional
packages import (``nvfp4_train.models.mamba._import``), and pure-PyTorch float32 versions otherwise
(``nvfp4_train.models.mamba.ssd`` for the scan).
"""

from nvfp4_train.models.mamba.ops import (
    causal_conv1d,
    causal_conv1d_ref,
    init_A_log,
    init_D,
    init_dt_bias,
    rmsnorm_gated,
    rmsnorm_gated_ref,
    ssd_scan,
)
from nvfp4_train.models.mamba.ssd import ssd_chunked_scan, ssd_sequential_ref

__all__ = [
    "ssd_scan",
    "ssd_chunked_scan",
    "ssd_sequential_ref",
    "causal_conv1d",
    "causal_conv1d_ref",
    "rmsnorm_gated",
    "rmsnorm_gated_ref",
    "init_dt_bias",
    "init_A_log",
    "init_D",
]
