"""Training and validation datasets: megatron-core's ``GPTDataset`` over indexed datasets, blended.

``build_datasets(config, train_samples=..., valid_samples=...)`` is what the trainer calls. It checks every
``.bin``/``.idx`` pair first (a missing or truncated file is named, before megatron-core memory-maps it),
then builds ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` with one blend per split
(``blend_per_split``), or with ``split`` over the training prefixes when no validation prefixes are given.

Samples are ``seq_length`` tokens cut from the documents concatenated in a shuffled order (documents end
with EOD), ``labels`` are the tokens shifted by one; order depends only on ``seed``, the data, the sample
counts and ``seq_length``, never on the process or the number of ranks. megatron-core writes its sample
indices to ``cache_dir`` and reuses them when the same dataset is
asked for again; the names hash the tokenizer's sha256, so a new tokenizer never reuses stale indices.
(Without ``cache_dir`` megatron-core uses ``<prefix>/cache/GPTDataset_indices/``, a folder named like the
prefix, and does not cache blend indices.)

No ``torch.distributed`` is needed: without a process group every process builds its own (identical)
datasets. With one, megatron-core builds on global rank 0 first (writing the caches), then the other ranks
load them; pass ``is_built_on_rank`` to skip ranks that never read data (e.g. TP rank > 0).

``build_data_loader`` wraps a dataset in a ``DataLoader`` whose batch sampler hands each data-parallel rank
its micro-batches of every global batch, starting at ``consumed_samples`` (resume = same stream).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from nvfp4_train.data.tokenizer import BPETokenizer

__all__ = ["DataConfig", "IndexInfo", "check_indexed_dataset", "build_datasets", "build_data_loader",
           "PretrainingBatchSampler", "load_tokenizer_for"]

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from and how samples are cut (the ``data`` config section)."""

    train_prefixes: list[str] = field(default_factory=lambda: ["data/tokens/text_train"])
    """Indexed datasets (paths without ``.bin``/``.idx``, as written by ``scripts/prepare_data.py``) blended
    for training."""
    train_weights: list[float] | None = None
    """One positive weight per training prefix (normalised). None: proportional to each prefix's tokens."""
    valid_prefixes: list[str] = field(default_factory=lambda: ["data/tokens/text_validation"])
    """Indexed datasets for validation. Empty: validation documents are taken from the training prefixes
    by ``split``."""
    valid_weights: list[float] | None = None
    """One positive weight per validation prefix. None: proportional to tokens."""
    split: str = "99,1,0"
    """Train/validation/test shares of each training prefix's documents, used only when ``valid_prefixes``
    is empty (megatron-core's split string: contiguous document ranges)."""
    tokenizer: str | None = None
    """A ``tokenizer.json``; None: the project's committed ``nvfp4_train/data/tokenizer.json``. Must be the
    one the prefixes were prepared with (checked against their ``.meta.json`` where present)."""
    eod_token: str | None = None
    """End-of-document token of a custom tokenizer (None: ``<|endoftext|>`` or another known name)."""
    seq_length: int = 1024
    """Tokens per sample (the model's context); each sample reads ``seq_length + 1`` tokens."""
    seed: int = 1234
    """Seed of the document and sample shuffles (and of the blend)."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0: load in the training process; samples are cheap memory-mapped
    slices, one worker is enough to prefetch)."""
    cache_dir: str | None = None
    """Where megatron-core caches its sample and blend indices (shared by all ranks of a node: rank 0 writes,
    the others read). None: ``<prefix>/cache/GPTDataset_indices/`` per prefix, blend indices not cached."""
    eod_mask_loss: bool = False
    """Zero the loss on positions whose input token is EOD."""
    reset_position_ids: bool = False
    """Restart position ids after each EOD."""
    reset_attention_mask: bool = False
    """Block attention across EOD (needs ``create_attention_mask``)."""
    create_attention_mask: bool = False
    """Return a dense ``[1, s, s]`` causal mask per sample; off: the model applies its causal mask itself."""
    mmap: bool = True
    """Memory-map the ``.bin`` files (off: read them with file reads)."""

    def __post_init__(self) -> None:
        if not self.train_prefixes:
            raise ValueError("data.train_prefixes is empty: give at least one prefix written by prepare_data.py")
        for name, prefixes, weights in (("train", self.train_prefixes, self.train_weights),
                                        ("valid", self.valid_prefixes, self.valid_weights)):
            if weights is None:
                continue
            if len(weights) != len(prefixes):
                raise ValueError(f"data.{name}_weights has {len(weights)} weights for {len(prefixes)} "
                                 f"data.{name}_prefixes: give one weight per prefix (or None)")
            if any(not w > 0 for w in weights):
                raise ValueError(f"data.{name}_weights must be positive, got {list(weights)}; drop a prefix "
                                 f"instead of weighting it 0")
        if self.seq_length < 1:
            raise ValueError(f"data.seq_length must be >= 1, got {self.seq_length}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.reset_attention_mask and not self.create_attention_mask:
            raise ValueError("data.reset_attention_mask needs data.create_attention_mask=true")
        if not self.valid_prefixes:
            parts = self.split.replace("/", ",").split(",")
            try:
                shares = [float(p) for p in parts]
            except ValueError:
                shares = []
            if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
                raise ValueError(f"data.split must be 'train,valid,test' shares such as '99,1,0', got "
                                 f"{self.split!r}")


# ----------------------------------------------------------------------------------------------------
# Checking indexed datasets before megatron-core reads them


@dataclass(frozen=True)
class IndexInfo:
    prefix: str
    dtype: type
    sequences: int
    documents: int
    tokens: int


def check_indexed_dataset(prefix: str | os.PathLike, tokenizer: BPETokenizer | None = None) -> IndexInfo:
    """Validate ``<prefix>.idx`` and ``<prefix>.bin`` against each other (and the tokenizer), cheaply.

    Raises FileNotFoundError naming a missing file, ValueError naming a truncated, corrupt or mismatched one.
    """
    prefix = str(prefix)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for f in (idx, bin_):
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} not found (dataset prefix {prefix!r}); create it with scripts/prepare_data.py "
                f"--output-prefix ... (which writes <prefix>_train and <prefix>_validation)")
    idx_size = idx.stat().st_size
    with open(idx, "rb") as f:
        header = f.read(_IDX_HEADER_BYTES)
        if len(header) < _IDX_HEADER_BYTES:
            raise ValueError(f"{idx} is truncated: {idx_size} bytes, shorter than the {_IDX_HEADER_BYTES}-byte "
                             f"header; re-run prepare_data.py")
        if header[:9] != _IDX_MAGIC:
            raise ValueError(f"{idx} is not a megatron-core index (bad magic {header[:9]!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != 1 or code not in _DTYPES:
            raise ValueError(f"{idx}: unsupported version {version} or dtype code {code}")
        expected_idx = _IDX_HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_size < expected_idx:
            raise ValueError(f"{idx} is truncated: {idx_size} bytes, its header describes {n_seq} sequences and "
                             f"{n_doc - 1} documents = {expected_idx} bytes; re-run prepare_data.py")
        if idx_size not in (expected_idx, expected_idx + n_seq):  # + n_seq: multimodal mode bytes
            raise ValueError(f"{idx} is {idx_size} bytes but its header describes {expected_idx}: corrupt")
        dtype = _DTYPES[code]
        itemsize = np.dtype(dtype).itemsize
        # O(1) reads: the last sequence's length and pointer give the .bin size the index expects.
        last_length = last_pointer = 0
        if n_seq:
            f.seek(_IDX_HEADER_BYTES + 4 * (n_seq - 1))
            (last_length,) = struct.unpack("<i", f.read(4))
            f.seek(_IDX_HEADER_BYTES + 4 * n_seq + 8 * (n_seq - 1))
            (last_pointer,) = struct.unpack("<q", f.read(8))
        last_doc = 0
        if n_doc:
            f.seek(_IDX_HEADER_BYTES + 12 * n_seq + 8 * (n_doc - 1))
            (last_doc,) = struct.unpack("<q", f.read(8))
    if n_doc < 1 or last_doc != n_seq:
        raise ValueError(f"{idx} is corrupt: its document index ends at {last_doc}, not at {n_seq} sequences")
    expected_bin = last_pointer + last_length * itemsize
    if last_length < 0 or last_pointer < 0 or expected_bin % itemsize:
        raise ValueError(f"{idx} is corrupt: last sequence at byte {last_pointer} with {last_length} tokens")
    tokens = expected_bin // itemsize
    bin_size = bin_.stat().st_size
    if bin_size < expected_bin:
        raise ValueError(f"{bin_} is truncated: {bin_size} bytes, but {idx} describes {tokens} tokens of "
                         f"{np.dtype(dtype).name} = {expected_bin} bytes; re-run prepare_data.py")
    if bin_size != expected_bin:
        raise ValueError(f"{bin_} is {bin_size} bytes, but {idx} describes {expected_bin}: the pair comes from "
                         f"different runs; re-run prepare_data.py")
    if tokenizer is not None:
        if np.iinfo(dtype).max < tokenizer.vocab_size - 1:
            raise ValueError(f"{bin_} stores {np.dtype(dtype).name} ids, too small for the tokenizer's "
                             f"{tokenizer.vocab_size} ids")
        meta_path = Path(prefix + ".meta.json")
        if meta_path.is_file():
            try:
                meta = json.loads(meta_path.read_text()).get("tokenizer", {})
            except ValueError as e:
                raise ValueError(f"{meta_path} is not valid JSON ({e}): re-run prepare_data.py or delete it") from None
            if meta.get("sha256") not in (None, tokenizer.sha256):
                raise ValueError(
                    f"{prefix} was tokenized with {meta.get('path')} (sha256 {meta['sha256'][:12]}…), not with "
                    f"{tokenizer.path} (sha256 {tokenizer.sha256[:12]}…): re-run prepare_data.py with this "
                    f"tokenizer or set data.tokenizer to the one used")
    return IndexInfo(prefix, dtype, n_seq, n_doc - 1, tokens)


# ----------------------------------------------------------------------------------------------------
# Datasets


def load_tokenizer_for(config: DataConfig) -> BPETokenizer:
    """The tokenizer named by the config (the committed one when ``config.tokenizer`` is None)."""
    return BPETokenizer(config.tokenizer, eod_token=config.eod_token)


@contextlib.contextmanager
def _rank0_without_process_group():
    """megatron-core 0.16.1's BlendedDataset calls ``torch.distributed.get_rank()`` before writing its index
    cache without checking ``is_initialized()`` first (GPTDataset does check), so a blend with a cache
    directory fails in a single process. Without a process group this process is rank 0: say so while
    building. With a process group nothing changes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = original


def _blend(prefixes: list[str], weights: list[float] | None, infos: dict[str, IndexInfo]):
    if len(prefixes) == 1:
        return ([prefixes[0]], None)
    # Explicit weights even when the user gave none: with weights=None megatron-core samples each prefix at
    # most one epoch and silently returns fewer samples than asked for.
    if weights is None:
        weights = [float(infos[p].tokens) for p in prefixes]
    return (list(prefixes), [float(w) for w in weights])


def build_datasets(config: DataConfig, *, train_samples: int, valid_samples: int,
                   tokenizer: BPETokenizer | None = None,
                   is_built_on_rank: Callable[[], bool] | None = None):
    """-> (train, valid): megatron-core GPTDataset / BlendedDataset with at least the asked-for samples
    (valid is None when ``valid_samples`` is 0). Each sample is a dict of ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` (and ``attention_mask`` when configured), int64/float tensors of
    length ``seq_length``.
    """
    if train_samples < 1:
        raise ValueError(f"train_samples must be >= 1, got {train_samples}")
    if valid_samples < 0:
        raise ValueError(f"valid_samples must be >= 0, got {valid_samples}")
    tok = tokenizer or load_tokenizer_for(config)
    prefixes = list(dict.fromkeys([*config.train_prefixes, *config.valid_prefixes]))
    infos = {p: check_indexed_dataset(p, tok) for p in prefixes}
    for p, info in infos.items():
        if info.tokens <= config.seq_length:
            raise ValueError(f"{p} holds {info.tokens} tokens, not enough for one sample of seq_length "
                             f"{config.seq_length} + 1")

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    common = dict(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        tokenizer=tok,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
        path_to_cache=config.cache_dir,
        mmap_bin_files=config.mmap,
    )
    if config.valid_prefixes:
        gpt_config = GPTDatasetConfig(
            blend_per_split=[
                _blend(config.train_prefixes, config.train_weights, infos),
                _blend(config.valid_prefixes, config.valid_weights, infos) if valid_samples else None,
                None,
            ],
            **common)
    else:
        gpt_config = GPTDatasetConfig(
            blend=_blend(config.train_prefixes, config.train_weights, infos), split=config.split, **common)
    sizes = [train_samples, valid_samples, 0]
    with _rank0_without_process_group():
        train, valid, _test = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, is_built_on_rank or (lambda: True), gpt_config).build()
    if valid_samples == 0:
        valid = None
    return train, valid


# ----------------------------------------------------------------------------------------------------
# Loading


class PretrainingBatchSampler:
    """Index batches of one data-parallel rank: global batch b (``micro_batch_size * dp_size`` consecutive
    sample indices from ``consumed_samples`` on) gives rank r the slice ``[r * mbs, (r + 1) * mbs)``.

    The same stream on every run and any ``num_workers``; resuming at ``consumed_samples`` continues it.
    Stops at ``total_samples`` (a last, incomplete global batch is dropped).
    """

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} is outside the dataset's {total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        lo = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + lo, start + lo + self.micro_batch_size))


def build_data_loader(dataset, *, micro_batch_size: int, consumed_samples: int = 0, dp_rank: int = 0,
                      dp_size: int = 1, num_workers: int = 0):
    """A DataLoader over `dataset` (from `build_datasets`) yielding this rank's micro-batches as dicts of
    stacked tensors (``tokens``: ``[micro_batch_size, seq_length]`` ...)."""
    import torch

    sampler = PretrainingBatchSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                      micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=False,
        persistent_workers=num_workers > 0)
