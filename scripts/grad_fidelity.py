#!/usr/bin/env python3
"""Gradient fidelity per recipe: each quantized layer's weight gradient and forward output against bf16's.

The code is ``nvfp4_train.experiments.grad_fidelity`` (``docs/grad_fidelity.md``); ``--help`` lists the options.
Run from the repository root with the project installed (``make install``) or on ``PYTHONPATH``
(``scripts/gpu_env.sh`` puts it there): ``python3 scripts/grad_fidelity.py`` or ``python3 -m scripts.grad_fidelity``.
"""

from nvfp4_train.experiments.grad_fidelity import main

if __name__ == "__main__":
    raise SystemExit(main())
