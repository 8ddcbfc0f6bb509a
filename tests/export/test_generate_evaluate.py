"""Generation (greedy, top-p) and perplexity from a checkpoint, with the run's tokenizer."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from nvfp4_train.generate import generate, next_token
from tests.export.conftest import VALIDATION
from tests.precision.mcore_util import megatron_single_rank


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def test_greedy_is_argmax_and_top_p_keeps_the_nucleus(gen):
    logits = torch.randn(3, 50, generator=gen)
    assert torch.equal(next_token(logits), logits.argmax(-1))
    # probabilities 0.5, 0.3, 0.2: top_p = 0.6 keeps {0, 1} (0.5 < 0.6 before token 1; 0.8 >= 0.6 before token 2)
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    seen = {int(next_token(probs.log(), temperature=1.0, top_p=0.6, generator=gen)) for _ in range(200)}
    assert seen <= {0, 1} and 0 in seen  # P(token 0 never drawn in 200) = 0.375^200: never
    # a tiny top_p keeps only the most likely token, whatever the temperature
    assert all(int(next_token(probs.log(), temperature=5.0, top_p=1e-6, generator=gen)) == 0 for _ in range(20))
    with pytest.raises(ValueError, match="top_p"):
        next_token(logits, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        next_token(logits, temperature=-1.0)


def test_generate_stops_at_eod_and_is_reproducible(gen):
    vocab, eod = 11, 3

    class Counter(torch.nn.Module):  # logits favour (last token + 1) mod vocab
        def forward(self, input_ids, position_ids, attention_mask=None):
            return torch.nn.functional.one_hot((input_ids + 1) % vocab, vocab).float() * 10

    out = generate(Counter(), torch.tensor([[0]]), max_new_tokens=8, eod=eod)
    assert out.tolist() == [[0, 1, 2, 3]]  # greedy, stopped after the end-of-document id
    a = generate(Counter(), torch.tensor([[5]]), max_new_tokens=6, temperature=50.0, seed=7)
    b = generate(Counter(), torch.tensor([[5]]), max_new_tokens=6, temperature=50.0, seed=7)
    assert torch.equal(a, b) and a.shape == (1, 7)


def test_token_batches_cut_the_stream_in_order():
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from nvfp4_train.evaluate import token_batches

    stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in IndexedDataset(VALIDATION)])
    got = list(token_batches(VALIDATION, seq_length=31, batch_size=2, max_batches=3))
    assert len(got) == 3
    for i, (tokens, labels) in enumerate(got):
        assert tokens.shape == labels.shape == (2, 31)
        for r in range(2):
            start = (2 * i + r) * 32
            assert tokens[r].tolist() == stream[start:start + 31].tolist()
            assert labels[r].tolist() == stream[start + 1:start + 32].tolist()


def test_perplexity_and_generation_from_a_checkpoint(trained_tiny, single_rank, tmp_path):
    import shutil

    from nvfp4_train.evaluate import load_model, perplexity, token_batches
    from nvfp4_train.generate import generate_text

    info, model = load_model(str(trained_tiny), precision="trained")
    res = perplexity(model, token_batches(VALIDATION, seq_length=32, batch_size=2, max_batches=2))
    assert res["tokens"] == 2 * 2 * 32 and res["perplexity"] == pytest.approx(math.exp(res["loss"]), rel=1e-12)
    # three steps from a uniform start: the loss is near log(vocab) = 10.4
    assert 5 < res["loss"] < 12
    text = generate_text(str(trained_tiny), "The kernel", max_new_tokens=4)
    assert text == generate_text(str(trained_tiny), "The kernel", max_new_tokens=4)  # greedy: deterministic
    # the run's tokenizer is gone: a clear error
    ckpt = tmp_path / "ckpt"
    shutil.copytree(info.path, ckpt)
    cfg = (ckpt / "config.yaml").read_text().replace("tokenizer: null", f"tokenizer: {tmp_path / 'gone.json'}")
    (ckpt / "config.yaml").write_text(cfg)
    manifest = json.loads((ckpt / "manifest.json").read_text())  # keep the manifest true to the edited file
    manifest["files"]["config.yaml"] = {"size": len(cfg.encode()),
                                        "sha256": hashlib.sha256(cfg.encode()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="tokenizer is missing.*--tokenizer"):
        generate_text(str(ckpt), "x", max_new_tokens=1)
