"""Train a model: compose the config (``configs/train.yaml`` + command-line overrides), build, train.

    python train.py model=tiny precision=nvfp4 schedule.train_steps=50
    torchrun --nproc-per-node 8 train.py model=1.2b parallel.tp=2 experiment.name=run1

Hydra's compose API (not ``@hydra.main``): no output directory per launch or rank; the run directory is
``experiment.run_dir`` (default ``runs/<experiment.name>``), shared by all ranks. See docs/training.md.
Exit status: 0 done, or stopped cleanly by SIGTERM/SIGUSR1 (checkpoint saved; before the first step: nothing
to save); 2 bad config (one line naming the key), or the run directory is in use by another run; 3 diverged;
4 a checkpoint could not be written (no space, a file-size limit, a read-only directory; earlier ones intact).
"""

import os
import signal
import sys


class _StoppedBeforeTraining(BaseException):  # not an Exception: no error handler may take it for one
    pass


def _stop_before_training(signum, _frame):
    raise _StoppedBeforeTraining(signum)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    # until the trainer takes the stop signals over, one ends the launch with a message (nothing to save)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _stop_before_training)
    try:
        return _run(argv)
    except _StoppedBeforeTraining as e:
        print(f"train.py: stopped by signal {signal.Signals(e.args[0]).name} before training started "
              f"(nothing to save)", file=sys.stderr)
        return 0


def _run(argv: list[str]) -> int:
    from nvfp4_train.config import compose_config
    from nvfp4_train.config.compose import check_run

    world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    try:
        cfg = compose_config("train", argv)
        check_run(cfg, world_size)  # what would otherwise fail only after the model is built
    except Exception as e:  # Hydra / OmegaConf / schema validation: the message names the key or value
        print(f"train.py: config error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from nvfp4_train.checkpoint import CheckpointWriteError
    from nvfp4_train.trainer import RunDirLocked, TrainingDiverged, train

    try:
        train(cfg)
    except RunDirLocked as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
