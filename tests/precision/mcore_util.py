"""Helpers for the tests of the megatron quantized layers: process groups and layer builders on CPU."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nvfp4_train.mcore_compat.cuda_on_cpu import enable_cpu_compat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two-rank tests: ``spawn_ranks`` starts the worker on every rank; the worker calls ``init_gloo_rank``, runs all its
# cases (megatron is imported once per rank: that import dominates the cost on CPU) and records each case with
# ``record_outcome``; one test per case then reads the ranks' outcomes with ``assert_ranks_ok``.


def init_gloo_rank(rank: int, port: int, world_size: int = 2, timeout_s: float = 60) -> None:
    """A worker's set-up: one CPU thread, the CPU-compatibility module, a gloo group over TCP."""
    torch.set_num_threads(1)
    enable_cpu_compat()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def record_outcome(out_dir: str, case: str, rank: int, check: Callable[[], None]) -> None:
    """Run one case's ``check`` on this rank; write "ok", or the traceback of what it raised, to
    ``out_dir/<case>.rank<rank>``. A failing check whose comparisons come after its last collective leaves
    the ranks in step for the next case."""
    try:
        check()
        outcome = "ok"
    except Exception:
        outcome = traceback.format_exc()
    Path(out_dir, f"{case}.rank{rank}").write_text(outcome)


def spawn_ranks(worker: Callable[[int, int, str], None], out_dir: Path, nprocs: int = 2) -> Path:
    """Run ``worker(rank, port, str(out_dir))`` on ``nprocs`` processes; returns ``out_dir``."""
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=nprocs, join=True)
    return out_dir


def assert_ranks_ok(out_dir: Path, case: str, nprocs: int = 2) -> None:
    for rank in range(nprocs):
        text = (out_dir / f"{case}.rank{rank}").read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


@contextlib.contextmanager
def megatron_single_rank(device: str = "cpu"):
    """A one-rank process group with megatron's parallel state at TP=1 (megatron's row layer needs a group even
    at TP=1): gloo with the CPU-compatibility module for ``device="cpu"``, NCCL for ``"cuda"``; torn down on exit.
    Skips the caller if a group already exists in this process."""
    import pytest

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    if device == "cpu":
        enable_cpu_compat()
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo" if device == "cpu" else "nccl",
                                init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
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
