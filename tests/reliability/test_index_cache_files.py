"""megatron-core's dataset index caches: a truncated cache (a write that was killed) or a file that is not a
plain ``.npy`` array (a planted pickle) is named, removed with its index set and rebuilt; nothing in it is
unpickled, and the rebuilt dataset gives exactly the samples of a fresh build."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4_train.data.datasets import DataConfig, build_datasets, check_index_caches
from nvfp4_train.data.prepare import prepare
from nvfp4_train.data.tokenizer import BPETokenizer
from tests.reliability.payload import Payload

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample_text.txt"
SEQ = 29


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tokens")
    paragraphs = [p.strip() for p in SAMPLE.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    for name, part in (("train", paragraphs[:-6]), ("valid", paragraphs[-6:])):
        with open(d / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for p in part:
                f.write(json.dumps({"text": p}) + "\n")
    prepare([d / "train.jsonl"], d / "text", valid_inputs=[d / "valid.jsonl"], log=lambda *a, **k: None)
    return d


def _config(tokens: Path, cache: Path, **kw) -> DataConfig:
    kw.setdefault("train_prefixes", [str(tokens / "text_train")])
    return DataConfig(valid_prefixes=[str(tokens / "text_validation")], seq_length=SEQ, cache_dir=str(cache), **kw)


def _samples(cfg: DataConfig) -> torch.Tensor:
    train, valid = build_datasets(cfg, train_samples=40, valid_samples=4, tokenizer=BPETokenizer())
    return torch.stack([train[i]["tokens"] for i in range(len(train))] + [valid[i]["tokens"] for i in range(4)])


def _cache_file(cache: Path, kind: str) -> Path:
    (f,) = sorted(cache.glob(f"*-GPTDataset-train-{kind}.npy"))
    return f


@pytest.mark.parametrize("cut", ["header", "half", "last_byte"])
def test_truncated_cache_is_named_and_rebuilt(tokens, tmp_path, cut):
    cache = tmp_path / "cache"
    cfg = _config(tokens, cache)
    fresh = _samples(cfg)
    f = _cache_file(cache, "sample_index")
    size = f.stat().st_size
    keep = {"header": 40, "half": size // 2, "last_byte": size - 1}[cut]
    with open(f, "r+b") as fh:
        fh.truncate(keep)
    # the fault: megatron-core memory-maps the truncated file (every later run fails the same way)
    with pytest.raises(ValueError):
        np.load(f, allow_pickle=True, mmap_mode="r")[-1]
    with pytest.warns(UserWarning) as rec:
        again = _samples(cfg)
    msgs = [str(w.message) for w in rec if str(f) in str(w.message)]
    assert len(msgs) == 1 and ("truncated" in msgs[0] or "header" in msgs[0]), msgs
    assert "rebuilds" in msgs[0]
    assert torch.equal(again, fresh)
    assert f.stat().st_size == size  # rebuilt in full
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete cache is used as it is, without a word
        assert torch.equal(_samples(cfg), fresh)


@pytest.mark.parametrize("kind", ["shuffle_index", "document_index", "dataset_index"])
def test_planted_pickle_in_a_cache_never_runs(tokens, tmp_path, kind):
    """A cache file replaced by a pickle (megatron-core 0.16.1 loads caches with ``allow_pickle=True``): it is
    named with the class it would import, removed and rebuilt; the payload never runs. ``dataset_index``:
    the blend cache (``BlendedDataset``), built for a blend of two training prefixes."""
    cache = tmp_path / "cache"
    blend = kind == "dataset_index"
    cfg = _config(tokens, cache, **({"train_prefixes": [str(tokens / "text_train"), str(tokens / "text_validation")],
                                     "train_weights": [0.7, 0.3]} if blend else {}))
    fresh = _samples(cfg)
    f = (sorted(cache.glob("*-BlendedDataset-train-dataset_index.npy"))[0] if blend else _cache_file(cache, kind))
    marker = tmp_path / "marker"
    original = np.load(f)
    with open(f, "wb") as fh:
        pickle.dump(Payload(marker), fh)
    # the payload is real: a permissive load runs it
    probe = tmp_path / "probe.npy"
    with open(probe, "wb") as fh:
        pickle.dump(Payload(tmp_path / "probe_marker"), fh)
    np.load(probe, allow_pickle=True, mmap_mode="r")
    assert (tmp_path / "probe_marker").exists()

    with pytest.warns(UserWarning) as rec:
        again = _samples(cfg)
    assert not marker.exists()
    msgs = [str(w.message) for w in rec if str(f) in str(w.message)]
    assert len(msgs) == 1 and "a pickle naming posix.system" in msgs[0], msgs
    assert torch.equal(again, fresh)
    assert np.array_equal(np.load(f), original)  # rebuilt as a plain .npy


def test_object_arrays_and_foreign_files(tmp_path):
    """An object-dtype ``.npy`` (only a pickle load reads it) is rebuilt too; files that are not megatron-core
    index caches are left alone."""
    cache = tmp_path / "cache"
    cache.mkdir()
    base = "0123abcd-GPTDataset-train"
    np.save(cache / f"{base}-document_index.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(cache / f"{base}-sample_index.npy", np.zeros((3, 2), np.int32))
    (cache / f"{base}-description.txt").write_text("{}")
    (cache / "notes.npy").write_bytes(b"not ours")
    with pytest.warns(UserWarning, match=r"document_index\.npy: a \.npy array of Python objects"):
        removed = check_index_caches([cache])
    assert sorted(p.name for p in removed) == sorted(f"{base}-{k}" for k in
                                                     ("document_index.npy", "sample_index.npy", "description.txt"))
    assert [p.name for p in cache.iterdir()] == ["notes.npy"]
