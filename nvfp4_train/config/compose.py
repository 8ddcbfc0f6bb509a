"""Compose a config from the YAML tree with Hydra's compose API (no Hydra app, no output directory).

The tree is ``configs/`` of the repository; an installed wheel carries the same files as the package data
``nvfp4_train/configs/`` (``setup.py``). :data:`CONFIG_DIR` is whichever this installation has; every
function takes another tree as ``config_dir``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["CONFIG_DIR", "default_config_dir", "register_configs", "compose_config", "check_known_keys",
           "config_groups"]


def default_config_dir() -> Path:
    """The YAML tree of this installation: the wheel's package data ``nvfp4_train/configs``, else the
    checkout's ``configs/`` (a source tree or an editable install)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "configs", package.parent / "configs"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"no config tree: neither {package / 'configs'} (an installed wheel) nor "
                            f"{package.parent / 'configs'} (a checkout) has train.yaml; reinstall nvfp4-train")


CONFIG_DIR = default_config_dir()
"""The YAML tree (see :func:`default_config_dir`)."""


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore under ``SCHEMA_NAME`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from nvfp4_train.config.schema import SCHEMA_NAME, Config

    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose_config(config_name: str, overrides: Sequence[str] = (), *, as_object: bool = True,
                   config_dir: str | Path | None = None):
    """Compose ``<config_dir>/<config_name>.yaml`` (default :data:`CONFIG_DIR`) with command-line style
    ``overrides``.

    Returns the typed dataclass tree (``Config``) when ``as_object``, else the ``DictConfig``. Unknown keys
    and wrong types raise (Hydra's ``ConfigCompositionException`` / OmegaConf's errors name the key);
    dataclass validation (``__post_init__``) raises ``ValueError`` when converting to objects.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(Path(config_dir or CONFIG_DIR).resolve()), version_base=None):
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


def config_groups(config_name: str, config_dir: str | Path | None = None) -> dict[str, tuple[str | None, list[str]]]:
    """``{group: (default option, [options])}`` of ``<config_dir>/<config_name>.yaml``'s defaults list (for
    ``--help``)."""
    from omegaconf import OmegaConf

    root = Path(config_dir or CONFIG_DIR)
    defaults = {}
    for entry in OmegaConf.to_container(OmegaConf.load(root / f"{config_name}.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            defaults.update(entry)
    return {group: (default, sorted(p.stem for p in (root / group).glob("*.yaml")))
            for group, default in defaults.items()}
