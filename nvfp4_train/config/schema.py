"""The root config schema. Sections are added as fields; every section is a kw-only dataclass whose fields
are typed (OmegaConf rejects a wrong key or a wrong type, naming it)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from models.config import ModelConfig
from nvfp4_train.config.precision import PrecisionConfig

__all__ = ["Config", "SCHEMA_NAME"]

SCHEMA_NAME = "nvfp4_train_schema"
"""Name under which :class:`Config` is stored in Hydra's ConfigStore (first entry of a defaults list)."""


@dataclass(kw_only=True)
class Config:
    """Everything a run reads. The trainer adds its sections (data, schedule, parallel, ...) here."""

    model: ModelConfig = MISSING
    """Architecture (``configs/model/``)."""
    precision: PrecisionConfig = MISSING
    """Linear-layer precision (``configs/precision/``)."""
