"""Training and validation datasets: megatron-core's ``GPTDataset`` over indexed datasets, blended.

``build_datasets(config, train_samples=..., valid_samples=..., vocab_size=model.vocab_size)`` is what the
trainer calls. It validates every ``.bin``/``.idx`` pair first (``validate_indexed_dataset``: header, the
whole index, sizes, every token id below the vocabulary; a missing, truncated or corrupt file, or a
tokenizer that does not fit the model, is a ``DataError`` naming it before megatron-core memory-maps anything),
then builds ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` with one blend per split
(``blend_per_split``), or with ``split`` over the training prefixes when no validation prefixes are given.

Samples are ``seq_length`` tokens cut from the documents concatenated in a shuffled order (documents end
with EOD), ``labels`` are the tokens shifted by one; order depends only on ``seed``, the data, the sample
counts and ``seq_length``, never on the process or the number of ranks. megatron-core writes its sample
indices to ``cache_dir`` and reuses them when the same dataset is
asked for again; the names hash the tokenizer's sha256, so a new tokenizer never reuses stale indices.
Before megatron-core opens them, ``check_index_caches`` removes (for a rebuild) any that is truncated or not
a plain ``.npy`` array, naming it: megatron-core would memory-map a cut file or unpickle a non-``.npy`` one.
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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from nvfp4_train.data.tokenizer import BPETokenizer

__all__ = ["DataConfig", "DataError", "DataFileNotFound", "IndexInfo", "validate_indexed_dataset",
           "check_tokenizer_matches", "check_indexed_dataset", "build_datasets", "build_data_loader",
           "PretrainingBatchSampler", "load_tokenizer_for", "check_index_caches"]

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}

_PREPARE_COMMAND = "python -m nvfp4_train.data.prepare"  # runs wherever the package is installed


def _prepare(args: str = "") -> str:
    """The data preparation command with ``args``, and its other names, for a message."""
    command = f"{_PREPARE_COMMAND} {args}" if args else _PREPARE_COMMAND
    return f"{command} (installed: nvfp4-prepare-data; in a checkout also scripts/prepare_data.py)"


@dataclass(kw_only=True)
class DataConfig:
    """Where the tokens come from and how samples are cut (the ``data`` config section)."""

    train_prefixes: list[str] = field(default_factory=lambda: ["data/tokens/text_train"])
    """Indexed datasets (paths without ``.bin``/``.idx``, as written by ``python -m nvfp4_train.data.prepare``,
    installed as ``nvfp4-prepare-data``) blended for training."""
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
    the others read). The shipped configs (``configs/data/*.yaml``) set it to ``${experiment.run_dir}/index_cache``,
    in the run's own directory. None: ``<prefix>/cache/GPTDataset_indices/`` per prefix, blend indices not
    cached."""
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
            raise ValueError(f"data.train_prefixes is empty: give at least one prefix written by {_PREPARE_COMMAND}")
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


class DataError(ValueError):
    """A data file that cannot be trained on as configured: missing, truncated or corrupt, written for another
    tokenizer, or too short for one sample. The message names the file, the problem and the fix (the
    trainer reports it as a ``RunSetupError``: ``train.py`` prints it on one line and exits 2)."""


class DataFileNotFound(DataError, FileNotFoundError):
    """A ``.bin`` or ``.idx`` file of a configured prefix does not exist."""


# The prefixes whose missing ``.meta.json`` was warned about (once per prefix and process).
_WARNED_NO_META: set[str] = set()


@dataclass(frozen=True)
class IndexInfo:
    prefix: str
    dtype: type
    sequences: int
    documents: int
    tokens: int
    max_token: int | None = None
    """The largest token id in the ``.bin`` (None when the tokens were not scanned)."""


# Tokens are read in chunks of this many ids by the vocabulary scan (16 M ids: 32 MB of uint16).
_SCAN_CHUNK = 1 << 24


