"""The root config schema. Sections are added as fields; every section is a kw-only dataclass whose fields
are typed (OmegaConf rejects a wrong key or a wrong type, naming it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from omegaconf import MISSING

from nvfp4_train.models.config import ModelConfig
from nvfp4_train.models.fusion import FusionConfig
from nvfp4_train.checkpoint import CheckpointConfig
from nvfp4_train.config.experiment import ExperimentConfig
from nvfp4_train.config.precision import PrecisionConfig
from nvfp4_train.data.datasets import DataConfig
from nvfp4_train.metrics import LoggingConfig
from nvfp4_train.optim import OptimConfig
from nvfp4_train.parallel.setup import ParallelConfig
from nvfp4_train.schedule import ScheduleConfig
from nvfp4_train.spikes import SpikeConfig

__all__ = ["Config", "SCHEMA_NAME", "nonfinite_fields"]

SCHEMA_NAME = "nvfp4_train_schema"
"""Name under which :class:`Config` is stored in Hydra's ConfigStore (first entry of a defaults list)."""


@dataclass(kw_only=True)
class Config:
    """Everything a run reads (``configs/train.yaml`` composes every group; the precision table only needs
    model and precision)."""

    model: ModelConfig = MISSING
    """Architecture (``configs/model/``)."""
    precision: PrecisionConfig = MISSING
    """Linear-layer precision (``configs/precision/``)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Run length, batch, learning-rate schedule, evaluation cadence (``configs/schedule/``)."""
    fusion: FusionConfig = field(default_factory=FusionConfig)
    """Fused kernels of the training step (``nvfp4_train.models.fusion``; all on by default)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, gradient clipping, distributed optimizer (``configs/optim/``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Token datasets and sample length (``configs/data/``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor / pipeline / sequence parallelism (``configs/parallel/``)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence, retention, resume (``configs/checkpoint/``)."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Loss-spike detection and rollback (``configs/spike/``; off by default)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Progress, metrics files, TensorBoard, wandb, telemetry (``configs/logging/``)."""
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    """Run name, directory, seed (``configs/experiment/``)."""


def nonfinite_fields(cfg, path: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float in ``cfg`` (a :class:`Config`, any config section, or their
    ``DictConfig``) that is inf or NaN. No field of the schema has a meaning at inf or NaN: a learning rate,
    beta, eps, clip or weight decay there makes every update NaN."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        items = ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
    elif isinstance(cfg, DictConfig):
        items = ((str(k), cfg[k]) for k in cfg.keys() if not OmegaConf.is_missing(cfg, k))
    elif isinstance(cfg, dict):
        items = ((str(k), v) for k, v in cfg.items())
    elif isinstance(cfg, (list, tuple, ListConfig)):
        items = ((f"[{i}]", v) for i, v in enumerate(cfg))
    elif isinstance(cfg, float) and not math.isfinite(cfg):
        return [(path, cfg)]
    else:
        return []
    out = []
    for key, value in items:
        out += nonfinite_fields(value, f"{path}{key}" if key.startswith("[") or not path else f"{path}.{key}")
    return out
