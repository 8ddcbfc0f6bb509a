"""A NaN injected into one quantized layer's gradient (the hybrid model, nvfp4, CPU, ``train.py`` in a
subprocess): the steps are skipped and counted, the run stops with exit status 3 and a report that names
that layer and gives its quantization telemetry, and ``checkpoint.resume=auto`` then resumes from the last
good checkpoint as if the bad steps had never happened."""

from __future__ import annotations

import math

import pytest

from nvfp4_train.metrics import load_metrics
from nvfp4_train.precision.telemetry import OPERAND_NAMES
from tests.trainer.runs import TINY, events, run, start, tail

pytest.importorskip("nvfp4_train.models.build")

STEPS = 7
LAYER = "blocks.3.mlp.fc2"  # an nvfp4 layer of the tiny model (its first and last blocks are bf16)
BASE = ["model=tiny", "precision=nvfp4",
        *(a for a in TINY if a.split("=")[0].split(".")[0] not in ("model", "experiment", "checkpoint")),
        "experiment.model_provider=tests.reliability.providers:hybrid", f"schedule.train_steps={STEPS}",
        "checkpoint.interval=3", "optim.max_consecutive_bad_steps=2"]


def test_nan_gradient_in_one_layer_is_skipped_named_and_resumed(reliability_runs):
    reliability_runs["test_nan_gradient_in_one_layer_is_skipped_named_and_resumed"].result()


def nan_gradient_runs(tmp_path) -> None:
    """The test's runs and checks (run by the package fixture ``reliability_runs``, beside the other end-to-end
    runs of tests/reliability)."""
    bad, ref = tmp_path / "bad", tmp_path / "ref"
    r = start([*BASE, f"experiment.run_dir={ref}"], log=tmp_path / "ref.log")
    # optimizer steps 3 and 4 (0-based; steps 4 and 5 counted from 1) get a NaN gradient at LAYER's output
    rc = run([*BASE, f"experiment.run_dir={bad}"], log=tmp_path / "bad.log",
             RELIABILITY_NAN_GRAD=f"{LAYER}:3,4")
    log = (tmp_path / "bad.log").read_text()
    assert rc == 3, tail(tmp_path / "bad.log")

    # skipped and counted, every one naming the layer
    recs = load_metrics(bad)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in recs] == [False, False, False, True, True]
    assert [r["skipped_steps"] for r in recs] == [0, 0, 0, 1, 2]
    assert all(r["grad_norm"] is None and math.isfinite(r["loss"]) for r in recs[3:])  # finite loss, NaN grad
    skipped = events(bad, "skipped_step")
    assert [(e["step"], e["reason"], e["consecutive"], e["first_nonfinite_layer"]) for e in skipped] == [
        (4, "non-finite gradient", 1, LAYER), (5, "non-finite gradient", 2, LAYER)]

    # the stop report: the layer, where it went non-finite, and its telemetry (collected in the step after
    # the first skipped one): its forward operands are finite, the NaN gradient gives NaN dy operands
    (div,) = events(bad, "diverged")
    assert div["step"] == 5 and not events(bad, "end")
    assert (div["first_nonfinite_layer"], div["first_nonfinite_step"], div["first_nonfinite_in"]) == (
        LAYER, 4, "backward")
    assert div["telemetry_step"] == 5
    tel = div["layer_telemetry"]
    assert set(tel) == set(OPERAND_NAMES)
    assert all(math.isfinite(tel[op]["sqnr_db"]) for op in ("fprop.x", "fprop.W", "wgrad.x_col"))
    assert all(math.isnan(tel[op]["sqnr_db"]) for op in ("dgrad.dy", "wgrad.dy_col"))
    assert load_metrics(bad, "telemetry")[-1]["step"] == 5
    assert f"first non-finite value: the input gradient of layer {LAYER} at step 4" in log
    assert "its quantization telemetry at step 5: fprop.x zero" in log
    assert "2 consecutive steps with a non-finite loss or gradient" in log
    ckpt = bad / "checkpoints" / "step_0000003"
    assert f"Resume from {ckpt}, the newest checkpoint (checkpoint.resume=auto picks it)" in log
    assert div["newest_checkpoint"] == div["recover_from"] == str(ckpt)  # step 4's loss was finite: ckpt is sound

    # resume on request: from that checkpoint, no fault now; the steps after it are those of a run that
    # never had one (bitwise: the checkpoint carries the stochastic-rounding counters)
    assert run([*BASE, f"experiment.run_dir={bad}"], log=tmp_path / "resume.log") == 0, tail(tmp_path / "resume.log")
    assert [e["step"] for e in events(bad, "resume")] == [3]
    assert r.wait(timeout=300) == 0, tail(tmp_path / "ref.log")
    got, want = load_metrics(bad), load_metrics(ref)
    assert [x["step"] for x in got] == [x["step"] for x in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert (a["loss"], a["grad_norm"], a["skipped_steps"]) == (b["loss"], b["grad_norm"], 0), a["step"]


@pytest.mark.dist
def test_nan_gradient_on_one_data_parallel_rank_is_skipped_by_all_and_named(tmp_path):
    """DP=2: the NaN gradient comes from rank 1's micro-batch only. Both ranks skip (the gradients are
    reduced, megatron's found-inf check is global), both stop together, and the report names the layer and
    its telemetry from rank 1, where it went non-finite (rank 0 wrote the report)."""
    out = tmp_path / "dp"
    args = [*(a for a in BASE if not a.startswith("schedule.train_steps")), "schedule.train_steps=4",
            f"experiment.run_dir={out}"]
    rc = run(args, nproc=2, log=tmp_path / "dp.log", RELIABILITY_NAN_GRAD=f"{LAYER}:1,2", RELIABILITY_NAN_RANK="1")
    log = (tmp_path / "dp.log").read_text()
    assert rc != 0 and "2 consecutive steps with a non-finite loss or gradient" in log, tail(tmp_path / "dp.log")
    assert [r["skipped"] for r in load_metrics(out)] == [False, True, True]
    assert [(e["step"], e["first_nonfinite_layer"]) for e in events(out, "skipped_step")] == [(2, LAYER), (3, LAYER)]
    (div,) = events(out, "diverged")
    assert (div["first_nonfinite_layer"], div["first_nonfinite_step"], div["first_nonfinite_rank"]) == (LAYER, 2, 1)
    assert div["telemetry_step"] == 3 and math.isnan(div["layer_telemetry"]["dgrad.dy"]["sqnr_db"])
    assert f"of layer {LAYER} at step 2 (rank 1)" in log
