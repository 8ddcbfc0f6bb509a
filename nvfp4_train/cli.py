"""The command lines, with Hydra's usual options around the compose API.

    nvfp4-train ...            (``python train.py ...``)             train a model
    nvfp4-summary ...          (``python -m nvfp4_train.summary ...``)     pattern and parameter count of a model
    nvfp4-precision-table ...  (``python -m nvfp4_train.table ...``)  the layer precision table

Each takes Hydra overrides (``group=option``, ``section.key=value``, ``+key=value``) and:

    -h, --help          the config groups with their options and defaults, then the tool's own help
    --cfg job           print the resolved config (YAML) and exit without running
    -m, --multirun      a sweep: ``a=1,2 b=x,y`` runs every combination, one after the other (training: one
                        process per run, each in ``<run dir>/<n>`` unless ``experiment.run_dir`` is swept;
                        every job's config is composed and checked before the first one starts)

The tools compose with ``nvfp4_train.config.compose_config`` (no ``@hydra.main``: no output directory per
launch or rank, no working-directory change).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence

__all__ = ["parse_args", "sweep", "sweep_jobs", "help_text", "train_main", "summary_main", "table_main", "CliArgs"]

CFG_KINDS = ("job",)


class CliArgs:
    """What :func:`parse_args` found: the overrides, and the options among ``--help``, ``--cfg``, ``-m``."""

    def __init__(self, overrides: list[str], help: bool, cfg: str | None, multirun: bool) -> None:
        self.overrides = overrides
        self.help = help
        self.cfg = cfg
        self.multirun = multirun


def parse_args(argv: Sequence[str]) -> CliArgs:
    """Split Hydra's options from the overrides; an unknown ``-option`` is a ``ValueError`` naming it."""
    overrides: list[str] = []
    help_, cfg, multirun = False, None, False
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-h", "--help"):
            help_ = True
        elif a in ("-m", "--multirun"):
            multirun = True
        elif a in ("-c", "--cfg") or a.startswith("--cfg="):
            if "=" in a:
                cfg = a.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                cfg = args[i]
            else:
                raise ValueError(f"{a} needs a value: {a} job")
            if cfg not in CFG_KINDS:
                raise ValueError(f"--cfg {cfg}: only --cfg job is supported (the config of the run; there is no "
                                 f"Hydra app config)")
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a!r}: the options are --help, --cfg job, -m/--multirun; "
                             f"everything else is an override such as schedule.train_steps=50")
        else:
            overrides.append(a)
        i += 1
    return CliArgs(overrides, help_, cfg, multirun)


def sweep(overrides: Sequence[str]) -> list[list[str]]:
    """Every combination of the comma-separated values in ``overrides`` (Hydra's basic sweeper: its
    override grammar, ``a=1,2``, ``a=range(1,4)``, ``a=choice(x,y)``), in Hydra's order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def help_text(prog: str, doc: str, config_name: str) -> str:
    """``--help``: the tool's docstring, the config groups (default first) and the common options."""
    from nvfp4_train.config.compose import config_groups

    lines = [doc.strip(), "", f"Config groups of {config_name}.yaml (choose with group=option; default in []):"]
    for group, (default, options) in config_groups(config_name).items():
        shown = ", ".join(f"[{o}]" if o == default else o for o in options)
        lines.append(f"  {group:<12} {shown}")
    lines += ["", "Any key can be overridden: section.key=value (for example schedule.train_steps=50);",
              f"`{prog} --cfg job [overrides]` prints every key with its value.", "",
              "Options: -h/--help, --cfg job (print the resolved config, do not run), "
              "-m/--multirun (sweep a=1,2 b=x,y)."]
    return "\n".join(lines)


