"""``Trainer`` built without running, stepped by ``train_step()`` (in this process, one rank, CPU, the GPTModel
stand-in): the step ``run()`` loops over, and a step whose update would be non-finite is a bad step."""

from __future__ import annotations

import math
import os

import pytest
import torch

from nvfp4_train.config import compose_config
from nvfp4_train.metrics import load_metrics
from nvfp4_train.trainer import StepOutcome, Trainer
from tests.trainer.runs import TINY, one_process_environ


@pytest.fixture
def one_process_env():
    """``setup_parallel`` writes the one-process rendezvous into ``os.environ``; undo it after the test."""
    with one_process_environ():
        yield


def _cfg(run_dir, *extra):
    return compose_config("train", [*TINY, "schedule.train_steps=3", "checkpoint.save_at_end=false",
                                    "data.num_workers=0", f"experiment.run_dir={run_dir}", *extra])


def test_train_step_is_the_step_run_loops_over(tmp_path, one_process_env):
    with Trainer(_cfg(tmp_path / "run")) as t:
        t.run()
    want = [r["loss"] for r in load_metrics(tmp_path / "run")]
    with Trainer(_cfg(tmp_path / "steps")) as t:
        outs = [t.train_step() for _ in range(3)]
        assert t.step == 3 and not list((tmp_path / "steps" / "checkpoints").glob("step_*"))
    assert all(isinstance(o, StepOutcome) and not o.skipped and o.reason is None for o in outs)
    assert [o.step for o in outs] == [1, 2, 3]
    assert [o.loss for o in outs] == want  # bitwise: the same step, the same data
    assert all(math.isfinite(float(o.grad_norm)) for o in outs)


def test_a_non_finite_learning_rate_skips_the_update(tmp_path, one_process_env, monkeypatch):
    """A NaN learning rate reaching the optimizer (the issue's ``schedule.lr=inf``, now refused at config time,
    gave NaN at the first warmup step and a finite loss) would make every weight NaN: the step is a bad step,
    skipped and counted, and the weights are untouched."""
    with Trainer(_cfg(tmp_path / "nan")) as t:
        resolved = type(t.lr_schedule.resolved)
        lr_at_step = resolved.lr_at_step
        monkeypatch.setattr(resolved, "lr_at_step",
                            lambda self, step: math.nan if step == 1 else lr_at_step(self, step))
        t.train_step()
        before = [p.detach().clone() for p in t.ddp.module.parameters()]
        out = t.train_step()
        assert (out.skipped, out.reason, out.grad_norm, out.step) == (True, "non-finite learning rate", None, 2)
        assert math.isfinite(out.loss) and math.isnan(out.lr)
        assert t.skipped_steps == 1 and t.streak.length == 1
        assert all(torch.equal(a, b) for a, b in zip(before, t.ddp.module.parameters()))
        nxt = t.train_step()
        assert not nxt.skipped and t.streak.length == 0 and t.skipped_steps == 1
        assert all(torch.isfinite(p).all() for p in t.ddp.module.parameters())


def test_a_resumed_run_saves_bitwise_the_uninterrupted_runs_state(tmp_path, one_process_env):
    """Train 4 steps and save; train 2 (a SIGTERM during step 2: save and stop), resume, train 2 and save: the
    two step_4 checkpoints hold the same RNG states and trainer state, not just the same losses. Before, each
    resume drew once more from the CPU generator (the data loader's iterator, made after the restore, took its
    workers' seed from it)."""
    import json
    import signal

    from nvfp4_train.checkpoint import step_dir_name

    a, b = tmp_path / "a", tmp_path / "b"
    with Trainer(_cfg(a, "schedule.train_steps=4", "checkpoint.save_at_end=true")) as t:
        t.run()
    with Trainer(_cfg(b, "schedule.train_steps=4", "checkpoint.save_at_end=true")) as t:
        step = t.train_step

        def preempted_in_step_2():
            if t.step == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: stop after this step
            return step()

        t.train_step = preempted_in_step_2
        assert t.run().stopped_by_signal and t.step == 2
    with Trainer(_cfg(b, "schedule.train_steps=4", "checkpoint.save_at_end=true")) as t:
        assert t.resumed_from == str(b / "checkpoints" / step_dir_name(2))
        t.run()
    last = [run / "checkpoints" / step_dir_name(4) for run in (a, b)]
    ra, rb = (torch.load(d / "rng" / "rank_00000.pt", weights_only=True) for d in last)
    assert ra.keys() == rb.keys()
    for key in ra:
        assert _same(ra[key], rb[key]), key
    sa, sb = (json.loads((d / "trainer_state.json").read_text()) for d in last)
    # the one difference: run b wrote step_2, whose weights gave step 3 a sound loss (run a wrote none before)
    assert (sa["recovery"].pop("checkpoint"), sb["recovery"].pop("checkpoint")) == (None, step_dir_name(2))
    assert sa == sb
    assert [r["loss"] for r in load_metrics(a)] == [r["loss"] for r in load_metrics(b)]


def _same(x, y) -> bool:
    """Bitwise equality of nested RNG states (tensors, tuples, lists, dicts, numbers, strings)."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y
