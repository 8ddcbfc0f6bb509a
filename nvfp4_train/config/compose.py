"""Compose a config from ``configs/`` with Hydra's compose API (no Hydra app, no output directory)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CONFIG_DIR", "register_configs", "compose_config", "check_known_keys"]

CONFIG_DIR = Path(os.environ.get("NVFP4_TRAIN_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))
"""The YAML tree (``configs/`` of the checkout; override with ``NVFP4_TRAIN_CONFIG_DIR``)."""


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore under ``SCHEMA_NAME`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from nvfp4_train.config.schema import SCHEMA_NAME, Config

    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose_config(config_name: str, overrides: Sequence[str] = (), *, as_object: bool = True):
    """Compose ``configs/<config_name>.yaml`` with command-line style ``overrides``.

    Returns the typed dataclass tree (``Config``) when ``as_object``, else the ``DictConfig``. Unknown keys
    and wrong types raise (Hydra's ``ConfigCompositionException`` / OmegaConf's errors name the key);
    dataclass validation (``__post_init__``) raises ``ValueError`` when converting to objects.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    check_known_keys(cfg)
    return OmegaConf.to_object(cfg) if as_object else cfg


def check_known_keys(cfg, path: str = "") -> None:
    """Raise ``KeyError``-like ``ValueError`` for a key that no schema field declares.

    OmegaConf rejects unknown keys on merge, but Hydra's ``+key=value`` override opens the struct flag and
    ``to_object`` would then drop the key silently; a typo must not pass that way.
    """
    import dataclasses

    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        typ = OmegaConf.get_type(cfg)
        fields = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
        for key in cfg.keys():
            full = f"{path}.{key}" if path else str(key)
            if fields is not None and key not in fields:
                raise ValueError(
                    f"unknown config key {full!r}: {typ.__name__} has no field {key!r} "
                    f"(fields: {', '.join(sorted(fields))})"
                )
            check_known_keys(cfg._get_node(key), full)
    elif isinstance(cfg, ListConfig):
        for i in range(len(cfg)):
            check_known_keys(cfg._get_node(i), f"{path}[{i}]")
