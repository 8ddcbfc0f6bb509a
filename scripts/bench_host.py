#!/usr/bin/env python3
"""Host time of one quantized layer's forward + backward, with the Triton launches stubbed (TRITON_INTERPRET=1).

The code is ``nvfp4_train.bench.host``; ``--help`` lists the options. Run from the repository root with the project
installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/bench_host.py`` or ``python3 -m scripts.bench_host``.
"""

from nvfp4_train.bench.host import main

if __name__ == "__main__":
    raise SystemExit(main())
