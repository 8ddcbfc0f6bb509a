"""GPTDataset / blending through build_datasets: exact samples, weights, determinism, bad files, loaders."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4_train.data.datasets import (
    DataConfig,
    DataError,
    DataFileNotFound,
    PretrainingBatchSampler,
    build_data_loader,
    build_datasets,
    check_indexed_dataset,
)
from nvfp4_train.data.prepare import prepare

SEQ = 37  # odd, shorter than most documents and longer than some


def quiet(*_args) -> None:
    pass


@pytest.fixture
def prepared(tmp_path, tok, docs, jsonl):
    """The small corpus as <tmp>/tok/text_{train,validation}; returns (prefix, train docs, valid docs)."""
    train, valid = docs[:-12], docs[-12:]
    jsonl(tmp_path / "train.jsonl", train)
    jsonl(tmp_path / "valid.jsonl", valid)
    prefix = tmp_path / "tok" / "text"
    prepare([tmp_path / "train.jsonl"], prefix, valid_inputs=[tmp_path / "valid.jsonl"], tokenizer=tok, log=quiet)
    return prefix, train, valid


def config(prefix: Path, tmp_path: Path, **kw) -> DataConfig:
    kw.setdefault("train_prefixes", [f"{prefix}_train"])
    kw.setdefault("valid_prefixes", [f"{prefix}_validation"])
    return DataConfig(seq_length=kw.pop("seq_length", SEQ), cache_dir=str(tmp_path / "cache"), **kw)


def stream_of(ds, tok, texts) -> np.ndarray:
    """The documents in the dataset's (shuffled, epoch-repeated) document order, each followed by EOD."""
    ids = [tok.encode(t) + [tok.eod] for t in texts]
    return np.concatenate([ids[d] for d in ds.document_index]).astype(np.int64)


def test_samples_are_windows_of_the_document_stream(prepared, tmp_path, tok):
    prefix, train, valid = prepared
    n_train = sum(len(tok.encode(t)) + 1 for t in train) // SEQ * 2  # about two epochs
    tr, va = build_datasets(config(prefix, tmp_path), train_samples=n_train, valid_samples=20, tokenizer=tok)
    for ds, texts in ((tr, train), (va, valid)):
        assert len(ds) >= (n_train if ds is tr else 20)
        stream = stream_of(ds, tok, texts)
        for i in range(len(ds)):
            j = int(ds.shuffle_index[i])  # unshuffled sample j = stream[j*SEQ : j*SEQ + SEQ + 1]
            s = ds[i]
            window = torch.from_numpy(stream[j * SEQ : j * SEQ + SEQ + 1])
            assert torch.equal(s["tokens"], window[:-1]) and torch.equal(s["labels"], window[1:])
            assert torch.equal(s["loss_mask"], torch.ones(SEQ)) and torch.equal(s["position_ids"], torch.arange(SEQ))
    # the stream decodes back to the texts; megatron-core shuffles all epochs' documents together, so each
    # document appears once per epoch
    counts = np.bincount(tr.document_index, minlength=len(train))
    assert counts.min() == counts.max() >= 2
    decoded = tok.decode(stream_of(tr, tok, train))
    assert decoded.split("<|endoftext|>")[:-1] == [train[d] for d in tr.document_index]


def test_eod_options(prepared, tmp_path, tok):
    prefix, _, _ = prepared
    cfg = config(prefix, tmp_path, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True,
                 create_attention_mask=True)
    tr, _ = build_datasets(cfg, train_samples=50, valid_samples=0, tokenizer=tok)
    seen_eod = False
    for i in range(50):
        s = tr[i]
        eod = (s["tokens"] == tok.eod).nonzero().flatten().tolist()
        assert s["loss_mask"][eod].sum() == 0 and s["loss_mask"].sum() == SEQ - len(eod)
        if eod and eod[0] + 1 < SEQ:
            seen_eod = True
            assert s["position_ids"][eod[0] + 1] == 0  # positions restart after EOD
            assert s["attention_mask"][0, eod[0] + 1 :, : eod[0] + 1].all()  # megatron: True = masked out
    assert seen_eod


