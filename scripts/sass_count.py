#!/usr/bin/env python3
"""Instructions per element of the fused NVFP4 quantize kernel, compiled for sm_90 here (no GPU needed).

The code is ``nvfp4_train.bench.sass``; ``--help`` lists the options. Run from the repository root with the project
installed (``make install``): ``python3 scripts/sass_count.py``.
"""

from nvfp4_train.bench.sass import main

if __name__ == "__main__":
    raise SystemExit(main())
