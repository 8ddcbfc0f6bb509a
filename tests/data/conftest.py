"""Fixtures of the data tests: the committed tokenizer and a small corpus of real text (written per test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nvfp4_train.data.tokenizer import BPETokenizer

SAMPLE = Path(__file__).with_name("sample_text.txt")


@pytest.fixture(scope="session")
def tok() -> BPETokenizer:
    return BPETokenizer()


def corpus_documents() -> list[str]:
    """~80 documents of different lengths (a line to a few KB), with unicode and whitespace runs."""
    paragraphs = [p for p in SAMPLE.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    lines = [line for p in paragraphs for line in p.splitlines() if line.strip()]
    docs = list(paragraphs)
    docs += [" ".join(lines[i : i + 3]) for i in range(0, min(len(lines), 120), 3)]
    docs += ["\n\n".join(paragraphs)]  # one long document
    docs += ["naïve café 日本語 🙂  tabs\t\there\n\n\nand <|endoftext|> as text", "x" + " " * 40 + "y"]
    return docs


def write_jsonl(path: Path, texts, field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"id": len(t), field: t}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture
def docs() -> list[str]:
    """The small corpus (fresh list per test)."""
    return corpus_documents()


@pytest.fixture
def jsonl():
    """`jsonl(path, texts, field="text")` writes one JSON object per text and returns `path`."""
    return write_jsonl