def _first_index(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def validate_indexed_dataset(prefix: str | os.PathLike, vocab_size: int | None = None) -> IndexInfo:
    """Check ``<prefix>.idx`` and ``<prefix>.bin`` completely before megatron-core memory-maps them.

    megatron-core's ``IndexedDataset`` trusts both files: a bad header is an ``assert``, inconsistent
    sizes or pointers read garbage or past the end of the memory map, and a token id beyond the model's
    vocabulary only fails inside the embedding after training has started (a device-side assert on GPU).
    Here, in this order:

    1. both files exist;
    2. the ``.idx`` header: its length, magic, version 1, an integer token dtype;
    3. the ``.idx`` size against the counts in its header;
    4. the whole index (12 bytes per sequence, 8 per document; read with numpy): lengths >= 0; pointers
       start at 0 and are contiguous (each sequence begins where the previous one ends, as megatron-core's
       ``IndexedDatasetBuilder`` writes them; pointers that advance by another item size mean the header's
       dtype is not the one the ``.bin`` was written with); the document index starts at 0, never
       decreases and ends at the sequence count;
    5. the ``.bin`` size equals what the index describes;
    6. with ``vocab_size``: every token id lies in ``[0, vocab_size)``, by a full scan of the ``.bin`` in
       chunks of ``_SCAN_CHUNK`` ids (measured: 0.08 s for the 43 MB default training split).

    Returns the counts (and the largest token id when scanned). Raises :class:`DataFileNotFound` naming a
    missing file, :class:`DataError` naming the file, the problem and the fix otherwise.
    """
    prefix = str(prefix)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for f in (idx, bin_):
        if not f.is_file():
            raise DataFileNotFound(
                f"{f} not found (dataset prefix {prefix!r}); create it with "
                f"{_prepare('--input ... --output-prefix ...')}, which writes <prefix>_train and "
                f"<prefix>_validation")
    idx_size = idx.stat().st_size
    with open(idx, "rb") as f:
        header = f.read(_IDX_HEADER_BYTES)
    if len(header) < _IDX_HEADER_BYTES:
        raise DataError(f"{idx} is truncated: {idx_size} bytes, shorter than the {_IDX_HEADER_BYTES}-byte "
                         f"header; re-run {_prepare()}")
    if header[:9] != _IDX_MAGIC:
        raise DataError(f"{idx} is not a megatron-core index (bad magic {header[:9]!r}, expected "
                         f"{_IDX_MAGIC!r}); re-run {_prepare()}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise DataError(f"{idx}: unsupported index version {version} (megatron-core reads version 1); "
                         f"re-run {_prepare()}")
    if code not in _DTYPES or not np.issubdtype(_DTYPES[code], np.integer):
        what = np.dtype(_DTYPES[code]).name if code in _DTYPES else "an unknown type"
        raise DataError(f"{idx}: dtype code {code} is {what}, not an integer token type "
                         f"(codes {sorted(c for c, t in _DTYPES.items() if np.issubdtype(t, np.integer))}); "
                         f"re-run {_prepare()}")
    dtype = _DTYPES[code]
    itemsize = np.dtype(dtype).itemsize
    expected_idx = _IDX_HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if idx_size < expected_idx:
        raise DataError(f"{idx} is truncated: {idx_size} bytes, its header describes {n_seq} sequences and "
                         f"{n_doc - 1} documents = {expected_idx} bytes; re-run {_prepare()}")
    if idx_size not in (expected_idx, expected_idx + n_seq):  # + n_seq: multimodal mode bytes
        raise DataError(f"{idx} is {idx_size} bytes but its header describes {expected_idx}: corrupt; "
                         f"re-run {_prepare()}")

    lengths = np.fromfile(idx, dtype="<i4", count=n_seq, offset=_IDX_HEADER_BYTES).astype(np.int64)
    pointers = np.fromfile(idx, dtype="<i8", count=n_seq, offset=_IDX_HEADER_BYTES + 4 * n_seq)
    doc_index = np.fromfile(idx, dtype="<i8", count=n_doc, offset=_IDX_HEADER_BYTES + 12 * n_seq)
    fix = f"re-run {_prepare()}"
    if n_doc < 1 or doc_index[0] != 0 or doc_index[-1] != n_seq:
        ends = f"runs from {doc_index[0]} to {doc_index[-1]}" if n_doc else "is empty"
        raise DataError(f"{idx} is corrupt: its document index {ends}, not from 0 to its {n_seq} sequences; {fix}")
    if n_doc > 1 and (np.diff(doc_index) < 0).any():
        d = _first_index(np.diff(doc_index) < 0)
        raise DataError(f"{idx} is corrupt: document {d + 1} starts at sequence {doc_index[d + 1]}, before "
                         f"document {d} (sequence {doc_index[d]}); {fix}")
    if (lengths < 0).any():
        s = _first_index(lengths < 0)
        raise DataError(f"{idx} is corrupt: sequence {s} has length {lengths[s]}; {fix}")
    if n_seq and pointers[0] != 0:
        raise DataError(f"{idx} is corrupt: the first sequence starts at byte {pointers[0]} of {bin_}, not 0; {fix}")
    if n_seq > 1:
        steps = np.diff(pointers)
        if (steps != lengths[:-1] * itemsize).any():
            for other in sorted({1, 2, 4, 8} - {itemsize}):
                if (steps == lengths[:-1] * other).all():
                    names = "/".join(np.dtype(t).name for t in _DTYPES.values()
                                     if np.issubdtype(t, np.integer) and np.dtype(t).itemsize == other)
                    raise DataError(
                        f"{idx}: dtype mismatch: its header says {np.dtype(dtype).name} ({itemsize} bytes per "
                        f"token) but its sequence pointers advance by {other} bytes per token ({names}): the "
                        f"header's dtype code is wrong; {fix}")
            s = _first_index(steps != lengths[:-1] * itemsize) + 1
            raise DataError(f"{idx} is corrupt: sequence {s} starts at byte {pointers[s]} of {bin_}, but "
                             f"sequence {s - 1} ends at byte {pointers[s - 1] + lengths[s - 1] * itemsize}; {fix}")
    expected_bin = int(pointers[-1] + lengths[-1] * itemsize) if n_seq else 0
    tokens = expected_bin // itemsize
    bin_size = bin_.stat().st_size
    if bin_size != expected_bin:
        hint = ""
        for other in (1, 2, 4, 8):
            if other != itemsize and tokens and bin_size == tokens * other:
                hint = (f" ({bin_size} bytes = {tokens} tokens of {other} bytes: the files disagree on the "
                        f"token dtype, {np.dtype(dtype).name} in the .idx)")
        if bin_size < expected_bin:
            raise DataError(f"{bin_} is truncated: {bin_size} bytes, but {idx} describes {tokens} tokens of "
                             f"{np.dtype(dtype).name} = {expected_bin} bytes{hint}; {fix}")
        raise DataError(f"{bin_} is {bin_size} bytes, but {idx} describes {expected_bin}: the pair comes from "
                         f"different runs{hint}; {fix}")

    max_token = None
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        data = np.memmap(bin_, dtype=dtype, mode="r") if tokens else np.zeros(0, dtype)
        max_token = -1
        for start in range(0, tokens, _SCAN_CHUNK):
            chunk = np.asarray(data[start : start + _SCAN_CHUNK])
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= vocab_size:
                pos = start + _first_index((chunk < 0) | (chunk >= vocab_size))
                seq = int(np.searchsorted(pointers, pos * itemsize, side="right")) - 1
                bad = int(data[pos])
                raise DataError(
                    f"{bin_} holds token id {bad} (token {pos}, in sequence {seq}) but the vocabulary has "
                    f"{vocab_size} ids (0..{vocab_size - 1}): the file was tokenized with another (larger) "
                    f"vocabulary, or is corrupt; re-run {_prepare()} with the model's tokenizer, or give the "
                    f"model a vocab_size of at least {bad + 1}")
            max_token = max(max_token, hi)
        del data
    return IndexInfo(prefix, dtype, n_seq, n_doc - 1, tokens, max_token)


def check_tokenizer_matches(info: IndexInfo, tokenizer: BPETokenizer) -> None:
    """The dataset was written for ``tokenizer``: its dtype holds the tokenizer's ids, and its
    ``.meta.json`` names the same tokenizer file (sha256) and dtype. Without a ``.meta.json`` (files written by
    another tool) the tokenizer cannot be checked: a warning says so, once per prefix and process. Raises
    :class:`DataError`."""
    prefix = info.prefix
    bin_ = prefix + ".bin"
    if np.iinfo(info.dtype).max < tokenizer.vocab_size - 1:
        raise DataError(f"{bin_} stores {np.dtype(info.dtype).name} ids, too small for the tokenizer's "
                         f"{tokenizer.vocab_size} ids: it was prepared with another tokenizer; re-run "
                         f"{_prepare(f'--tokenizer {tokenizer.path}')}")
    meta_path = Path(prefix + ".meta.json")
    if not meta_path.is_file():
        if prefix not in _WARNED_NO_META:
            _WARNED_NO_META.add(prefix)
            warnings.warn(f"{meta_path} not found: the tokenizer {prefix} was prepared with cannot be checked (only "
                          f"that its ids fit the vocabulary); {_PREPARE_COMMAND} writes this file", stacklevel=3)
        return
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}): re-run {_prepare()} or delete it") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} is not a JSON object: re-run {_prepare()} or delete it")
    tok_meta = meta.get("tokenizer") or {}
    if tok_meta.get("sha256") not in (None, tokenizer.sha256):
        raise DataError(
            f"{prefix} was tokenized with {tok_meta.get('path')} (sha256 {tok_meta['sha256'][:12]}…), not with "
            f"{tokenizer.path} (sha256 {tokenizer.sha256[:12]}…): re-run "
            f"{_prepare(f'--tokenizer {tokenizer.path}')}, or set data.tokenizer to the one used")
    if meta.get("dtype") not in (None, np.dtype(info.dtype).name):
        raise DataError(f"{prefix}.idx says the tokens are {np.dtype(info.dtype).name}, but {meta_path} records "
                         f"{meta['dtype']}: the files come from different runs; re-run {_prepare()}")


