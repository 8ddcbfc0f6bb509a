"""What a run finds wrong before its first step is one ``RunSetupError`` (``train.py``: one line, exit status 2),
a run directory that cannot be written a ``CheckpointWriteError`` (exit status 4), and a run directory in use is
refused before anything is written into it. ``Trainer`` built in this process (one rank, CPU, the GPTModel
stand-in); the command line around it: ``tests/reliability/test_checkpoint_faults.py`` (a refused checkpoint)
and ``tests/trainer/test_run_faults.py`` (a run directory that is a file, a locked one)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from nvfp4_train.checkpoint import CheckpointWriteError
from nvfp4_train.config import compose_config
from nvfp4_train.mcore_compat.safe_load import UntrustedPickleError
from nvfp4_train.trainer import RunDirLocked, RunSetupError, Trainer, _RunDirLock, _SignalFlag
from tests.trainer.runs import TINY, build_test_tokens, one_process_environ


@pytest.fixture(scope="module")
def one_process_env():
    """``setup_parallel`` writes the one-process rendezvous into ``os.environ``; undo it after the tests."""
    with one_process_environ():
        yield


def _cfg(run_dir: Path, *extra: str):
    return compose_config("train", [*TINY, "schedule.train_steps=3", "data.num_workers=0",
                                    f"experiment.run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, one_process_env) -> Path:
    """A run directory with the checkpoint of a 3-step run (step_0000003)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    with Trainer(_cfg(run_dir)) as t:
        t.run()
    assert (run_dir / "checkpoints" / "step_0000003" / "manifest.json").is_file()
    return run_dir


def _tokens_copy(tmp_path: Path) -> Path:
    src = build_test_tokens()
    dst = tmp_path / "tokens"
    dst.mkdir()
    for f in src.glob("text_*"):
        shutil.copy(f, dst / f.name)
    return dst


def _truncated_idx(tmp_path: Path) -> list[str]:
    tokens = _tokens_copy(tmp_path)
    idx = tokens / "text_train.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    return [f"data.train_prefixes=[{tokens / 'text_train'}]"]


