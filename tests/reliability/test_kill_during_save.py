"""SIGKILL during checkpoint saves, many times in a row: every restart resumes from a complete, verified
checkpoint, the newest one whose save finished, and the run ends with the losses of an uninterrupted run.

One ``train.py`` process (the GPTModel stand-in, CPU) per kill, all in one run directory, saving after every
step (``checkpoint.interval=1``, ``keep_last=2``, so pruning runs in every save). Each process is killed
while its k-th save (k = 1 or 2) is under way, at a random moment: a random delay after the save starts
(mostly inside megatron's dist-checkpoint write), as soon as the manifest is being written (the hashing and
the commit), or as soon as ``step_N`` exists (the ``latest`` update and the pruning). After each kill the
newest ``step_*`` must be the killed save if its rename happened and else the one before (none before
step 1), verify without a warning, and be at or after every checkpoint any process reported; ``latest``
must name a verified checkpoint; the next process must say it resumed from exactly that step.

The kill goes to the trainer's process group (as Slurm, ``timeout`` and a job's end deliver it), not to the
trainer alone, so that no orphaned checkpoint writer (megatron-core forks them during a save) outlives the
run and its temporary files; such an orphan does not hold the run-directory lock
(``tests/trainer/test_run_faults.py::test_a_forked_child_does_not_hold_the_run_directory_lock``)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import time
from pathlib import Path

from nvfp4_train.checkpoint import find_resume_checkpoint, list_checkpoints, step_dir_name, verify_checkpoint
from nvfp4_train.metrics import load_metrics
from tests.trainer.runs import TINY, events, run, start, tail

STEPS = 12  # more than the kills can reach (at most two saves per process): none hits the end
KILLS = 5
BASE = [*(a for a in TINY if not a.startswith("checkpoint.")), f"schedule.train_steps={STEPS}"]
SAVE_EVERY_STEP = ["checkpoint.interval=1", "checkpoint.keep_last=2"]


def _events(run_dir: Path, name: str) -> list[dict]:
    return events(run_dir, name) if (run_dir / "metrics.jsonl").is_file() else []


def _train_steps(run_dir: Path) -> list[int]:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    recs = (json.loads(line) for line in f.read_text().splitlines() if line.strip())
    return [r["step"] for r in recs if r["type"] == "train"]


def _fresh(path: Path, since_ns: int) -> bool:
    try:
        return path.stat().st_mtime_ns >= since_ns
    except FileNotFoundError:
        return False


def _wait_for_the_lock(run_dir: Path, timeout: float = 60) -> None:
    """Wait until no process holds the killed run's flock on ``<run dir>/.lock`` (released only when its
    last descriptor closes): the processes of the killed group exit a moment after the signal, and the next
    process must not find the directory in use."""
    lock = run_dir / ".lock"
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDONLY)
    try:
        t0 = time.time()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.time() - t0 < timeout, f"{lock} still locked {timeout}s after the kill"
                time.sleep(0.05)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _kill_during_a_save(proc, run_dir: Path, rng: random.Random, log: Path, timeout: float = 120) -> tuple[int, str]:
    """SIGKILL ``proc`` at a random moment of its k-th save (k = 1 or 2). A save of step N starts right after
    the ``train`` record of step N (every step is saved), so the records written by this process count the
    saves (a leftover ``.tmp_step_N`` of an earlier process cannot be told from a new one by its name).
    Returns N and how the moment was chosen."""
    k = rng.choice((1, 2))
    mode = rng.choice(("delay", "delay", "manifest", "renamed"))
    delay = rng.uniform(0.0, 0.5)
    before = len(_train_steps(run_dir))
    root = run_dir / "checkpoints"
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, f"the run ended before its save could be killed:\n{tail(log)}"
        mine = _train_steps(run_dir)[before:]
        if len(mine) >= k:
            step, t1, t1_ns = mine[k - 1], time.time(), time.time_ns()
            tmp, final = root / f".tmp_{step_dir_name(step)}", root / step_dir_name(step)
            if mode == "delay":
                time.sleep(delay)
            else:
                while time.time() - t1 < 30 and proc.poll() is None:
                    if mode == "manifest":  # the manifest is being written, or was renamed with its directory
                        if (_fresh(tmp / "manifest.json.tmp", t1_ns) or _fresh(tmp / "manifest.json", t1_ns)
                                or final.is_dir()):
                            break
                    elif final.is_dir():  # renamed: the `latest` update and the pruning follow
                        break
                    time.sleep(0.0005)
            assert proc.poll() is None, f"the run ended before its save could be killed:\n{tail(log)}"
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: see the module docstring
            proc.wait(timeout=30)
            _wait_for_the_lock(run_dir)
            return step, (f"{mode} {delay:.3f}s" if mode == "delay" else mode)
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError(f"no save started within {timeout}s:\n{tail(log)}")


def kill_schedule_seed() -> int:
    fixed = os.environ.get("TEST_GEN_SEED")  # replays a schedule, as for the gen fixture (tests/conftest.py)
    return int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")


def test_sigkill_during_saves_always_resumes_from_the_newest_complete_checkpoint(reliability_runs):
    seed, result = reliability_runs["test_sigkill_during_saves_always_resumes_from_the_newest_complete_checkpoint"]
    print(f"[kill schedule seed {seed}]")
    print("kills (step of the save, moment, result):", result.result())


def kill_during_saves(tmp_path: Path, seed: int) -> list:
    """The test's runs and checks (run by the package fixture ``reliability_runs``, beside the other end-to-end
    runs of tests/reliability); returns the kills' outcomes."""
    rng = random.Random(seed)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    root = run_dir / "checkpoints"
    ref = start([*BASE, "checkpoint.interval=0", f"experiment.run_dir={ref_dir}"], log=tmp_path / "ref.log")

    try:
        expected_resume = None  # the step the next process must resume from (None: start fresh)
        outcomes = []
        for i in range(KILLS):
            log = tmp_path / f"kill{i}.log"
            n_resume, n_start = len(_events(run_dir, "resume")), len(_events(run_dir, "start"))
            proc = start([*BASE, *SAVE_EVERY_STEP, f"experiment.run_dir={run_dir}"], log=log, new_session=True)
            step, how = _kill_during_a_save(proc, run_dir, rng, log)
            assert proc.returncode == -signal.SIGKILL
            resumes = _events(run_dir, "resume")
            if expected_resume is None:
                assert len(resumes) == n_resume and len(_events(run_dir, "start")) == n_start + 1, tail(log)
            else:
                assert len(resumes) == n_resume + 1 and resumes[-1]["step"] == expected_resume, (outcomes, tail(log))
            # the newest committed checkpoint: the save that was killed if it got as far as its rename, else the
            # one before (killed before its rename, or even before its directory was made); one later only if
            # the random delay outlasted the save
            committed = [int(p.name.removeprefix("step_")) for p in list_checkpoints(root)]
            newest = max(committed, default=0)
            assert step - 1 <= newest <= step + 1, (step, committed)
            expected_resume = newest
            outcomes.append((step, how, "renamed" if newest >= step else "not renamed"))
            # the newest checkpoint is good, no fallback to an older one: asserted below as `found` being the
            # newest listed checkpoint (no warnings filter: this job runs in a thread beside others)
            found = find_resume_checkpoint("auto", root)
            # nothing older was lost: every checkpoint the killed runs reported saved is at or before this one
            assert max((e["step"] for e in _events(run_dir, "checkpoint")), default=0) <= expected_resume
            if expected_resume == 0:  # killed during the very first save: nothing to resume, start fresh
                assert found is None and list_checkpoints(root) == [], outcomes
                expected_resume = None
                continue
            assert found == root / step_dir_name(expected_resume), (outcomes, found)
            assert list_checkpoints(root)[-1] == found and verify_checkpoint(found) == []
            # `latest` (for people and tools) may lag behind a rename, but names a complete checkpoint; it is
            # absent only while no save has got as far as writing it
            if (root / "latest").exists():
                latest = root / (root / "latest").read_text().strip()
                assert latest.name <= found.name and verify_checkpoint(latest) == [], (outcomes, latest)

    except BaseException:
        ref.kill()  # no orphaned reference run
        raise

    # the last process runs to the end, saving only there (fewer saves, same steps)
    rc = run([*BASE, "checkpoint.interval=0", f"experiment.run_dir={run_dir}"], log=tmp_path / "final.log")
    assert rc == 0, tail(tmp_path / "final.log")
    if expected_resume is not None:
        assert _events(run_dir, "resume")[-1]["step"] == expected_resume
    assert ref.wait(timeout=240) == 0, tail(tmp_path / "ref.log")
    got, want = load_metrics(run_dir), load_metrics(ref_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])  # bitwise: the resumed steps are exact
    assert (root / "latest").read_text().strip() == step_dir_name(STEPS)
    assert not list(root.glob(".tmp_*"))
    return outcomes
