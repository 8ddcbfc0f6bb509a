#!/usr/bin/env python3
"""Tokenize text into megatron-core indexed datasets: see nvfp4_train/data/prepare.py and docs/data.md.

    python scripts/prepare_data.py --input data/corpus/text/train.jsonl \
        --valid-input data/corpus/text/validation.jsonl --output-prefix data/tokens/text

The same command as ``nvfp4-prepare-data`` and ``python -m nvfp4_train.data.prepare`` (an installed wheel).
"""

import sys

from nvfp4_train.data.prepare import main

if __name__ == "__main__":
    sys.exit(main(prog="prepare_data.py"))
