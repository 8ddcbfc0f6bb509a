"""Byte-level BPE tokenizer: a ``tokenizer.json`` (HuggingFace ``tokenizers`` format) with a fast encoder.

The project's tokenizer is the committed file ``nvfp4_train/data/tokenizer.json`` (32,768 ids, trained by
``scripts/train_tokenizer.py``; ``<|endoftext|>`` = 0 ends every document). Users may pass their own
``tokenizer.json``.

Two encoders give the same ids:

- **tiktoken** (fast, ~4 MB/s per thread here vs ~0.5 MB/s): a GPT-2-style byte-level BPE is fully
  described by its vocabulary when every merge ``a + b`` creates a token whose id grows with the merge's
  priority. tiktoken then merges, inside each regex piece, the adjacent pair whose concatenation has the
  lowest id, which is the merge ``tokenizers`` applies. The vocabulary's strings are bytes written in
  ByteLevel's printable alphabet (``Ġ`` = space ...), so mapping them back gives ``tiktoken``'s
  ``{bytes: rank}`` with rank = vocab id, and the split regex is GPT-2's, the one ByteLevel uses.
- **tokenizers** (the reference): used when the file does not fit that description (a normalizer, a
  different pre-tokenizer, non-special added tokens, merges out of id order...), with a warning saying why.

Text is always encoded as *ordinary* text: a literal ``<|endoftext|>`` inside a document is split like any
other string, never turned into the EOD id (``tokenizers`` is told ``encode_special_tokens = True``). The
EOD id is appended by the data preparation, per document.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

# tiktoken copies *files* it loads into a temp cache unless this is empty; we build the encoding from
# memory, so this only guards a user's own tiktoken calls in the same process.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", "")

DEFAULT_TOKENIZER_PATH = Path(__file__).with_name("tokenizer.json")
EOD_TOKEN = "<|endoftext|>"
# Tried in this order when a user's file has no <|endoftext|> and no eod_token is given.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
# The split regex of tokenizers' ByteLevel pre-tokenizer (use_regex=True), i.e. GPT-2's.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# No pad token: packed pretraining never pads. megatron-core's GPTDataset pads only a short last
# validation sample (drop_last_partial_validation_sequence=False) and masks the loss where labels == pad;
# -1 is megatron's own "no pad" sentinel and matches no real id (it maps those positions to id 0).
NO_PAD = -1


def bytes_to_unicode() -> dict[int, str]:
    """ByteLevel's (GPT-2's) reversible map from the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tiktoken_ranks(spec: dict) -> tuple[dict[bytes, int] | None, str]:
    """-> ({token bytes: id}, "") when tiktoken reproduces `tokenizers` on this file, else (None, why)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model type is {model.get('type')!r}, not BPE"
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            return None, f"model.{key} is set"
    if model.get("byte_fallback"):
        return None, "model.byte_fallback is set"
    if spec.get("normalizer") is not None:
        return None, "the file has a normalizer"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        return None, "the pre-tokenizer is not ByteLevel(add_prefix_space=False, use_regex=True)"
    if any(not t.get("special") for t in spec.get("added_tokens", [])):
        return None, "the file has non-special added tokens"

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"] for t in spec.get("added_tokens", [])}
    ranks: dict[bytes, int] = {}
    for token, idx in model["vocab"].items():
        if token in added:  # tiktoken keeps them apart as special tokens: never produced by merging
            continue
        try:
            ranks[bytes(byte_of[c] for c in token)] = idx
        except KeyError:
            return None, f"vocabulary entry {token!r} is not in ByteLevel's alphabet"
    if len(set(ranks.values())) != len(ranks):
        return None, "two vocabulary entries share an id"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "not all 256 single bytes are in the vocabulary"
    last = -1
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = model["vocab"].get(a + b)
        if merged is None or merged <= last or merged <= model["vocab"][a] or merged <= model["vocab"][b]:
            return None, f"merge {a!r} + {b!r} does not create tokens in increasing id order"
        last = merged
    return ranks, ""


class BPETokenizer:
    """A byte-level BPE ``tokenizer.json`` with what megatron-core's GPTDataset needs (``vocab_size``,
    ``eod``, ``pad``, ``unique_identifiers``) and a fast, exact tiktoken encoder.

    Args:
        path: a ``tokenizer.json``; None is the project's committed tokenizer.
        eod_token: the end-of-document token; None takes the first of ``EOD_CANDIDATES`` in the vocabulary.
        backend: "auto" (tiktoken when exact, else tokenizers), "tiktoken" (error if not exact) or
            "tokenizers".
    """

    def __init__(self, path: str | os.PathLike | None = None, *, eod_token: str | None = None,
                 backend: str = "auto") -> None:
        if backend not in ("auto", "tiktoken", "tokenizers"):
            raise ValueError(f"backend must be 'auto', 'tiktoken' or 'tokenizers', got {backend!r}")
        self.path = Path(path) if path is not None else DEFAULT_TOKENIZER_PATH
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} not found (pass the path of a tokenizer.json)")
        self._init_args = (path, eod_token, backend)
        raw = self.path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            spec = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{self.path} is not a tokenizer.json: {e}") from None
        if not isinstance(spec, dict) or "model" not in spec:
            raise ValueError(f"{self.path} is not a tokenizer.json (no 'model' entry)")

        vocab = dict(spec["model"].get("vocab") or {})
        for t in spec.get("added_tokens", []):
            vocab[t["content"]] = t["id"]
        self._vocab = vocab
        #: Number of ids (max id + 1): the embedding size before any padding for tensor parallelism.
        self.vocab_size = max(vocab.values()) + 1

        candidates = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        found = [t for t in candidates if t in vocab]
        if not found:
            raise ValueError(
                f"{self.path} has no end-of-document token: none of {list(candidates)} is in its vocabulary; "
                f"pass eod_token='<the token that ends a document>'")
        self.eod_token = found[0]
        #: Id appended after every document.
        self.eod = vocab[self.eod_token]
        #: No pad token (see NO_PAD).
        self.pad = NO_PAD
        self.special_tokens_dict = {"eod_token": self.eod_token}

        self._tiktoken = None
        self.backend = "tokenizers"
        if backend in ("auto", "tiktoken"):
            ranks, why = _tiktoken_ranks(spec)
            if ranks is None:
                if backend == "tiktoken":
                    raise ValueError(f"{self.path} cannot be encoded exactly by tiktoken: {why}; "
                                     f"use backend='tokenizers'")
                warnings.warn(f"{self.path}: {why}; encoding with `tokenizers` (slower, same ids)",
                              stacklevel=2)
            else:
                import tiktoken

                specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
                self._tiktoken = tiktoken.Encoding(f"bpe-{self.sha256[:12]}", pat_str=GPT2_SPLIT_PATTERN,
                                                   mergeable_ranks=ranks, special_tokens=specials)
                self.backend = "tiktoken"

    # megatron-core hashes this into its dataset cache names: a different tokenizer file -> new caches.
    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "sha256": self.sha256, "eod": self.eod}

    @cached_property
    def hf(self):
        """The `tokenizers.Tokenizer` of the file, with special tokens encoded as ordinary text."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(self.path))
        tok.encode_special_tokens = True
        return tok

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as ordinary text (no EOD appended)."""
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return self.hf.encode(_clean_surrogates(text), add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """`encode` of each text; tiktoken encodes on `num_threads` threads (it releases the GIL),
        tokenizers uses its own thread pool (RAYON_NUM_THREADS)."""
        if self._tiktoken is not None:
            if num_threads <= 1:
                return [self._tiktoken.encode_ordinary(t) for t in texts]
            return self._tiktoken.encode_ordinary_batch(list(texts), num_threads=num_threads)
        texts = [_clean_surrogates(t) for t in texts]
        fast = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 (a cut multi-byte character) -> U+FFFD."""
        ids = [int(i) for i in ids]
        if self._tiktoken is not None:
            return self._tiktoken.decode(ids, errors="replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    # megatron-style names
    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    def id_to_token(self, idx: int) -> str | None:
        return self.hf.id_to_token(idx)

    def __repr__(self) -> str:
        return (f"BPETokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eod={self.eod} "
                f"{self.eod_token!r}, backend={self.backend!r}, sha256={self.sha256[:12]})")

    # tiktoken's core object does not pickle: rebuild from the file (DataLoader workers under spawn)
    def __getstate__(self) -> dict:
        return {"init_args": self._init_args, "sha256": self.sha256}

    def __setstate__(self, state: dict) -> None:
        path, eod_token, backend = state["init_args"]
        self.__init__(path, eod_token=eod_token, backend=backend)
        if self.sha256 != state["sha256"]:
            raise ValueError(f"{self.path} changed since this tokenizer was pickled")


def _clean_surrogates(text: str) -> str:
    # Lone surrogates (e.g. "\ud800" escapes in JSON) cannot reach Rust strings; tiktoken replaces them
    # with U+FFFD the same way.
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def load_tokenizer(path: str | os.PathLike | None = None, *, eod_token: str | None = None,
                   backend: str = "auto") -> BPETokenizer:
    """The tokenizer at `path` (None: the project's committed tokenizer.json)."""
    return BPETokenizer(path, eod_token=eod_token, backend=backend)
