"""Checkpoints from a stranger and saves that cannot finish, end to end through ``train.py`` (CPU, stand-in).

One run writes a real checkpoint (step 3). Each untrusted-file test copies it, plants a pickle payload whose
``__reduce__`` would run ``touch <marker>`` in one of the files the resume path unpickles, re-writes the
manifest (whoever ships a checkpoint ships its manifest, so the checksums are right) and resumes from the
copy: the resume must refuse it with an error naming the file and ``posix.system``, and the marker must
never appear. The payloads are real: ``test_payloads_run_under_permissive_loads`` shows each one running
under the loader it targets when that loader is permissive. The save tests resume the good checkpoint
under a file-size limit (``RLIMIT_FSIZE``) smaller than a shard."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvfp4_train.checkpoint import MANIFEST, list_checkpoints, read_manifest, verify_checkpoint, write_manifest
from tests.trainer.runs import ROOT, TINY, env, run, tail
from tests.reliability.payload import Payload
from tests.side_by_side import side_by_side

BASE = [*(a for a in TINY if not a.startswith("checkpoint.")), "checkpoint.keep_last=3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run directory holding the checkpoint of a 3-step run."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    log = run_dir.parent / "log.txt"
    rc = run([*BASE, "schedule.train_steps=3", f"experiment.run_dir={run_dir}"], log=log)
    assert rc == 0, tail(log)
    return run_dir


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    return run_dir, run_dir / "checkpoints" / "step_0000003"


def _reseal(step_dir: Path) -> None:
    """Re-write the manifest of a modified checkpoint (as whoever ships one would)."""
    old = read_manifest(step_dir)
    (step_dir / MANIFEST).unlink()
    write_manifest(step_dir, step=old["step"], meta=old["meta"])
    assert verify_checkpoint(step_dir) == []


def _plant_rng(step_dir: Path, marker: Path) -> Path:
    f = step_dir / "rng" / "rank_00000.pt"
    state = torch.load(f, weights_only=True)
    state["extra"]["note"] = Payload(marker)
    torch.save(state, f)
    return f


def _plant_metadata(step_dir: Path, marker: Path) -> Path:
    f = step_dir / "dist" / ".metadata"
    with open(f, "rb") as fh:
        md = pickle.load(fh)  # our own, unmodified file
    md.planner_data = Payload(marker)
    with open(f, "wb") as fh:
        pickle.dump(md, fh)
    return f


def _plant_byte_item(step_dir: Path, marker: Path) -> Path:
    """Replace an ``_extra_state`` byte item of a shard: the payload is appended to the shard and the
    item's storage entry in ``.metadata`` points at it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_file = step_dir / "dist" / ".metadata"
    with open(meta_file, "rb") as fh:
        md = pickle.load(fh)
    index, info = next((i, s) for i, s in md.storage_data.items()
                       if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata) and "_extra_state" in i.fqn)
    buf = io.BytesIO()
    torch.save([Payload(marker)], buf)
    shard = step_dir / "dist" / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    with open(meta_file, "wb") as fh:
        pickle.dump(md, fh)
    return shard


def _plant_common(step_dir: Path, marker: Path) -> Path:
    f = step_dir / "dist" / "common.pt"
    common = torch.load(f, weights_only=True)
    common["note"] = Payload(marker)
    torch.save(common, f)
    return f


PLANTS = {"rng": _plant_rng, "metadata": _plant_metadata, "byte_item": _plant_byte_item, "common": _plant_common}


def _start(args: list[str], log: Path, **popen):
    def start() -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env(), stdout=f,
                                    stderr=subprocess.STDOUT, **popen)
    return start


FSIZE_LIMIT = 4 << 20


@pytest.fixture(scope="module")
def resumes(saved, tmp_path_factory) -> dict:
    """The resumes of the tests below, each from its own copy of the saved run, run side by side: one per
    planted pickle, the RNG file with a class outside the allow-list, the save under a file-size limit.
    ``{name: (exit status, log, run directory, step directory, extra)}``."""
    jobs, made = {}, {}
    for vector, plant in sorted(PLANTS.items()):
        tmp = tmp_path_factory.mktemp(f"planted_{vector}")
        run_dir, step_dir = _copy(saved, tmp)
        marker = tmp / "marker"
        planted = plant(step_dir, marker)
        _reseal(step_dir)
        assert not marker.exists()
        log = tmp / "resume.txt"
        jobs[vector] = _start([*BASE, "schedule.train_steps=5", f"experiment.run_dir={run_dir}"], log)
        made[vector] = (log, run_dir, step_dir, (planted, marker))

    import datetime

    tmp = tmp_path_factory.mktemp("untrusted_class")
    run_dir, step_dir = _copy(saved, tmp)
    f = step_dir / "rng" / "rank_00000.pt"
    state = torch.load(f, weights_only=True)
    state["extra"]["written"] = datetime.date(2026, 12, 1)
    torch.save(state, f)
    _reseal(step_dir)
    log = tmp / "refused.txt"
    jobs["untrusted_class"] = _start([*BASE, "schedule.train_steps=4", f"experiment.run_dir={run_dir}"], log)
    made["untrusted_class"] = (log, run_dir, step_dir, f)

    tmp = tmp_path_factory.mktemp("fsize")
    run_dir, step_dir = _copy(saved, tmp)
    assert max(p.stat().st_size for p in step_dir.rglob("*.distcp")) > FSIZE_LIMIT

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))

    log = tmp / "log.txt"
    jobs["fsize"] = _start([*BASE, "schedule.train_steps=5", f"experiment.run_dir={run_dir}"], log,
                           preexec_fn=limited)
    made["fsize"] = (log, run_dir, step_dir, None)
    codes = side_by_side(jobs)
    return {name: (codes[name], *made[name]) for name in jobs}


