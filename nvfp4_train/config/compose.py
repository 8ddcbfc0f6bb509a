"""Compose a config from the YAML tree with Hydra's compose API (no Hydra app, no output directory).

The tree is ``configs/`` of the repository; an installed wheel carries the same files as the package data
``nvfp4_train/configs/`` (``setup.py``). :data:`CONFIG_DIR` is whichever this installation has; every
function takes another tree as ``config_dir``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["CONFIG_DIR", "default_config_dir", "register_configs", "compose_config", "whole_number_overrides",
           "default_run_name", "check_known_keys", "check_finite", "check_run", "config_groups"]


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

    An integer field takes a float with an integer value (``schedule.train_tokens=2e9``,
    :func:`whole_number_overrides`). ``experiment.name`` null becomes :func:`default_run_name` (the model and
    precision configs chosen: ``tiny_nvfp4``), ``experiment.run_dir`` null ``runs/<experiment.name>``.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf, open_dict

    register_configs()
    overrides = whole_number_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir or CONFIG_DIR).resolve()), version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except ConfigCompositionException as e:
        explained = _explain(e)
        if explained != str(e):  # it names the key and the fix; Hydra's and OmegaConf's messages add nothing
            raise ValueError(explained) from None
        raise ValueError(explained) from e
    with open_dict(cfg):
        choices = dict(cfg.pop("hydra").runtime.choices)
    if cfg.experiment.name is None:
        cfg.experiment.name = default_run_name(choices, cfg)
    if cfg.experiment.run_dir is None:
        cfg.experiment.run_dir = f"runs/{cfg.experiment.name}"
    check_known_keys(cfg)
    check_finite(cfg)
    return OmegaConf.to_object(cfg) if as_object else cfg


def default_run_name(choices: dict, cfg) -> str:
    """``<model>_<precision>``: the options of the ``model`` and ``precision`` config groups that composed
    ``cfg`` (Hydra's choices: ``precision=nvfp4_no_rht`` gives ``nvfp4_no_rht``, where the recipe is ``nvfp4``),
    else the model's name and the recipe. Two runs of another model or precision never share a run directory;
    a changed key inside a group (``model.hidden_size=256``) needs its own ``experiment.name``."""
    model = choices.get("model") or cfg.model.name
    precision = choices.get("precision") or cfg.precision.recipe
    return f"{model}_{precision}".replace("/", "-")


def _schema_type(key: str):
    """The annotated type of the dotted ``key`` in the schema (``schedule.train_tokens`` -> ``int | None``),
    None for a key the schema does not have."""
    import dataclasses
    import typing

    from nvfp4_train.config.schema import Config

    typ = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(typ):
            return None
        typ = typing.get_type_hints(typ).get(part)
        if typ is None:
            return None
    return typ


def _is_int_type(typ) -> bool:
    """``int`` or ``int | None`` (not a union that takes floats too)."""
    import types
    import typing

    args = typing.get_args(typ) if typing.get_origin(typ) in (typing.Union, types.UnionType) else (typ,)
    return int in args and float not in args


def whole_number_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with a float given for an integer field written as that integer: Hydra reads
    ``schedule.train_tokens=2e9`` as the float 2000000000.0, which OmegaConf refuses for an ``int``; it
    becomes ``schedule.train_tokens=2000000000``. A float that is not a whole number there (``1.5``, ``inf``)
    is a ValueError naming the key. Sweeps and overrides Hydra cannot parse pass unchanged (composition
    reports the latter)."""
    import math

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            (o,) = parser.parse_overrides([text])
        except HydraException:
            out.append(text)
            continue
        value = o.value()
        if type(value) is not float or not _is_int_type(_schema_type(o.key_or_group)):
            out.append(text)
            continue
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{o.key_or_group}={text.split('=', 1)[1]} is not a whole number: "
                             f"{o.key_or_group} takes an integer (2000000000 or 2e9)")
        out.append(f"{o.get_key_element()}={int(value)}")
    return out


def check_finite(cfg) -> None:
    """ValueError naming the first inf or NaN value of the config (``schedule.lr=inf``): no hyperparameter has
    a meaning there, and one makes every update NaN."""
    from nvfp4_train.config.schema import nonfinite_fields

    bad = nonfinite_fields(cfg)
    if bad:
        key, value = bad[0]
        raise ValueError(f"{key}={value} is not a finite number: give a finite value")


def _schema_keys(typ, path: str = "") -> list[str]:
    """Every dotted key of the dataclass schema ``typ`` (sections and their fields)."""
    import dataclasses
    import typing

    keys = []
    hints = typing.get_type_hints(typ)
    for f in dataclasses.fields(typ):
        full = f"{path}.{f.name}" if path else f.name
        keys.append(full)
        if dataclasses.is_dataclass(hints.get(f.name)):
            keys += _schema_keys(hints[f.name], full)
    return keys


