"""Data: the committed byte-level BPE tokenizer, text -> megatron-core indexed datasets, blended GPT datasets.

See docs/data.md. megatron-core is imported only when datasets are prepared or built. The preparation is the
module ``nvfp4_train.data.prepare`` (``from nvfp4_train.data.prepare import prepare``), not imported here: it
runs as ``python -m nvfp4_train.data.prepare``, which must find it not imported yet.
"""

from nvfp4_train.data.datasets import DataConfig, build_data_loader, build_datasets, check_indexed_dataset
from nvfp4_train.data.tokenizer import DEFAULT_TOKENIZER_PATH, BPETokenizer, load_tokenizer


__all__ = [
    "BPETokenizer",
    "DEFAULT_TOKENIZER_PATH",
    "DataConfig",
    "build_data_loader",
    "build_datasets",
    "check_indexed_dataset",
    "load_tokenizer",
]