def _other_tokenizer(tmp_path: Path) -> list[str]:
    tokens = _tokens_copy(tmp_path)
    meta = tokens / "text_validation.meta.json"
    m = json.loads(meta.read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    meta.write_text(json.dumps(m))
    return [f"data.valid_prefixes=[{tokens / 'text_validation'}]"]


# name: (resumes the saved run?, the overrides (or a function of tmp_path making them), the message, regex)
CASES = {
    "missing data prefix": (False, lambda tmp: [f"data.train_prefixes=[{tmp / 'nope'}]"],
                            r"nope\.idx not found \(dataset prefix .*\); create it with python -m nvfp4_train\.data\.prepare --input"),
    "truncated .idx": (False, _truncated_idx, r"text_train\.idx is truncated: .* bytes, its header describes .*; "
                                              r"re-run python -m nvfp4_train\.data\.prepare"),
    "data from another tokenizer": (False, _other_tokenizer, r"text_validation was tokenized with .* \(sha256 "
                                                             r"000000000000…\), not with .*: re-run python -m nvfp4_train\.data\.prepare --tokenizer"),
    "model.vocab_size below the data's ids": (False, ["model.vocab_size=32000"],
                                              r"model\.vocab_size=32000 is smaller than the tokenizer's 32768 ids "
                                              r".*: set model\.vocab_size >= 32768"),
    "Adam overflow": (False, ["schedule.lr=3e38"], r"schedule\.lr=3e\+38 overflows AdamW in fp32: its first step "
                                                   r"moves a weight by up to .* = 3e\+39, .*: set schedule\.lr below"),
    "checkpoint.resume=none over checkpoints": (True, ["checkpoint.resume=none"],
                                                r"checkpoint\.resume=none but .*/checkpoints already holds "
                                                r"checkpoints \(step_0000003\)"),
    "another model's checkpoint": (True, ["model.hidden_size=64"],
                                   r"step_0000003 was written for another model .*hidden_size: checkpoint 32, this "
                                   r"run 64\. Resume with the checkpoint's model config"),
    "a changed global batch": (True, ["schedule.global_batch_size=8"],
                               r"consumed_samples=12 is not .* 3 \* 8 \+ 0: the global batch size changed; resume "
                               r"with schedule\.global_batch_size=4 as saved"),
    "train_steps below the checkpoint's step": (True, ["schedule.train_steps=2", "schedule.warmup_steps=1"],
                                                r"step_0000003 is at step 3, past schedule\.train_steps=2: resume "
                                                r"with schedule\.train_steps >= 3 \(the run that wrote it had 3\)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_setup_error_is_one_line_naming_the_problem_and_the_fix(case, saved, tmp_path, one_process_env):
    """Each was a ValueError or FileNotFoundError (``lr=3e38``: torch's RuntimeError in the middle of step 2)
    that ``train.py`` ended in a 27-73 line traceback with exit status 1."""
    resumes, extra, pattern = CASES[case]
    extra = extra(tmp_path) if callable(extra) else extra
    run_dir = saved if resumes else tmp_path / "run"
    with pytest.raises(RunSetupError, match=pattern) as e:
        Trainer(_cfg(run_dir, *extra))
    assert "\n" not in str(e.value)


def test_a_poisoned_metadata_file_is_refused_by_name_before_torch_reads_it(saved, tmp_path, one_process_env):
    """``dist/.metadata`` with a pickle payload: before, torch read it on one rank, fell back "to rank local
    metadata", and the run ended in ``AssertionError: metadata is None`` with the refusal only in its text.
    Now the file is read through the allow-list first: the ``UntrustedPickleError`` itself, one line."""
    from tests.reliability.test_checkpoint_faults import _plant_metadata, _reseal

    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    step = run_dir / "checkpoints" / "step_0000003"
    marker = tmp_path / "marker"
    _plant_metadata(step, marker)
    _reseal(step)
    with pytest.raises(RunSetupError, match=rf"{step}/dist/\.metadata \(distributed-checkpoint metadata\) holds a "
                                            rf"pickled posix\.system, .* set checkpoint\.trust=true only") as e:
        Trainer(_cfg(run_dir, "schedule.train_steps=4"))
    assert isinstance(e.value.__cause__, UntrustedPickleError) and "\n" not in str(e.value)
    assert not marker.exists()  # the payload never ran


def test_a_run_directory_that_is_a_file_is_named(tmp_path, one_process_env):
    """A raw ``FileExistsError`` before; now the ``CheckpointWriteError`` of a directory that cannot be written."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointWriteError, match=rf"cannot write {tmp_path / 'afile'}: {tmp_path / 'afile'} is a "
                                                   rf"file, not a directory, found before the first step: set "
                                                   rf"experiment\.run_dir"):
        Trainer(_cfg(tmp_path / "afile"))
    with pytest.raises(CheckpointWriteError, match=rf"{tmp_path / 'afile'} is a file, not a directory"):
        Trainer(_cfg(tmp_path / "afile" / "below"))


def test_a_refused_run_writes_nothing_and_is_not_handed_the_run_directory(tmp_path, one_process_env):
    """``run_dir_ready`` (where ``train.py`` opens ``warnings.log``) runs only once the lock is this run's: a run
    refused by the lock leaves the directory as it was (before, ``warnings.log`` was appended to)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = _RunDirLock(run_dir)
    try:
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        ready: list[Path] = []
        with pytest.raises(RunDirLocked, match=f"run directory {run_dir} is in use by another run"):
            Trainer(_cfg(run_dir), run_dir_ready=ready.append)
        assert ready == [] and {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    finally:
        held.release()
    with Trainer(_cfg(run_dir, "schedule.train_steps=3"), run_dir_ready=ready.append) as t:
        assert ready == [run_dir] and t.metrics is not None


def test_ctrl_c_sets_the_stop_flag_and_a_second_one_ends_the_process_at_once():
    """SIGINT is handled as SIGTERM (the step finishes, a checkpoint, exit 0: end to end in
    test_sigterm_resume_is_bitwise_with_the_hybrid_nvfp4_model); a second one kills the process by SIGINT."""
    pid = os.fork()
    if pid == 0:  # the child: its own handlers, no pytest around it
        try:
            flag = _SignalFlag(True)
            os.kill(os.getpid(), signal.SIGINT)
            if flag.signum != signal.SIGINT:
                os._exit(3)
            os.kill(os.getpid(), signal.SIGINT)
            os._exit(4)  # not reached: the second SIGINT ends the process
        finally:
            os._exit(5)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, status


def test_a_directory_where_the_lock_file_goes_is_named(tmp_path, one_process_env):
    """An OSError the writability probe does not name (``.lock`` is a directory) is the same one-line
    ``CheckpointWriteError`` on every rank, not a traceback on rank 0 alone."""
    (tmp_path / "run" / ".lock").mkdir(parents=True)
    with pytest.raises(CheckpointWriteError, match=r"cannot write .*\.lock: Is a directory: remove it or choose "
                                                   r"another experiment\.run_dir"):
        Trainer(_cfg(tmp_path / "run"))


def test_a_disabled_signal_flag_leaves_ctrl_c_to_python():
    """``checkpoint.save_on_signal=false``: SIGTERM/SIGUSR1 keep their default action, SIGINT its
    ``KeyboardInterrupt`` (not a kill without clean-up)."""
    before = signal.getsignal(signal.SIGINT)
    flag = _SignalFlag(False)
    try:
        assert signal.getsignal(signal.SIGINT) is before
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) is before