def check_indexed_dataset(prefix: str | os.PathLike, tokenizer: BPETokenizer | None = None) -> IndexInfo:
    """``validate_indexed_dataset`` (scanning the token ids against the tokenizer's vocabulary when one is
    given) and ``check_tokenizer_matches``. Raises :class:`DataFileNotFound` (a ``FileNotFoundError``) naming a
    missing file, :class:`DataError` (a ``ValueError``) naming a truncated, corrupt or mismatched one."""
    if tokenizer is None:
        return validate_indexed_dataset(prefix)
    info = validate_indexed_dataset(prefix)
    check_tokenizer_matches(info, tokenizer)  # names a tokenizer mismatch before the scan finds its symptom
    return validate_indexed_dataset(prefix, tokenizer.vocab_size)


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


# megatron-core 0.16.1's index caches: "<hash>-<GPTDataset|BlendedDataset>-<split>-<kind>.npy"
_CACHE_KINDS = ("document_index", "sample_index", "shuffle_index", "dataset_index", "dataset_sample_index")


def _npy_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete plain ``.npy`` array (None: it is), read without unpickling anything:
    the magic, the header (numpy parses it as a literal), a dtype without Python objects, and the size the
    header implies."""
    from numpy.lib import format as npy

    try:
        with open(path, "rb") as f:
            try:
                version = npy.read_magic(f)
            except ValueError:
                from nvfp4_train.mcore_compat.safe_load import first_pickle_global

                name = first_pickle_global(path)
                return ("not a .npy array but a pickle naming " + name if name else "not a .npy array (bad magic)")
            if version not in ((1, 0), (2, 0)):
                return f"unsupported .npy version {version}"
            read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            try:
                shape, _fortran, dtype = read_header(f)
            except ValueError as e:
                return f"bad .npy header ({e})"
            offset = f.tell()
    except OSError as e:
        return f"unreadable ({e})"
    if dtype.hasobject:
        return f"a .npy array of Python objects (dtype {dtype}), which only a pickle load reads"
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        return (f"{size} bytes, but its header describes {expected} ({dtype} {tuple(shape)}): truncated (a write "
                f"that was killed) or overwritten")
    return None


def check_index_caches(directories) -> list[Path]:
    """Check every megatron-core index cache file (``<hash>-<class>-<split>-<kind>.npy``) in ``directories``
    and remove each bad one together with the other files of its index set, so that megatron-core rebuilds
    them, with a warning naming the file and why. Returns the removed files.

    megatron-core 0.16.1 writes these caches in place (``numpy.save``; a kill mid-write leaves a truncated
    file that it then memory-maps: "mmap length is greater than file size", for every later run) and reads
    them with ``numpy.load(allow_pickle=True, mmap_mode='r')`` (``gpt_dataset.py``, ``blended_dataset.py``),
    which unpickles any file that is not a ``.npy`` array. So a cache file is used only when it is a complete
    ``.npy`` array of plain numbers; nothing in it is ever unpickled. Call it on the rank that builds the
    caches, before megatron-core opens them."""
    removed: list[Path] = []
    for d in directories:
        d = Path(d)
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.npy")):
            if not f.exists():  # removed with an earlier sibling
                continue
            base, _, kind = f.name[: -len(".npy")].rpartition("-")
            if kind not in _CACHE_KINDS or not base:
                continue
            problem = _npy_problem(f)
            if problem is None:
                continue
            siblings = sorted(p for p in d.glob(f"{base}-*") if p.is_file())
            for p in siblings:
                p.unlink(missing_ok=True)
            removed.extend(siblings)
            warnings.warn(f"{f}: {problem}; removed with the other {len(siblings) - 1} files of its index set "
                          f"({base}-*): megatron-core rebuilds them", stacklevel=2)
    return removed


def _cache_dirs(config: DataConfig, prefixes: list[str]) -> list[Path]:
    """Where megatron-core 0.16.1 keeps the index caches of these prefixes: ``data.cache_dir``, else
    ``<prefix>/cache/GPTDataset_indices`` per prefix (blend indices are then not cached)."""
    if config.cache_dir:
        return [Path(config.cache_dir)]
    return [Path(p) / "cache" / "GPTDataset_indices" for p in prefixes]


def _builds_caches(is_built_on_rank: Callable[[], bool] | None) -> bool:
    """Whether this process writes megatron-core's caches: global rank 0, or any process without a process
    group (megatron-core builds there first; the other ranks read what it wrote)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0 and (is_built_on_rank is None or is_built_on_rank())
    return True


