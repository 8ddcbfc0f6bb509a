"""Train a model: compose the config (``configs/train.yaml`` + command-line overrides), build, train.

    python train.py model=tiny precision=nvfp4 schedule.train_steps=50
    torchrun --nproc-per-node 8 train.py model=1.2b parallel.tp=2 experiment.name=run1
    python train.py --help | --cfg job [overrides] | -m precision=bf16,nvfp4

The same command as the installed ``nvfp4-train`` (``nvfp4_train.cli.train_main``; under torchrun:
``torchrun ... --no-python nvfp4-train ...``). Hydra's compose API (not ``@hydra.main``): no output directory
per launch or rank; the run directory is ``experiment.run_dir`` (default ``runs/<experiment.name>``, the name
``<model>_<precision>`` unless given), shared by all ranks. See docs/training.md.
Exit status: see ``nvfp4_train.cli.TRAIN_DOC`` (0 done or stopped cleanly, 2 bad config, a file or value it
names that the run cannot use, or the run directory in use, 3 diverged, 4 a checkpoint could not be written).
"""

import sys

from nvfp4_train.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))
