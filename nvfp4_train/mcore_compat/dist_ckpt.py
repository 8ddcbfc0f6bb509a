"""megatron-core's dist-checkpointing: the writer's results queue."""

from __future__ import annotations

__all__ = ["write_results_queue_set", "set_write_results_queue"]


def write_results_queue_set() -> bool:
    """Whether dist-checkpointing already has the queue its writer reports its results through.

    megatron-core 0.16.1 ... 0.19.2: the queue is the module global ``filesystem_async._results_queue``, created
    by ``get_write_results_queue()`` in a ``multiprocessing`` Manager it spawns at the first save (no
    argument lets a caller supply its own manager)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return getattr(filesystem_async, "_results_queue", None) is not None


def set_write_results_queue(queue) -> None:
    """Make ``queue`` the writer's results queue (see :func:`write_results_queue_set`): for synchronous saves an
    in-process ``queue.Queue`` (the caller puts and gets; ``nvfp4_train.checkpoint.start_checkpoint_writer``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError("megatron-core's filesystem_async has no _results_queue: this release is not "
                           "supported (see nvfp4_train.mcore_compat.SUPPORTED_MEGATRON_CORE)")
    filesystem_async._results_queue = queue