def _check_split_ranges(config: DataConfig, infos: dict[str, IndexInfo]) -> None:
    """megatron-core cuts each training prefix into contiguous document ranges by ``data.split``. A range
    with a non-zero share but no tokens (too few documents for a small share: 30 documents at "99,1,0"
    give the validation split [30, 30)) makes megatron-core 0.16.1's GPTDataset loop forever
    (``_get_num_epochs`` adds epochs of 0 tokens until it has enough), even when no sample of that split
    is asked for. Say so instead, with the same ranges megatron-core computes."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(config.split))
    for p in config.train_prefixes:
        n = infos[p].sequences
        lengths = np.fromfile(p + ".idx", dtype="<i4", count=n, offset=_IDX_HEADER_BYTES)
        for name, bookends in zip(("training", "validation", "test"), matrix, strict=True):
            if bookends is None:
                continue
            beg, end = int(round(bookends[0] * n)), int(round(bookends[1] * n))
            if int(lengths[beg:end].sum()) == 0:
                raise DataError(
                    f"data.split {config.split!r} gives the {name} split of {p} its documents [{beg}, {end}) of "
                    f"{n}, which hold no tokens (megatron-core would loop forever building it): use more "
                    f"documents, a larger {name} share, a share of 0 for it, or data.valid_prefixes")


def _blend(prefixes: list[str], weights: list[float] | None, infos: dict[str, IndexInfo]):
    if len(prefixes) == 1:
        return ([prefixes[0]], None)
    # Explicit weights even when the user gave none: with weights=None megatron-core samples each prefix at
    # most one epoch and silently returns fewer samples than asked for.
    if weights is None:
        weights = [float(infos[p].tokens) for p in prefixes]
    return (list(prefixes), [float(w) for w in weights])


def build_datasets(config: DataConfig, *, train_samples: int, valid_samples: int,
                   tokenizer: BPETokenizer | None = None, vocab_size: int | None = None,
                   is_built_on_rank: Callable[[], bool] | None = None):
    """-> (train, valid): megatron-core GPTDataset / BlendedDataset with at least the asked-for samples
    (valid is None when ``valid_samples`` is 0). Each sample is a dict of ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` (and ``attention_mask`` when configured), int64/float tensors of
    length ``seq_length``.

    ``vocab_size``: the model's vocabulary (embedding rows, ``ModelConfig.vocab_size``); the tokenizer's ids
    must fit in it. None: the tokenizer's own size. Every prefix is validated first
    (``validate_indexed_dataset``, with a full scan of its token ids against the tokenizer's vocabulary),
    so a bad file or a vocabulary mismatch is an error here (:class:`DataError`), before any training step.
    megatron-core's index caches are checked first (:func:`check_index_caches`): a truncated or non-``.npy`` one
    is rebuilt.
    """
    if train_samples < 1:
        raise ValueError(f"train_samples must be >= 1, got {train_samples}")
    if valid_samples < 0:
        raise ValueError(f"valid_samples must be >= 0, got {valid_samples}")
    tok = tokenizer or load_tokenizer_for(config)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}: "
            f"ids {vocab_size}..{tok.vocab_size - 1} would index past the embedding; set the model's "
            f"vocab_size to at least {tok.vocab_size} (e.g. {-(-tok.vocab_size // 128) * 128}) or use a "
            f"tokenizer with at most {vocab_size} ids")
    prefixes = list(dict.fromkeys([*config.train_prefixes, *config.valid_prefixes]))
    infos = {p: check_indexed_dataset(p, tok) for p in prefixes}
    for p, info in infos.items():
        if info.tokens <= config.seq_length:
            raise DataError(f"{p} holds {info.tokens} tokens, not enough for one sample of seq_length "
                             f"{config.seq_length} + 1")

    if not config.valid_prefixes:
        _check_split_ranges(config, infos)

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
    if _builds_caches(is_built_on_rank):
        check_index_caches(_cache_dirs(config, prefixes))
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


def _ignore_stop_signals(_worker_id: int) -> None:
    """A DataLoader worker's init: SIGTERM, SIGUSR1 and SIGINT sent to the whole process group (Slurm,
    ``timeout``, Ctrl-C) are the training process's to handle (it saves and exits); a worker killed by one
    would fail the run before it could save. The worker still ends with its loader, or with its parent."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def build_data_loader(dataset, *, micro_batch_size: int, consumed_samples: int = 0, dp_rank: int = 0,
                      dp_size: int = 1, num_workers: int = 0, seed: int = 0):
    """A DataLoader over `dataset` (from `build_datasets`) yielding this rank's micro-batches as dicts of
    stacked tensors (``tokens``: ``[micro_batch_size, seq_length]`` ...).

    The loader draws its workers' base seed from a generator of its own (seeded with ``seed``), not from the
    process's CPU generator: each ``iter(loader)`` would otherwise advance that generator by one draw, so a
    resumed run (which opens its iterator after restoring the RNG states) would save other RNG states than an
    uninterrupted one. The samples use no randomness: the order is the sampler's."""
    import torch

    sampler = PretrainingBatchSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                      micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=False,
        persistent_workers=num_workers > 0, worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(seed))
