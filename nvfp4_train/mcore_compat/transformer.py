"""``TransformerConfig`` arguments whose names differ between megatron-core releases."""

from __future__ import annotations

import dataclasses

__all__ = ["no_cuda_graph_kwargs"]


def no_cuda_graph_kwargs(config_cls=None) -> dict:
    """The ``TransformerConfig`` keyword that says "no CUDA-graph scope" without a deprecation warning.

    megatron-core 0.16 / 0.17: ``cuda_graph_scope`` defaults to ``"full"``, which its own ``__post_init__``
    calls deprecated and warns about on every build; ``[]`` is the same setting.
    megatron-core >= 0.18: the field is ``cuda_graph_modules`` (same default and warning); ``cuda_graph_scope``
    is still accepted but may not be set together with it.
    No CUDA graph is captured either way (``cuda_graph_impl`` stays ``"none"``).
    """
    if config_cls is None:
        from megatron.core.transformer import TransformerConfig as config_cls
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"cuda_graph_modules": []} if "cuda_graph_modules" in names else {"cuda_graph_scope": []}
