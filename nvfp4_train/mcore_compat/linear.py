"""The arguments megatron-core's tensor-parallel linear layers pass to ``_forward_impl``."""

from __future__ import annotations

__all__ = ["forward_impl_kwargs"]


def forward_impl_kwargs(kwargs: dict) -> dict:
    """``kwargs`` of a ``ColumnParallelLinear`` / ``RowParallelLinear`` ``_forward_impl`` call as the
    megatron-core 0.16.1 signature has them.

    megatron-core >= 0.19: the layers also pass ``gtp_remat_size`` (the number of shards of a weight under
    its generalized tensor parallelism, 1 when that is off). A quantized GEMM needs the whole local weight,
    so a value above 1 is refused; 1 is dropped.
    """
    out = dict(kwargs)
    gtp = out.pop("gtp_remat_size", 1)
    if gtp is not None and gtp != 1:
        raise ValueError(f"gtp_remat_size={gtp}: the quantized linear layers need the whole local weight; "
                         "turn megatron-core's generalized tensor parallelism off for these layers")
    return out
