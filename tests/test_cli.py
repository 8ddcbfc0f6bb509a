"""The command lines (nvfp4_train.cli): --help, --cfg job, -m sweeps, errors; and an installed wheel that
carries its configs and console scripts."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from nvfp4_train.cli import parse_args, sweep, summary_main, table_main

REPO = Path(__file__).resolve().parents[1]


def test_parse_args_splits_hydra_options_from_overrides():
    a = parse_args(["--cfg", "job", "model=tiny", "-m", "x=1,2"])
    assert (a.overrides, a.cfg, a.multirun, a.help) == (["model=tiny", "x=1,2"], "job", True, False)
    assert parse_args(["--cfg=job"]).cfg == "job"
    assert parse_args(["--multirun"]).multirun and parse_args(["-h"]).help
    with pytest.raises(ValueError, match="--cfg hydra"):
        parse_args(["--cfg", "hydra"])
    with pytest.raises(ValueError, match="unknown option '--bogus'"):
        parse_args(["--bogus"])


def test_sweep_is_hydras_cartesian_product():
    assert sweep(["model=tiny,small", "a.b=1,2", "c=3"]) == [
        ["model=tiny", "a.b=1", "c=3"], ["model=tiny", "a.b=2", "c=3"],
        ["model=small", "a.b=1", "c=3"], ["model=small", "a.b=2", "c=3"]]
    assert sweep(["c=3"]) == [["c=3"]]


def test_help_lists_the_groups_and_cfg_job_prints_the_config(capsys):
    assert summary_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "model" in out and "[tiny]" in out and "12b" in out and "--cfg job" in out
    assert table_main(["--cfg", "job", "model=small", "precision=fp8"]) == 0
    out = capsys.readouterr().out
    assert "name: small" in out and "hidden_size: 512" in out and "bf16 linear layers" not in out


def test_multirun_runs_every_job_and_errors_name_the_key(capsys):
    assert summary_main(["-m", "model=tiny,small"]) == 0
    out = capsys.readouterr().out
    assert "model: tiny" in out and "model: small" in out and out.count("parameters:") == 2
    assert summary_main(["model.hiden_size=3"]) == 2
    assert "hiden_size" in capsys.readouterr().err


def test_train_help_and_cfg_job_do_not_train():
    out = subprocess.run([sys.executable, "train.py", "--cfg", "job", "schedule.train_steps=7"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "train_steps: 7" in out.stdout and "megatron" not in out.stderr.lower()
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "precision" in out.stdout and "[nvfp4]" in out.stdout


@pytest.mark.slow
def test_installed_wheel_composes_configs_and_has_console_scripts(tmp_path):
    """The wheel, installed with --no-deps into a venv that sees this interpreter's packages through a .pth
    file, run outside the checkout: the configs come from the wheel, the console scripts exist."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, timeout=300, capture_output=True)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "host_packages.pth").write_text("\n".join(deps) + "\n")
    (wheel,) = wheels.glob("nvfp4_train-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(py), "-c", "import nvfp4_train.config.compose as c; print(c.CONFIG_DIR); "
                          "print(c.compose_config('train', ['model=small']).model.name)"], **run)
    assert out.returncode == 0, out.stderr
    config_dir, name = out.stdout.split()
    assert Path(config_dir).is_relative_to(site) and name == "small"
    for script, args, expect in (("nvfp4-summary", ["model=12b"], "parameters:"),
                                 ("nvfp4-precision-table", ["--help"], "Config groups"),
                                 ("nvfp4-train", ["--cfg", "job"], "train_steps:")):
        out = subprocess.run([str(env_dir / "bin" / script), *args], **run)
        assert out.returncode == 0 and expect in out.stdout, (script, out.stderr)
