#!/usr/bin/env python3
"""Build a corpus from this machine's own text files (Python environment, standard library, system headers) and
tokenize it: see nvfp4_train/data/env_corpus.py and docs/data.md.

    python scripts/build_env_corpus.py                                  # -> data/env_corpus/, data/tokens/env_*
    python scripts/build_env_corpus.py --root /usr/lib/python3/dist-packages --root /usr/include
    python scripts/build_env_corpus.py --verify                         # token files against the manifest

Run it before installing anything else into the environment it reads: the corpus is what the roots hold.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nvfp4_train.data.env_corpus import (  # noqa: E402
    EnvCorpusError,
    EnvCorpusOptions,
    collect,
    default_roots,
    record_tokens,
    verify_tokens,
    write_corpus,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "data" / "env_corpus",
                    help="corpus folder: train.jsonl, validation.jsonl, MANIFEST.json (default data/env_corpus)")
    ap.add_argument("--tokens-prefix", default=str(REPO / "data" / "tokens" / "env"),
                    help="prefix of the token files, <prefix>_{train,validation}.{bin,idx} (default data/tokens/env)")
    ap.add_argument("--root", action="append", default=None,
                    help="a directory to collect from (repeat); default: site-packages, the standard library, "
                         "/usr/include")
    ap.add_argument("--val-fraction", type=float, default=0.01, help="share of files held out (default 0.01)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes for reading and tokenizing")
    ap.add_argument("--stage", choices=("all", "collect", "tokenize"), default="all",
                    help="collect: only the JSONL corpus and manifest (reads the roots; run it before installing "
                         "anything into them); tokenize: only the token files of a collected corpus")
    ap.add_argument("--verify", action="store_true", help="only check the token files against MANIFEST.json")
    a = ap.parse_args(argv)
    try:
        if a.verify:
            m = verify_tokens(a.out)
            print(f"[env_corpus] {a.out}: token files match the manifest ({m['tokens']['prefix']})")
            return 0
        if not 0.0 <= a.val_fraction < 1.0:
            ap.error(f"--val-fraction {a.val_fraction} must be in [0, 1)")
        t0 = time.time()
        if a.stage == "tokenize":
            if not (a.out / "MANIFEST.json").is_file():
                raise EnvCorpusError(f"{a.out}/MANIFEST.json not found: run --stage collect first")
            return _tokenize(a, t0)
        opts = EnvCorpusOptions(roots=tuple(a.root or default_roots()), val_fraction=a.val_fraction)
        c = collect(opts, jobs=a.jobs)
        m = write_corpus(c, a.out)
        t1 = time.time()
        print(f"[env_corpus] {m['files_taken']:,} files, {m['bytes_taken'] / 1e6:.1f} MB of {m['files_examined']:,} "
              f"examined ({m['exact_duplicates']:,} exact duplicates dropped; left out {m['left_out']}); "
              f"file list sha256 {m['file_list_sha256']}; {t1 - t0:.1f}s", flush=True)
        for split, s in m["splits"].items():
            print(f"[env_corpus] {split}: {s['files']:,} files, {s['documents']:,} documents, {s['bytes'] / 1e6:.1f} MB",
                  flush=True)
        if a.stage == "collect":
            return 0
        return _tokenize(a, t0)
    except EnvCorpusError as e:
        print(f"[env_corpus] error: {e}", file=sys.stderr)
        return 2


def _tokenize(a: argparse.Namespace, t0: float) -> int:
    """prepare_data.py on the collected corpus, then the token files' sha256 into the manifest."""
    try:
        cmd = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--input", str(a.out / "train.jsonl"),
               "--valid-input", str(a.out / "validation.jsonl"), "--output-prefix", a.tokens_prefix,
               "--workers", str(a.jobs), "--force"]
        pp = os.environ.get("PYTHONPATH")
        r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + pp if pp else "")))
        if r.returncode != 0:
            print(f"[env_corpus] error: tokenization failed (exit {r.returncode}, above): {' '.join(cmd)}",
                  file=sys.stderr)
            return r.returncode
        m = record_tokens(a.out, a.tokens_prefix)
        for name, h in m["tokens"]["sha256"].items():
            print(f"[env_corpus] {name}: {m['tokens']['bytes'][name]:,} bytes, sha256 {h}")
        print(f"[env_corpus] done in {time.time() - t0:.1f}s", flush=True)
        return 0
    except EnvCorpusError as e:
        print(f"[env_corpus] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
