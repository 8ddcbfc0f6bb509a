"""End to end, in subprocesses (train.py with the GPTModel stand-in, CPU, one rank): exact resume after
SIGTERM, fallback from a damaged checkpoint, a checkpoint of another model, non-finite steps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from nvfp4_train.metrics import load_metrics
from tests.side_by_side import for_selected_tests
from tests.trainer.runs import TINY, events, run, start, tail

STEPS = 8


def _wait_for_step(run_dir, step, proc, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        f = run_dir / "metrics.jsonl"
        if f.is_file() and any(r["step"] >= step for r in load_metrics(f)):
            return
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.02)
    raise TimeoutError(f"no step {step} in {run_dir}")


def _same(a, b, keys=("loss", "grad_norm", "lr", "tokens")):
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for k in keys:
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])  # bitwise (floats round-trip through JSON)


@pytest.fixture(scope="module")
def train_runs(request, tmp_path_factory) -> dict:
    """Each test's runs and checks in a thread, two tests at a time (their runs partly come one at a time):
    ``{test name: future}``; each test waits for its own, and its failure is raised there."""
    jobs = {"test_sigterm_resume_is_bitwise_and_damaged_checkpoint_falls_back": _sigterm_resume_gpt,
            "test_nonfinite_steps_are_skipped_then_the_run_stops": _nonfinite_steps,
            "test_sigterm_resume_is_bitwise_with_the_hybrid_nvfp4_model": _sigterm_resume_hybrid,
            "test_nonfinite_check_after_skip_trains_the_hybrid_nvfp4_model": _after_skip_hybrid}
    dirs = {name: tmp_path_factory.mktemp(name.removeprefix("test_")[:40]) for name in jobs}
    return for_selected_tests(request, {name: (lambda f=f, d=dirs[name]: f(d)) for name, f in jobs.items()})


def test_sigterm_resume_is_bitwise_and_damaged_checkpoint_falls_back(train_runs):
    train_runs["test_sigterm_resume_is_bitwise_and_damaged_checkpoint_falls_back"].result()


def _sigterm_resume_gpt(tmp_path):
    """Run A uninterrupted; run B checkpoints every 2 steps, gets SIGTERM sent to its whole process group (as
    Slurm and `timeout` do: the save on it must not depend on another process) after step 3, saves, exits 0,
    and is resumed: B's per-step losses, grad norms and lrs equal A's bitwise."""
    import os

    base = [*TINY, f"schedule.train_steps={STEPS}"]
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    b_args = [*base, "checkpoint.interval=2", f"experiment.run_dir={b_dir}"]
    a = start([*base, f"experiment.run_dir={a_dir}"], log=tmp_path / "a.log")
    b = start(b_args, log=tmp_path / "b.log", new_session=True)
    _wait_for_step(b_dir, 3, b)
    os.killpg(b.pid, signal.SIGTERM)
    assert b.wait(timeout=240) == 0, tail(tmp_path / "b.log")
    assert a.wait(timeout=240) == 0, tail(tmp_path / "a.log")
    ev = events(b_dir)
    stopped = [e for e in ev if e["event"] == "signal"][0]["step"]
    assert 3 <= stopped < STEPS
    assert (b_dir / "checkpoints" / f"step_{stopped:07d}" / "manifest.json").is_file()
    assert (b_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:07d}"

    # a checkpoint of another model size is a clear error, not a fallback (on a copy of B, beside B's resume)
    b4_dir = tmp_path / "b4"
    shutil.copytree(b_dir, b4_dir)
    b4 = start([*base, "checkpoint.interval=2", f"experiment.run_dir={b4_dir}", "model.hidden_size=64"],
               log=tmp_path / "b4.log")
    assert run(b_args, log=tmp_path / "b2.log") == 0, tail(tmp_path / "b2.log")
    rc = b4.wait(timeout=240)
    log = (tmp_path / "b4.log").read_text()
    assert rc == 2 and "Traceback" not in log, tail(tmp_path / "b4.log")  # one line (a RunSetupError)
    (line,) = [x for x in log.splitlines() if x.startswith("train.py: ")]
    assert "was written for another model" in line and "hidden_size: checkpoint 32, this run 64" in line
    assert [e["step"] for e in events(b_dir) if e["event"] == "resume"] == [stopped]
    ref = load_metrics(a_dir)
    _same(ref, load_metrics(b_dir))
    assert [r["val_loss"] for r in load_metrics(a_dir, "eval")] == [r["val_loss"] for r in load_metrics(b_dir, "eval")]

    # damage the newest checkpoint (end of run): resume falls back to the one before it, warns, redoes the
    # steps after it, and gets the same losses again
    ckpts = sorted((b_dir / "checkpoints").glob("step_*"))
    assert ckpts[-1].name == f"step_{STEPS:07d}" and len(ckpts) == 3  # keep_last
    last, previous = ckpts[-1], int(ckpts[-2].name.split("_")[1])
    shard = sorted((last / "dist").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert run(b_args, log=tmp_path / "b3.log") == 0, tail(tmp_path / "b3.log")
    log = (tmp_path / "b3.log").read_text()
    assert f"checkpoint {last} is not usable" in log and shard.name in log
    assert [e["step"] for e in events(b_dir) if e["event"] == "resume"] == [stopped, previous]
    _same(ref, load_metrics(b_dir))


def test_nonfinite_steps_are_skipped_then_the_run_stops(train_runs):
    train_runs["test_nonfinite_steps_are_skipped_then_the_run_stops"].result()


def _nonfinite_steps(tmp_path):
    base = [*TINY, "schedule.train_steps=6", "optim.max_consecutive_bad_steps=3"]
    # grad: step 1 (0-based) gets a NaN gradient with a finite loss -> megatron's found-inf path skips it
    g = start([*base, f"experiment.run_dir={tmp_path / 'g'}"], log=tmp_path / "g.log", STANDIN_NAN="grad:1")
    # loss: from step 2 on every loss is NaN -> skipped; the third in a row stops the run (exit status 3)
    n = start([*base, f"experiment.run_dir={tmp_path / 'n'}"], log=tmp_path / "n.log", STANDIN_NAN="loss:2,3,4,5")
    assert g.wait(timeout=240) == 0, tail(tmp_path / "g.log")
    assert n.wait(timeout=240) == 3, tail(tmp_path / "n.log")

    recs = load_metrics(tmp_path / "g")
    assert [r["skipped"] for r in recs] == [False, True, False, False, False, False]
    assert recs[1]["grad_norm"] is None and recs[1]["loss"] == recs[1]["loss"]  # finite loss, no norm
    assert recs[-1]["skipped_steps"] == 1
    skipped = [e for e in events(tmp_path / "g") if e["event"] == "skipped_step"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(2, "non-finite gradient")]

    recs = load_metrics(tmp_path / "n")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in recs] == [False, False, True, True, True]
    assert recs[-1]["skipped_steps"] == 3
    ev = events(tmp_path / "n")
    assert [e["event"] for e in ev if e["event"] in ("diverged", "end")] == ["diverged"]
    assert "3 consecutive steps with a non-finite loss or gradient" in (tmp_path / "n.log").read_text()
    # nothing was saved from the diverged state
    assert not list((tmp_path / "n" / "checkpoints").glob("step_*"))  # the directory is checked writable up front


def test_sigterm_resume_is_bitwise_with_the_hybrid_nvfp4_model(train_runs):
    train_runs["test_sigterm_resume_is_bitwise_with_the_hybrid_nvfp4_model"].result()


def _sigterm_resume_hybrid(tmp_path):
    """The same with the real model (nvfp4_train.models.build, tiny, nvfp4): stochastic rounding of the gradients draws
    from per-layer counters, which the checkpoint carries (tiny keeps 4 of 12 layers in bf16; the others
    round dy stochastically in dgrad and wgrad). This one saves the optimizer state as dp_reshardable (the
    other test: the default fully_reshardable), and is stopped by Ctrl-C: SIGINT to its process group, as a
    terminal sends it, handled as SIGTERM (before: a KeyboardInterrupt traceback, no checkpoint)."""
    pytest.importorskip("nvfp4_train.models.build")
    base = ["model=tiny", "precision=nvfp4", *[a for a in TINY if a.split("=")[0].split(".")[0] not in ("model", "experiment")],
            f"schedule.train_steps={STEPS}", "checkpoint.optim_format=dp_reshardable", "logging.telemetry_interval=3"]
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a = start([*base, f"experiment.run_dir={a_dir}"], log=tmp_path / "a.log")
    b = start([*base, f"experiment.run_dir={b_dir}"], log=tmp_path / "b.log", new_session=True)
    _wait_for_step(b_dir, 3, b)
    os.killpg(b.pid, signal.SIGINT)
    assert b.wait(timeout=240) == 0, tail(tmp_path / "b.log")
    assert "Traceback" not in (tmp_path / "b.log").read_text()
    assert [e["signum"] for e in events(b_dir, "signal")] == [signal.SIGINT]
    assert a.wait(timeout=240) == 0, tail(tmp_path / "a.log")
    assert run([*base, f"experiment.run_dir={b_dir}"], log=tmp_path / "b2.log") == 0, tail(tmp_path / "b2.log")
    manifest = json.loads(next((b_dir / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["meta"]["optim_format"] == "dp_reshardable"
    assert len([e for e in events(b_dir) if e["event"] == "resume"]) == 1
    _same(load_metrics(a_dir), load_metrics(b_dir))
    # telemetry (nvfp4_train.precision.telemetry) every 3 steps: steps 0, 3, 6 (0-based) -> records 1, 4, 7
    tel = load_metrics(a_dir, "telemetry")
    assert [r["step"] for r in tel] == [1, 4, 7]
    layers = tel[0]["layers"]
    assert "blocks.2.attention.qkv" in layers and "blocks.0.mamba.in_proj" not in layers  # block 0 is bf16
    assert set(layers["blocks.2.attention.qkv"]["fprop.x"]) == {"zero", "saturated", "sqnr_db"}


def test_nonfinite_check_after_skip_trains_the_hybrid_nvfp4_model(train_runs):
    train_runs["test_nonfinite_check_after_skip_trains_the_hybrid_nvfp4_model"].result()


def _after_skip_hybrid(tmp_path):
    """``logging.nonfinite_check=after_skip`` through train.py with real quantized layers: the check starts off
    (test_telemetry covers the switching) and training is unchanged by it: the losses equal the default's."""
    pytest.importorskip("nvfp4_train.models.build")
    base = ["model=tiny", "precision=nvfp4", *[a for a in TINY if a.split("=")[0].split(".")[0] not in ("model", "experiment")],
            "schedule.train_steps=3"]
    a = start([*base, f"experiment.run_dir={tmp_path / 'a'}"], log=tmp_path / "a.log")
    b = start([*base, "logging.nonfinite_check=after_skip", f"experiment.run_dir={tmp_path / 'b'}"], log=tmp_path / "b.log")
    assert a.wait(timeout=300) == 0, tail(tmp_path / "a.log")
    assert b.wait(timeout=300) == 0, tail(tmp_path / "b.log")
    la, lb = ([r["loss"] for r in load_metrics(tmp_path / d)] for d in ("a", "b"))
    assert len(la) == 3 and la == lb