def test_blend_follows_weights(prepared, tmp_path, tok, jsonl):
    prefix, _, _ = prepared
    jsonl(tmp_path / "b.jsonl", [f"document {k} of the second source: " + "qwertzuiop " * (20 + k) for k in range(30)])
    prepare([tmp_path / "b.jsonl"], tmp_path / "b", valid_fraction=0.3, tokenizer=tok, log=quiet)
    cfg = config(prefix, tmp_path, train_prefixes=[f"{prefix}_train", f"{tmp_path}/b_train"], train_weights=[1, 3])
    tr, _ = build_datasets(cfg, train_samples=400, valid_samples=0, tokenizer=tok)
    # megatron-core's greedy blending keeps each count within 1 of weight * n at every prefix of the order
    counts = np.bincount(tr.dataset_index[:400], minlength=2)
    assert counts.tolist() == [100, 300]
    for n in (7, 50, 333):
        c = np.bincount(tr.dataset_index[:n], minlength=2)
        assert abs(c[0] - n / 4) <= 1 and abs(c[1] - 3 * n / 4) <= 1
    for i in range(400):  # every 37-token window of the second source holds its marker word
        s = tr[i]
        assert int(s["dataset_id"]) == tr.dataset_index[i]
        assert ("qwertzuiop" in tok.decode(s["tokens"].tolist())) == (tr.dataset_index[i] == 1)


def test_blend_without_weights_is_by_tokens(prepared, tmp_path, tok, jsonl):
    prefix, _, _ = prepared
    jsonl(tmp_path / "b.jsonl", ["gamma " * 200] * 5)
    prepare([tmp_path / "b.jsonl"], tmp_path / "b", valid_fraction=0.0, tokenizer=tok, log=quiet)
    a_tokens = check_indexed_dataset(f"{prefix}_train").tokens
    b_tokens = check_indexed_dataset(f"{tmp_path}/b_train").tokens
    cfg = config(prefix, tmp_path, train_prefixes=[f"{prefix}_train", f"{tmp_path}/b_train"])
    n = 3000  # more than one epoch of either source: weights=None in megatron-core would stop at one epoch
    tr, _ = build_datasets(cfg, train_samples=n, valid_samples=0, tokenizer=tok)
    assert (a_tokens + b_tokens) // SEQ < n // 5 and len(tr) >= n  # each source repeated, none cut short
    share_a = a_tokens / (a_tokens + b_tokens)
    assert abs(np.bincount(tr.dataset_index[:n], minlength=2)[0] - share_a * n) <= 1


def test_deterministic_and_seeded(prepared, tmp_path, tok):
    prefix, _, _ = prepared

    def samples(seed, cache):
        cfg = config(prefix, tmp_path / cache, seed=seed)
        tr, va = build_datasets(cfg, train_samples=100, valid_samples=10, tokenizer=tok)
        return torch.stack([tr[i]["tokens"] for i in range(100)]), torch.stack([va[i]["tokens"] for i in range(10)])

    a, b, c = samples(1, "c1"), samples(1, "c2"), samples(2, "c3")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    again = samples(1, "c1")  # from megatron-core's index cache
    assert torch.equal(a[0], again[0])
    assert len(list((tmp_path / "c1" / "cache").glob("*.npy"))) == 6  # 3 arrays per split, written once


def test_split_mode_without_valid_prefixes(prepared, tmp_path, tok):
    prefix, train, _ = prepared
    cfg = config(prefix, tmp_path, valid_prefixes=[], split="80,20,0")
    tr, va = build_datasets(cfg, train_samples=30, valid_samples=5, tokenizer=tok)
    n = len(train)
    lo = int(round(0.8 * n))
    # megatron-core's split: contiguous document ranges
    assert sorted(set(tr.document_index.tolist())) == list(range(lo))
    assert sorted(set(va.document_index.tolist())) == list(range(lo, n))


