#!/usr/bin/env python3
"""Kernel launches of one quantized layer's forward + backward, counted on CPU through the GPU code path.

The code is ``nvfp4_train.bench.launch_inventory``; ``--help`` lists the options. Run from the repository root with
the project installed (``make install``) or on ``PYTHONPATH`` (``scripts/gpu_env.sh`` puts it there): ``python3
scripts/launch_inventory.py`` or ``python3 -m scripts.launch_inventory``.
"""

from nvfp4_train.bench.launch_inventory import main

if __name__ == "__main__":
    raise SystemExit(main())
