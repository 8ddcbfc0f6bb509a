"""``Trainer`` built without running, stepped by ``train_step()`` (in this process, one rank, CPU, the GPTModel
stand-in): the step ``run()`` loops over, and a step whose update would be non-finite is a bad step."""

from __future__ import annotations

import contextlib
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


def test_one_host_read_per_step_and_the_next_batches_read_during_it(tmp_path, one_process_env):
    """Outside its forwards and backwards (a CUDA graph's replay on a GPU) a good step reads the device once:
    loss, non-finite flags, signal and the optimizer's two decisions in one ``tolist`` (a host read waits for
    every queued kernel: the host work after it runs while the GPU idles). The next step's micro-batches are
    read in this step, after its forwards and backwards are queued; the last step reads none ahead. The AdamW is
    the fused form a GPU run uses (torch's CPU default reads each parameter's step count on the host)."""
    from nvfp4_train.mcore_compat.optimizer import set_fused_adam
    from tests.trainer.test_clip import _HostReads, _ScalarCopies

    reads, copies, seen = _Outside(_HostReads), _Outside(_ScalarCopies), []
    with Trainer(_cfg(tmp_path / "r", "schedule.train_steps=3")) as t:
        run_fb = t._run_fb

        def fb(iterator, **kw):
            with reads.paused(), copies.paused():
                return run_fb(_Seen(iterator, seen), **kw)

        t._run_fb = fb
        set_fused_adam(t.optimizer, True)
        t.train_step()  # the first step opens the data and builds the optimizer's state
        want = [{k: v.clone() for k, v in b.items()} for b in t._ahead]
        loader = iter(t._loader(t.train_ds, t.cfg.schedule.global_batch_size))
        for b, ref in zip(want, [next(loader) for _ in range(t.num_micro)]):
            assert b.keys() == ref.keys() and all(torch.equal(b[k], ref[k]) for k in b)
        seen.clear()
        with reads.mode, copies.mode:
            out = t.train_step()
        assert not out.skipped
        assert reads.mode.reads == ["tolist"] and len(copies.mode.syncs) <= 1, (reads.mode.reads, copies.mode.syncs)
        # step 2 trained on what step 1 read ahead, and read step 3's
        assert len(seen) == t.num_micro and all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(seen, want))
        assert t._ahead is not None and len(t._ahead) == t.num_micro
        t.train_step()
        assert t.step == 3 and t._ahead is None  # nothing after the last step


class _Seen:
    """An iterator over ``it`` that keeps what it yields."""

    def __init__(self, it, seen: list) -> None:
        self.it, self.seen = it, seen

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.seen.append(item)
        return item


class _Outside:
    """A counting mode of tests/trainer/test_clip.py whose counts made inside ``paused()`` are dropped."""

    def __init__(self, kind) -> None:
        self.mode = kind()

    @contextlib.contextmanager
    def paused(self):
        counts = self.mode.reads if hasattr(self.mode, "reads") else self.mode.syncs
        n = len(counts)
        try:
            yield
        finally:
            del counts[n:]


def test_the_step_marks_its_host_phases_for_the_profiler(tmp_path, one_process_env):
    """``bench_train --profile`` splits the GPU's idle time by these ranges: a good step has each, in order,
    one after the other."""
    from torch.profiler import ProfilerActivity, profile

    from nvfp4_train.bench.profile import PHASE_PREFIX, host_ranges

    with Trainer(_cfg(tmp_path / "p")) as t:
        t.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t.train_step()
    ranges = host_ranges(prof, PHASE_PREFIX)
    assert [r[0][len(PHASE_PREFIX):] for r in ranges] == ["prepare", "forward_backward", "read_ahead",
                                                          "optimizer_begin", "host_read", "optimizer_finish", "end"]
    assert all(a[2] <= b[1] for a, b in zip(ranges, ranges[1:]))