def _message(e: BaseException) -> str:
    """One line: the message of ``e`` and of its causes (Hydra puts the key and the reason in the cause), the
    first line of each, leaving out what an earlier one already says."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = (str(e).strip().splitlines() or [""])[0].strip()
        if msg and "$VALUE" not in msg and not any(msg in p for p in parts):
            parts.append(msg)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return "; caused by: ".join(parts)


def _error(prog: str, e: BaseException) -> int:
    print(f"{prog}: config error: {_message(e)}", file=sys.stderr)
    return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return ValueError, TypeError, KeyError, HydraException, OmegaConfBaseException


def run_tool(argv: Sequence[str], *, prog: str, doc: str, config_name: str,
             run: Callable[[list[str]], int], catch: bool = True) -> int:
    """The common command line of a tool that composes ``config_name``: ``--help``, ``--cfg job``,
    ``-m`` (each job of a sweep through ``run(overrides)``, in this process), else ``run(overrides)``.
    Returns the exit status: 0, 2 for a bad command line or config, or the first failing job's status.
    ``catch``: a user error (``ValueError``, Hydra's, ...) raised by ``run`` is reported as a config error
    (status 2); else it propagates."""
    try:
        args = parse_args(argv)
        if args.help:
            print(help_text(prog, doc, config_name))
            return 0
        jobs = sweep(args.overrides) if args.multirun else [args.overrides]
        if args.cfg:
            from omegaconf import OmegaConf

            from nvfp4_train.config.compose import compose_config

            for job in jobs:
                print(OmegaConf.to_yaml(compose_config(config_name, job, as_object=False), resolve=True), end="")
            return 0
    except _user_errors() as e:
        return _error(prog, e)
    for n, job in enumerate(jobs):
        if args.multirun:
            print(f"[{prog}] #{n} {' '.join(job)}", flush=True)
        if not catch:
            status = run(job)
            if status:
                return status
            continue
        try:
            status = run(job)
        except _user_errors() as e:
            status = _error(prog, e)
        if status:
            return status
    return 0


# ---------------------------------------------------------------------------------------------------------
# train


TRAIN_DOC = """nvfp4-train (python train.py): compose the config (train.yaml + overrides), build, train.

    nvfp4-train model=tiny precision=nvfp4 schedule.train_steps=50
    torchrun --nproc-per-node 8 --no-python nvfp4-train model=1.2b parallel.tp=2 experiment.name=run1
    nvfp4-train -m precision=bf16,nvfp4 experiment.run_dir=runs/cmp   (one run after the other: runs/cmp/0, 1)

The run directory is experiment.run_dir (default runs/<experiment.name>; the name defaults to
<model>_<precision>, the configs chosen: tiny_nvfp4), shared by all ranks. A sweep runs job n in
<run dir>/<n> unless experiment.run_dir is swept, and checks every job's config before the first starts; a
stop signal (Ctrl-C, SIGTERM) stops the running job as it would stop alone, and no later job starts.
Exit status: 0 done, or stopped cleanly by SIGTERM/SIGUSR1/SIGINT (the step finishes, a checkpoint is saved;
before the first step: nothing to save; a second Ctrl-C ends the process at once, without a checkpoint); 2 bad
config (one line naming the key), a file or value the config names that the run cannot use (data, tokenizer,
checkpoint: one line naming it and the fix), or the run directory is in use by another run; 3 diverged
(optim.max_consecutive_bad_steps skipped steps in a row, a run that ended inside a streak of skipped steps, or a
loss spike with no rollback left: the message names the checkpoint to resume from); 4 the run directory or a
checkpoint cannot be written (before the first step: the run or checkpoint directory is a file, read-only or
not permitted; at a save: no space, a file-size limit; earlier checkpoints intact). In a sweep, the first
failing job's status (128 + N for a job killed by signal N, e.g. 130 after a second Ctrl-C)."""


class _StoppedBeforeTraining(BaseException):  # not an Exception: no error handler may take it for one
    pass


def _stop_before_training(signum, _frame):
    raise _StoppedBeforeTraining(signum)


def _train_one(overrides: list[str]) -> int:
    """One training run in this process. Until the trainer takes the stop signals over, SIGTERM/SIGUSR1/SIGINT
    (Ctrl-C) end the launch with a message and status 0 (nothing to save yet)."""
    import signal

    previous = {sig: signal.signal(sig, _stop_before_training)
                for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        return _train_one_run(overrides)
    except _StoppedBeforeTraining as e:
        print(f"train.py: stopped by signal {signal.Signals(e.args[0]).name} before training started "
              f"(nothing to save)", file=sys.stderr)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _train_one_run(overrides: list[str]) -> int:
    from nvfp4_train.warnings_log import ThirdPartyWarnings

    routed = ThirdPartyWarnings().install()  # before megatron-core and torch.distributed are imported
    try:
        return _train_routed(overrides, routed)
    finally:
        routed.close()


def _world_size() -> int:
    """The processes of this launch: torchrun's WORLD_SIZE, else Slurm's task count, else 1."""
    import os

    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def _train_routed(overrides: list[str], routed) -> int:
    import os
    from pathlib import Path

    from nvfp4_train.config import compose_config
    from nvfp4_train.config.compose import check_run

    try:
        cfg = compose_config("train", overrides)
        check_run(cfg, _world_size())  # what would otherwise fail only after the model is built
    except _user_errors() as e:  # Hydra / OmegaConf / schema validation: the message names the key or value
        return _error("train.py", e)
    from nvfp4_train.checkpoint import CheckpointWriteError
    from nvfp4_train.trainer import RunDirLocked, RunSetupError, TrainingDiverged, train

    rank = int(os.environ.get("RANK") or 0)

    def run_dir_ready(run_dir: Path) -> None:  # locked for this run: a refused run writes nothing into it
        routed.attach(run_dir, rank=rank)

    try:
        train(cfg, run_dir_ready=run_dir_ready)
    except (RunDirLocked, RunSetupError) as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 4
    return 0


def _sweeps(overrides: Sequence[str], key: str) -> bool:
    """Whether ``overrides`` give ``key`` more than one value (``key=a,b``, ``key=range(...)``, ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return any(o.key_or_group == key and o.is_sweep_override()
               for o in OverridesParser.create().parse_overrides(list(overrides)))


def sweep_jobs(overrides: Sequence[str], world_size: int = 1) -> list[list[str]]:
    """The jobs of a training sweep (:func:`sweep`), each with its own run directory, every job's config
    composed and checked (``check_run`` on ``world_size`` processes) before any of them runs.

    Job ``n`` runs in ``<run dir>/<n>``, its run directory being the one its config names (``experiment.run_dir``,
    else ``runs/<experiment.name>``), unless ``experiment.run_dir`` is itself swept: then each job runs in its
    value, and two jobs given the same directory are an error. A job's bad config is a ValueError naming the
    job."""
    from nvfp4_train.config import compose_config
    from nvfp4_train.config.compose import check_run

    swept_dir = _sweeps(overrides, "experiment.run_dir")
    jobs, owner = [], {}
    for n, job in enumerate(sweep(overrides)):
        try:
            cfg = compose_config("train", job)
            check_run(cfg, world_size)
        except _user_errors() as e:
            raise ValueError(f"sweep job #{n} ({' '.join(job)}): {_message(e)}") from None
        run_dir = cfg.experiment.resolved_run_dir()
        if not swept_dir:
            run_dir = f"{run_dir}/{n}"
            job = [o for o in job if o.lstrip("+~").split("=", 1)[0] != "experiment.run_dir"]
            job.append(f"experiment.run_dir={run_dir}")
        if run_dir in owner:
            raise ValueError(f"sweep jobs #{owner[run_dir]} and #{n} would both run in {run_dir}: give each job "
                             f"its own experiment.run_dir")
        owner[run_dir] = n
        jobs.append(job)
    return jobs


def train_main(argv: Sequence[str] | None = None) -> int:
    """``nvfp4-train`` / ``python train.py``. A sweep runs each job in its own process (a training run owns
    its process: process groups, signal handlers, the checkpoint writer), after every job's config is checked
    (:func:`sweep_jobs`); never sweep under torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except ValueError as e:
        return _error("nvfp4-train", e)
    if not args.multirun or args.help or args.cfg:
        return run_tool(argv, prog="nvfp4-train", doc=TRAIN_DOC, config_name="train", run=_train_one, catch=False)
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("nvfp4-train: -m/--multirun under torchrun would start every job on every rank: launch one "
              "torchrun per job instead", file=sys.stderr)
        return 2
    import warnings

    try:
        with warnings.catch_warnings():  # megatron-core's import warnings: each job's own process reports them
            warnings.simplefilter("ignore")
            jobs = sweep_jobs(args.overrides, _world_size())
    except _user_errors() as e:
        return _error("nvfp4-train", e)
    return _run_sweep(jobs)


def _run_sweep(jobs: list[list[str]]) -> int:
    """Each job in a process of its own, one after the other; the first failing job's status ends the sweep.
    A stop signal ends it after the running job has stopped as it does alone (the step finishes, a checkpoint,
    status 0): Ctrl-C reaches that job from the terminal, SIGTERM/SIGUSR1 sent to this process are passed on
    to it; the jobs after it do not start."""
    import signal

    stop: list[int] = []
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame) -> None:
        stop.append(signum)
        if child is not None and child.poll() is None and signum != signal.SIGINT:
            child.send_signal(signum)  # (a second SIGINT would end the job at once, unsaved)

    stop_signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {sig: signal.signal(sig, on_signal) for sig in stop_signals}
    try:
        for n, job in enumerate(jobs):
            if stop:  # a signal between two jobs: the next one does not start
                left = f"job #{n}" if n + 1 == len(jobs) else f"jobs #{n} to #{len(jobs) - 1}"
                print(f"nvfp4-train: sweep stopped by signal {signal.Signals(stop[0]).name}: {left} not started "
                      f"(the same command runs them; finished jobs find their last checkpoint)", file=sys.stderr)
                return 0
            print(f"[nvfp4-train] #{n} {' '.join(job)}", flush=True)
            seen = len(stop)
            child = subprocess.Popen([sys.executable, "-m", "nvfp4_train.cli", "train", *job])
            for signum in stop[seen:]:  # arrived while the job was starting: pass it on now
                if signum != signal.SIGINT:
                    child.send_signal(signum)
            status = child.wait()
            if status:
                return 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell says
            if stop:
                if n + 1 < len(jobs):
                    left = f"job #{n + 1}" if n + 2 == len(jobs) else f"jobs #{n + 1} to #{len(jobs) - 1}"
                    print(f"nvfp4-train: sweep stopped by signal {signal.Signals(stop[0]).name} after job #{n}: "
                          f"{left} not started (the same command runs them; finished jobs find their last "
                          f"checkpoint)", file=sys.stderr)
                return 0
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def summary_main(argv: Sequence[str] | None = None) -> int:
    """``nvfp4-summary`` / ``python -m nvfp4_train.summary``."""
    from nvfp4_train.summary import __doc__ as doc
    from nvfp4_train.summary import summary

    def one(job: list[str]) -> int:
        print(summary(job))
        return 0

    return run_tool(list(sys.argv[1:] if argv is None else argv), prog="nvfp4-summary", doc=doc,
                    config_name="table", run=one)


def table_main(argv: Sequence[str] | None = None) -> int:
    """``nvfp4-precision-table`` / ``python -m nvfp4_train.table``."""
    from nvfp4_train.table import __doc__ as doc
    from nvfp4_train.table import render

    def one(job: list[str]) -> int:
        print(render(job))
        return 0

    return run_tool(list(sys.argv[1:] if argv is None else argv), prog="nvfp4-precision-table", doc=doc,
                    config_name="table", run=one)


_TOOLS = {"train": train_main, "summary": summary_main, "table": table_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in _TOOLS:
        print(f"usage: python -m nvfp4_train.cli {{{','.join(_TOOLS)}}} [options] [overrides]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_TOOLS[sys.argv[1]](sys.argv[2:]))
