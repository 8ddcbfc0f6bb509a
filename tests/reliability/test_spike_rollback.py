"""The loss-spike detector in the trainer (``spike.*``), end to end with ``train.py`` in subprocesses on CPU.
A spike is injected by multiplying the model's loss by 3 in chosen steps (tests/reliability/providers.py),
and every run logs a hash of each training micro-batch, so the data a run trained on can be compared.

- log only (the hybrid nvfp4 model, telemetry every 5 steps): the spike is an event with the step, the loss,
  the running median and the latest per-layer telemetry; the next step collects telemetry; the run goes on.
- rollback (the GPTModel stand-in, checkpoints every 2 steps, ``max_rollbacks=1``): the first spike reloads
  the last checkpoint and skips the data window since it (the spiking step's batch included): the run's
  batches are exactly the uninterrupted stream, never one of the window again; the second spike stops the
  run (exit status 3); the checkpoint holds the detector state, the rollback count and the skipped samples;
  resuming it continues the stream past the skipped window; with no checkpoint yet the spike is only logged.
"""

from __future__ import annotations

import json
import statistics

import pytest

from nvfp4_train.metrics import load_metrics
from nvfp4_train.precision.telemetry import OPERAND_NAMES
from tests.trainer.runs import TINY, events, run, start, tail

pytest.importorskip("nvfp4_train.models.build")

GBS, MICRO = 4, 2  # TINY: 4 samples per step in 2 micro-batches
SPIKE = ["spike.factor=1.5", "spike.window=8", "spike.min_history=3"]
COMMON = [*(a for a in TINY if a.split("=")[0].split(".")[0] not in ("model", "experiment", "checkpoint")), *SPIKE]
GPT = [*(a for a in TINY if a.startswith("model.")), "experiment.model_provider=tests.reliability.providers:gpt"]
HYBRID = ["model=tiny", "precision=nvfp4", "experiment.model_provider=tests.reliability.providers:hybrid"]


def _batches(path):
    return path.read_text().split()


def test_spike_is_logged_or_rolled_back_past_its_data_window(reliability_runs):
    reliability_runs["test_spike_is_logged_or_rolled_back_past_its_data_window"].result()


