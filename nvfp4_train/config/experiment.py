"""The ``experiment`` config section: the run's name, directory, seed and (optionally) its model provider."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExperimentConfig"]


@dataclass(kw_only=True)
class ExperimentConfig:
    """What identifies a run."""

    name: str | None = None
    """Run name (logs, wandb); the default run directory is ``runs/<name>``. None: ``<model>_<precision>``, the
    model and precision configs chosen (``tiny_nvfp4``, ``small_nvfp4_no_rht``; set by ``compose_config``), so
    that a run of another model or precision never continues or collides with this one."""
    run_dir: str | None = None
    """Directory shared by all ranks: metrics, resolved config, checkpoints, megatron-core's index caches
    (``data.cache_dir``). None: ``runs/<name>``. Never per-rank or timestamped, so that a restarted job finds
    its checkpoints."""
    seed: int = 1234
    """Seed of the model initialisation and every RNG (the data order has its own ``data.seed``)."""
    model_provider: str | None = None
    """``module:function``; ``function(cfg)`` returns ``provider(pre_process, post_process) -> module``.
    None: ``nvfp4_train.models.build.build_model`` (the hybrid model). Tests use a megatron GPTModel stand-in."""

    def __post_init__(self) -> None:
        if self.name is not None and (not self.name or "/" in self.name):
            raise ValueError(f"experiment.name={self.name!r} must be a non-empty name without '/' "
                             f"(use experiment.run_dir for a path)")
        if self.model_provider is not None and ":" not in self.model_provider:
            raise ValueError(f"experiment.model_provider={self.model_provider!r} must be 'module:function'")

    def resolved_run_dir(self) -> str:
        if self.run_dir is not None:
            return self.run_dir
        if self.name is None:
            raise ValueError("experiment.name and experiment.run_dir are both unset: give one (compose_config "
                             "names the run <model>_<precision>)")
        return f"runs/{self.name}"
