"""Generate text from a checkpoint (greedy or top-p sampling), with the tokenizer the run used.

    python scripts/generate.py runs/tiny_nvfp4_cpu --prompt "The kernel" --max-new-tokens 40
    python scripts/generate.py CKPT --prompt "..." --temperature 0.8 --top-p 0.9 --seed 1 --device cuda

The same command as ``python -m nvfp4_train.generate`` (see ``nvfp4_train.generate`` for the decoding rules).
"""

from __future__ import annotations

import sys

from nvfp4_train.generate import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/generate.py"))