def test_missing_and_truncated_files_are_named(prepared, tmp_path, tok):
    prefix, _, _ = prepared
    info = check_indexed_dataset(f"{prefix}_train", tok)
    assert info.dtype is np.uint16 and info.documents == info.sequences
    assert info.tokens * 2 == os.path.getsize(f"{prefix}_train.bin")
    cfg = config(prefix, tmp_path)
    bin_, idx = Path(f"{prefix}_train.bin"), Path(f"{prefix}_train.idx")
    saved_bin, saved_idx = bin_.read_bytes(), idx.read_bytes()

    bin_.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{bin_} not found"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    bin_.write_bytes(saved_bin[:-2])
    with pytest.raises(ValueError, match=rf"{bin_} is truncated: {len(saved_bin) - 2} bytes, but .* = "
                                         rf"{len(saved_bin)} bytes"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    bin_.write_bytes(saved_bin + b"\0\0")
    with pytest.raises(ValueError, match=rf"{bin_} is {len(saved_bin) + 2} bytes, but .* different runs"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    bin_.write_bytes(saved_bin)
    idx.write_bytes(saved_idx[:-8])
    with pytest.raises(ValueError, match=rf"{idx} is truncated"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    idx.write_bytes(saved_idx[:20])
    with pytest.raises(ValueError, match=rf"{idx} is truncated: 20 bytes"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    idx.write_bytes(b"NOTANIDX" + saved_idx[8:])
    with pytest.raises(ValueError, match="not a megatron-core index"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    idx.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{idx} not found"):
        build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)
    idx.write_bytes(saved_idx)
    build_datasets(cfg, train_samples=10, valid_samples=1, tokenizer=tok)  # intact again


def test_tokenizer_mismatch_is_caught(prepared, tmp_path, tok):
    prefix, _, _ = prepared
    meta_path = Path(f"{prefix}_validation.meta.json")
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"]["sha256"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"{prefix}_validation was tokenized with .* re-run python -m "
                                         rf"nvfp4_train\.data\.prepare --tokenizer {re.escape(str(tok.path))} "
                                         rf"\(installed: nvfp4-prepare-data; in a checkout also "
                                         rf"scripts/prepare_data\.py\), or set data\.tokenizer to the one used"):
        build_datasets(config(prefix, tmp_path), train_samples=10, valid_samples=1, tokenizer=tok)


def test_a_missing_or_damaged_file_names_the_command_that_prepares_it(tmp_path):
    """The fix names the module command, which runs wherever the package is installed (``scripts/`` is not in a
    wheel); before, the messages named only scripts/prepare_data.py."""
    prefix = tmp_path / "text_train"
    with pytest.raises(DataFileNotFound) as missing:
        check_indexed_dataset(prefix)
    assert str(missing.value) == (
        f"{prefix}.idx not found (dataset prefix {str(prefix)!r}); create it with python -m nvfp4_train.data.prepare "
        f"--input ... --output-prefix ... (installed: nvfp4-prepare-data; in a checkout also "
        f"scripts/prepare_data.py), which writes <prefix>_train and <prefix>_validation")
    Path(f"{prefix}.idx").write_bytes(b"MMIDIDX")
    Path(f"{prefix}.bin").write_bytes(b"")
    with pytest.raises(DataError) as truncated:
        check_indexed_dataset(prefix)
    assert str(truncated.value).endswith(
        "; re-run python -m nvfp4_train.data.prepare (installed: nvfp4-prepare-data; in a checkout also "
        "scripts/prepare_data.py)")


def test_a_prefix_without_its_meta_file_warns_once_that_the_tokenizer_cannot_be_checked(prepared, tmp_path, tok):
    """A .bin/.idx pair written by another tool has no .meta.json: the ids are still scanned against the
    vocabulary, but which tokenizer wrote them cannot be known. Before, that passed silently."""
    import warnings

    prefix, _, _ = prepared
    meta = Path(f"{prefix}_train.meta.json")
    meta.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            check_indexed_dataset(f"{prefix}_train", tok)
        build_datasets(config(prefix, tmp_path), train_samples=10, valid_samples=1, tokenizer=tok)
    said = [str(w.message) for w in caught if "cannot be checked" in str(w.message)]
    assert said == [f"{meta} not found: the tokenizer {prefix}_train was prepared with cannot be checked (only that "
                    f"its ids fit the vocabulary); python -m nvfp4_train.data.prepare writes this file"]
    assert not [w for w in caught if f"{prefix}_validation" in str(w.message)]  # it has its meta file


def test_data_errors_are_their_own_classes(prepared, tmp_path, tok):
    """The trainer reports these as one-line errors (RunSetupError); they stay ValueError / FileNotFoundError."""
    prefix, _, _ = prepared
    Path(f"{prefix}_train.idx").write_bytes(b"MMIDIDX")
    with pytest.raises(DataError, match="is truncated: 7 bytes"):
        check_indexed_dataset(f"{prefix}_train", tok)
    Path(f"{prefix}_train.idx").unlink()
    with pytest.raises(DataFileNotFound) as e:
        build_datasets(config(prefix, tmp_path), train_samples=10, valid_samples=1, tokenizer=tok)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)


def test_too_few_tokens(prepared, tmp_path, tok):
    prefix, _, _ = prepared
    with pytest.raises(ValueError, match=r"not enough for one sample of seq_length 100000"):
        build_datasets(config(prefix, tmp_path, seq_length=100000), train_samples=1, valid_samples=0, tokenizer=tok)


def test_loader_splits_global_batches_over_ranks_and_resumes(prepared, tmp_path, tok):
    prefix, _, _ = prepared
    tr, _ = build_datasets(config(prefix, tmp_path), train_samples=64, valid_samples=0, tokenizer=tok)
    mbs, dp = 2, 3
    loaders = [build_data_loader(tr, micro_batch_size=mbs, dp_rank=r, dp_size=dp) for r in range(dp)]
    batches = [list(dl) for dl in loaders]
    steps = len(tr) // (mbs * dp)
    assert all(len(b) == steps for b in batches)
    for step in range(steps):  # global batch = rank 0's, rank 1's, rank 2's micro-batch, in sample order
        got = torch.cat([batches[r][step]["tokens"] for r in range(dp)])
        want = torch.stack([tr[i]["tokens"] for i in range(step * mbs * dp, (step + 1) * mbs * dp)])
        assert torch.equal(got, want)
    resumed = list(build_data_loader(tr, micro_batch_size=mbs, dp_rank=1, dp_size=dp, consumed_samples=3 * mbs * dp,
                                     num_workers=1))
    assert len(resumed) == steps - 3
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(resumed, batches[1][3:], strict=True))


def test_opening_a_loader_draws_nothing_from_the_process_rng(prepared, tmp_path, tok):
    """Each ``iter(DataLoader)`` drew one number from the process's CPU generator (its workers' base seed): a
    resumed run, which opens its iterator after restoring the RNG states, saved other RNG states than an
    uninterrupted run. The loader now has a generator of its own; the batches do not change."""
    prefix, _, _ = prepared
    tr, _ = build_datasets(config(prefix, tmp_path), train_samples=16, valid_samples=0, tokenizer=tok)
    before = torch.get_rng_state()
    for workers in (0, 1):
        first = next(iter(build_data_loader(tr, micro_batch_size=2, num_workers=workers)))
        assert torch.equal(first["tokens"], torch.stack([tr[0]["tokens"], tr[1]["tokens"]]))
    assert torch.equal(torch.get_rng_state(), before)


def test_batch_sampler_indices():
    s = PretrainingBatchSampler(total_samples=20, consumed_samples=4, micro_batch_size=2, dp_rank=1, dp_size=3)
    assert list(s) == [[6, 7], [12, 13]] and len(s) == 2
    with pytest.raises(ValueError):
        PretrainingBatchSampler(total_samples=20, consumed_samples=0, micro_batch_size=2, dp_rank=3, dp_size=3)


def test_config_validation():
    with pytest.raises(ValueError, match="2 weights for 1 data.train_prefixes"):
        DataConfig(train_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="must be positive"):
        DataConfig(train_prefixes=["a", "b"], train_weights=[1.0, 0.0])
    with pytest.raises(ValueError, match="data.split must be"):
        DataConfig(valid_prefixes=[], split="99;1")
    with pytest.raises(ValueError, match="seq_length"):
        DataConfig(seq_length=0)
    with pytest.raises(TypeError):
        DataConfig(["positional"])  # kw-only
    DataConfig(valid_prefixes=[], split="98,2")


def test_config_is_a_structured_omegaconf_schema():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(DataConfig)
    merged = OmegaConf.merge(base, {"train_prefixes": ["x", "y"], "train_weights": [0.3, 0.7], "seq_length": 8})
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DataConfig) and cfg.train_weights == [0.3, 0.7] and cfg.seq_length == 8
    with pytest.raises(Exception, match="seq_lenght"):
        OmegaConf.merge(base, {"seq_lenght": 8})
