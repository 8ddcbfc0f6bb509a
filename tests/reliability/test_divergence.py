"""Divergence reported as such (``Trainer`` in this process, one rank, CPU, the GPTModel stand-in of
tests/trainer/standin.py): a run that ends inside a streak of skipped steps is a ``TrainingDiverged``
(``train.py`` exit status 3), and the stop report names a checkpoint a resume recovers from, not merely the
newest one with finite weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nvfp4_train.config import compose_config
from nvfp4_train.metrics import load_metrics
from nvfp4_train.trainer import Trainer, TrainingDiverged
from tests.trainer.runs import TINY, events
from tests.trainer.test_trainer_step import one_process_env  # noqa: F401 (a fixture)


def _cfg(run_dir: Path, *extra: str):
    return compose_config("train", [*TINY, "data.num_workers=0", f"experiment.run_dir={run_dir}", *extra])


def test_a_run_that_ends_inside_a_streak_of_skipped_steps_diverged(tmp_path, one_process_env,  # noqa: F811
                                                                    monkeypatch):
    """NaN losses in the last two of 6 steps (the limit is 5 in a row): before, the run ended normally (exit
    status 0, an ``end`` event reporting the last good loss, no final checkpoint)."""
    monkeypatch.setenv("STANDIN_NAN", "loss:4,5")  # steps 5 and 6, counted from 1
    run_dir = tmp_path / "run"
    with Trainer(_cfg(run_dir, "schedule.train_steps=6", "checkpoint.interval=2")) as t:
        with pytest.raises(TrainingDiverged) as e:
            t.run()
    ckpts = run_dir / "checkpoints"
    assert str(e.value).startswith("the run ended at step 6 inside a streak of 2 steps with a non-finite loss or "
                                   "gradient (2 skipped in total; last loss nan); no quantized layer saw a non-finite "
                                   "value (the loss, or a module outside them); no final checkpoint was written. ")
    # step_4's weights computed step 5's NaN loss: the report points at step_2 (whose next loss was sound)
    assert f"No loss inside the window followed the newest checkpoint, {ckpts / 'step_0000004'} (the loss left its " \
           f"window at step 5 (loss nan)); resume from {ckpts / 'step_0000002'}" in str(e.value)
    # in a new run directory, where resume=auto cannot pick the newer, ruined checkpoints
    assert f"experiment.run_dir={run_dir}_from_step_0000002" in str(e.value)
    (div,) = events(run_dir, "diverged")
    assert (div["step"], div["newest_checkpoint"], div["recover_from"], div["loss_left_window_at"]) == (
        6, str(ckpts / "step_0000004"), str(ckpts / "step_0000002"), 5)
    assert not events(run_dir, "end") and sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000002",
                                                                                           "step_0000004"]


def test_the_stop_report_after_a_huge_learning_rate_names_a_checkpoint_that_recovers(
        tmp_path, one_process_env):  # noqa: F811
    """``schedule.lr=1e6``, a checkpoint every step: step 1 runs at lr 0 (warmup), step 2 at 5e5 and its update
    makes every weight ~5e5; step 3's loss is ~2e12, finite, and later ones NaN. step_0000002 and step_0000003
    are finite (what ``resume=auto`` picks, and what the report used to call the last good checkpoint) but
    already ruined: resumed at a sane lr they never come back. The report names step_0000001, which does."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    with Trainer(_cfg(run_dir, "schedule.train_steps=8", "schedule.lr=1e6", "checkpoint.interval=1",
                      "optim.max_consecutive_bad_steps=2")) as t:
        with pytest.raises(TrainingDiverged) as e:
            t.run()
    msg = str(e.value)
    assert f"No loss inside the window followed the newest checkpoint, {ckpts / 'step_0000003'} (the loss left its " \
           f"window at step 3 (" in msg
    assert f"resume from {ckpts / 'step_0000001'}, the newest one a loss inside the window followed, in a new run " \
           f"directory (so that checkpoint.resume=auto there never returns to the newer ones): rerun with " \
           f"checkpoint.resume={ckpts / 'step_0000001'} experiment.run_dir={run_dir}_from_step_0000001 and a lower " \
           f"schedule.lr" in msg
    (div,) = events(run_dir, "diverged")
    assert div["recover_from"] == str(ckpts / "step_0000001") and div["loss_left_window_at"] == 3

    def resumed_losses(step: str) -> list[float]:
        with Trainer(_cfg(tmp_path / f"from_{step}", "schedule.train_steps=8", "checkpoint.save_at_end=false",
                          f"checkpoint.resume={ckpts / step}")) as r:
            return [r.train_step().loss for _ in range(2)]

    # Two regimes 1e11 apart: from step_0000001 (the initial weights: step 1 ran at lr 0) two steps at the default
    # lr stay near the initial loss ~ln(32768) = 10.4 (a loss 1% above it would already be a failed recovery);
    # from step_0000002 (every weight ~5e5) the loss is ~2e12 or not finite. The bounds sit between.
    first = load_metrics(run_dir)[0]["loss"]  # step 1, at lr 0: the initial weights' loss, ~ln(32768)
    recovered = resumed_losses("step_0000001")
    assert all(math.isfinite(x) and x < 1.01 * first for x in recovered), recovered
    ruined = resumed_losses("step_0000002")
    assert all(not math.isfinite(x) or x > 1e6 for x in ruined), ruined
