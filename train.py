"""Train a model: compose the config (``configs/train.yaml`` + command-line overrides), build, train.

    python train.py model=tiny precision=nvfp4 schedule.train_steps=50
    torchrun --nproc-per-node 8 train.py model=1.2b parallel.tp=2 experiment.name=run1

Hydra's compose API (not ``@hydra.main``): no output directory per launch or rank; the run directory is
``experiment.run_dir`` (default ``runs/<experiment.name>``), shared by all ranks. See docs/training.md.
Exit status: 0 done or stopped cleanly by SIGTERM/SIGUSR1 (checkpoint saved), 2 bad config, 3 diverged,
4 a checkpoint could not be written (no space, a file-size limit, a read-only directory; earlier ones intact).
"""

import sys


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from nvfp4_train.config import compose_config

    try:
        cfg = compose_config("train", argv)
    except Exception as e:  # Hydra / OmegaConf / schema validation: the message names the key or value
        print(f"train.py: config error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from nvfp4_train.checkpoint import CheckpointWriteError
    from nvfp4_train.trainer import TrainingDiverged, train

    try:
        train(cfg)
    except TrainingDiverged as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
