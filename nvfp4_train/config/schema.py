"""The root config schema. Sections are added as fields; every section is a kw-only dataclass whose fields
are typed (OmegaConf rejects a wrong key or a wrong type, naming it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from models.config import ModelConfig
from nvfp4_train.checkpoint import CheckpointConfig
from nvfp4_train.config.experiment import ExperimentConfig
from nvfp4_train.config.precision import PrecisionConfig
from nvfp4_train.data.datasets import DataConfig
from nvfp4_train.metrics import LoggingConfig
from nvfp4_train.optim import OptimConfig
from nvfp4_train.parallel.setup import ParallelConfig
from nvfp4_train.schedule import ScheduleConfig
from nvfp4_train.spikes import SpikeConfig

__all__ = ["Config", "SCHEMA_NAME"]

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
