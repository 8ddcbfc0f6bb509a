"""Bad indexed-dataset files: every fault is a clear error naming the file, raised before megatron-core reads it.

``validate_indexed_dataset`` (called by ``build_datasets``) checks the ``.idx`` header, the whole index, the
``.bin`` size and every token id against the vocabulary. Here: missing files, truncations at random
lengths, random byte flips in the ``.idx`` (hypothesis), wrong magic / version / dtype code, a ``.bin``
from another run, a token id beyond the vocabulary (the tokenizer/model vocabulary mismatch), and a
tokenizer larger than the model's vocabulary.

The property for random corruption of the ``.idx``: validation either raises a ValueError that names the
``.idx`` or ``.bin`` path, or the files it accepts are read by megatron-core's ``IndexedDataset`` as exactly
the original token stream (every sequence in bounds, concatenated in order) -- never a crash, never
garbage. Byte flips in the ``.bin`` that stay below the vocabulary cannot be detected (there is no
checksum); those that leave it are, at the exact position.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvfp4_train.data.datasets import DataConfig, build_datasets, check_indexed_dataset, validate_indexed_dataset

VOCAB = 1000  # the vocabulary of the synthetic datasets below: ids 0..999, EOD = 0
HEADER = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def write_dataset(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> Path:
    """``docs`` written by megatron-core's IndexedDatasetBuilder (what prepare_data.py uses): one sequence per
    document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        arr = np.asarray(d, dtype=dtype)
        builder.add_document(arr, [arr.size])
    builder.finalize(f"{prefix}.idx")
    return prefix


def random_docs(rng: np.random.Generator, n: int = 12, vocab: int = VOCAB) -> list[np.ndarray]:
    """``n`` documents of 1..60 ids in [1, vocab), each ended by EOD 0."""
    return [np.append(rng.integers(1, vocab, rng.integers(1, 61)), 0) for _ in range(n)]


