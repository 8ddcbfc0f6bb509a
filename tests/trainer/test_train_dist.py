"""Two gloo ranks through torchrun (train.py with the GPTModel stand-in): TP=2, PP=2 and DP=2 train and
checkpoint, and a TP=2 checkpoint resumes under PP=2 (model and optimizer state resharded)."""

from __future__ import annotations

import json
import math

import pytest

from nvfp4_train.metrics import load_metrics
from tests.trainer.runs import TINY, run, tail

pytestmark = pytest.mark.dist


def _events(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "event"]


def test_two_ranks_tp2_checkpoint_resumes_under_pp2(tmp_path):
    """TP=2 for 7 steps (checkpoints at 3 and 6); a second run resumes the step-3 checkpoint with two pipeline
    stages and must follow the TP=2 run: the model AND the optimizer state (FP32 master weights, Adam moments,
    fully_reshardable format) are resharded."""
    tp, pp = tmp_path / "tp", tmp_path / "pp"
    args = [*TINY, "schedule.train_steps=7", "schedule.lr=3e-3", "schedule.eval_interval=2", "checkpoint.interval=3"]
    rc = run([*args, "parallel.tp=2", f"experiment.run_dir={tp}"], nproc=2, log=tmp_path / "tp.log")
    assert rc == 0, tail(tmp_path / "tp.log")
    ref = load_metrics(tp)
    assert [r["step"] for r in ref] == list(range(1, 8))
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in ref)
    assert [r["step"] for r in load_metrics(tp, "eval")] == [2, 4, 6, 7]
    ckpt = tp / "checkpoints" / "step_0000003"
    assert (ckpt / "manifest.json").is_file()
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert sum(1 for line in (tp / "metrics.jsonl").read_text().splitlines() if '"train"' in line) == 7  # rank 0

    rc = run([*args, "parallel.pp=2", f"experiment.run_dir={pp}", f"checkpoint.resume={ckpt}"], nproc=2,
             log=tmp_path / "pp.log")
    assert rc == 0, tail(tmp_path / "pp.log")
    assert [e["step"] for e in _events(pp) if e["event"] == "resume"] == [3]
    got = load_metrics(pp)
    assert [r["step"] for r in got] == [4, 5, 6, 7]
    # TP=2 and PP=2 do the same arithmetic up to the order of the TP reductions and where activations are
    # rounded to bf16: measured |loss difference| <= 1.5e-4 over these steps, |grad norm difference| <= 0.005.
    # Restarting the optimizer state instead (master weights from bf16, zero Adam moments) moves step 5's
    # loss by 7.7e-3 and its grad norm by 0.27 (measured with optim_format=dp_reshardable): the bounds below
    # (1e-3, 0.05) separate the two.
    for a, b in zip(ref[3:], got):
        assert abs(a["loss"] - b["loss"]) < 1e-3, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 0.05, (a["step"], a["grad_norm"], b["grad_norm"])
    log = (tmp_path / "pp.log").read_text()
    assert "restart from the bf16 weights" not in log  # the optimizer state was loaded, not restarted
    assert "RNG states are not restored" in log  # another layout: the run continues from its seeds


def test_two_ranks_pp2_data_parallel_equivalence(tmp_path):
    """PP=2 over two ranks trains (1F1B over 2 micro-batches); DP=2 over two ranks gives the same first-step
    loss as one rank (the same 4 samples, the mean of two 2-sample means = the 4-sample mean up to rounding)."""
    pp, dp, one = tmp_path / "pp", tmp_path / "dp", tmp_path / "one"
    base = [*TINY, "schedule.train_steps=3", "checkpoint.save_at_end=false"]
    assert run([*base, "parallel.pp=2", f"experiment.run_dir={pp}"], nproc=2, log=tmp_path / "pp.log") == 0, \
        tail(tmp_path / "pp.log")
    assert run([*base, "schedule.micro_batch_size=2", f"experiment.run_dir={dp}"], nproc=2,
               log=tmp_path / "dp.log") == 0, tail(tmp_path / "dp.log")
    assert run([*base, f"experiment.run_dir={one}"], log=tmp_path / "one.log") == 0, tail(tmp_path / "one.log")
    lp, ld, lo = (load_metrics(x) for x in (pp, dp, one))
    assert [r["step"] for r in lp] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in lp)
    # one rank: mean over 2 micro-batch means (each over 64 tokens); DP=2: mean over the two ranks' single
    # micro-batch means of the same samples. Both average the same two fp32 numbers, in a different order
    # (a + b) / 2 vs a / 2 + b / 2: equal up to 1 ulp of ~10.4 (2e-6); bound 1e-5
    assert ld[0]["loss"] == pytest.approx(lo[0]["loss"], abs=1e-5)
