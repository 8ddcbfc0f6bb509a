"""A corpus from the text files of the machine's own software: its Python environment and system headers.

A GPU machine that cannot download anything and receives at most a few tens of MB still holds hundreds of MB of
real text: the ``.py``/``.md``/``.rst``/``.txt`` files of its Python packages and standard library and the C/C++
headers of ``/usr/include``. :func:`collect` turns them into documents, deterministically:

- roots (default :func:`default_roots`: ``site.getsitepackages()``, the standard library, ``/usr/include``) are
  walked in sorted order without following links; a root nested in another is walked once, as itself;
- a file is taken when its suffix is in ``suffixes``, its size in ``[min_bytes, max_bytes]``, it is strict UTF-8
  without NUL bytes, no line is longer than ``max_line_chars`` (minified or generated data), and at least
  ``min_letter_fraction`` of its characters are letters; ``LICENSE``/``COPYING``/``NOTICE`` files are skipped and a
  leading comment block that names a licence or copyright is cut (``strip_license_headers``): the same few
  licence texts would otherwise be thousands of documents;
- line ends become LF, trailing spaces go; exact duplicates (after that) are dropped, the first in walk order
  kept (the roots in the order given, each in sorted path order);
- a file goes to validation when a salted SHA-256 of its text falls in the lowest ``val_fraction`` (the split is
  by file: the pieces of one file never straddle it), and files longer than ``MAX_CHUNK_CHARS`` are cut at line
  boundaries into pieces (documents) of at most that many characters;
- the training documents are written in hash order (any prefix mixes every root).

Nothing depends on time, locale, file-system order or the number of worker processes: the same image gives the
same bytes. ``MANIFEST.json`` records the options, the interpreter, per-root and per-reason counts, the sha256 of
the sorted list of taken files (path and content hash) and of every output file; after tokenization
(``scripts/build_env_corpus.py``) also the sha256 of the token files, which :func:`verify_tokens` checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sys
import sysconfig
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["EnvCorpusOptions", "EnvCorpusError", "default_roots", "collect", "write_corpus", "verify_tokens",
           "MAX_CHUNK_CHARS", "FORMAT"]

FORMAT = 1  # bump when selection, cleaning, chunking or splitting changes
MAX_CHUNK_CHARS = 32_000  # as scripts/build_corpus.py: ~8k tokens, more than any context we train with
_SPLIT_SALT = b"nvfp4-train/env-corpus-split/v1\0"
_LICENSE_NAMES = ("license", "licence", "copying", "notice", "copyright", "authors")
_LICENSE_WORDS = ("license", "licence", "copyright", "spdx-license-identifier")


class EnvCorpusError(RuntimeError):
    """A corpus that cannot be built or does not match its manifest; the message is one line with the fix."""


def default_roots() -> list[str]:
    """The interpreter's site-packages, its standard library and ``/usr/include`` (those that exist)."""
    roots = [*site.getsitepackages(), sysconfig.get_paths()["stdlib"], "/usr/include"]
    out: list[str] = []
    for r in roots:
        p = os.path.realpath(r)
        if os.path.isdir(p) and p not in out:
            out.append(p)
    return out


@dataclass(frozen=True)
class EnvCorpusOptions:
    """What :func:`collect` takes; recorded in the manifest (a change rebuilds)."""

    roots: tuple[str, ...]
    suffixes: tuple[str, ...] = (".py", ".pyi", ".md", ".rst", ".txt", ".h", ".hh", ".hpp", ".hxx", ".c", ".cc",
                                 ".cpp", ".cxx", ".cu", ".cuh")
    min_bytes: int = 256
    max_bytes: int = 1_000_000
    max_line_chars: int = 1_000
    min_letter_fraction: float = 0.25
    strip_license_headers: bool = True
    val_fraction: float = 0.01


@dataclass
class _Taken:
    path: str
    root: str
    text: str
    raw_sha256: str


def _walk(root: str, skip: set[str]) -> list[str]:
    """Files under ``root`` in sorted order; directories in ``skip`` (other roots), hidden ones and
    ``__pycache__`` are not entered, links are not followed."""
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                             and os.path.join(dirpath, d) not in skip)
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            if not f.startswith(".") and not os.path.islink(p):
                files.append(p)
    return sorted(files)


def _is_license_file(name: str) -> bool:
    stem = name.lower().split(".")[0]
    return any(stem.startswith(w) for w in _LICENSE_NAMES)


