#!/usr/bin/env python3
"""Time the host's read of one training step's micro-batches from the trainer's data loader, with and without its
worker process, per benchmark case's shape (no GPU, no model).

The code is ``nvfp4_train.bench.data_loader``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH``: ``python3 scripts/bench_data_loader.py``.
"""

from nvfp4_train.bench.data_loader import main

if __name__ == "__main__":
    raise SystemExit(main())
