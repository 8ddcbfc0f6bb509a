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
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                            str(wheels), str(REPO)], check=True, timeout=300, capture_output=True, text=True)
    # setuptools' deprecations (a license table) and "Package 'nvfp4_train.configs.model' is absent from the
    # `packages` configuration", about 450 lines
    assert "Warning:" not in built.stdout + built.stderr, [ln for ln in (built.stdout + built.stderr).splitlines()
                                                           if "Warning:" in ln][:5]
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
                                 ("nvfp4-train", ["--cfg", "job"], "train_steps:"),
                                 ("nvfp4-prepare-data", ["--help"], "usage: nvfp4-prepare-data")):
        out = subprocess.run([str(env_dir / "bin" / script), *args], **run)
        assert out.returncode == 0 and expect in out.stdout, (script, out.stderr)


class _Job:
    """A sweep job's process (``subprocess.Popen``) that records its command line and ends at once, with
    ``on_wait()`` run while the sweep waits for it."""

    def __init__(self, args: list[str], started: list, on_wait=lambda job: None) -> None:
        self.args, self.signals, self.on_wait = args, [], on_wait
        started.append(self)

    def wait(self) -> int:
        self.on_wait(self)
        return 0

    def poll(self) -> None:
        return None

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


def test_sweep_jobs_each_get_a_run_dir_unless_it_is_swept():
    """``-m ... experiment.run_dir=X`` put every job in X: job #1 resumed job #0's last checkpoint and trained
    nothing. Each job runs in ``X/<n>``; a swept run_dir gives each job its value; without one, ``<runs/name>/<n>``."""
    from nvfp4_train.cli import sweep_jobs

    assert sweep_jobs(["experiment.run_dir=/r/x", "experiment.seed=1,2"]) == [
        ["experiment.seed=1", "experiment.run_dir=/r/x/0"], ["experiment.seed=2", "experiment.run_dir=/r/x/1"]]
    assert sweep_jobs(["precision=bf16,fp8"]) == [
        ["precision=bf16", "experiment.run_dir=runs/tiny_bf16/0"], ["precision=fp8", "experiment.run_dir=runs/tiny_fp8/1"]]
    assert sweep_jobs(["experiment.run_dir=/r/a,/r/b", "experiment.seed=3"]) == [
        ["experiment.run_dir=/r/a", "experiment.seed=3"], ["experiment.run_dir=/r/b", "experiment.seed=3"]]
    with pytest.raises(ValueError, match="sweep jobs #0 and #1 would both run in /r/a"):
        sweep_jobs(["experiment.run_dir=/r/a,/r/a"])


def test_a_sweep_checks_every_job_before_the_first_starts(tmp_path, capsys, monkeypatch):
    """Job #0 trained 411 s before job #1 failed on a typo: now no job starts, and the error is one line naming
    the job. A good sweep starts one process per job, in its own run directory."""
    import nvfp4_train.cli as cli

    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda args: _Job(args, started))
    run_dir = tmp_path / "sweep"
    assert cli.train_main(["-m", f"experiment.run_dir={run_dir}", "experiment.seed=1,oops"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert started == [] and not run_dir.exists()
    assert err == [f"nvfp4-train: config error: sweep job #1 (experiment.run_dir={run_dir} experiment.seed=oops): "
                   f"Error merging override experiment.seed=oops: experiment.seed expects int (Value 'oops' of type "
                   f"'str' could not be converted to Integer)"]
    with pytest.raises(ValueError, match=r"sweep job #1 \(schedule.warmup_steps=200\): schedule: warmup"):
        cli.sweep_jobs(["schedule.warmup_steps=0,200"])  # check_run's checks too, before any job
    assert cli.train_main(["-m", f"experiment.run_dir={run_dir}", "experiment.seed=1,2"]) == 0
    assert [job.args[-3:] for job in started] == [["train", "experiment.seed=1", f"experiment.run_dir={run_dir}/0"],
                                                  ["train", "experiment.seed=2", f"experiment.run_dir={run_dir}/1"]]


def test_a_stop_signal_ends_the_sweep_after_the_running_job_stopped(capsys, monkeypatch):
    """A SIGTERM to the sweep reaches the running job (which stops as it does alone: the step, a checkpoint,
    status 0) and no later job starts. Before, the sweep died of it and its job ran on, orphaned; a Ctrl-C made
    ``subprocess.call`` kill the job 0.25 s later, before its checkpoint."""
    import os
    import signal

    import nvfp4_train.cli as cli

    started = []
    monkeypatch.setattr(cli.subprocess, "Popen",
                        lambda args: _Job(args, started, on_wait=lambda job: os.kill(os.getpid(), signal.SIGTERM)))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.train_main(["-m", "experiment.seed=1,2,3"]) == 0
    assert len(started) == 1 and started[0].signals == [signal.SIGTERM]
    assert capsys.readouterr().err.splitlines() == [
        "nvfp4-train: sweep stopped by signal SIGTERM after job #0: jobs #1 to #2 not started (the same command runs "
        "them; finished jobs find their last checkpoint)"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_config_errors_are_one_line(capsys):
    """A missing group option printed Hydra's 10-line search path, an unknown key three "caused by" lines of
    OmegaConf internals."""
    from nvfp4_train.cli import train_main

    for override, needle in (("parallel=tp3", "parallel=tp3: configs/parallel/ has no tp3.yaml (options: pp2,"),
                             ("model.hiden=3", "(did you mean 'hidden_size'?)"),
                             ("experiment.seed=oops", "experiment.seed expects int")):
        assert train_main(["--cfg", "job", override]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("nvfp4-train: config error: ") and needle in err[0], err
