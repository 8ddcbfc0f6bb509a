"""prepare_data: every input kind -> .bin/.idx whose documents are exactly encode(text) + [EOD]."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from nvfp4_train.data.prepare import is_validation_text, main, prepare, token_dtype


def read_docs(prefix) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    assert ds.index.dtype == np.uint16
    assert len(ds) == len(ds.document_indices) - 1  # one sequence per document
    return [np.array(ds[k]) for k in range(len(ds))]  # copies: the views die with the memory map


def expected(tok, texts) -> list[list[int]]:
    return [tok.encode(t) + [tok.eod] for t in texts]


def quiet(*_args) -> None:
    pass


def test_jsonl_train_and_valid_exact(tmp_path, tok, docs, jsonl):
    train, valid = docs[:-10], docs[-10:]
    jsonl(tmp_path / "train.jsonl", train)
    jsonl(tmp_path / "valid.jsonl", valid)
    res = prepare([tmp_path / "train.jsonl"], tmp_path / "out" / "ds", valid_inputs=[tmp_path / "valid.jsonl"],
                  tokenizer=tok, log=quiet)
    got_train = read_docs(tmp_path / "out" / "ds_train")
    got_valid = read_docs(tmp_path / "out" / "ds_validation")
    assert [d.tolist() for d in got_train] == expected(tok, train)
    assert [d.tolist() for d in got_valid] == expected(tok, valid)
    assert [tok.decode(d[:-1]) for d in got_train] == train
    n_tokens = sum(len(d) for d in got_train)
    assert res.docs == {"train": len(train), "validation": len(valid)}
    assert res.tokens["train"] == n_tokens
    assert (tmp_path / "out" / "ds_train.bin").stat().st_size == 2 * n_tokens  # uint16
    meta = json.loads((tmp_path / "out" / "ds_train.meta.json").read_text())
    assert meta["tokens"] == n_tokens and meta["tokenizer"]["sha256"] == tok.sha256
    assert not list((tmp_path / "out").glob("*.tmp.*"))


def test_every_input_kind_in_order(tmp_path, tok, docs):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b, c, d, e, f = docs[0:5], docs[5:9], docs[9:14], docs[14:18], docs[18:22], docs[22:26]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as fh:  # gzipped JSONL, field "body"
        fh.writelines(json.dumps({"body": t}) + "\n" for t in a)
    (tmp_path / "b.json").write_text(json.dumps([{"body": t} for t in b]))  # a JSON array
    pq.write_table(pa.table({"body": c, "n": list(range(len(c)))}), tmp_path / "c.parquet")
    text_dir = tmp_path / "texts"
    (text_dir / "sub").mkdir(parents=True)
    for k, t in enumerate(d):  # one document per file, sorted by path
        (text_dir / ("sub" if k % 2 else ".") / f"{k}.txt").write_text(t, encoding="utf-8")
    (text_dir / "ignored.bin").write_bytes(b"\x00\x01")
    datasets.Dataset.from_dict({"body": e}).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": f}),
                          "test": datasets.Dataset.from_dict({"body": ["x"]})}).save_to_disk(str(tmp_path / "hfd"))

    inputs = [tmp_path / "a.jsonl.gz", tmp_path / "b.json", tmp_path / "c.parquet", text_dir, tmp_path / "hf",
              tmp_path / "hfd"]
    res = prepare(inputs, tmp_path / "all", valid_fraction=0.0, text_field="body", tokenizer=tok, log=quiet)
    text_order = [d[0], d[2], d[1], d[3]]  # texts/0.txt, texts/2.txt, texts/sub/1.txt, texts/sub/3.txt
    want = a + b + c + text_order + e + f
    assert [x.tolist() for x in read_docs(tmp_path / "all_train")] == expected(tok, want)
    assert res.prefixes == {"train": str(tmp_path / "all_train")}
    assert not (tmp_path / "all_validation.bin").exists()


def test_valid_fraction_splits_by_text_hash(tmp_path, tok, docs, jsonl):
    jsonl(tmp_path / "in.jsonl", docs)
    prepare([tmp_path / "in.jsonl"], tmp_path / "h", valid_fraction=0.3, tokenizer=tok, log=quiet)
    want_valid = [t for t in docs if is_validation_text(t, 0.3)]
    want_train = [t for t in docs if not is_validation_text(t, 0.3)]
    assert 0 < len(want_valid) < len(docs) // 2
    assert [x.tolist() for x in read_docs(tmp_path / "h_train")] == expected(tok, want_train)
    assert [x.tolist() for x in read_docs(tmp_path / "h_validation")] == expected(tok, want_valid)


def test_empty_and_null_documents_are_skipped(tmp_path, tok):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": ""}\n{"text": null}\n{"text": "two"}\n')
    res = prepare([path], tmp_path / "e", valid_fraction=0.0, tokenizer=tok, log=quiet)
    assert res.empty_skipped == 2
    assert [x.tolist() for x in read_docs(tmp_path / "e_train")] == expected(tok, ["one", "two"])


def test_rerun_is_skipped_until_an_input_changes(tmp_path, tok, docs, jsonl):
    path = jsonl(tmp_path / "in.jsonl", docs[:8])
    out = tmp_path / "r"
    assert not prepare([path], out, tokenizer=tok, log=quiet).skipped
    bin_mtime = os.stat(f"{out}_train.bin").st_mtime_ns
    again = prepare([path], out, tokenizer=tok, log=quiet)
    assert again.skipped and os.stat(f"{out}_train.bin").st_mtime_ns == bin_mtime
    jsonl(path, docs[:9])
    changed = prepare([path], out, tokenizer=tok, log=quiet)
    assert not changed.skipped and sum(changed.docs.values()) == 9
    assert not prepare([path], out, tokenizer=tok, log=quiet, force=True).skipped


def test_threads_do_not_change_the_output(tmp_path, tok, docs, jsonl):
    path = jsonl(tmp_path / "in.jsonl", docs)
    prepare([path], tmp_path / "w1", tokenizer=tok, workers=1, log=quiet)
    prepare([path], tmp_path / "w2", tokenizer=tok, workers=2, log=quiet)
    for suffix in ("_train.bin", "_train.idx", "_validation.bin", "_validation.idx"):
        assert Path(f"{tmp_path}/w1{suffix}").read_bytes() == Path(f"{tmp_path}/w2{suffix}").read_bytes()


def test_token_dtype():
    assert token_dtype(32768) is np.uint16
    assert token_dtype(65536) is np.uint16  # ids 0..65535
    assert token_dtype(65537) is np.int32


# ---- errors name the file (and line)


def test_bad_json_names_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": "broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        prepare([path], tmp_path / "o", tokenizer=tok, log=quiet)
    assert not list(tmp_path.glob("o_*"))  # nothing half-written


def test_missing_field_lists_fields(tmp_path, tok):
    path = tmp_path / "f.jsonl"
    path.write_text('{"text": "ok"}\n{"content": "no text field", "id": 3}\n')
    with pytest.raises(ValueError, match=r"f\.jsonl:2: no field 'text' \(fields: \['content', 'id'\]\)"):
        prepare([path], tmp_path / "o", tokenizer=tok, log=quiet)
    path.write_text('{"text": 12}\n')
    with pytest.raises(ValueError, match=r"f\.jsonl:1: field 'text' is a int"):
        prepare([path], tmp_path / "o", tokenizer=tok, log=quiet)


def test_other_input_errors(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(FileNotFoundError, match=r"input .*missing\.jsonl not found"):
        prepare([tmp_path / "missing.jsonl"], tmp_path / "o", tokenizer=tok, log=quiet)
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: no column 'text' \(columns: \['content'\]\)"):
        prepare([tmp_path / "p.parquet"], tmp_path / "o", tokenizer=tok, log=quiet)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not valid utf-8"):
        prepare([tmp_path / "latin1.txt"], tmp_path / "o", tokenizer=tok, log=quiet)
    res = prepare([tmp_path / "latin1.txt"], tmp_path / "l1", encoding="latin-1", valid_fraction=0, tokenizer=tok,
                  log=quiet)
    assert [x.tolist() for x in read_docs(tmp_path / "l1_train")] == expected(tok, ["café"])
    assert res.docs == {"train": 1}
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty holds no"):
        prepare([tmp_path / "empty"], tmp_path / "o", tokenizer=tok, log=quiet)
    with pytest.raises(ValueError, match=r"without \.bin/\.idx"):
        prepare([tmp_path / "latin1.txt"], tmp_path / "o.bin", tokenizer=tok, log=quiet)


def test_cli(tmp_path, capsys, docs, jsonl):
    path = jsonl(tmp_path / "in.jsonl", docs[:6], field="body")
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "c"), "--text-field", "body",
                 "--valid-fraction", "0"]) == 0
    assert (tmp_path / "c_train.idx").is_file() and not (tmp_path / "c_validation.idx").exists()
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "d")]) == 2
    assert "in.jsonl:1: no field 'text'" in capsys.readouterr().err


def test_a_datasetdict_given_as_validation_gives_its_validation_split(tmp_path, tok, docs):
    """``--hf-split`` chose the split of --valid-input too: one DatasetDict given as --input and --valid-input
    gave its train split twice (validation = training data). Validation now takes ``--valid-hf-split``."""
    datasets = pytest.importorskip("datasets")
    train, valid = docs[:6], docs[6:9]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                          "validation": datasets.Dataset.from_dict({"text": valid})}).save_to_disk(str(tmp_path / "d"))
    prepare([tmp_path / "d"], tmp_path / "o", valid_inputs=[tmp_path / "d"], tokenizer=tok, log=quiet)
    assert [x.tolist() for x in read_docs(tmp_path / "o_train")] == expected(tok, train)
    assert [x.tolist() for x in read_docs(tmp_path / "o_validation")] == expected(tok, valid)
    with pytest.raises(ValueError, match="no split 'dev'.*choose it with --valid-hf-split"):
        prepare([tmp_path / "d"], tmp_path / "p", valid_inputs=[tmp_path / "d"], valid_hf_split="dev", tokenizer=tok,
                log=quiet)


def test_module_entry_prints_usage_and_a_bad_tokenizer_is_one_line(tmp_path):
    """``python -m nvfp4_train.data.prepare`` is the entry an installed wheel has (the module had no ``__main__``:
    ``--help`` printed nothing and exited 0); a missing tokenizer file was a traceback."""
    import subprocess
    import sys

    run = dict(capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = subprocess.run([sys.executable, "-m", "nvfp4_train.data.prepare", "--help"], **run)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m nvfp4_train.data.prepare") and "--output-prefix" in out.stdout
    assert out.stderr == ""  # runpy's "found in sys.modules" warning: the package must not import the module
    (tmp_path / "a.txt").write_text("some text\n")
    out = subprocess.run([sys.executable, "-m", "nvfp4_train.data.prepare", "--input", "a.txt", "--output-prefix",
                          "o", "--tokenizer", "missing.json"], **run)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["python -m nvfp4_train.data.prepare: error: tokenizer file missing.json not "
                                       "found (pass the path of a tokenizer.json)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
