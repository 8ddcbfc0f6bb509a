"""The corpus of the machine's own text files (nvfp4_train/data/env_corpus.py, scripts/build_env_corpus.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvfp4_train.data.env_corpus import (
    EnvCorpusError,
    EnvCorpusOptions,
    chunk_lines,
    collect,
    strip_license_header,
    verify_tokens,
    write_corpus,
)

REPO = Path(__file__).resolve().parents[2]

PROSE = ("The quick brown fox jumps over the lazy dog while the model learns to predict the next token.\n" * 6)


def _tree(root: Path) -> None:
    """A small tree with one file per filter outcome."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "a.py").write_text("# Copyright 2020 Someone\n# Licensed under the MIT License.\n\n"
                                       "def f(x):\n    return x + 1\n\n" + "# " + PROSE)
    (root / "pkg" / "b.md").write_text("# Title\n\n" + PROSE.replace("fox", "cat"))
    (root / "pkg" / "copy.md").write_text("# Title\n\n" + PROSE.replace("fox", "cat"))  # exact duplicate of b.md
    (root / "pkg" / "sub" / "c.h").write_text("/* header */\n#pragma once\nint g(int y);  /* " + PROSE + " */\n")
    (root / "pkg" / "LICENSE.txt").write_text(PROSE)  # a licence file: left out
    (root / "pkg" / "data.txt").write_text(("0123456789 " * 10 + "\n") * 10)  # few letters
    (root / "pkg" / "long.txt").write_text("x" * 5000 + "\n" + PROSE)  # a line past max_line_chars
    (root / "pkg" / "bin.txt").write_bytes(b"abc\0def" * 100)  # binary
    (root / "pkg" / "latin.txt").write_bytes(("caf\xe9 " * 100).encode("latin-1"))  # not UTF-8
    (root / "pkg" / "tiny.py").write_text("x = 1\n")  # too small
    (root / "pkg" / "image.png").write_bytes(b"\x89PNG" * 100)  # suffix
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc.txt").write_text(PROSE)  # never entered
    (root / "pkg" / ".hidden.py").write_text(PROSE)  # hidden: skipped


def test_filters_dedup_and_license_header(tmp_path):
    _tree(tmp_path / "r")
    c = collect(EnvCorpusOptions(roots=(str(tmp_path / "r"),), min_bytes=64))
    names = [Path(t.path).name for t in c.taken]
    assert names == ["a.py", "b.md", "c.h"]  # sorted paths; copy.md is b.md's duplicate
    assert c.duplicates == 1
    assert c.reasons["license_file"] == 1 and c.reasons["few_letters"] == 1 and c.reasons["long_lines"] == 1
    assert c.reasons["binary"] == 1 and c.reasons["not_utf8"] == 1 and c.reasons["suffix"] == 1
    a = c.taken[0].text
    assert a.startswith("def f(x):") and "Copyright" not in a  # the licence header is cut, the code kept


def test_strip_license_header_keeps_other_comments():
    assert strip_license_header("# just a comment\nx = 1\n") == "# just a comment\nx = 1\n"
    assert strip_license_header("#!/usr/bin/env python\n# SPDX-License-Identifier: MIT\n\nx = 1\n") == \
        "#!/usr/bin/env python\nx = 1\n"
    assert strip_license_header("/*\n * Copyright (c) 2001\n */\n#include <a.h>\n") == "#include <a.h>\n"
    assert strip_license_header("#include <a.h>\n// license\n") == "#include <a.h>\n// license\n"


@pytest.mark.parametrize("n", [0, 1, 5, 31, 32, 33, 100])
def test_chunk_lines_round_trips_within_the_limit(n):
    text = "".join(f"line {i} " + "y" * (i % 7) + "\n" for i in range(n)) + "z" * 70
    pieces = chunk_lines(text, max_chars=32)
    assert "".join(pieces) == text and all(0 < len(p) <= 32 for p in pieces)