@pytest.fixture
def dataset(tmp_path):
    """(prefix, documents, .bin bytes, .idx bytes) of a fresh 12-document uint16 dataset."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[dataset seed {seed}]")
    docs = random_docs(np.random.default_rng(seed))
    prefix = write_dataset(tmp_path / "ds", docs)
    return prefix, docs, Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def read_with_megatron(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix), mmap=True)
    # copies: the arrays are views of a memory map that megatron-core closes when `ds` is collected
    out = [np.array(ds[i], copy=True) for i in range(len(ds))]
    del ds
    return out


def restore(prefix: Path, bin_bytes: bytes, idx_bytes: bytes) -> None:
    Path(f"{prefix}.bin").write_bytes(bin_bytes)
    Path(f"{prefix}.idx").write_bytes(idx_bytes)


def with_header(idx_bytes: bytes, **fields) -> bytes:
    """The .idx bytes with header fields replaced (magic, version, code, n_seq, n_doc)."""
    magic = fields.get("magic", idx_bytes[:9])
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", idx_bytes[9:HEADER])
    header = magic + struct.pack("<QBQQ", fields.get("version", version), fields.get("code", code),
                                 fields.get("n_seq", n_seq), fields.get("n_doc", n_doc))
    return header + idx_bytes[HEADER:]


def test_valid_dataset_is_accepted_and_counted(dataset):
    prefix, docs, _, _ = dataset
    info = validate_indexed_dataset(prefix, VOCAB)
    stream = np.concatenate(docs)
    assert (info.sequences, info.documents, info.tokens) == (len(docs), len(docs), stream.size)
    assert info.dtype is np.uint16 and info.max_token == int(stream.max())
    assert validate_indexed_dataset(prefix).max_token is None  # no scan without a vocabulary
    assert all(np.array_equal(a, b) for a, b in zip(read_with_megatron(prefix), docs, strict=True))
    # the exact vocabulary bound: ids < vocab_size pass, one id == vocab_size fails
    assert validate_indexed_dataset(prefix, int(stream.max()) + 1).max_token == int(stream.max())
    with pytest.raises(ValueError, match=rf"holds token id {stream.max()} .* has {stream.max()} ids"):
        validate_indexed_dataset(prefix, int(stream.max()))


def test_missing_files_are_named(dataset):
    prefix, _, bin_bytes, idx_bytes = dataset
    for missing in (".bin", ".idx"):
        Path(f"{prefix}{missing}").unlink()
        with pytest.raises(FileNotFoundError, match=rf"{prefix}\{missing} not found .*prepare_data\.py"):
            validate_indexed_dataset(prefix, VOCAB)
        restore(prefix, bin_bytes, idx_bytes)
    with pytest.raises(FileNotFoundError, match=rf"{prefix}_nope\.idx not found"):
        validate_indexed_dataset(f"{prefix}_nope", VOCAB)


@FUZZ
@given(data=st.data())
def test_truncated_or_extended_bin(dataset, data):
    prefix, docs, bin_bytes, idx_bytes = dataset
    cut = data.draw(st.integers(0, len(bin_bytes) - 1), label="bin length")
    restore(prefix, bin_bytes[:cut], idx_bytes)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin is truncated: {cut} bytes, but {prefix}\.idx describes "
                                         rf"{len(bin_bytes) // 2} tokens of uint16 = {len(bin_bytes)} bytes"):
        validate_indexed_dataset(prefix, VOCAB)
    extra = data.draw(st.integers(1, 64), label="extra bytes")
    restore(prefix, bin_bytes + b"\x01" * extra, idx_bytes)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin is {len(bin_bytes) + extra} bytes, .* different runs"):
        validate_indexed_dataset(prefix, VOCAB)


@FUZZ
@given(data=st.data())
def test_truncated_idx(dataset, data):
    prefix, _, bin_bytes, idx_bytes = dataset
    cut = data.draw(st.integers(0, len(idx_bytes) - 1), label="idx length")
    restore(prefix, bin_bytes, idx_bytes[:cut])
    with pytest.raises(ValueError, match=rf"{prefix}\.idx is truncated: {cut} bytes.* re-run python -m nvfp4_train\.data\.prepare"):
        validate_indexed_dataset(prefix, VOCAB)


@FUZZ
@given(data=st.data())
def test_random_idx_corruption_is_caught_or_harmless(dataset, data):
    prefix, docs, bin_bytes, idx_bytes = dataset
    corrupt = bytearray(idx_bytes)
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(idx_bytes) - 1), st.integers(1, 255)),
                               min_size=1, max_size=4), label="(byte, xor mask)")
    for pos, mask in flips:
        corrupt[pos] ^= mask
    restore(prefix, bin_bytes, bytes(corrupt))
    try:
        info = validate_indexed_dataset(prefix, VOCAB)
    except ValueError as e:
        assert f"{prefix}.idx" in str(e) or f"{prefix}.bin" in str(e), str(e)
        return
    # accepted: megatron-core must read exactly the original tokens, every sequence within the .bin
    got = read_with_megatron(prefix)
    assert len(got) == info.sequences
    assert np.array_equal(np.concatenate(got) if got else np.zeros(0), np.concatenate(docs))


def test_header_faults_have_their_own_messages(dataset):
    prefix, _, bin_bytes, idx_bytes = dataset
    idx = f"{prefix}.idx"
    cases = [
        (with_header(idx_bytes, magic=b"NOTANIDX\x00"), rf"{idx} is not a megatron-core index \(bad magic"),
        (with_header(idx_bytes, version=2), rf"{idx}: unsupported index version 2"),
        (with_header(idx_bytes, code=6), rf"{idx}: dtype code 6 is float64, not an integer token type"),
        (with_header(idx_bytes, code=7), rf"{idx}: dtype code 7 is float32, not an integer token type"),
        (with_header(idx_bytes, code=0), rf"{idx}: dtype code 0 is an unknown type"),
        (with_header(idx_bytes, code=200), rf"{idx}: dtype code 200 is an unknown type"),
        (with_header(idx_bytes, n_seq=13), rf"{idx} is truncated: .* 13 sequences"),
        (with_header(idx_bytes, n_seq=11), rf"{idx} is {len(idx_bytes)} bytes but its header describes"),
        (with_header(idx_bytes, n_doc=0), rf"{idx} is {len(idx_bytes)} bytes but its header describes"),
        (idx_bytes + b"\0" * 5, rf"{idx} is {len(idx_bytes) + 5} bytes but its header describes"),
    ]
    for bad, msg in cases:
        restore(prefix, bin_bytes, bad)
        with pytest.raises(ValueError, match=msg):
            validate_indexed_dataset(prefix, VOCAB)


def idx_arrays(idx_bytes: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_seq, n_doc = struct.unpack("<QQ", idx_bytes[18:HEADER])
    lengths = np.frombuffer(idx_bytes, "<i4", n_seq, HEADER).copy()
    pointers = np.frombuffer(idx_bytes, "<i8", n_seq, HEADER + 4 * n_seq).copy()
    doc_index = np.frombuffer(idx_bytes, "<i8", n_doc, HEADER + 12 * n_seq).copy()
    return lengths, pointers, doc_index


def with_arrays(idx_bytes: bytes, lengths, pointers, doc_index) -> bytes:
    return idx_bytes[:HEADER] + lengths.astype("<i4").tobytes() + pointers.astype("<i8").tobytes() + \
        doc_index.astype("<i8").tobytes()


def test_index_arrays_inconsistent_with_each_other_or_the_bin(dataset):
    prefix, _, bin_bytes, idx_bytes = dataset
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    lengths, pointers, doc_index = idx_arrays(idx_bytes)

    def case(msg, lengths=lengths, pointers=pointers, doc_index=doc_index):
        restore(prefix, bin_bytes, with_arrays(idx_bytes, lengths, pointers, doc_index))
        with pytest.raises(ValueError, match=msg):
            validate_indexed_dataset(prefix, VOCAB)

    bad = lengths.copy(); bad[4] = -3  # noqa: E702
    case(rf"{idx} is corrupt: sequence 4 has length -3", lengths=bad)
    bad = lengths.copy(); bad[4] += 1  # noqa: E702
    case(rf"{idx} is corrupt: sequence 5 starts at byte {pointers[5]} of {bin_}, but sequence 4 ends at byte "
         rf"{pointers[5] + 2}", lengths=bad)
    bad = lengths.copy(); bad[-1] += 1  # noqa: E702  (the last sequence runs past the end of the .bin)
    case(rf"{bin_} is truncated", lengths=bad)
    bad = pointers.copy(); bad[0] = 2  # noqa: E702
    case(rf"{idx} is corrupt: the first sequence starts at byte 2 of {bin_}", pointers=bad)
    bad = pointers.copy(); bad[7] -= 2  # noqa: E702  (sequences 6 and 7 overlap)
    case(rf"{idx} is corrupt: sequence 7 starts at byte", pointers=bad)
    bad = doc_index.copy(); bad[-1] = 11  # noqa: E702
    case(rf"{idx} is corrupt: its document index runs from 0 to 11, not from 0 to its 12 sequences",
         doc_index=bad)
    bad = doc_index.copy(); bad[0] = 1  # noqa: E702
    case(rf"{idx} is corrupt: its document index runs from 1 to 12", doc_index=bad)
    bad = doc_index.copy(); bad[5] = 9  # noqa: E702  (document 5 starts after document 6)
    case(rf"{idx} is corrupt: document 6 starts at sequence 6, before document 5 \(sequence 9\)", doc_index=bad)


def test_dtype_mismatch_between_idx_and_bin(tmp_path, dataset):
    prefix, docs, bin_bytes, idx_bytes = dataset
    # header says uint8 / int32 / int64 over a uint16 .bin: the pointers advance by 2 bytes per token
    for code, name in ((1, "uint8"), (4, "int32"), (5, "int64")):
        restore(prefix, bin_bytes, with_header(idx_bytes, code=code))
        with pytest.raises(ValueError, match=rf"{prefix}\.idx: dtype mismatch: its header says {name} .* advance by 2 "
                                             rf"bytes per token \(int16/uint16\)"):
            validate_indexed_dataset(prefix, VOCAB)
    # one sequence: no pointer step to compare, the .bin size says it
    one = write_dataset(tmp_path / "one", docs[:1], dtype=np.uint16)
    n = docs[0].size
    idx_one = Path(f"{one}.idx").read_bytes()
    Path(f"{one}.idx").write_bytes(with_header(idx_one, code=4))
    with pytest.raises(ValueError, match=rf"{one}\.bin is truncated: {2 * n} bytes, .* {n} tokens of int32 = "
                                         rf"{4 * n} bytes \({2 * n} bytes = {n} tokens of 2 bytes: the files "
                                         rf"disagree on the token dtype"):
        validate_indexed_dataset(one, VOCAB)


def test_idx_and_bin_from_different_runs(tmp_path, dataset):
    prefix, _, bin_bytes, _ = dataset
    other = write_dataset(tmp_path / "other", random_docs(np.random.default_rng(1), n=12))
    Path(f"{prefix}.idx").write_bytes(Path(f"{other}.idx").read_bytes())
    if len(bin_bytes) == Path(f"{other}.bin").stat().st_size:  # same total length: the pointers must differ
        with pytest.raises(ValueError, match=rf"{prefix}\.idx"):
            validate_indexed_dataset(prefix, VOCAB)
    else:
        with pytest.raises(ValueError, match=rf"{prefix}\.bin (is truncated|is {len(bin_bytes)} bytes)"):
            validate_indexed_dataset(prefix, VOCAB)


@FUZZ
@given(data=st.data())
def test_bin_byte_flips_beyond_the_vocabulary_are_found(dataset, data):
    prefix, docs, bin_bytes, idx_bytes = dataset
    pos = data.draw(st.integers(0, len(bin_bytes) - 1), label="byte")
    mask = data.draw(st.integers(1, 255), label="xor mask")
    corrupt = bytearray(bin_bytes)
    corrupt[pos] ^= mask
    restore(prefix, bytes(corrupt), idx_bytes)
    ids = np.frombuffer(bytes(corrupt), np.uint16)
    token = pos // 2
    if ids[token] < VOCAB:  # an in-vocabulary flip is undetectable without a checksum
        assert validate_indexed_dataset(prefix, VOCAB).tokens == ids.size
        return
    starts = np.cumsum([0] + [d.size for d in docs])
    seq = int(np.searchsorted(starts, token, side="right")) - 1
    with pytest.raises(ValueError, match=rf"{prefix}\.bin holds token id {ids[token]} \(token {token}, in sequence "
                                         rf"{seq}\) but the vocabulary has {VOCAB} ids"):
        validate_indexed_dataset(prefix, VOCAB)


def test_negative_token_ids(tmp_path):
    docs = [np.array([5, 6, 0]), np.array([7, -2, 0])]
    prefix = write_dataset(tmp_path / "neg", docs, dtype=np.int32)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin holds token id -2 \(token 4, in sequence 1\)"):
        validate_indexed_dataset(prefix, VOCAB)


def test_scan_covers_every_chunk(tmp_path, monkeypatch):
    """The scan reads the .bin in chunks: an out-of-vocabulary id in the last, partial chunk is found."""
    import nvfp4_train.data.datasets as datasets

    monkeypatch.setattr(datasets, "_SCAN_CHUNK", 7)
    docs = [np.arange(1, 30) % 50, np.array([3, 4, 999, 0])]
    prefix = write_dataset(tmp_path / "chunks", docs)
    assert validate_indexed_dataset(prefix, 1000).max_token == 999
    with pytest.raises(ValueError, match=r"holds token id 999 \(token 31, in sequence 1\)"):
        validate_indexed_dataset(prefix, 999)


# ----------------------------------------------------------------------------------------------------
# Through build_datasets, with the project's tokenizer (32,768 ids)


def split_config(prefix: Path, tmp_path: Path, split: str = "100,0,0") -> DataConfig:
    return DataConfig(train_prefixes=[str(prefix)], valid_prefixes=[], split=split, seq_length=16,
                      cache_dir=str(tmp_path / "cache"))


def test_empty_split_range_is_an_error_not_a_hang(tmp_path, tok):
    """Regression: 30 documents at split "99,1,0" give the validation split the documents [30, 30);
    megatron-core 0.16.1's GPTDataset then loops forever (epochs of 0 tokens), even with no validation
    sample asked for. build_datasets names the split instead."""
    prefix = write_dataset(tmp_path / "few", random_docs(np.random.default_rng(0), n=30))
    with pytest.raises(ValueError, match=rf"data.split '99,1,0' gives the validation split of {prefix} its "
                                         rf"documents \[30, 30\) of 30, which hold no tokens"):
        build_datasets(split_config(prefix, tmp_path, "99,1,0"), train_samples=4, valid_samples=0, tokenizer=tok)
    # 90,10,0: documents [27, 30) validate; zero-length sequences hold no tokens either
    train, valid = build_datasets(split_config(prefix, tmp_path, "90,10,0"), train_samples=4, valid_samples=2,
                                  tokenizer=tok)
    assert sorted(set(valid.document_index.tolist())) == [27, 28, 29] and len(train) >= 4
    docs = random_docs(np.random.default_rng(0), n=27) + [np.zeros(0, np.int64)] * 3
    prefix = write_dataset(tmp_path / "empty_tail", docs)
    with pytest.raises(ValueError, match=r"gives the validation split .* its documents \[27, 30\) of 30, which "
                                         r"hold no tokens"):
        build_datasets(split_config(prefix, tmp_path, "90,10,0"), train_samples=4, valid_samples=1, tokenizer=tok)


def test_build_datasets_rejects_a_bin_beyond_the_tokenizer(tmp_path, tok):
    """Data written with a larger vocabulary (no .meta.json to say so): the scan names it before megatron."""
    rng = np.random.default_rng(0)
    docs = random_docs(rng, n=30, vocab=tok.vocab_size)
    docs[17][3] = 40000
    prefix = write_dataset(tmp_path / "big", docs)
    cfg = split_config(prefix, tmp_path)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin holds token id 40000 \(token \d+, in sequence 17\) but "
                                         rf"the vocabulary has {tok.vocab_size} ids"):
        build_datasets(cfg, train_samples=4, valid_samples=0, tokenizer=tok)
    with pytest.raises(ValueError, match="holds token id 40000"):
        check_indexed_dataset(prefix, tok)
    docs[17][3] = tok.vocab_size - 1  # the largest valid id: accepted, and megatron-core builds the dataset
    prefix = write_dataset(tmp_path / "ok", docs)
    cfg = split_config(prefix, tmp_path)
    train, _ = build_datasets(cfg, train_samples=4, valid_samples=0, tokenizer=tok, vocab_size=tok.vocab_size)
    assert len(train) >= 4 and int(train[0]["tokens"].max()) < tok.vocab_size


def test_build_datasets_rejects_a_tokenizer_larger_than_the_model(tmp_path, tok):
    prefix = write_dataset(tmp_path / "small", random_docs(np.random.default_rng(0), n=30))
    cfg = split_config(prefix, tmp_path)
    with pytest.raises(ValueError, match=rf"the tokenizer .*tokenizer\.json has {tok.vocab_size} ids but the model's "
                                         rf"vocab_size is 32000: ids 32000\.\.{tok.vocab_size - 1} would index past "
                                         rf"the embedding; set the model's vocab_size to at least {tok.vocab_size}"):
        build_datasets(cfg, train_samples=4, valid_samples=0, tokenizer=tok, vocab_size=32000)
    train, _ = build_datasets(cfg, train_samples=4, valid_samples=0, tokenizer=tok, vocab_size=tok.vocab_size + 128)
    assert len(train) >= 4


def test_build_datasets_names_a_dtype_mismatch_with_the_meta_file(tmp_path, tok):
    import json

    prefix = write_dataset(tmp_path / "m", random_docs(np.random.default_rng(0), n=30))
    Path(f"{prefix}.meta.json").write_text(json.dumps({"dtype": "int32", "tokenizer": {"sha256": tok.sha256}}))
    cfg = split_config(prefix, tmp_path)
    with pytest.raises(ValueError, match=rf"{prefix}\.idx says the tokens are uint16, but {prefix}\.meta\.json "
                                         rf"records int32"):
        build_datasets(cfg, train_samples=4, valid_samples=0, tokenizer=tok)


def test_bad_meta_file_and_missing_tokenizer_are_named(tmp_path, tok):
    prefix = write_dataset(tmp_path / "m", random_docs(np.random.default_rng(0), n=30))
    meta = Path(f"{prefix}.meta.json")
    for text, msg in (("{", rf"{meta} is not valid JSON"), ("[1, 2]", rf"{meta} is not a JSON object")):
        meta.write_text(text)
        with pytest.raises(ValueError, match=msg + r".*re-run python -m nvfp4_train\.data\.prepare .*\) or delete it"):
            build_datasets(split_config(prefix, tmp_path), train_samples=4, valid_samples=0, tokenizer=tok)
    meta.unlink()
    cfg = DataConfig(train_prefixes=[str(prefix)], valid_prefixes=[], split="100,0,0", seq_length=16,
                     tokenizer=str(tmp_path / "no_such_tokenizer.json"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*no_such_tokenizer\.json not found"):
        build_datasets(cfg, train_samples=4, valid_samples=0)


def test_token_dtype_too_small_for_the_tokenizer(tmp_path, tok):
    prefix = write_dataset(tmp_path / "u8", random_docs(np.random.default_rng(0), n=30, vocab=200), dtype=np.uint8)
    with pytest.raises(ValueError, match=rf"{prefix}\.bin stores uint8 ids, too small for the tokenizer's "
                                         rf"{tok.vocab_size} ids: it was prepared with another tokenizer"):
        build_datasets(split_config(prefix, tmp_path), train_samples=4, valid_samples=0, tokenizer=tok)
