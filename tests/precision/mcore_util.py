"""Helpers for the tests of the megatron quantized layers: process groups and layer builders on CPU."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile

import torch
import torch.distributed as dist

from nvfp4_train.parallel.cpu_compat import enable_cpu_compat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_single_rank():
    """A one-rank gloo process group with megatron's parallel state at TP=1 (megatron's row layer needs a
    group even at TP=1); torn down on exit. Skips the caller if a group already exists in this process."""
    import pytest

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    enable_cpu_compat()
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


def config(hidden: int = 64, tp: int = 1, sp: bool = False, dtype=torch.bfloat16, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        **kw,
    )


def init_normal(std: float = 0.05):
    return lambda w: torch.nn.init.normal_(w, 0.0, std)


def column(cls, in_f: int, out_f: int, cfg, bias: bool = False, tp_group=None, **extra):
    return cls(in_f, out_f, config=cfg, init_method=init_normal(), bias=bias, gather_output=False,
               skip_bias_add=False, tp_group=tp_group, **extra)


def row(cls, in_f: int, out_f: int, cfg, bias: bool = False, tp_group=None, **extra):
    return cls(in_f, out_f, config=cfg, init_method=init_normal(), bias=bias, input_is_parallel=True,
               skip_bias_add=False, tp_group=tp_group, **extra)
