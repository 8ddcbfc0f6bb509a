"""Text -> megatron-core indexed datasets (``<prefix>_train.bin/.idx``, ``<prefix>_validation.bin/.idx``).

    nvfp4-prepare-data --input my_texts/ --output-prefix data/tokens/mine      (an installed wheel)
    python -m nvfp4_train.data.prepare --input ... --output-prefix ...         (the same; --help: the options)
    python scripts/prepare_data.py ...                                         (the same, from a checkout)

Inputs (offline, any mix): JSONL files (``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``; one JSON
object per line, the text in ``text_field``; a ``.json`` holding one JSON array of objects also works),
Parquet files (column ``text_field``), plain-text files (one document per file; ``.txt``, ``.md``, ``.rst``
or any file named explicitly), directories of those (recursively, sorted), and local HuggingFace
``datasets`` directories written by ``save_to_disk`` (read with ``load_from_disk``, no hub contact).

Each document is encoded as ordinary text and followed by the tokenizer's EOD id; it is one sequence and one
document of the indexed dataset. Ids are stored as uint16 when the vocabulary has at most 65,536 ids, else
int32. Validation is either given (``valid_inputs``) or a share of the documents chosen by a hash of their
text (``valid_fraction``), so the split does not depend on file order and is the same on every run.

Next to each ``.bin``/``.idx`` pair a ``<prefix>_<split>.meta.json`` records the tokenizer (sha256),
counts and the inputs' fingerprint: a re-run with unchanged inputs and tokenizer does nothing.
The files are written under temporary names and renamed at the end: an interrupted run leaves no
half-written dataset behind.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from nvfp4_train.data.tokenizer import BPETokenizer

PREPARE_FORMAT = 1
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
SPLITS = ("train", "validation")
_HASH_SALT = b"nvfp4-train/prepare-split/v1\0"


def token_dtype(vocab_size: int) -> type[np.integer]:
    """uint16 holds ids 0..65535, i.e. a vocabulary of up to 65,536 ids (as megatron-core's GPTDataset)."""
    return np.uint16 if vocab_size <= 65536 else np.int32


# ----------------------------------------------------------------------------------------------------
# Reading documents


def _suffix(path: Path) -> str:
    """The data suffix, looking through a trailing .gz."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in HF_MARKERS)


def expand_inputs(paths: Sequence[str | os.PathLike]) -> list[tuple[str, Path]]:
    """-> [(kind, path)], kind in {"jsonl", "parquet", "text", "hf"}; directories expanded, sorted."""
    out: list[tuple[str, Path]] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"input {p} not found")
        if _is_hf_dir(p):
            out.append(("hf", p))
        elif p.is_dir():
            found = []
            for f in sorted(p.rglob("*")):
                if not f.is_file() or any(part.startswith(".") for part in f.relative_to(p).parts):
                    continue
                kind = {**dict.fromkeys(JSONL_SUFFIXES, "jsonl"), **dict.fromkeys(PARQUET_SUFFIXES, "parquet"),
                        **dict.fromkeys(TEXT_SUFFIXES, "text")}.get(_suffix(f))
                if kind:
                    found.append((kind, f))
            if not found:
                raise ValueError(f"input directory {p} holds no {JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES} "
                                 f"files and is not a `datasets` save_to_disk directory")
            out += found
        else:
            s = _suffix(p)
            out.append(("jsonl" if s in JSONL_SUFFIXES else "parquet" if s in PARQUET_SUFFIXES else "text", p))
    return out


def _open_text(path: Path, encoding: str) -> io.TextIOBase:
    if path.suffix.lower() == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding=encoding, newline="")
    return open(path, encoding=encoding, newline="")


def _field(obj, path: Path, where: str, text_field: str) -> str | None:
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{where}: expected a JSON object, got {type(obj).__name__}")
    if text_field not in obj:
        raise ValueError(f"{path}:{where}: no field {text_field!r} (fields: {sorted(obj)}); "
                         f"choose the text field with --text-field")
    value = obj[text_field]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}:{where}: field {text_field!r} is a {type(value).__name__}, not a string")
    return value


def read_jsonl(path: Path, text_field: str, encoding: str = "utf-8") -> Iterator[str | None]:
    with _open_text(path, encoding) as f:
        try:
            first = f.read(1)
            while first and first.isspace():
                first = f.read(1)
            if first == "[":  # a .json file holding one array of objects
                try:
                    items = json.loads(first + f.read())
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
                for k, obj in enumerate(items):
                    yield _field(obj, path, f"item {k}", text_field)
                return
            f.seek(0)
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
                yield _field(obj, path, str(lineno), text_field)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid {encoding} ({e.reason} at byte {e.start} of a chunk); "
                             f"pass --encoding") from None


def read_parquet(path: Path, text_field: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError subclasses
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); choose it with --text-field")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        yield from batch.column(0).to_pylist()


def read_text_file(path: Path, encoding: str = "utf-8") -> Iterator[str]:
    try:
        with _open_text(path, encoding) as f:
            yield f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid {encoding} ({e.reason} at byte {e.start}); pass --encoding") from None


def read_hf(path: Path, text_field: str, hf_split: str, split_option: str = "--hf-split") -> Iterator[str | None]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if hf_split not in ds:
            raise ValueError(f"{path}: no split {hf_split!r} (splits: {list(ds)}); choose it with {split_option}")
        ds = ds[hf_split]
    if text_field not in ds.column_names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {ds.column_names}); "
                         f"choose it with --text-field")
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        yield from batch[text_field]


def iter_documents(paths: Sequence[str | os.PathLike], *, text_field: str = "text", hf_split: str = "train",
                   encoding: str = "utf-8", split_option: str = "--hf-split") -> Iterator[str | None]:
    """The documents of `paths` in order; None for a null text field. `split_option` names the option that
    chooses `hf_split` (in errors)."""
    for kind, p in expand_inputs(paths):
        if kind == "jsonl":
            yield from read_jsonl(p, text_field, encoding)
        elif kind == "parquet":
            yield from read_parquet(p, text_field)
        elif kind == "hf":
            yield from read_hf(p, text_field, hf_split, split_option)
        else:
            yield from read_text_file(p, encoding)


def fingerprint(paths: Sequence[str | os.PathLike]) -> list:
    """Path, size and mtime of every input file: a changed input triggers a rebuild."""
    out = []
    for kind, p in expand_inputs(paths):
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            out.append([kind, str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def is_validation_text(text: str, valid_fraction: float) -> bool:
    h = hashlib.blake2b(_HASH_SALT + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") < valid_fraction * 2**64


# ----------------------------------------------------------------------------------------------------
# Writing


def check_output_prefix(prefix: Path) -> None:
    if prefix.name in ("", ".") or prefix.suffix in (".bin", ".idx"):
        raise ValueError(f"output prefix {prefix} must be a path without .bin/.idx, e.g. data/tokens/mine")


class _SplitWriter:
    """One split: an IndexedDatasetBuilder on temporary files, renamed by `commit`."""

    def __init__(self, prefix: Path, dtype) -> None:
        self.prefix = prefix
        self.tmp_bin = prefix.with_name(prefix.name + ".tmp.bin")
        self.tmp_idx = prefix.with_name(prefix.name + ".tmp.idx")
        self.dtype = dtype
        self.docs = 0
        self.tokens = 0
        self.bytes = 0

    @cached_property
    def builder(self):
        # megatron-core (a ~6-9 s import) only once a document is written: a bad input is reported at once
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        return IndexedDatasetBuilder(str(self.tmp_bin), dtype=self.dtype)

    def add(self, ids: list[int], eod: int, nbytes: int) -> None:
        arr = np.empty(len(ids) + 1, dtype=self.dtype)
        arr[:-1] = ids
        arr[-1] = eod
        self.builder.add_document(arr, [arr.size])
        self.docs += 1
        self.tokens += arr.size
        self.bytes += nbytes

    def commit(self) -> None:
        self.builder.finalize(str(self.tmp_idx))
        os.replace(self.tmp_bin, f"{self.prefix}.bin")
        os.replace(self.tmp_idx, f"{self.prefix}.idx")

    def abort(self) -> None:
        if "builder" in self.__dict__:
            self.builder.data_file.close()
        for f in (self.tmp_bin, self.tmp_idx):
            f.unlink(missing_ok=True)


@dataclass
class PrepareResult:
    prefixes: dict[str, str] = field(default_factory=dict)  # split -> prefix
    docs: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    empty_skipped: int = 0
    encode_seconds: float = 0.0
    seconds: float = 0.0
    skipped: bool = False  # True: outputs were current, nothing done


def _meta_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".meta.json")


def _current(prefixes: dict[str, Path], fp: dict) -> bool:
    for p in prefixes.values():
        try:
            meta = json.loads(_meta_path(p).read_text())
        except (OSError, ValueError):
            return False
        if meta.get("fingerprint") != fp or not Path(f"{p}.bin").is_file() or not Path(f"{p}.idx").is_file():
            return False
        if Path(f"{p}.bin").stat().st_size != meta.get("bin_bytes"):
            return False
    return True


def prepare(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike, *,
            valid_inputs: Sequence[str | os.PathLike] | None = None, valid_fraction: float = 0.01,
            tokenizer: BPETokenizer | str | os.PathLike | None = None, text_field: str = "text",
            hf_split: str = "train", valid_hf_split: str = "validation", encoding: str = "utf-8", workers: int = 1,
            force: bool = False, log=print) -> PrepareResult:
    """Tokenize `inputs` into ``<output_prefix>_train`` and ``<output_prefix>_validation`` datasets.

    Validation comes from `valid_inputs` when given, else from a `valid_fraction` of the documents chosen by
    text hash (0 writes no validation split). A ``datasets`` DatasetDict gives its `hf_split` split among
    `inputs`, its `valid_hf_split` split among `valid_inputs` (so one DatasetDict given as both gives its
    training and its validation split, never the training split twice).
    """
    t0 = time.time()
    if not inputs:
        raise ValueError("no inputs given")
    if valid_inputs is None and not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    tok = tokenizer if isinstance(tokenizer, BPETokenizer) else BPETokenizer(tokenizer)
    out = Path(output_prefix)
    check_output_prefix(out)
    splits = ("train", "validation") if (valid_inputs or valid_fraction > 0) else ("train",)
    prefixes = {s: out.with_name(f"{out.name}_{s}") for s in splits}
    dtype = token_dtype(tok.vocab_size)
    fp = {
        "format": PREPARE_FORMAT,
        "tokenizer_sha256": tok.sha256,
        "eod": tok.eod,
        "dtype": np.dtype(dtype).name,
        "inputs": fingerprint(inputs),
        "valid_inputs": fingerprint(valid_inputs) if valid_inputs else None,
        "valid_fraction": None if valid_inputs else valid_fraction,
        "text_field": text_field,
        "hf_split": hf_split,
        "encoding": encoding,
    }
    if valid_inputs:
        fp["valid_hf_split"] = valid_hf_split
    result = PrepareResult(prefixes={s: str(p) for s, p in prefixes.items()})
    if not force and _current(prefixes, fp):
        for s, p in prefixes.items():
            meta = json.loads(_meta_path(p).read_text())
            result.docs[s], result.tokens[s], result.bytes[s] = meta["docs"], meta["tokens"], meta["text_bytes"]
        result.skipped = True
        result.seconds = time.time() - t0
        log(f"[prepare_data] {out}_{{{','.join(splits)}}} up to date (inputs and tokenizer unchanged)")
        return result

    out.parent.mkdir(parents=True, exist_ok=True)
    writers = {s: _SplitWriter(p, dtype) for s, p in prefixes.items()}
    # (documents, fixed split or None = by hash)
    streams = [(iter_documents(inputs, text_field=text_field, hf_split=hf_split, encoding=encoding),
                "train" if valid_inputs else None)]
    if valid_inputs:
        streams.append((iter_documents(valid_inputs, text_field=text_field, hf_split=valid_hf_split,
                                       encoding=encoding, split_option="--valid-hf-split"), "validation"))
    batch_chars = 4_000_000
    last_log = time.time()

    def flush(batch: list[str], fixed_split: str | None) -> None:
        nonlocal last_log
        t = time.time()
        ids = tok.encode_batch(batch, num_threads=workers)
        result.encode_seconds += time.time() - t
        for text, doc_ids in zip(batch, ids, strict=True):
            split = fixed_split or ("validation" if "validation" in writers and
                                    is_validation_text(text, valid_fraction) else "train")
            writers[split].add(doc_ids, tok.eod, len(text.encode("utf-8", "surrogatepass")))
        if time.time() - last_log > 10:
            mb = sum(w.bytes for w in writers.values()) / 1e6
            log(f"[prepare_data] {mb:.0f} MB, {sum(w.tokens for w in writers.values()) / 1e6:.1f}M tokens, "
                f"{mb / (time.time() - t0):.1f} MB/s")
            last_log = time.time()

    try:
        for docs, fixed_split in streams:
            batch: list[str] = []
            size = 0
            for text in docs:
                if not text:  # None or "": nothing to learn, and an empty doc would be a lone EOD
                    result.empty_skipped += 1
                    continue
                batch.append(text)
                size += len(text)
                if size >= batch_chars:
                    flush(batch, fixed_split)
                    batch, size = [], 0
            if batch:
                flush(batch, fixed_split)
        if writers["train"].docs == 0:
            raise ValueError(f"no documents in {[str(p) for p in inputs]} (all empty?)")
        if "validation" in writers and writers["validation"].docs == 0:
            log(f"[prepare_data] warning: no document fell in the validation split; give --valid-input or a "
                f"larger --valid-fraction (now {valid_fraction})")
        for w in writers.values():
            w.commit()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise

    result.seconds = time.time() - t0
    for s, w in writers.items():
        result.docs[s], result.tokens[s], result.bytes[s] = w.docs, w.tokens, w.bytes
        meta = {
            "prefix": str(w.prefix), "split": s, "docs": w.docs, "tokens": w.tokens, "text_bytes": w.bytes,
            "bin_bytes": Path(f"{w.prefix}.bin").stat().st_size, "dtype": np.dtype(dtype).name,
            "tokenizer": {"path": str(tok.path), "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                          "eod": tok.eod},
            "fingerprint": fp,
        }
        _meta_path(w.prefix).write_text(json.dumps(meta, indent=2) + "\n")
    for s in splits:
        log(f"[prepare_data] {prefixes[s]}.bin/.idx: {result.docs[s]} docs, {result.tokens[s]:,} tokens "
            f"({np.dtype(dtype).name}), {result.bytes[s] / 1e6:.1f} MB of text")
    total_mb = sum(result.bytes.values()) / 1e6
    log(f"[prepare_data] done in {result.seconds:.1f}s (encoding {result.encode_seconds:.1f}s, "
        f"{total_mb / max(result.encode_seconds, 1e-9):.1f} MB/s with {tok.backend}); "
        f"{result.empty_skipped} empty documents skipped")
    return result


PROG = "nvfp4-prepare-data"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The command line (``nvfp4-prepare-data``, ``python -m nvfp4_train.data.prepare``,
    ``scripts/prepare_data.py``). Exit status 0 (written, or up to date), 2 a bad input or option (one line)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize text into megatron-core indexed datasets (<prefix>_train / <prefix>_validation). "
                    "The same command: nvfp4-prepare-data, python -m nvfp4_train.data.prepare, "
                    "python scripts/prepare_data.py (docs/data.md).",
        epilog="Examples:\n"
               f"  {prog} --input data/corpus/text/train.jsonl "
               "--valid-input data/corpus/text/validation.jsonl --output-prefix data/tokens/text\n"
               f"  {prog} --input my_texts/ more.parquet --valid-fraction 0.005 "
               "--output-prefix data/tokens/mine --tokenizer my/tokenizer.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True,
                    help="JSONL/JSON/Parquet/text files, directories of them, or `datasets` save_to_disk dirs")
    ap.add_argument("--output-prefix", required=True,
                    help="writes <prefix>_train.{bin,idx} and <prefix>_validation.{bin,idx}")
    ap.add_argument("--valid-input", nargs="+", default=None,
                    help="validation documents (default: --valid-fraction of --input by text hash)")
    ap.add_argument("--valid-fraction", type=float, default=0.01,
                    help="share of --input documents sent to validation when --valid-input is not given "
                         "(default 0.01; 0 = no validation split)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the project's committed one)")
    ap.add_argument("--eod-token", default=None, help="end-of-document token of a custom tokenizer")
    ap.add_argument("--text-field", default="text", help="JSON field / Parquet or datasets column (default: text)")
    ap.add_argument("--hf-split", default="train", help="split of a DatasetDict directory given as --input "
                                                         "(default: train)")
    ap.add_argument("--valid-hf-split", default="validation",
                    help="split of a DatasetDict directory given as --valid-input (default: validation)")
    ap.add_argument("--encoding", default="utf-8", help="encoding of JSONL and text files (default: utf-8)")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                    help="encoding threads (default: min(4, cores)); the output does not depend on it")
    ap.add_argument("--force", action="store_true", help="rebuild even if the outputs are up to date")
    args = ap.parse_args(argv)
    try:
        tok = BPETokenizer(args.tokenizer, eod_token=args.eod_token)
        prepare(args.input, args.output_prefix, valid_inputs=args.valid_input, valid_fraction=args.valid_fraction,
                tokenizer=tok, text_field=args.text_field, hf_split=args.hf_split,
                valid_hf_split=args.valid_hf_split, encoding=args.encoding,
                workers=args.workers, force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m nvfp4_train.data.prepare"))
