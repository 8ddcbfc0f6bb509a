"""Generation (greedy, top-p) and perplexity from a checkpoint, with the run's tokenizer; their command lines
(help, progress, the default bound, streaming, tokens/s, routed warnings). Cached decoding against the uncached
path: tests/models/test_decode.py."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from nvfp4_train.generate import TextStream, generate, next_token
from tests.export.conftest import VALIDATION
from tests.precision.mcore_util import megatron_single_rank
from tests.trainer.runs import ROOT, env


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

    seen = []
    out = generate(Counter(), torch.tensor([[0]]), max_new_tokens=8, eod=eod, cache=False, on_token=seen.append)
    assert out.tolist() == [[0, 1, 2, 3]] and seen == [1, 2, 3]  # greedy, stopped after the end-of-document id
    a = generate(Counter(), torch.tensor([[5]]), max_new_tokens=6, temperature=50.0, seed=7, cache=False)
    b = generate(Counter(), torch.tensor([[5]]), max_new_tokens=6, temperature=50.0, seed=7, cache=False)
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
    text = generate_text(str(trained_tiny), "The kernel", max_new_tokens=4, device="cpu")
    assert text == generate_text(str(trained_tiny), "The kernel", max_new_tokens=4, device="cpu")  # greedy
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
        generate_text(str(ckpt), "x", max_new_tokens=1, device="cpu")


# ------------------------------------------------------------------------------------------ command lines

THIRD_PARTY = re.compile(r"\w+Warning: |site-packages")  # a warning as Python prints it, or its source path


def _python(*args: str) -> subprocess.CompletedProcess:
    e = env()
    e.pop("PYTHONWARNINGS", None)  # the caller's warning filters switch the routing off on purpose
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)


def test_every_module_entry_prints_its_help():
    for entry in (["-m", "nvfp4_train.generate"], ["-m", "nvfp4_train.evaluate"], ["scripts/generate.py"]):
        done = _python(*entry, "--help")
        assert done.returncode == 0 and done.stdout.startswith("usage: "), (entry, done.stdout, done.stderr)
        assert "exit status: 0 done; 2 bad arguments" in done.stdout


def test_the_commands_run_on_cuda_when_there_is_one(monkeypatch):
    from nvfp4_train.evaluate import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"


def test_progress_is_a_line_per_tenth_off_a_terminal_and_a_bar_on_one():
    from nvfp4_train.evaluate import Progress

    out = io.StringIO()
    progress = Progress(25, out=out)
    for _ in range(25):
        progress.update()
    lines = out.getvalue().splitlines()
    assert [int(line.split("%")[0]) for line in lines] == [12, 20, 32, 40, 52, 60, 72, 80, 92, 100]
    assert lines[-1].startswith("100% (25/25 batches, ")
    out = io.StringIO()
    progress = Progress(3, out=out)  # fewer steps than lines: one line per step
    for _ in range(3):
        progress.update()
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == ["33%", "66%", "100%"]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = Progress(3, out=out)
    for _ in range(3):
        progress.update()
    progress.close()
    assert "| 0/3 [" in out.getvalue() and "% (" not in out.getvalue()  # tqdm's bar (redrawn at most every 0.1 s)


def test_text_stream_holds_back_an_incomplete_character():
    from nvfp4_train.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    text = "Zoë's café 🙂 ✓ naïve"
    ids = tok.encode(text)
    writes: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            writes.append(s)

        def flush(self) -> None:
            pass

    stream = TextStream(tok, Out())
    for i in ids + [tok.eod]:
        stream.push(i)
    assert stream.close() == text == "".join(writes)
    assert "\ufffd" not in "".join(writes) and len(writes) < len(ids)  # a multi-byte character waited for its end


def test_evaluate_command_bounds_reports_progress_and_routes_warnings(trained_tiny):
    """A fresh process (megatron-core's warnings come at its import): none printed; 320 tokens bound it to 10
    batches of 1 x 32, with a progress line per batch and the share of the split on stderr."""
    done = _python("-m", "nvfp4_train.evaluate", str(trained_tiny), "--data", VALIDATION, "--seq-length", "32",
                   "--max-tokens", "320", "--precision", "bf16", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["batches"] == 10 and res["tokens"] == 320
    assert res["split_fraction"] == pytest.approx(10 * 33 / res["split_tokens"], rel=1e-12)
    assert not THIRD_PARTY.search(done.stderr), done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(" (")[0] for line in lines[:10]] == [f"{10 * i}%" for i in range(1, 11)]
    assert lines[10] == (f"evaluated 320 predicted tokens in 10 batches of 1 x 32: "
                         f"{100 * res['split_fraction']:.1f}% of the split's {res['split_tokens']} tokens; "
                         f"--max-tokens all evaluates the whole split")


def test_evaluate_default_bound_and_the_whole_split(trained_tiny, single_rank, capsys, monkeypatch):
    from nvfp4_train import evaluate

    monkeypatch.setattr(evaluate, "DEFAULT_MAX_TOKENS", 64)  # the default, as small as the fixture's split needs
    args = [str(trained_tiny), "--data", VALIDATION, "--seq-length", "32", "--precision", "bf16", "--device", "cpu"]
    assert evaluate.main(args) == 0
    assert json.loads(capsys.readouterr().out)["batches"] == 2
    assert evaluate.main([*args, "--max-tokens", "all"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert res["batches"] == res["split_tokens"] // 33 and "--max-tokens all" not in err


def test_generate_command_streams_the_text_and_reports_tokens_per_second(trained_tiny, single_rank):
    """A fresh process: the prompt and its continuation on stdout (the text generate_text returns), one line of
    tokens/s on stderr and no third-party warning."""
    from nvfp4_train.generate import generate_text

    done = _python("-m", "nvfp4_train.generate", str(trained_tiny), "--prompt", "The kernel", "--max-new-tokens", "8",
                   "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The kernel" + generate_text(str(trained_tiny), "The kernel", max_new_tokens=8,
                                                              device="cpu") + "\n"
    assert not THIRD_PARTY.search(done.stderr), done.stderr
    assert re.search(r"^[1-8] tokens in [0-9.]+ s: the first after [0-9.]+ s \(prompt of \d+ tokens\)"
                     r"(, then [0-9.]+ tokens/s)? \(cached decoding on cpu\)$", done.stderr, re.M), done.stderr


def test_command_errors_are_one_line(trained_tiny, single_rank, capsys):
    from nvfp4_train import evaluate
    from nvfp4_train import generate as gen_cli

    missing = f"{trained_tiny}_missing"
    assert gen_cli.main([missing, "--prompt", "x"]) == 2
    assert capsys.readouterr().err == f"python -m nvfp4_train.generate: checkpoint {missing} does not exist\n"
    assert evaluate.main([str(trained_tiny), "--data", f"{VALIDATION}_missing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m nvfp4_train.evaluate: ") and "_missing" in err, err
