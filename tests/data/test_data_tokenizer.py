"""The committed tokenizer and the tiktoken fast path: same ids as `tokenizers`, pinned ids, user files."""

from __future__ import annotations

import hashlib
import inspect
import json
import warnings
from pathlib import Path

import pytest

from nvfp4_train.data.tokenizer import DEFAULT_TOKENIZER_PATH, EOD_TOKEN, NO_PAD, BPETokenizer, bytes_to_unicode

SAMPLE = Path(__file__).with_name("sample_text.txt")

# The committed file: changing it changes every token id (all data must be re-tokenized), so it is pinned.
TOKENIZER_SHA256 = "e907e75c821fa47757c7aed66a90ac2d5e0541a1fed535ab23f4277902f30307"

EDGE_CASES = [
    "",
    " ",
    "\n",
    "Hello, world!\n",
    "  leading spaces, trailing spaces   \n",
    "x" + " " * 50 + "y",  # long whitespace run before a word: GPT-2's \s+(?!\S) rule
    "tabs\t\tand\t \t mixed\n\n\n\nnewlines\r\nand CRLF\r\n",
    "They're here; we'll see, I'd say it's 'quoted' and THEY'RE LOUD'S",
    "numbers 1234567890 3.14159 1e-9 0x1F 2024-05-01",
    "naïve café, Ångström, Straße, façade",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇩🇪",
    "combining e\u0301 vs \u00e9, ligature \ufb01, NBSP\u00a0here, zero\u200bwidth, line\u2028separator",
    "مرحبا بالعالم — שלום עולם",
    "ASCII art: <|>  <|endoftext|> is ordinary text here, not the EOD id",
    "a\x00b\x01c\x7f control chars",
    "lone surrogate \ud800 here",
    "\u3000ideographic space\u3000\u3000",
]


@pytest.fixture(scope="module")
def fast() -> BPETokenizer:
    return BPETokenizer(backend="tiktoken")


@pytest.fixture(scope="module")
def ref() -> BPETokenizer:
    return BPETokenizer(backend="tokenizers")


def real_texts() -> list[str]:
    """Public-domain prose and verse plus Python source (code, indentation, long whitespace runs)."""
    import argparse
    import json as json_mod
    import textwrap

    texts = SAMPLE.read_text(encoding="utf-8").split("\n\n")
    texts += [inspect.getsource(m) for m in (argparse, json_mod.decoder, textwrap)]
    return texts


def test_committed_file_is_pinned():
    assert hashlib.sha256(DEFAULT_TOKENIZER_PATH.read_bytes()).hexdigest() == TOKENIZER_SHA256


def test_megatron_interface(fast):
    assert fast.vocab_size == 32768
    assert fast.eod == 0 and fast.eod_token == EOD_TOKEN
    assert fast.pad == NO_PAD == -1
    assert fast.unique_identifiers == {"class": "BPETokenizer", "sha256": TOKENIZER_SHA256, "eod": 0}
    assert fast.backend == "tiktoken"


def test_pinned_ids(fast, ref):
    # ids of the committed tokenizer (Ġ = space, Ċ = newline in ByteLevel's alphabet)
    cases = {
        "Hello, world!\n": [13883, 12, 2166, 1, 199],
        "To be, or not to be": [1019, 327, 12, 321, 409, 296, 327],
        "  def main():\n\treturn 0\n": [221, 646, 1623, 8598, 199, 198, 3315, 582, 199],
    }
    for text, ids in cases.items():
        assert fast.encode(text) == ids, text
        assert ref.encode(text) == ids, text
        assert fast.decode(ids) == text


def test_tiktoken_equals_tokenizers_on_real_text(fast, ref):
    texts = real_texts() + EDGE_CASES
    assert sum(len(t) for t in texts) > 100_000  # enough text to exercise most merges
    got = fast.encode_batch(texts, num_threads=2)
    want = ref.encode_batch(texts)
    for text, a, b in zip(texts, got, want, strict=True):
        assert a == b, f"tiktoken and tokenizers differ on {text[:80]!r}"
    assert got == [fast.encode(t) for t in texts]  # batch == one by one
    assert sum(map(len, got)) > 25_000


def test_roundtrip_and_eod_is_never_produced(fast, ref):
    for text in real_texts() + EDGE_CASES:
        ids = fast.encode(text)
        assert fast.eod not in ids  # a literal "<|endoftext|>" is ordinary text
        if "\ud800" not in text:  # a lone surrogate becomes U+FFFD
            assert fast.decode(ids) == text
            assert ref.decode(ids) == text
    assert fast.decode([fast.eod]) == EOD_TOKEN == ref.decode([ref.eod])
    assert fast.encode("lone \ud800") == fast.encode("lone \ufffd") == ref.encode("lone \ud800")


def test_bytes_to_unicode_is_bytelevel_alphabet():
    from tokenizers import pre_tokenizers

    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert sorted(table.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"


def test_pickle_roundtrip(fast):
    import pickle

    clone = pickle.loads(pickle.dumps(fast))
    assert clone.backend == "tiktoken" and clone.encode("Hello, world!\n") == [13883, 12, 2166, 1, 199]


# ---- a user's own tokenizer.json


def _train_small(tmp_path: Path, *, byte_level: bool = True, special: str = "</s>") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    specials = [special, "[UNK]"] if not byte_level else [special]
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(SAMPLE.read_text(encoding="utf-8").split("\n\n"), trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_user_bytelevel_tokenizer_uses_tiktoken(tmp_path):
    path = _train_small(tmp_path)
    fast = BPETokenizer(path)
    ref = BPETokenizer(path, backend="tokenizers")
    assert fast.backend == "tiktoken" and fast.eod_token == "</s>" and fast.eod == 0
    assert fast.vocab_size == 700
    texts = real_texts() + EDGE_CASES
    assert fast.encode_batch(texts) == ref.encode_batch(texts)
    assert fast.unique_identifiers["sha256"] != TOKENIZER_SHA256


def test_user_tokenizer_not_bytelevel_falls_back(tmp_path):
    path = _train_small(tmp_path, byte_level=False)
    with pytest.warns(UserWarning, match="pre-tokenizer is not ByteLevel"):
        tok = BPETokenizer(path)
    assert tok.backend == "tokenizers"
    assert tok.encode("the question") == tok.hf.encode("the question").ids
    with pytest.raises(ValueError, match="cannot be encoded exactly by tiktoken"):
        BPETokenizer(path, backend="tiktoken")


def test_user_tokenizer_merges_out_of_order_fall_back(tmp_path):
    spec = json.loads(_train_small(tmp_path).read_text())
    merges = spec["model"]["merges"]
    merges[3], merges[4] = merges[4], merges[3]  # priorities no longer follow ids: tiktoken would differ
    bad = tmp_path / "swapped.json"
    bad.write_text(json.dumps(spec))
    with pytest.warns(UserWarning, match="increasing id order"):
        assert BPETokenizer(bad).backend == "tokenizers"


def test_user_tokenizer_without_eod_is_an_error(tmp_path):
    path = _train_small(tmp_path, special="<pad>")
    with pytest.raises(ValueError, match=r"tokenizer\.json has no end-of-document token.*eod_token="):
        BPETokenizer(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert BPETokenizer(path, eod_token="<pad>").eod == 0


def test_missing_or_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        BPETokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a tokenizer.json"):
        BPETokenizer(bad)