def spike_runs(tmp_path) -> None:
    """The test's runs and checks (run by the package fixture ``reliability_runs``, beside the other end-to-end
    runs of tests/reliability)."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    # A: log only, 12 steps, the loss of step 6 (0-based 5) x 3. Its batches are the reference stream: B's
    # dataset has the same size (10 steps + a reserve of max_rollbacks x checkpoint.interval = 2 steps).
    a = start([*HYBRID, *COMMON, "schedule.train_steps=12", "logging.telemetry_interval=5", "checkpoint.interval=0",
               f"experiment.run_dir={a_dir}"], log=tmp_path / "a.log",
              RELIABILITY_LOSS_SCALE="3:5", RELIABILITY_BATCH_LOG=str(tmp_path / "a.batches"))
    # C: rollback asked for, but no checkpoint yet (none before the end): the spike is logged, the run goes on
    c_dir = tmp_path / "c"
    c = start([*GPT, *COMMON, "schedule.train_steps=7", "checkpoint.interval=0", "spike.rollback=true",
               f"experiment.run_dir={c_dir}"], log=tmp_path / "c.log", RELIABILITY_LOSS_SCALE="3:5")
    # B: rollback, 10 steps, spikes in the 6th and the 10th training step of the process
    b_args = [*GPT, *COMMON, "schedule.train_steps=10", "checkpoint.interval=2", "spike.rollback=true",
              "spike.max_rollbacks=1", f"experiment.run_dir={b_dir}"]
    rc = run(b_args, log=tmp_path / "b.log", RELIABILITY_LOSS_SCALE="3:5,9",
             RELIABILITY_BATCH_LOG=str(tmp_path / "b.batches"))
    assert rc == 3, tail(tmp_path / "b.log")
    assert a.wait(timeout=300) == 0, tail(tmp_path / "a.log")
    assert c.wait(timeout=300) == 0, tail(tmp_path / "c.log")
    assert [e["step"] for e in events(c_dir, "loss_spike")] == [6] and not events(c_dir, "rollback")
    assert "step 6: no checkpoint to roll back to yet; continuing" in (tmp_path / "c.log").read_text()
    assert [r["step"] for r in load_metrics(c_dir)] == list(range(1, 8))

    # A: one spike event, at step 6, against the median of steps 1-5, with the telemetry collected in step 6
    # (every 5 steps: 1, 6, 11); the step after the spike collects it too (7)
    recs = load_metrics(a_dir)
    (ev,) = events(a_dir, "loss_spike")
    assert ev["step"] == 6 and ev["loss"] == recs[5]["loss"] and ev["factor"] == 1.5
    assert ev["median"] == statistics.median(r["loss"] for r in recs[:5])
    assert ev["loss"] > 1.5 * ev["median"]
    assert ev["telemetry_step"] == 6 and "blocks.2.attention.qkv" in ev["telemetry"]
    assert set(ev["telemetry"]["blocks.2.attention.qkv"]) == set(OPERAND_NAMES)
    assert [r["step"] for r in load_metrics(a_dir, "telemetry")] == [1, 6, 7, 11]
    assert not events(a_dir, "rollback") and [r["step"] for r in recs] == list(range(1, 13))
    ref = _batches(tmp_path / "a.batches")
    assert len(ref) == 12 * MICRO and len(set(ref)) == len(ref)

    # B: spike at 6 -> back to the checkpoint of step 4, samples [16, 24) (steps 5 and 6) skipped; the redone
    # steps 5-8 train on the batches of A's steps 7-10; the spike at (redone) step 8 finds no rollback left
    spikes = events(b_dir, "loss_spike")
    assert [e["step"] for e in spikes] == [6, 8]
    (rb,) = events(b_dir, "rollback")
    assert (rb["step"], rb["from_step"], rb["skipped_samples"], rb["rollbacks"]) == (4, 6, [16, 24], 1)
    assert rb["checkpoint"] == str(b_dir / "checkpoints" / "step_0000004")
    assert _batches(tmp_path / "b.batches") == ref[:10 * MICRO]
    (div,) = events(b_dir, "diverged")
    assert div["step"] == 8 and "spike.max_rollbacks=1 rollbacks done" in div["message"]
    assert "loss spike" in (tmp_path / "b.log").read_text()
    recs = load_metrics(b_dir)
    assert [r["step"] for r in recs] == list(range(1, 9))
    # the newest checkpoint (step 6, redone) carries what a resume needs
    state = json.loads((b_dir / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())
    assert (state["step"], state["consumed_samples"], state["skipped_samples"], state["rollbacks"]) == (6, 32, 8, 1)
    assert state["spike"] == {"history": [r["loss"] for r in recs[:6]], "seen": 6}

    # resume B without faults: from step 6 at sample 32, i.e. A's batches of steps 9-12 for steps 7-10
    rc = run(b_args, log=tmp_path / "b2.log", RELIABILITY_BATCH_LOG=str(tmp_path / "b2.batches"))
    assert rc == 0, tail(tmp_path / "b2.log")
    assert [e["step"] for e in events(b_dir, "resume")] == [6]
    assert _batches(tmp_path / "b2.batches") == ref[8 * MICRO:]
    state = json.loads((b_dir / "checkpoints" / "step_0000010" / "trainer_state.json").read_text())
    assert (state["consumed_samples"], state["skipped_samples"], state["rollbacks"]) == (48, 8, 1)

    # the data position is step x global batch + skipped samples: a checkpoint resumed with another global
    # batch size is refused, naming both
    rc = run([*b_args, "schedule.global_batch_size=8"], log=tmp_path / "b3.log")
    assert rc != 0 and ("consumed_samples=48 is not step * global_batch_size + skipped_samples = 10 * 8 + 8"
                        in (tmp_path / "b3.log").read_text()), tail(tmp_path / "b3.log")
