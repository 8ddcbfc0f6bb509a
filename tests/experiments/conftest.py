"""The tools under test set up a one-process group (``init_single_process``) and keep it, as their command lines
do; each module's group is torn down when the module ends, so the tests after it start without one (the export
and trainer tests refuse or skip in a process that already has a group)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_after_the_module():
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
