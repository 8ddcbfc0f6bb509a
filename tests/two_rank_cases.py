"""One two-rank gloo group for the in-process two-rank checks of several test modules.

Each spawned rank imports megatron-core, which dominates a spawn's cost on CPU; so the first module fixture
that asks for outcomes runs the cases of every module in ``MODULES`` in one ``mcore_util.spawn_ranks`` group,
each module's ``run_two_rank_cases(rank, out_dir)`` in turn (recording outcomes with ``record_outcome``; case
names carry the module's prefix), and later fixtures read the same folder.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch.distributed as dist

from tests.precision.mcore_util import init_gloo_rank, spawn_ranks

MODULES = ("tests.precision.test_linear_dist", "tests.trainer.test_clip", "tests.kernels.test_cross_entropy_dist")

_out: Path | None = None


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo_rank(rank, port, timeout_s=120)
    try:
        for name in MODULES:
            dist.barrier()
            importlib.import_module(name).run_two_rank_cases(rank, out_dir)
    finally:
        dist.destroy_process_group()


def two_rank_outcomes(tmp_path_factory) -> Path:
    """The outcome folder of the shared group (spawned on the first call of the session)."""
    global _out
    if _out is None:
        _out = spawn_ranks(_worker, tmp_path_factory.mktemp("two_rank_cases"))
    return _out
