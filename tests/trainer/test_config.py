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
    ("schedule.lr=inf", "schedule.lr=inf is not a finite number"),  # passed, and step 1 ran at lr=nan
    ("schedule.min_lr=nan", "schedule.min_lr=nan is not a finite number"),
    ("optim.adam_eps=inf", "optim.adam_eps=inf is not a finite number"),
    ("optim.clip_grad=inf", "optim.clip_grad=inf is not a finite number"),
    ("optim.weight_decay=nan", "optim.weight_decay=nan is not a finite number"),
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


@pytest.mark.parametrize("override,needle", [
    # a wrong type said only "Error merging override schedule.train_steps=many"
    ("schedule.train_steps=many", "schedule.train_steps expects int | None"),
    ("logging.tensorboard=maybe", "logging.tensorboard expects bool"),
    # a typo's hint was "To append to your config use +schedule.train_step=5" (the next error)
    ("schedule.train_step=5", "(did you mean 'train_steps'?)"),
    ("+schedule.warmup=5", "(did you mean 'warmup_steps'?)"),
    ("optim.lr=0.1", "(did you mean 'schedule.lr'?)"),
])
def test_wrong_type_names_the_expected_type_and_a_typo_the_nearest_key(override, needle):
    with pytest.raises(ValueError) as e:
        compose_config("train", [override])
    assert needle in str(e.value)


@pytest.mark.parametrize("overrides,world,needle", [
    (["schedule.global_batch_size=6", "schedule.micro_batch_size=2"], 2,
     "schedule.global_batch_size=6 is not a multiple of micro_batch_size * DP = 2 * 2"),
    (["model=tiny", "parallel.tp=3"], 3, "model.num_attention_heads=4 is not divisible by parallel.tp=3"),
    (["model=tiny", "precision=nvfp4", "data.seq_length=24", "schedule.micro_batch_size=1"], 1,
     "blocks of 16 tokens, but a micro-batch has schedule.micro_batch_size * data.seq_length = 1 * 24 = 24"),
    (["model=tiny", "parallel.pp=5"], 5, "pipeline stages of (1, 1, 2, 1, 1) blocks"),
    (["parallel.tp=2"], 3, "world size 3 is not divisible by parallel.tp * parallel.pp = 2 * 1"),
    (["schedule.train_steps=1", "schedule.warmup_steps=2"], 1, "exceed the run"),
])
def test_run_checks_before_building_name_the_key(overrides, world, needle):
    """What failed only after the model was built (exit 1 with a traceback) is found by check_run, which
    train.py calls before building (exit 2, one line)."""
    from nvfp4_train.config.compose import check_run

    cfg = compose_config("train", overrides)
    with pytest.raises(ValueError) as e:
        check_run(cfg, world)
    assert needle in str(e.value)


def test_train_py_reports_a_config_error_found_before_building(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "train.py"), "model=tiny", "parallel.pp=5"], cwd=root,
                       capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "WORLD_SIZE": "5"})
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("train.py:")]
    assert len(lines) == 1 and "pipeline stages of" in lines[0] and "Traceback" not in r.stderr


def test_the_default_run_name_is_the_model_and_precision_chosen():
    """The default name was ``default``: the next command in the same directory with another model crashed on
    the old checkpoint, with the same model it silently continued the old run. An explicit name still wins."""
    cfg = compose_config("train", [])
    assert (cfg.experiment.name, cfg.experiment.run_dir) == ("tiny_nvfp4", "runs/tiny_nvfp4")
    cfg = compose_config("train", ["model=small", "precision=nvfp4_no_rht"])  # the config's name, not the recipe's
    assert (cfg.experiment.name, cfg.experiment.resolved_run_dir()) == ("small_nvfp4_no_rht", "runs/small_nvfp4_no_rht")
    cfg = compose_config("train", ["model=small", "experiment.name=mine"])
    assert cfg.experiment.resolved_run_dir() == "runs/mine"


def test_index_caches_go_to_the_run_directory():
    """``data.cache_dir`` was ``data/cache/indices``, relative to wherever train.py was started."""
    assert compose_config("train", []).data.cache_dir == "runs/tiny_nvfp4/index_cache"
    for data in ("text", "text_cpu"):
        cfg = compose_config("train", [f"data={data}", "experiment.run_dir=/r/x"])
        assert cfg.data.cache_dir == "/r/x/index_cache"
    assert compose_config("train", ["data.cache_dir=null"]).data.cache_dir is None  # megatron-core's <prefix>/cache/


@pytest.mark.parametrize("override,value", [("schedule.train_tokens=2e9", 2_000_000_000),
                                            ("schedule.warmup_tokens=1.5e6", 1_500_000),
                                            ("++schedule.eval_interval=1e2", 100)])
def test_an_integer_field_takes_a_float_with_an_integer_value(override, value):
    """``schedule.train_tokens=2e9`` (docs/training.md) was rejected: Hydra reads 2e9 as a float."""
    cfg = compose_config("train", ["schedule.train_steps=null", "schedule.warmup_steps=null", override])
    key = override.split("=")[0].split(".")[-1]
    assert getattr(cfg.schedule, key) == value and type(getattr(cfg.schedule, key)) is int


@pytest.mark.parametrize("override", ["schedule.train_tokens=2.5", "schedule.train_steps=1e-3",
                                      "schedule.train_tokens=inf"])
def test_a_float_that_is_no_whole_number_is_an_error_naming_the_key(override):
    key, raw = override.split("=")
    with pytest.raises(ValueError) as e:
        compose_config("train", [override])
    assert str(e.value) == f"{key}={raw} is not a whole number: {key} takes an integer (2000000000 or 2e9)"
    assert compose_config("train", ["schedule.lr=2e-3"]).schedule.lr == 2e-3  # a float field: unchanged
