"""Hydra configs (configs/precision, configs/table.yaml) and the table command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from nvfp4_train.config import CONFIG_DIR, Config, PrecisionConfig, compose_config
from nvfp4_train.precision.recipe import ABLATIONS, Ablations

REPO = Path(__file__).resolve().parents[2]
PRECISIONS = ("bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4")
NAMED_ABLATIONS = tuple(f"nvfp4_{tag}" for tag in ABLATIONS)


def test_config_dir_is_the_checkout():
    assert CONFIG_DIR == REPO / "configs"
    assert sorted(p.stem for p in (CONFIG_DIR / "precision").glob("*.yaml")) == sorted(PRECISIONS + NAMED_ABLATIONS)


@pytest.mark.parametrize("tag", list(ABLATIONS))
def test_each_named_ablation_config(tag):
    """precision=nvfp4_<tag> is nvfp4 with exactly the ABLATIONS switch of <tag>; the run's recipe is named
    nvfp4+<tag> (all_blocks: nvfp4 itself, every block quantized)."""
    fld, value = ABLATIONS[tag]
    cfg = compose_config("table", [f"precision=nvfp4_{tag}", "model=12b"])
    p = cfg.precision
    assert p.recipe == "nvfp4" and p.ablations == Ablations(**{fld: value})
    assert p.gemm_engine == "cublas" and p.keep_first is None and p.rules == []
    m = p.layer_map(cfg.model.pattern)
    assert m.run_recipe.name == ("nvfp4" if tag == "all_blocks" else f"nvfp4+{tag}")
    assert m.num_bf16 == (0 if tag == "all_blocks" else 20)
    # the switches stay the underlying fields: an override on top of the named config wins
    cfg = compose_config("table", [f"precision=nvfp4_{tag}", f"precision.ablations.{fld}={str(not value).lower()}"])
    assert cfg.precision.ablations == Ablations()


# ids: a bare id "triton" would mark the test a Triton one (tests/conftest.py reads the keywords)
@pytest.mark.parametrize("engine", ["cublas", "triton", "native", "auto"], ids=lambda e: f"engine_{e}")
def test_gemm_engine_reaches_every_quantized_recipe(engine):
    cfg = compose_config("table", ["model=12b", f"precision.gemm_engine={engine}",
                                   "precision.rules=[{recipe:mxfp4,blocks:'10'}]"])
    m = cfg.precision.layer_map(cfg.model.pattern)
    for r in m.recipes.values():
        assert r.gemm_engine == (engine if not r.is_bf16 else "cublas"), r.name


def test_gemm_engine_is_validated_once_with_the_choices():
    with pytest.raises(ValueError, match=r"precision.gemm_engine='cuBLAS' is not one of \('cublas', 'triton', "
                                        r"'native', 'auto'\)"):
        compose_config("table", ["precision.gemm_engine=cuBLAS"])


@pytest.mark.parametrize("name", PRECISIONS)
def test_each_precision_config(name):
    cfg = compose_config("table", [f"precision={name}", "model=12b"])
    assert isinstance(cfg, Config) and isinstance(cfg.precision, PrecisionConfig)
    p = cfg.precision
    assert p.recipe == name and p.keep_first is None and p.keep_last is None and p.rules == []
    assert p.ablations == Ablations() and not p.switch.enabled
    m = p.layer_map(cfg.model.pattern)
    expect = {"bf16": 124, "fp8": 6, "fp8_tensorwise": 6, "nvfp4": 20, "mxfp4": 20}[name]
    assert m.num_bf16 == expect


def test_nvfp4_yaml_lists_every_ablation_key():
    import dataclasses

    from omegaconf import OmegaConf

    raw = OmegaConf.load(CONFIG_DIR / "precision" / "nvfp4.yaml")
    assert set(raw.ablations) == {f.name for f in dataclasses.fields(Ablations)}
    assert Ablations(**raw.ablations) == Ablations()
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(PrecisionConfig)}


def test_overrides_reach_the_map():
    cfg = compose_config(
        "table",
        [
            "model=12b",
            "precision.ablations.rht=false",
            "precision.keep_first=0",
            "precision.keep_last=4",
            "precision.switch.at_fraction=0.82",
            "precision.rules=[{recipe:fp8,blocks:'10-11',roles:'mlp.*'}]",
        ],
    )
    m = cfg.precision.layer_map(cfg.model.pattern)
    assert m.run_recipe.name == "nvfp4+no_rht"
    assert m.num_bf16 == 8
    assert m.recipe_name(10, "mlp.fc1") == "fp8" and m.recipe_name(11, "mamba.in_proj") == "nvfp4+no_rht"
    assert m.switch.start_step(1000) == 820


@pytest.mark.parametrize(
    "override, names",
    [
        ("model.hiden_size=64", "hiden_size"),
        ("precision.ablations.no_rht=true", "no_rht"),
        ("precision.keep_frist=1", "keep_frist"),
        ("precision.rules=[{recipe:bf16,blokcs:'0'}]", "blokcs"),
    ],
)
def test_wrong_key_is_an_error_naming_it(override, names):
    with pytest.raises(ValueError) as info:
        compose_config("table", [override])
    assert names in _chain(info.value)


def test_appended_unknown_key_is_an_error_naming_it():
    with pytest.raises(ValueError, match="unknown config key 'model.hiden_size'"):
        compose_config("table", ["+model.hiden_size=64"])


@pytest.mark.parametrize(
    "override, names",
    [("model.hidden_size=wide", "model.hidden_size"), ("precision.ablations.rht=maybe", "precision.ablations.rht")],
)
def test_wrong_type_is_an_error_naming_it(override, names):
    with pytest.raises(ValueError) as info:
        compose_config("table", [override])
    assert names in _chain(info.value)


def test_dataclass_validation_runs_on_compose():
    with pytest.raises(ValueError, match="has 6 blocks but num_layers=7"):
        compose_config("table", ["model.num_layers=7"])
    with pytest.raises(ValueError, match="mode='half' is not one of"):
        compose_config("table", ["precision.switch.mode=half"])


def _chain(e: BaseException) -> str:
    out = []
    while e is not None:
        out.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(out)


# --- the command -------------------------------------------------------------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "nvfp4_train.table", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_table_command_12b_nvfp4():
    out = _run("model=12b", "precision=nvfp4")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "bf16 linear layers: 20/124 (16.1%)"
    assert lines[0].startswith("model: 12b  62 blocks (28 M, 28 -, 6 *)")
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert len(rows) == 124
    assert rows[0] == ["0", "M", "mamba.in_proj", "bf16", "first", "2"]
    assert rows[4] == ["2", "M", "mamba.in_proj", "nvfp4", "default"]


def test_table_command_error_names_the_key():
    out = _run("model=12b", "model.hiden_size=3")
    assert out.returncode == 2
    assert "hiden_size" in out.stderr and "Traceback" not in out.stderr


def test_table_imports_stay_light():
    code = (
        "import sys, nvfp4_train.precision, nvfp4_train.table, nvfp4_train.config, nvfp4_train.models, "
        "nvfp4_train.models.config, nvfp4_train.models.pattern; "
        "heavy = [m for m in ('torch', 'megatron', 'nvfp4_train.kernels', 'triton') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
