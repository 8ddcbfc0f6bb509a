"""The train config: every group composes, wrong keys / types / values are errors that name them."""

from __future__ import annotations

import pytest

from nvfp4_train.config import compose_config


def test_train_config_composes_with_every_group():
    cfg = compose_config("train", ["schedule.train_steps=7", "parallel=pp2", "experiment.name=abc"])
    assert cfg.schedule.train_steps == 7
    assert cfg.parallel.pp == 2
    assert cfg.experiment.resolved_run_dir() == "runs/abc"
    assert cfg.optim.adam_beta1 == 0.9 and cfg.optim.adam_beta2 == 0.95 and cfg.optim.weight_decay == 0.1
    assert cfg.logging.wandb == "offline"
    assert cfg.checkpoint.resume == "auto"
    assert cfg.data.train_prefixes == ["data/tokens/text_train"]


@pytest.mark.parametrize("override,needle", [
    ("schedule.train_step=5", "train_step"),            # typo of a key: Hydra/OmegaConf name it
    ("+schedule.warmup=5", "warmup"),                   # a new key forced in with '+': our check names it
    ("optim.lr=0.1", "lr"),                             # the lr lives in schedule, not in optim
    ("schedule.train_steps=many", "train_steps"),       # wrong type
    ("logging.tensorboard=maybe", "tensorboard"),       # wrong type
    ("parallel=tp3", "tp3"),                            # no such group option
])
def test_unknown_key_or_wrong_type_names_it(override, needle):
    with pytest.raises(Exception) as e:
        compose_config("train", [override])
    assert needle in str(e.value)


@pytest.mark.parametrize("override,needle", [
    ("optim.weight_decay=-0.1", "weight_decay"),
    ("optim.max_consecutive_bad_steps=0", "max_consecutive_bad_steps=0"),
    ("schedule.decay_style=step", "decay_style='step'"),
    ("logging.wandb=maybe", "logging.wandb='maybe'"),
    ("logging.nonfinite_check=never", "logging.nonfinite_check='never' is not one of every_step, after_skip"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0"),
    ("checkpoint.verify=md5", "checkpoint.verify='md5'"),
    ("checkpoint.optim_format=zip", "checkpoint.optim_format='zip'"),
    ("parallel.sequence_parallel=true", "sequence_parallel"),
    ("experiment.name=a/b", "experiment.name='a/b'"),
    ("experiment.model_provider=nocolon", "module:function"),
])
def test_bad_values_raise_value_error_naming_them(override, needle):
    with pytest.raises(ValueError) as e:
        compose_config("train", [override])
    assert needle in str(e.value)


def test_train_py_reports_a_config_error(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "train.py"), "schedule.bogus_key=1"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "config error" in r.stderr and "bogus_key" in r.stderr
