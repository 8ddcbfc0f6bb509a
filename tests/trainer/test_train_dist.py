"""Two gloo ranks through torchrun (train.py with the GPTModel stand-in): PP=2 and TP=2 train, checkpoint,
and a TP=2 checkpoint resumes under PP=2 (megatron reshards the model)."""

from __future__ import annotations

import json
import math

import pytest

from nvfp4_train.metrics import load_metrics
from tests.trainer.runs import TINY, run, tail

pytestmark = pytest.mark.dist


def _events(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "event"]


def test_two_ranks_tp2_then_resume_under_pp2(tmp_path):
    d = tmp_path / "run"
    args = [*TINY, "schedule.eval_interval=2", f"experiment.run_dir={d}"]
    rc = run([*args, "schedule.train_steps=3", "parallel.tp=2"], nproc=2, log=tmp_path / "tp.log")
    assert rc == 0, tail(tmp_path / "tp.log")
    recs = load_metrics(d)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in recs)
    assert [r["step"] for r in load_metrics(d, "eval")] == [2, 3]
    ckpt = d / "checkpoints" / "step_0000003"
    assert (ckpt / "manifest.json").is_file()
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    # the same samples at step 1 under TP=2 as under TP=1: one loss per step, logged once (rank 0)
    assert sum(1 for line in (d / "metrics.jsonl").read_text().splitlines() if '"train"' in line) == 3

    # resume the TP=2 checkpoint with two pipeline stages: the model is resharded, the run continues
    rc = run([*args, "schedule.train_steps=5", "parallel.pp=2"], nproc=2, log=tmp_path / "pp.log")
    log = (tmp_path / "pp.log").read_text()
    assert rc == 0, tail(tmp_path / "pp.log")
    assert "the model weights are resharded" in log
    assert [e["step"] for e in _events(d) if e["event"] == "resume"] == [3]
    recs = load_metrics(d)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in recs)
    # continuing from trained weights: step 4's loss is below the untrained step 1's (ln(32768) = 10.397 at
    # init; after 3 steps at lr 1e-3 the bias of the output layer alone has moved far below that)
    assert recs[3]["loss"] < recs[0]["loss"]
    assert (d / "checkpoints" / "step_0000005" / "manifest.json").is_file()


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
