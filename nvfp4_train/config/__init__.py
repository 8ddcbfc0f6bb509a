"""Config schemas (typed dataclasses registered in Hydra's ConfigStore) and the compose helper.

``nvfp4_train.config`` imports omegaconf (for ``MISSING``) but not Hydra; Hydra is imported when composing.
"""

from nvfp4_train.config.compose import CONFIG_DIR, compose_config, register_configs
from nvfp4_train.config.precision import PrecisionConfig
from nvfp4_train.config.schema import SCHEMA_NAME, Config

__all__ = ["Config", "PrecisionConfig", "SCHEMA_NAME", "CONFIG_DIR", "compose_config", "register_configs"]
