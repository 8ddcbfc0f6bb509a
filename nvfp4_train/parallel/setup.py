"""Process groups of a run: torch.distributed (env:// rendezvous), then megatron-core's model-parallel groups.

One order, always: (1) CPU compatibility when there is no CUDA device, (2) the CUDA device of this local rank,
(3) ``init_process_group`` (nccl on CUDA, gloo on CPU) from the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with
MASTER_ADDR exported) under ``srun python train.py``, or a one-process group as plain ``python train.py``,
(4) ``parallel_state.initialize_model_parallel(tp, pp)``; data parallelism is what remains
(world = tp * pp * dp), (5) seeds: python, numpy and torch get ``seed + 100 * pp_rank`` (megatron's
convention: pipeline stages initialise different layers), megatron's RNG tracker gets ``seed`` (it derives
its tensor-parallel streams from it).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass

__all__ = ["ParallelConfig", "ParallelState", "setup_parallel", "teardown_parallel", "seed_everything",
           "init_single_process"]


@dataclass(kw_only=True)
class ParallelConfig:
    """Model parallelism (the ``parallel`` section); data parallelism = world size / (tp * pp)."""

    tp: int = 1
    """Tensor-parallel size (ranks that split each layer's weights)."""
    pp: int = 1
    """Pipeline-parallel size (stages; the model's layers are split over them)."""
    sequence_parallel: bool = False
    """Split norms and dropout along the sequence over the tensor-parallel ranks (needs tp > 1)."""
    backend: str = "auto"
    """``auto`` (nccl with CUDA, gloo without), ``nccl`` or ``gloo``."""
    timeout_minutes: int = 30
    """Collective timeout."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel.tp={self.tp} and parallel.pp={self.pp} must be >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend={self.backend!r} is not one of auto, nccl, gloo")
        if self.timeout_minutes < 1:
            raise ValueError(f"parallel.timeout_minutes={self.timeout_minutes} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: str
    backend: str
    cpu_compat: bool
    owns_process_group: bool

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def layout(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "world_size": self.world_size}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int, pp_rank: int = 0) -> None:
    """Seed python, numpy and torch (``seed + 100 * pp_rank``) and megatron's RNG tracker (``seed``)."""
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    s = seed + 100 * pp_rank
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    model_parallel_cuda_manual_seed(seed)


def setup_parallel(cfg: ParallelConfig, *, seed: int) -> ParallelState:
    """Initialise torch.distributed and megatron's groups (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from nvfp4_train.mcore_compat.cuda_on_cpu import enable_cpu_compat

    compat = enable_cpu_compat()
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # `srun python train.py`: one task per GPU, ranks from Slurm (torchrun not needed)
        if "MASTER_ADDR" not in os.environ:
            raise ValueError("srun without torchrun: export MASTER_ADDR (the first node, e.g. "
                             "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)) and MASTER_PORT")
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_PORT", "29500")
    if "WORLD_SIZE" not in os.environ:  # plain `python train.py`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world % (cfg.tp * cfg.pp):
        raise ValueError(f"world size {world} is not divisible by parallel.tp * parallel.pp = {cfg.tp} * {cfg.pp}: "
                         f"launch a multiple of {cfg.tp * cfg.pp} processes")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("parallel.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    device = "cpu"
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    owns = not dist.is_initialized()
    if owns:
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device(device)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=cfg.timeout_minutes), **kwargs)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)
    state = ParallelState(
        rank=rank, world_size=world, local_rank=local_rank, tp=cfg.tp, pp=cfg.pp, dp=world // (cfg.tp * cfg.pp),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), device=device, backend=backend, cpu_compat=compat,
        owns_process_group=owns)
    seed_everything(seed, state.pp_rank)
    return state


def teardown_parallel(state: ParallelState | None) -> None:
    """Destroy megatron's groups, and the process group when :func:`setup_parallel` created it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if state is not None and state.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def init_single_process() -> None:
    """One process, world size 1, TP = PP = 1 (benchmarks and tools that build megatron models outside
    ``train.py``): nccl with CUDA, gloo with the CPU compatibility layer otherwise; a file store in a fresh
    temporary directory, so no port is needed. Does nothing that is already initialised."""
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nvfp4_train.mcore_compat.cuda_on_cpu import enable_cpu_compat

    enable_cpu_compat()  # a no-op with CUDA
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
