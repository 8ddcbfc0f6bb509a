"""Two gloo ranks through torchrun (train.py with the GPTModel stand-in): TP=2, PP=2 and DP=2 train and
checkpoint, and a TP=2 checkpoint resumes under PP=2 (model and optimizer state resharded)."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_train.metrics import load_metrics
from tests.trainer.runs import TINY, events, run, tail

pytestmark = pytest.mark.dist

FP32_U = 2.0 ** -24  # unit roundoff of fp32


def _read_dist(step_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's ``dist/`` folder, assembled to its global shape (offline, one process):
    the keys do not depend on the layout that wrote it (megatron's sharded state dict, ``fully_reshardable``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = FileSystemReader(str(step_dir / "dist"))
    md = reader.read_metadata()
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
           if isinstance(v, TensorStorageMetadata)}
    _load_state_dict(out, storage_reader=reader, no_dist=True)
    return out


def _adam_steps(step_dir) -> list[float]:
    common = torch.load(step_dir / "dist" / "common.pt", weights_only=False)  # a file this test's run wrote
    return [g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]]


def test_two_ranks_tp2_checkpoint_resumes_under_pp2(tmp_path):
    """TP=2 for 7 steps (checkpoints at 3 and 6); a second run resumes the step-3 checkpoint with two pipeline
    stages: the model AND the optimizer state (FP32 master weights, Adam moments and step, fully_reshardable
    format) are resharded, not restarted.

    Lockstep, no tolerance: the PP=2 run trains one step (4) at learning rate 0 and saves it. At lr 0 AdamW's
    update is exactly zero (decoupled weight decay multiplies by 1 - 0 * wd = 1, the step adds 0 * m / (sqrt(v)
    + eps), finite), so its master weights and bf16 parameters must be the TP=2 step-3 checkpoint's bit for bit,
    and its Adam step counter 4. The second moments after one more gradient are v4 = fl(fl(b2 v3) + (1 - b2)
    g^2) >= fl(b2 v3) (rounding is monotone, the added term is >= 0): exact against the loaded v3. A restart
    of the optimizer state (master weights from the bf16 parameters, zero moments; what dp_reshardable does
    across a TP/PP change) breaks all three: the master weights lose their low bits, the counter is 1, and
    v4 = (1 - b2) g^2 < b2 v3 wherever the earlier gradients dominate. (The multi-step loss comparison this
    replaces was exposed to bf16 rounding differences that Adam amplifies step after step.)"""
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

    lr0 = ["schedule.train_steps=4", "schedule.lr=0", "schedule.min_lr=0", "schedule.init_lr=0",
           "checkpoint.interval=0", "checkpoint.save_at_end=true"]
    rc = run([*args, *lr0, "parallel.pp=2", f"experiment.run_dir={pp}", f"checkpoint.resume={ckpt}"], nproc=2,
             log=tmp_path / "pp.log")
    assert rc == 0, tail(tmp_path / "pp.log")
    assert [e["step"] for e in events(pp) if e["event"] == "resume"] == [3]
    got = load_metrics(pp)
    assert [r["step"] for r in got] == [4] and got[0]["lr"] == 0.0
    assert math.isfinite(got[0]["loss"]) and got[0]["grad_norm"] > 0
    log = (tmp_path / "pp.log").read_text()
    assert "restart from the bf16 weights" not in log  # the optimizer state was loaded, not restarted
    assert "RNG states are not restored" in log  # another layout: the run continues from its seeds

    before, after = _read_dist(ckpt), _read_dist(pp / "checkpoints" / "step_0000004")
    assert set(before) == set(after)
    masters = [k for k in before if k.startswith("optimizer.state.param.")]
    model = [k for k in before if not k.startswith("optimizer.")]
    assert masters and len(masters) == len(model)
    for k in masters + model:
        assert torch.equal(after[k], before[k]), k  # bitwise (torch.equal: no NaN in a finite checkpoint)
    assert _adam_steps(ckpt) and set(_adam_steps(ckpt)) == {3.0}
    assert set(_adam_steps(pp / "checkpoints" / "step_0000004")) == {4.0}
    beta2 = 0.95  # OptimConfig's default, recorded in the checkpoint's param groups
    for k in (k for k in before if k.startswith("optimizer.state.exp_avg_sq.")):
        floor = before[k].mul(beta2)  # fl(b2 v3), as torch's AdamW computes it
        assert bool((after[k] >= floor).all()), (k, float((floor - after[k]).max()))


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