def _nearest_field(typ, name: str) -> str:
    """`` (did you mean 'x'?)``: the field of dataclass ``typ`` nearest to ``name`` (difflib), else a key of
    that name in another section (``optim.lr`` -> ``schedule.lr``), else ``""``."""
    import dataclasses
    import difflib

    from nvfp4_train.config.schema import Config

    if not dataclasses.is_dataclass(typ):
        return ""
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(typ)], n=1, cutoff=0.5)
    if close:
        return f" (did you mean {close[0]!r}?)"
    elsewhere = [k for k in _schema_keys(Config) if k.rsplit(".", 1)[-1] == name]
    return f" (did you mean {elsewhere[0]!r}?)" if elsewhere else ""


def _explain(e: Exception) -> str:
    """Hydra's composition error with what OmegaConf found: the key, and the expected type (a wrong value) or
    the nearest valid key (an unknown one). Anything else: Hydra's message."""
    import dataclasses

    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return f"{group}={option}: configs/{group}/ has no {option}.yaml (options: {', '.join(e.options)})"
    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    typ = getattr(cause, "object_type", None)
    if not key or not isinstance(cause, (ValidationError, ConfigAttributeError, ConfigKeyError)):
        return str(e)
    name = key.rsplit(".", 1)[-1]
    first = str(cause).splitlines()[0]
    if isinstance(cause, ValidationError):
        fields = {f.name: f.type for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else {}
        expected = fields.get(name)
        want = f": {key} expects {expected}" if expected is not None else f": {key}"
        return f"{e}{want} ({first})"
    return (f"unknown config key {key!r}: {getattr(typ, '__name__', 'the section')} has no field {name!r}"
            f"{_nearest_field(typ, name)}")


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
                    f"unknown config key {full!r}: {typ.__name__} has no field {key!r}{_nearest_field(typ, str(key))} "
                    f"(fields: {', '.join(sorted(fields))})"
                )
            check_known_keys(cfg._get_node(key), full)
    elif isinstance(cfg, ListConfig):
        for i in range(len(cfg)):
            check_known_keys(cfg._get_node(i), f"{path}[{i}]")


def check_run(cfg, world_size: int) -> None:
    """ValueError naming the key and the fix for what a run of ``cfg`` on ``world_size`` processes would
    only find after the model is built: the parallel layout and the batch split, the schedule's lengths in
    tokens, the layer precision map
    (recipe names, rules), attention and Mamba heads vs tensor parallelism; for the hybrid model (no
    ``experiment.model_provider``) its megatron config (pipeline stages) and every quantized recipe's token
    block vs the tokens of a micro-batch."""
    from nvfp4_train.precision.megatron_linear import token_block

    par, sc, m = cfg.parallel, cfg.schedule, cfg.model
    mp = par.tp * par.pp
    if world_size % mp:
        raise ValueError(f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {par.tp} * "
                         f"{par.pp}: launch a multiple of {mp} processes")
    dp = world_size // mp
    if sc.global_batch_size % (sc.micro_batch_size * dp):
        raise ValueError(f"schedule.global_batch_size={sc.global_batch_size} is not a multiple of "
                         f"micro_batch_size * DP = {sc.micro_batch_size} * {dp}")
    sc.resolve(cfg.data.seq_length)  # warmup + decay within the run
    layer_map = cfg.precision.layer_map(m.pattern)
    for key in ("num_attention_heads", "num_query_groups", "mamba_num_heads", "mamba_num_groups"):
        value = getattr(m, key, None)
        used = ("M" if key.startswith("mamba") else "*") in m.pattern
        if used and value and value % par.tp:
            raise ValueError(f"model.{key}={value} is not divisible by parallel.tp={par.tp}: each tensor-parallel "
                             f"rank holds whole heads/groups; choose a tp that divides it")
    if cfg.experiment.model_provider is not None:
        return  # another model: what its layers and megatron config need is its provider's to check
    from nvfp4_train.models.build import transformer_config

    transformer_config(m, tp=par.tp, pp=par.pp, sequence_parallel=par.sequence_parallel)
    tokens = sc.micro_batch_size * cfg.data.seq_length
    for name, recipe in layer_map.recipes.items():
        block = token_block(recipe)
        if tokens % block:
            raise ValueError(f"recipe {name!r} quantizes the weight-gradient operands in blocks of {block} tokens, "
                             f"but a micro-batch has schedule.micro_batch_size * data.seq_length = "
                             f"{sc.micro_batch_size} * {cfg.data.seq_length} = {tokens}: make it a multiple of "
                             f"{block}, or keep those layers in bf16 with precision rules")


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
