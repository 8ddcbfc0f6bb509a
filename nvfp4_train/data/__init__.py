"""Data: the committed byte-level BPE tokenizer, text -> megatron-core indexed datasets, blended GPT datasets.

See docs/data.md. megatron-core is imported only when datasets are prepared or built. The preparation is the
module ``nvfp4_train.data.prepare`` (``from nvfp4_train.data.prepare import prepare``), not imported here: it
runs as ``python -m nvfp4_train.data.prepare``, which must find it not imported yet. The names below are
imported at first use, so that ``nvfp4_train.data.env_corpus`` (standard library only) runs on a bare
interpreter, before anything is installed (scripts/build_env_corpus.py --stage collect).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "BPETokenizer": "nvfp4_train.data.tokenizer",
    "DEFAULT_TOKENIZER_PATH": "nvfp4_train.data.tokenizer",
    "load_tokenizer": "nvfp4_train.data.tokenizer",
    "DataConfig": "nvfp4_train.data.datasets",
    "build_data_loader": "nvfp4_train.data.datasets",
    "build_datasets": "nvfp4_train.data.datasets",
    "check_indexed_dataset": "nvfp4_train.data.datasets",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
