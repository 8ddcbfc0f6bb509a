#!/usr/bin/env python3
"""Train the project's byte-level BPE tokenizer on the default corpus.

The result is committed as ``nvfp4_train/data/tokenizer.json``: a fixed file, so every machine maps text to
the same ids. Re-running this script is only needed to change the tokenizer on purpose (a new file changes
every token id: re-tokenize all data and retrain; the pinned ids in tests/data must be updated).

Recipe: ``tokenizers`` BPE, GPT-2 style byte level (ByteLevel pre-tokenizer with GPT-2's split regex and no
prefix space, ByteLevel decoder, the 256-symbol ByteLevel alphabet as initial alphabet, so every byte string
encodes without an unknown token), ``min_frequency=2``, one special token ``<|endoftext|>`` (id 0) used as
the end-of-document token, trained on the first ``--sample-mb`` MB of ``data/corpus/text/train.jsonl``
(that file is in hash order, so any prefix mixes all sources).

Usage::

    python scripts/build_corpus.py
    python scripts/train_tokenizer.py                  # -> nvfp4_train/data/tokenizer.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EOD_TOKEN = "<|endoftext|>"


def read_sample(path: Path, sample_bytes: int) -> tuple[list[str], int, str]:
    """The first documents of `path` up to `sample_bytes` of UTF-8 text -> (texts, bytes, sha256)."""
    texts, total = [], 0
    h = hashlib.sha256()
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            texts.append(text)
            data = text.encode("utf-8")
            h.update(data + b"\0")
            total += len(data)
            if total >= sample_bytes:
                break
    return texts, total, h.hexdigest()


def train(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(REPO / "data/corpus/text/train.jsonl"),
                    help="JSONL with a 'text' field (default: the default corpus's train split)")
    ap.add_argument("--sample-mb", type=float, default=50.0, help="MB of text to train on (default 50)")
    ap.add_argument("--vocab-size", type=int, default=32768,
                    help="vocabulary size including <|endoftext|> and the 256 byte symbols (default 32768)")
    ap.add_argument("--output", default=str(REPO / "nvfp4_train/data/tokenizer.json"))
    args = ap.parse_args(argv)

    corpus = Path(args.corpus)
    if not corpus.is_file():
        raise SystemExit(f"{corpus} not found: build the corpus first (python scripts/build_corpus.py)")
    t0 = time.time()
    texts, nbytes, sample_sha = read_sample(corpus, int(args.sample_mb * 1e6))
    t1 = time.time()
    tok = train(texts, args.vocab_size)
    t2 = time.time()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    import tokenizers

    vocab = tok.get_vocab_size()
    print(f"trained on {len(texts)} documents, {nbytes / 1e6:.1f} MB (sample sha256 {sample_sha}) "
          f"in {t2 - t1:.1f}s (read {t1 - t0:.1f}s); tokenizers {tokenizers.__version__}")
    print(f"wrote {out}: vocab {vocab}, {EOD_TOKEN} = {tok.token_to_id(EOD_TOKEN)}, "
          f"{out.stat().st_size / 1e6:.2f} MB, sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}")
    if vocab != args.vocab_size:
        print(f"warning: asked for {args.vocab_size} tokens, got {vocab} (sample too small?)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