def strip_license_header(text: str) -> str:
    """Cut the leading comment block (``#`` lines, a ``/* ... */`` block or ``//`` lines, after an optional
    shebang/encoding line) when it names a licence or copyright; anything else is returned unchanged."""
    lines = text.split("\n")
    i = 0
    head: list[str] = []
    while i < len(lines) and (lines[i].startswith("#!") or lines[i].startswith("# -*-")):
        head.append(lines[i])
        i += 1
    start = i
    if i < len(lines) and lines[i].lstrip().startswith("/*"):
        while i < len(lines) and "*/" not in lines[i]:
            i += 1
        i = min(i + 1, len(lines))
    else:
        while i < len(lines) and (lines[i].startswith("#") and not lines[i].startswith("#include")
                                  and not lines[i].startswith("#define") and not lines[i].startswith("#if")
                                  and not lines[i].startswith("#pragma") or lines[i].startswith("//")):
            i += 1
    block = "\n".join(lines[start:i]).lower()
    if i == start or not any(w in block for w in _LICENSE_WORDS):
        return text
    rest = lines[i:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    return "\n".join(head + rest)


def _normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n") + "\n"


def _examine(args: tuple[str, str, EnvCorpusOptions]) -> tuple[str, _Taken | None]:
    """(reason, taken): reason is ``"taken"`` or why the file is left out."""
    path, root, o = args
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # a file name that is not UTF-8 (undecodable bytes kept as surrogates)
        return "path_not_utf8", None
    name = os.path.basename(path)
    if not name.lower().endswith(o.suffixes):
        return "suffix", None
    if _is_license_file(name):
        return "license_file", None
    try:
        size = os.path.getsize(path)
        if size < o.min_bytes or size > o.max_bytes:
            return "size", None
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return "unreadable", None
    if b"\0" in raw:
        return "binary", None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8", None
    text = _normalize(text)
    if o.strip_license_headers:
        text = strip_license_header(text)
    if len(text.encode("utf-8")) < o.min_bytes:
        return "size", None
    if max(len(line) for line in text.split("\n")) > o.max_line_chars:
        return "long_lines", None
    letters = sum(c.isalpha() for c in text)
    if letters < o.min_letter_fraction * len(text):
        return "few_letters", None
    return "taken", _Taken(path, root, text, hashlib.sha256(raw).hexdigest())


def _split_hash(text: str) -> bytes:
    return hashlib.sha256(_SPLIT_SALT + text.encode("utf-8")).digest()


def chunk_lines(text: str, max_chars: int = MAX_CHUNK_CHARS) -> list[str]:
    """``text`` cut at line boundaries into pieces of at most ``max_chars`` characters (a longer line is cut
    inside); joined back with ``""`` they give ``text``."""
    if len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    cur: list[str] = []
    n = 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            if cur:
                pieces.append("".join(cur))
                cur, n = [], 0
            pieces.append(line[:max_chars])
            line = line[max_chars:]
        if n + len(line) > max_chars and cur:
            pieces.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += len(line)
    if cur:
        pieces.append("".join(cur))
    return pieces


@dataclass
class Collected:
    """What :func:`collect` found: the kept files in walk order (roots in the order given, each sorted), and
    counts."""

    options: EnvCorpusOptions
    taken: list[_Taken]
    reasons: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    per_root: dict[str, dict[str, int]] = field(default_factory=dict)


def collect(options: EnvCorpusOptions, jobs: int = 1) -> Collected:
    """Walk the roots and keep the files that pass the filters, without exact duplicates; raises
    :class:`EnvCorpusError` when a root is missing or nothing is kept."""
    roots = [os.path.realpath(r) for r in options.roots]
    for r in roots:
        if not os.path.isdir(r):
            raise EnvCorpusError(f"corpus root {r} is not a directory: name existing directories with --root")
    skip = set(roots)
    work: list[tuple[str, str, EnvCorpusOptions]] = []
    seen: set[str] = set()
    for r in roots:
        for p in _walk(r, skip - {r}):
            if p not in seen:
                seen.add(p)
                work.append((p, r, options))
    reasons: Counter[str] = Counter()
    results: list[tuple[str, _Taken | None]]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            results = list(ex.map(_examine, work, chunksize=256))
    else:
        results = [_examine(w) for w in work]
    taken: list[_Taken] = []
    texts: set[str] = set()
    duplicates = 0
    per_root: dict[str, dict[str, int]] = {r: {"files": 0, "bytes": 0} for r in roots}
    for reason, t in results:
        reasons[reason] += 1
        if t is None:
            continue
        h = hashlib.sha256(t.text.encode("utf-8")).hexdigest()
        if h in texts:
            duplicates += 1
            continue
        texts.add(h)
        taken.append(t)
        per_root[t.root]["files"] += 1
        per_root[t.root]["bytes"] += len(t.text.encode("utf-8"))
    if not taken:
        raise EnvCorpusError(f"no text file passed the filters under {', '.join(roots)} "
                             f"({dict(sorted(reasons.items()))}): name other roots with --root or loosen the filters")
    return Collected(options, taken, dict(sorted(reasons.items())), duplicates, per_root)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_list_sha256(taken: list[_Taken]) -> str:
    """sha256 over ``path\\tsha256(raw bytes)\\n`` of the kept files in sorted path order."""
    h = hashlib.sha256()
    for t in sorted(taken, key=lambda t: t.path):
        h.update(f"{t.path}\t{t.raw_sha256}\n".encode("utf-8"))
    return h.hexdigest()


def write_corpus(c: Collected, out_dir: Path) -> dict:
    """Write ``train.jsonl``, ``validation.jsonl`` and ``MANIFEST.json`` under ``out_dir`` (atomically per file)
    and return the manifest."""
    o = c.options
    out_dir.mkdir(parents=True, exist_ok=True)
    keyed = sorted(((_split_hash(t.text), t) for t in c.taken), key=lambda kt: (kt[0], kt[1].path))
    threshold = int(o.val_fraction * 2**64)
    splits: dict[str, list[_Taken]] = {"train": [], "validation": []}
    for key, t in keyed:
        splits["validation" if int.from_bytes(key[:8], "big") < threshold else "train"].append(t)
    if not splits["validation"] and o.val_fraction > 0:  # at least one validation file
        splits["validation"].append(splits["train"].pop(0))
    stats: dict[str, dict[str, int]] = {}
    files: dict[str, str] = {}
    for split, ts in splits.items():
        path = out_dir / f"{split}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        docs = nbytes = 0
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for t in ts:
                pieces = chunk_lines(t.text)
                for i, piece in enumerate(pieces):
                    doc_id = t.path if len(pieces) == 1 else f"{t.path}#{i}"
                    f.write(json.dumps({"source": t.root, "id": doc_id, "text": piece}, ensure_ascii=False) + "\n")
                    docs += 1
                    nbytes += len(piece.encode("utf-8"))
        os.replace(tmp, path)
        stats[split] = {"files": len(ts), "documents": docs, "bytes": nbytes}
        files[path.name] = _sha256_file(path)
    manifest = {
        "format": FORMAT,
        "options": asdict(o),
        "python": sys.version.split()[0],
        "files_examined": sum(c.reasons.values()),
        "left_out": {k: v for k, v in c.reasons.items() if k != "taken"},
        "exact_duplicates": c.duplicates,
        "files_taken": len(c.taken),
        "bytes_taken": sum(v["bytes"] for v in c.per_root.values()),
        "per_root": c.per_root,
        "file_list_sha256": file_list_sha256(c.taken),
        "splits": stats,
        "sha256": files,
    }
    _write_manifest(out_dir, manifest)
    return manifest


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    tmp = out_dir / "MANIFEST.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / "MANIFEST.json")


def token_files(prefix: str) -> list[Path]:
    """The ``.bin``/``.idx`` files prepare_data writes for ``prefix`` (both splits)."""
    return [Path(f"{prefix}_{split}.{ext}") for split in ("train", "validation") for ext in ("bin", "idx")]


def record_tokens(out_dir: Path, prefix: str) -> dict:
    """Add the sha256 and size of the token files of ``prefix`` to the manifest under ``out_dir``."""
    manifest = json.loads((out_dir / "MANIFEST.json").read_text())
    manifest["tokens"] = {"prefix": prefix,
                          "sha256": {p.name: _sha256_file(p) for p in token_files(prefix)},
                          "bytes": {p.name: p.stat().st_size for p in token_files(prefix)}}
    _write_manifest(out_dir, manifest)
    return manifest


def verify_tokens(out_dir: Path) -> dict:
    """Check the token files named in the manifest against their recorded sha256; raises
    :class:`EnvCorpusError` (one line) on a missing manifest, missing file or mismatch."""
    mpath = out_dir / "MANIFEST.json"
    if not mpath.is_file():
        raise EnvCorpusError(f"{mpath} not found: build the corpus first (scripts/build_env_corpus.py --out {out_dir})")
    manifest = json.loads(mpath.read_text())
    tok = manifest.get("tokens")
    if not tok:
        raise EnvCorpusError(f"{mpath} records no token files: run scripts/build_env_corpus.py --out {out_dir} "
                             "again (it tokenizes after collecting)")
    for p in token_files(tok["prefix"]):
        if not p.is_file():
            raise EnvCorpusError(f"{p} (named in {mpath}) is missing: rebuild with scripts/build_env_corpus.py --force")
        got = _sha256_file(p)
        if got != tok["sha256"][p.name]:
            raise EnvCorpusError(f"{p} does not match {mpath} (sha256 {got[:12]}…, manifest "
                                 f"{tok['sha256'][p.name][:12]}…): it was changed or built from other files; "
                                 "rebuild with scripts/build_env_corpus.py --force")
    return manifest
