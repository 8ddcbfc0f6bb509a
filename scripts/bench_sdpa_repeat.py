#!/usr/bin/env python3
"""Whether attention's backward is bitwise repeatable, per SDPA backend and shape.

The code is ``nvfp4_train.bench.sdpa_repeat``; ``--help`` lists the options. Run from the repository root with the
project installed: ``python3 scripts/bench_sdpa_repeat.py``.
"""

from nvfp4_train.bench.sdpa_repeat import main

if __name__ == "__main__":
    raise SystemExit(main())
