#!/usr/bin/env python3
"""Every Triton launch the kernel tests make, compiled for sm_90 on a machine without a GPU (any Triton version).

The code is ``nvfp4_train.bench.compile_check``; ``--help`` lists the options. Run from the repository root with the
project installed (``make install``): ``python3 scripts/compile_check.py record --out launches.jsonl``, then
``PYTHONPATH=<another triton> python3 scripts/compile_check.py compile launches.jsonl``.
"""

from nvfp4_train.bench.compile_check import main

if __name__ == "__main__":
    raise SystemExit(main())