def test_write_is_deterministic_and_independent_of_jobs(tmp_path):
    _tree(tmp_path / "r")
    for i in range(12):  # enough files that both splits get some at val_fraction 0.3
        (tmp_path / "r" / "pkg" / f"doc{i}.rst").write_text(f"Document {i}.\n\n" + PROSE.replace("dog", f"dog {i}"))
    opts = EnvCorpusOptions(roots=(str(tmp_path / "r"),), min_bytes=64, val_fraction=0.3)
    m1 = write_corpus(collect(opts, jobs=1), tmp_path / "o1")
    m2 = write_corpus(collect(opts, jobs=2), tmp_path / "o2")
    assert m1["sha256"] == m2["sha256"] and m1["file_list_sha256"] == m2["file_list_sha256"]
    for split in ("train", "validation"):
        assert (tmp_path / "o1" / f"{split}.jsonl").read_bytes() == (tmp_path / "o2" / f"{split}.jsonl").read_bytes()
    train = [json.loads(line)["id"] for line in (tmp_path / "o1" / "train.jsonl").read_text().splitlines()]
    valid = [json.loads(line)["id"] for line in (tmp_path / "o1" / "validation.jsonl").read_text().splitlines()]
    assert train and valid and not set(train) & set(valid)
    assert m1["files_taken"] == len(train) + len(valid) == m1["splits"]["train"]["files"] + m1["splits"]["validation"]["files"]


def test_nothing_taken_and_missing_root_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EnvCorpusError, match="no text file passed the filters"):
        collect(EnvCorpusOptions(roots=(str(tmp_path / "empty"),)))
    with pytest.raises(EnvCorpusError, match="is not a directory"):
        collect(EnvCorpusOptions(roots=(str(tmp_path / "nope"),)))


def test_script_builds_tokens_and_verify_catches_a_changed_file(tmp_path):
    _tree(tmp_path / "r")
    for i in range(20):
        (tmp_path / "r" / "pkg" / f"doc{i}.md").write_text(f"Note {i}.\n\n" + PROSE.replace("lazy", f"lazy {i}"))
    out, prefix = tmp_path / "corpus", str(tmp_path / "tok" / "env")
    cmd = [sys.executable, str(REPO / "scripts" / "build_env_corpus.py"), "--out", str(out), "--tokens-prefix",
           prefix, "--root", str(tmp_path / "r"), "--jobs", "1", "--val-fraction", "0.2"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    m = verify_tokens(out)
    assert set(m["tokens"]["sha256"]) == {"env_train.bin", "env_train.idx", "env_validation.bin", "env_validation.idx"}
    v = subprocess.run(cmd[:2] + ["--out", str(out), "--verify"], capture_output=True, text=True, cwd=REPO)
    assert v.returncode == 0 and "match the manifest" in v.stdout
    with open(prefix + "_train.bin", "r+b") as f:  # one token changed
        b = f.read(2)
        f.seek(0)
        f.write(bytes([b[0] ^ 1, b[1]]))
    v = subprocess.run(cmd[:2] + ["--out", str(out), "--verify"], capture_output=True, text=True, cwd=REPO)
    assert v.returncode == 2 and "does not match" in v.stderr and "Traceback" not in v.stderr
    assert len(v.stderr.strip().splitlines()) == 1
    e = subprocess.run(cmd[:2] + ["--out", str(tmp_path / "none"), "--root", str(tmp_path / "nope")],
                       capture_output=True, text=True, cwd=REPO)
    assert e.returncode == 2 and len(e.stderr.strip().splitlines()) == 1 and "is not a directory" in e.stderr


def test_collect_runs_on_a_bare_interpreter(tmp_path):
    """``--stage collect`` runs before anything is installed: without site-packages (``python -S``: no numpy,
    no torch) it writes the corpus."""
    _tree(tmp_path / "r")
    r = subprocess.run([sys.executable, "-S", str(REPO / "scripts" / "build_env_corpus.py"), "--stage", "collect",
                        "--root", str(tmp_path / "r"), "--out", str(tmp_path / "c"), "--jobs", "1"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "c" / "MANIFEST.json").is_file() and (tmp_path / "c" / "train.jsonl").is_file()


def test_a_file_name_that_is_not_utf8_is_left_out(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    (root / "ok.md").write_text(PROSE)
    try:
        with open(os.path.join(os.fsencode(root), b"caf\xe9.md"), "w") as f:
            f.write(PROSE.replace("fox", "owl"))
    except OSError:  # a file system that refuses such names has none to leave out
        pytest.skip("this file system refuses a non-UTF-8 file name")
    c = collect(EnvCorpusOptions(roots=(str(root),), min_bytes=64))
    assert [Path(t.path).name for t in c.taken] == ["ok.md"] and c.reasons["path_not_utf8"] == 1
    write_corpus(c, tmp_path / "out")  # no UnicodeEncodeError
