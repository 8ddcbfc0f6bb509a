"""Faults of a whole run (train.py in subprocesses, the GPTModel stand-in, CPU, one rank): no checkpoint during
a streak of bad steps, a second run in a used run directory, a run directory that is a file, a SIGTERM to the
process group with DataLoader workers and before the first step, and resumes that change the schedule or the
precision or re-run a finished run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nvfp4_train.metrics import load_metrics
from tests.side_by_side import for_selected_tests
from tests.trainer.runs import TINY, env, events, run, start, tail
from tests.trainer.test_train_run import _wait_for_step


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> tuple[Path, dict]:
    """The train.py runs of the tests below (each test's runs in the order they need), two tests' runs at a
    time: ``(folder, {test name: future of what its runs left})``."""
    tmp = tmp_path_factory.mktemp("run_faults")
    return tmp, for_selected_tests(request, {
        "test_resumes_that_change_the_run_say_so_and_a_finished_run_adds_no_eval": lambda: _resumes(tmp),
        "test_a_second_run_in_a_used_run_directory_is_refused_and_a_dead_runs_lock_taken_over":
            lambda: _second_run(tmp),
        "test_sigterm_to_the_process_group_with_dataloader_workers_saves_and_exits_0":
            lambda: _dataloader_workers(tmp),
        "test_no_checkpoint_is_written_during_a_streak_of_bad_steps": lambda: _streak(tmp),
        "test_sigterm_before_the_first_step_exits_0_and_names_it": lambda: _sigterm_in_build(tmp),
        "test_a_run_directory_that_is_a_file_is_one_line_and_exit_status_4": lambda: _run_dir_is_a_file(tmp),
    })


def _streak(tmp: Path) -> tuple:
    out = tmp / "n"
    args = [*TINY, "schedule.train_steps=6", "optim.max_consecutive_bad_steps=3", "checkpoint.interval=1",
            f"experiment.run_dir={out}"]
    return run(args, log=tmp / "n.log", STANDIN_NAN="loss:2,3,4"), out


def test_no_checkpoint_is_written_during_a_streak_of_bad_steps(runs):
    """NaN losses from step 3 (counted from 1) on, a checkpoint due every step: steps 3 and 4 are skipped and
    save nothing (before: step_3 and step_4 were written from the failing state and the stop report named
    step_4); the stop report names step_2, the last checkpoint before the streak."""
    tmp, res = runs
    rc, out = res["test_no_checkpoint_is_written_during_a_streak_of_bad_steps"].result()
    assert rc == 3, tail(tmp / "n.log")
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000002"]
    assert [e["step"] for e in events(out) if e["event"] == "checkpoint_skipped"] == [3, 4]
    (div,) = [e for e in events(out) if e["event"] == "diverged"]
    ckpts = out / "checkpoints"
    assert div["newest_checkpoint"] == str(ckpts / "step_0000002")
    # step_2's weights computed step 3's NaN loss: the report points at step_1, the newest one followed by a
    # sound loss (tests/reliability/test_divergence.py)
    assert div["recover_from"] == str(ckpts / "step_0000001") and div["loss_left_window_at"] == 3
    assert f"No loss inside the window followed the newest checkpoint, {ckpts / 'step_0000002'} (the loss left its " \
           f"window at step 3 (loss nan)); resume from {ckpts / 'step_0000001'}" in (tmp / "n.log").read_text()


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"pid 4242 on host elsewhere\\n")
print("locked", flush=True)
time.sleep(600)
"""


def _second_run(tmp: Path) -> dict:
    """A run directory locked by a live process (a second run is refused), then by a dead one (taken over)."""
    out = tmp / "r"
    out.mkdir()
    got = {"out": out}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        got["holder"] = holder.stdout.readline().strip()
        args = [*TINY, "schedule.train_steps=3", f"experiment.run_dir={out}"]
        got["second"] = run(args, log=tmp / "second.log")
        got["left"] = sorted(p.name for p in out.iterdir())
    finally:
        holder.kill()  # SIGKILL: the kernel drops its flock, the lock file stays
        holder.wait()
    got["third"] = run(args, log=tmp / "third.log")
    return got


def test_a_second_run_in_a_used_run_directory_is_refused_and_a_dead_runs_lock_taken_over(runs):
    tmp, res = runs
    got = res["test_a_second_run_in_a_used_run_directory_is_refused_and_a_dead_runs_lock_taken_over"].result()
    out = got["out"]
    assert got["holder"] == "locked"
    assert got["second"] == 2, tail(tmp / "second.log")
    log = (tmp / "second.log").read_text()
    assert f"run directory {out} is in use by another run (pid 4242 on host elsewhere" in log
    assert got["left"] == [".lock"]  # nothing written: no metrics.jsonl, config.yaml, warnings.log (appended to before)
    assert got["third"] == 0, tail(tmp / "third.log")
    (ev,) = [e for e in events(out) if e["event"] == "lock_taken_over"]
    assert ev["previous"] == "pid 4242 on host elsewhere"


_FORK_AND_HOLD = """
import os, sys, time
from pathlib import Path
from nvfp4_train.trainer import _RunDirLock
lock = _RunDirLock(Path(sys.argv[1]))
child = os.fork()
if child == 0:  # as megatron's checkpoint writer forks its workers during a save
    time.sleep(600)
    os._exit(0)
print(child, flush=True)
time.sleep(600)
"""


def test_a_forked_child_does_not_hold_the_run_directory_lock(tmp_path):
    """The trainer SIGKILLed while a process it forked lives on (an orphaned checkpoint writer): the lock is free
    at once. Before, the child shared the flock's open file description and held the lock until it ended, and
    every restart was refused as "in use by another run"."""
    import fcntl

    holder = subprocess.Popen([sys.executable, "-c", _FORK_AND_HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env=env())
    child = int(holder.stdout.readline())
    try:
        fd = os.open(tmp_path / ".lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # held while the trainer lives
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait()
            os.kill(child, 0)  # the forked child is still alive
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and the lock is free
        finally:
            os.close(fd)
    finally:
        holder.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _dataloader_workers(tmp: Path) -> tuple:
    out = tmp / "w"
    p = start([*TINY, "schedule.train_steps=40", "data.num_workers=2", f"experiment.run_dir={out}"],
              log=tmp / "w.log", new_session=True)
    try:
        _wait_for_step(out, 2, p)
        os.killpg(p.pid, signal.SIGTERM)
        return p.wait(timeout=240), out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_sigterm_to_the_process_group_with_dataloader_workers_saves_and_exits_0(runs):
    """With data.num_workers=2 the SIGTERM of the whole group (Slurm, `timeout`) killed the workers and the run
    died ("DataLoader worker ... is killed by signal: Terminated") without a checkpoint."""
    tmp, res = runs
    rc, out = res["test_sigterm_to_the_process_group_with_dataloader_workers_saves_and_exits_0"].result()
    assert rc == 0, tail(tmp / "w.log")
    stopped = [e for e in events(out) if e["event"] == "signal"][0]["step"]
    assert (out / "checkpoints" / f"step_{stopped:07d}" / "manifest.json").is_file()


def _sigterm_in_build(tmp: Path) -> tuple:
    out = tmp / "s"
    args = [*TINY, "schedule.train_steps=3", "experiment.model_provider=tests.reliability.providers:gpt",
            f"experiment.run_dir={out}"]
    return run(args, log=tmp / "s.log", RELIABILITY_SIGTERM_IN_BUILD="1"), out


def test_sigterm_before_the_first_step_exits_0_and_names_it(runs):
    """A SIGTERM while the model is built (it ended the process with -15): the run stops before training,
    exit 0, with a message; nothing is saved."""
    tmp, res = runs
    rc, out = res["test_sigterm_before_the_first_step_exits_0_and_names_it"].result()
    assert rc == 0, tail(tmp / "s.log")
    assert "signal received before the first step; stopping without training" in (tmp / "s.log").read_text()
    assert load_metrics(out) == [] and not list((out / "checkpoints").glob("step_*"))  # the directory is checked writable up front
    (ev,) = [e for e in events(out) if e["event"] == "signal"]
    assert ev["before_first_step"] is True


def _run_dir_is_a_file(tmp: Path) -> int:
    (tmp / "afile").write_text("x")
    return run([*TINY, "schedule.train_steps=3", f"experiment.run_dir={tmp / 'afile'}"], log=tmp / "f.log")


def test_a_run_directory_that_is_a_file_is_one_line_and_exit_status_4(runs):
    """Before: ``FileExistsError`` in a 24-line traceback, exit status 1 (``warnings.log`` was opened in the run
    directory before anything checked it)."""
    tmp, res = runs
    rc = res["test_a_run_directory_that_is_a_file_is_one_line_and_exit_status_4"].result()
    log = (tmp / "f.log").read_text()
    assert rc == 4, tail(tmp / "f.log")
    assert "Traceback" not in log
    (line,) = [x for x in log.splitlines() if x.startswith("train.py: ")]
    assert line == (f"train.py: cannot write {tmp / 'afile'}: {tmp / 'afile'} is a file, not a directory, found "
                    f"before the first step: set experiment.run_dir / checkpoint.dir to a writable directory (or make "
                    f"this one writable)")


def test_sigterm_while_the_config_is_composed_exits_0(tmp_path):
    """The same before the trainer exists (train.py composing the config): a named message, exit 0."""
    code = ("import os, signal, sys, train\n"
            "import nvfp4_train.config as c\n"
            "def compose(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "c.compose_config = compose\n"
            "sys.exit(train.train_main(['schedule.train_steps=1']))\n")
    from tests.trainer.runs import ROOT

    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stopped by signal SIGTERM before training started (nothing to save)" in r.stderr


def _resumes(tmp: Path) -> dict:
    """A 3-step run, the finished run again, then longer and in another precision; what each run left."""
    out = tmp / "c"
    base = [*TINY, f"experiment.run_dir={out}"]
    got = {"out": out, "first": run([*base, "schedule.train_steps=3"], log=tmp / "1.log")}
    got["first_evals"] = [r["step"] for r in load_metrics(out, "eval")] if got["first"] == 0 else None
    got["again"] = run([*base, "schedule.train_steps=3"], log=tmp / "2.log")
    got["again_evals"] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                          if '"type": "eval"' in x]
    got["longer"] = run([*base, "schedule.train_steps=5", "precision=bf16"], log=tmp / "3.log")
    return got


def test_resumes_that_change_the_run_say_so_and_a_finished_run_adds_no_eval(runs):
    tmp, res = runs
    got = res["test_resumes_that_change_the_run_say_so_and_a_finished_run_adds_no_eval"].result()
    out = got["out"]
    assert got["first"] == 0, tail(tmp / "1.log")
    assert got["first_evals"] == [3]
    # the finished run again: it resumes at its end and appends no second eval record
    assert got["again"] == 0, tail(tmp / "2.log")
    assert [r["step"] for r in got["again_evals"]] == [3]
    # longer, and another precision: a warning and an event for each
    assert got["longer"] == 0, tail(tmp / "3.log")
    log = (tmp / "3.log").read_text()
    assert "the schedule differs from checkpoint" in log and "the precision differs from checkpoint" in log
    (sched,) = [e for e in events(out) if e["event"] == "schedule_change"]
    assert sched["step"] == 3 and sched["changed"]["train_steps"] == [3, 5]
    (prec,) = [e for e in events(out) if e["event"] == "precision_change"]
    assert (prec["checkpoint"]["recipe"], prec["now"]["recipe"]) == ("nvfp4", "bf16")
    assert not [e for e in events(out) if e["event"] == "lock_taken_over"]  # each run released it cleanly
