"""scripts/build_corpus.py's pure helpers (the build itself needs apt and is run by hand: docs/data.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_corpus.py"


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("build_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_corpus"] = module  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("build_corpus", None)


def test_html_to_text(bc):
    page = (
        '<?xml version="1.0"?><html><head><title>T</title><style>p {}</style></head><body>'
        '<div class="navheader"><table><tr><td><a href="x">Prev</a></td></tr></table></div>'
        "<h2>SELECT</h2><p>\n    Retrieve   <code>rows</code>&nbsp;from a\n    table &amp; view.</p>"
        '<pre class="synopsis">SELECT *\n    FROM t  -- two spaces kept\n</pre>'
        "<ul><li>one</li><li>two</li></ul><script>alert(1)</script>"
        "<table><tr><th>Name</th><th>Size</th></tr><tr><td>int</td><td>4 bytes</td></tr></table>"
        '<div class="navfooter"><div>Next</div></div><p>End.</p></body></html>'
    )
    assert bc.html_to_text(page) == (
        "SELECT\n\nRetrieve rows from a table & view.\n\n"  # &nbsp; collapses like any whitespace
        "SELECT *\n    FROM t  -- two spaces kept\n\n"
        "one\ntwo\n\nName | Size\nint | 4 bytes\n\nEnd."
    )


def test_chunk_text_cuts_at_paragraphs(bc):
    paragraphs = [f"paragraph {k} " + "word " * (k * 7 % 50) for k in range(200)]
    text = "\n\n".join(p.strip() for p in paragraphs)
    chunks = bc.chunk_text(text, max_chars=1000)
    assert all(len(c) <= 1000 for c in chunks) and len(chunks) > 5
    assert "\n\n".join(chunks) == text  # cuts only at paragraph boundaries here, nothing lost
    hard = bc.chunk_text("x" * 2500, max_chars=1000)  # no boundary at all: hard cuts
    assert [len(c) for c in hard] == [1000, 1000, 500]


def test_assign_splits(bc):
    records = [("big", f"b{k}", f"big document number {k}") for k in range(3000)]
    records += [("tiny", "t0", "the only tiny document"), ("big", "dup", "big document number 7")]
    train, valid, dups = bc.assign_splits(records, 0.01)
    assert dups == 1
    assert len(train) + len(valid) == 3001
    assert ("tiny", "t0", "the only tiny document") in valid  # every source reaches validation
    big_valid = [r for r in valid if r[0] == "big"]
    assert 10 <= len(big_valid) <= 55  # 30 expected; binomial(3000, 0.01) sd 5.4, bound > 3.5 sd
    assert all(bc.is_validation(bc.split_key(r[2]), 0.01) for r in big_valid)
    again = bc.assign_splits(list(reversed(records)), 0.01)  # order of the input does not matter
    assert {r[2] for r in again[0]} == {r[2] for r in train} and {r[2] for r in again[1]} == {r[2] for r in valid}
    assert [bc.split_key(r[2]) for r in train] == sorted(bc.split_key(r[2]) for r in train)


def test_gcide_helpers(bc):
    assert bc._dictd_number("B") == 1 and bc._dictd_number("BA") == 64 and bc._dictd_number("5I") == 57 * 64 + 8
    entry = "Caloric \\Ca*lor\"ic\\, a.\n   Of or pertaining to caloric.\n   [1913 Webster +PJC]\n   [Obs.]\n"
    assert bc._GCIDE_ATTRIBUTION.sub("", entry) == (
        "Caloric \\Ca*lor\"ic\\, a.\n   Of or pertaining to caloric.\n   [Obs.]\n")


def test_decode_and_normalize(bc):
    assert bc.decode("café".encode()) == "café"
    assert bc.decode("café".encode("latin-1")) == "café"
    assert bc.normalize("\r\n\nline one  \r\nline two\t\n\n") == "line one\nline two"