def _one_line(log: Path) -> str:
    """The run's one error line (``train.py: ...``); there is no traceback."""
    text = log.read_text()
    assert "Traceback" not in text, tail(log)
    (line,) = [x for x in text.splitlines() if x.startswith("train.py: ")]
    return line


@pytest.mark.parametrize("vector", sorted(PLANTS))
def test_a_planted_pickle_is_refused_and_never_runs(resumes, vector):
    """The refusal (``UntrustedPickleError``, reported as a ``RunSetupError``) is one line, exit status 2. The
    poisoned ``.metadata`` used to end in torch's ``AssertionError: metadata is None`` after "Falling back to
    rank local metadata", with the refusal only in its text."""
    rc, log, _, _, (planted, marker) = resumes[vector]
    text = log.read_text()
    assert rc == 2, tail(log)
    assert not marker.exists()
    line = _one_line(log)
    assert f"{planted}" in line and "pickled posix.system" in line, line
    assert "checkpoint.trust=true" in line
    assert "Falling back" not in text and "step 4" not in text  # nothing trained


def test_payloads_run_under_permissive_loads(saved, tmp_path):
    """The planted files are real attacks: each runs its payload under the load it targets, made permissive
    (``pickle.load`` / ``torch.load(weights_only=False)``), so the refusals above are what stops them."""
    _, step_dir = _copy(saved, tmp_path)
    for name, plant in sorted(PLANTS.items()):
        marker = tmp_path / f"marker_{name}"
        f = plant(step_dir, marker)
        if name == "metadata":
            with open(f, "rb") as fh:
                pickle.load(fh)
        elif name == "byte_item":
            with open(step_dir / "dist" / ".metadata", "rb") as fh:
                md = pickle.load(fh)
            info = next(s for s in md.storage_data.values() if s.offset + s.length == f.stat().st_size)
            with open(f, "rb") as fh:
                fh.seek(info.offset)
                torch.load(io.BytesIO(fh.read(info.length)), weights_only=False)
        else:
            torch.load(f, weights_only=False)
        assert marker.exists(), name


def test_trust_true_loads_what_trust_false_refuses(resumes, tmp_path):
    """``checkpoint.trust=true`` restores the permissive loads, for a checkpoint you wrote yourself: an RNG
    file holding a class outside the allow-list (a harmless ``datetime.date``) is refused by default, naming
    the file and the class, and resumes with trust."""
    rc, log, run_dir, _, f = resumes["untrusted_class"]
    assert rc == 2, tail(log)
    assert f"{f} holds a pickled datetime.date" in _one_line(log)
    log = tmp_path / "trusted.txt"
    assert run([*BASE, "schedule.train_steps=4", f"experiment.run_dir={run_dir}", "checkpoint.trust=true"],
               log=log) == 0, tail(log)
    assert "resumed from" in log.read_text()


def test_file_size_limit_during_a_save_stops_cleanly(resumes):
    """A save that hits ``RLIMIT_FSIZE`` (4 MiB, below the 15 MB shards; the logs and the RNG file stay
    under it): exit status 4 with one line naming the limit, the partial ``.tmp_step_*`` removed, the
    previous checkpoint intact and still what a resume picks."""
    rc, log, run_dir, step_dir, _ = resumes["fsize"]
    assert rc == 4, tail(log)
    lines = [line for line in log.read_text().splitlines() if line.startswith("train.py: ")]
    assert len(lines) == 1, tail(log)
    assert "cannot write" in lines[0] and "file-size limit" in lines[0] and "earlier checkpoints are intact" in lines[0]
    assert "Traceback" not in log.read_text()
    ckpt_root = run_dir / "checkpoints"
    assert not [q for q in ckpt_root.iterdir() if q.name.startswith(".tmp_")]
    assert list_checkpoints(ckpt_root) == [step_dir] and verify_checkpoint(step_dir) == []
    assert (ckpt_root / "latest").read_text().strip() == "step_0000003"
    # the run's record says where it got to
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any(e.get("type") == "train" and e.get("step") == 5 for e in events)
