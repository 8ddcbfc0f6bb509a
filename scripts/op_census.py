#!/usr/bin/env python3
"""Per-step census of aten ops (operands, source line, forward or backward) of a benchmark case, on CPU.

The code is ``nvfp4_train.bench.op_census``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/op_census.py`` or ``python3 -m scripts.op_census``.
"""

from nvfp4_train.bench.op_census import main

if __name__ == "__main__":
    raise SystemExit(main())
