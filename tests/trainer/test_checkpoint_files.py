"""Crash safety of the checkpoint directory protocol (no megatron: fake payloads written the same way).

A save writes into .tmp_step_N, writes manifest.json LAST, renames to step_N, then replaces `latest`.
Simulated crashes at each point must leave the previous checkpoint usable and be detected."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import nvfp4_train.checkpoint as ckpt
from nvfp4_train.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    check_free_space,
    check_writable,
    commit_checkpoint,
    find_resume_checkpoint,
    is_finite_checkpoint,
    list_checkpoints,
    model_mismatch,
    newest_good_checkpoint,
    prune_checkpoints,
    resume_candidates,
    step_dir_name,
    verify_checkpoint,
    weights_finite,
    write_manifest,
)


def _payload(d: Path, step: int) -> None:
    (d / "dist").mkdir(parents=True)
    (d / "rng").mkdir()
    (d / "dist" / "__0_0.distcp").write_bytes(os.urandom(3000 + step))
    (d / "dist" / ".metadata").write_bytes(os.urandom(100))
    (d / "rng" / "rank_00000.pt").write_bytes(os.urandom(50))
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))


def _save(root: Path, step: int, *, keep_last: int = 3, crash: str | None = None, finite: bool | None = None) -> Path:
    tmp = root / f".tmp_{step_dir_name(step)}"
    _payload(tmp, step)
    if crash == "before_manifest":
        return tmp
    meta = {"model": {"hidden_size": 64}, **({} if finite is None else {"finite": finite})}
    write_manifest(tmp, step=step, meta=meta)
    if crash == "before_rename":
        return tmp
    final = commit_checkpoint(tmp, root, step)
    prune_checkpoints(root, keep_last)
    return final


def test_save_commit_prune_and_latest(tmp_path):
    for s in (10, 20, 30, 40):
        _save(tmp_path, s, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000030", "step_0000040"]
    assert (tmp_path / "latest").read_text().strip() == "step_0000040"
    assert verify_checkpoint(tmp_path / "step_0000040") == []
    manifest = json.loads((tmp_path / "step_0000040" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"dist/__0_0.distcp", "dist/.metadata", "rng/rank_00000.pt",
                                      "trainer_state.json"}
    assert manifest["files"]["dist/__0_0.distcp"]["size"] == 3040
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000040"


@pytest.mark.parametrize("crash", ["before_manifest", "before_rename"])
def test_crash_before_rename_keeps_previous_checkpoint(tmp_path, crash):
    _save(tmp_path, 10)
    tmp = _save(tmp_path, 20, crash=crash)
    assert tmp.is_dir()
    assert (tmp_path / "latest").read_text().strip() == "step_0000010"
    assert [p.name for p in resume_candidates(tmp_path)] == ["step_0000010"]
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000010"
    # the next successful save removes the stale temporary directory
    _save(tmp_path, 30)
    assert not tmp.exists()
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000030"


def test_crash_between_rename_and_latest_update_resumes_from_the_complete_newer_one(tmp_path):
    _save(tmp_path, 10)
    tmp = _save(tmp_path, 20, crash="before_rename")
    os.replace(tmp, tmp_path / "step_0000020")  # renamed, `latest` not yet updated
    assert (tmp_path / "latest").read_text().strip() == "step_0000010"
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000020"


def test_commit_refuses_a_directory_without_manifest(tmp_path):
    tmp = _save(tmp_path, 10, crash="before_manifest")
    with pytest.raises(CheckpointError, match="without manifest.json"):
        commit_checkpoint(tmp, tmp_path, 10)
    assert not (tmp_path / "step_0000010").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_latest_is_detected_and_resume_falls_back(tmp_path, damage):
    _save(tmp_path, 10)
    last = _save(tmp_path, 20)
    f = last / "dist" / "__0_0.distcp"
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(1000)
        needle = "__0_0.distcp: 1000 bytes, the manifest says 3020"
    elif damage == "flip":
        data = bytearray(f.read_bytes())
        data[1234] ^= 0x01
        f.write_bytes(bytes(data))
        needle = "__0_0.distcp: sha256"
    elif damage == "delete":
        f.unlink()
        needle = "__0_0.distcp: missing"
    else:
        (last / "manifest.json").write_text('{"format": "nvfp4_train-checkpoint-1", "files": ')
        needle = "manifest.json is not valid JSON"
    problems = verify_checkpoint(last)
    assert len(problems) == 1 and needle in problems[0]
    with pytest.warns(UserWarning, match="step_0000020 is not usable"):
        assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000010"
    if damage == "truncate":  # sizes alone catch a truncation
        assert verify_checkpoint(last, checksums=False) != []
    if damage == "flip":  # only the checksum catches a flipped bit
        assert verify_checkpoint(last, checksums=False) == []


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    last = _save(tmp_path, 10)
    (last / "manifest.json").unlink()
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="none of the 1 checkpoints is usable"):
        find_resume_checkpoint("auto", tmp_path)


def test_explicit_path_and_none(tmp_path):
    assert find_resume_checkpoint("auto", tmp_path / "nothing_here") is None
    assert find_resume_checkpoint("none", tmp_path) is None
    a = _save(tmp_path, 10)
    b = _save(tmp_path, 20)
    assert find_resume_checkpoint(str(a), tmp_path / "elsewhere") == a  # an explicit checkpoint directory
    assert find_resume_checkpoint(str(tmp_path), tmp_path / "elsewhere") == b  # an explicit root: its newest
    with pytest.raises(ValueError, match="already holds checkpoints"):
        find_resume_checkpoint("none", tmp_path)
    (a / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="trainer_state.json: 2 bytes"):
        find_resume_checkpoint(str(a), tmp_path)  # an explicit bad checkpoint: no silent fallback


def test_model_mismatch_names_fields():
    saved = {"name": "small", "hidden_size": 256, "num_layers": 8, "mamba_chunk_size": 128}
    current = {"name": "tiny", "hidden_size": 128, "num_layers": 8, "mamba_chunk_size": 32}
    assert model_mismatch(saved, current) == ["hidden_size: checkpoint 256, this run 128"]
    assert model_mismatch(saved, dict(saved, name="renamed")) == []


def _many_files(d: Path) -> dict[str, bytes]:
    """Files of several sizes (empty, below, at and above the patched read buffer), in nested folders."""
    sizes = [0, 1, 999, 1000, 1001, 4096, 25_000, 77_777, 3, 1000 * 7]
    contents = {}
    for i, n in enumerate(sizes):
        name = f"dist/__0_{i}.distcp" if i % 3 else f"rng/rank_{i:05d}.pt"
        contents[name] = os.urandom(n)
    for name, data in contents.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return contents


@pytest.mark.parametrize("threads", [None, 1, 2, 4, 64])
def test_threaded_manifest_equals_a_sequential_hash(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(ckpt, "_HASH_BUFFER", 1000)  # many reads per file, partial last reads
    contents = _many_files(tmp_path)
    manifest = write_manifest(tmp_path, step=5, meta={"k": 1}, threads=threads)
    expected = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for name, data in sorted(contents.items())}
    assert manifest["files"] == expected
    assert list(manifest["files"]) == sorted(contents)  # the order of the file list, not of the threads
    assert json.loads((tmp_path / "manifest.json").read_text())["files"] == expected
    assert verify_checkpoint(tmp_path, threads=threads) == []


@pytest.mark.parametrize("threads", [1, 3])
def test_threaded_verify_names_each_corrupt_file(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(ckpt, "_HASH_BUFFER", 1000)
    _many_files(tmp_path)
    write_manifest(tmp_path, step=5, meta={}, threads=threads)
    for name, pos in (("dist/__0_7.distcp", 77_000), ("rng/rank_00006.pt", 0)):
        f = tmp_path / name
        data = bytearray(f.read_bytes())
        data[pos] ^= 0x80
        f.write_bytes(bytes(data))
    problems = verify_checkpoint(tmp_path, threads=threads)
    assert len(problems) == 2
    assert "__0_7.distcp: sha256" in problems[0] and "rank_00006.pt: sha256" in problems[1]


def test_hash_threads_must_be_positive(tmp_path):
    _many_files(tmp_path)
    with pytest.raises(ValueError, match="hash threads=0"):
        write_manifest(tmp_path, step=1, meta={}, threads=0)


# ------------------------------------------------------------------------------------------------------
# Pruning killed midway, files the manifest does not list, "last good" = finite, write faults


def test_a_kill_mid_prune_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Pruning renames ``step_N`` to ``.trash_step_N`` before deleting it: a kill (here: an exception after
    the first file deleted) leaves only complete ``step_*`` directories; the next prune removes the trash."""
    for s in (10, 20, 30):
        _save(tmp_path, s)
    real_rmtree = ckpt.shutil.rmtree

    def killed_rmtree(path, ignore_errors=False):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if files:
            files[0].unlink()
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert (tmp_path / ".trash_step_0000010").is_dir()
    for p in resume_candidates(tmp_path):
        assert verify_checkpoint(p) == [], p
    assert [p.name for p in resume_candidates(tmp_path)] == ["step_0000030", "step_0000020"]
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000030"]


def test_a_file_the_manifest_does_not_list_is_damage(tmp_path):
    """A checkpoint is exactly the files its manifest lists (the loaders look files up by name, e.g.
    megatron-core's sharded objects): an added file makes it unusable, named, and resume falls back."""
    _save(tmp_path, 10)
    last = _save(tmp_path, 20)
    extra = last / "dist" / "extra.pt"
    extra.write_bytes(b"x")
    problems = verify_checkpoint(last, checksums=False)
    assert problems == [f"{extra}: not in the manifest (added after the save; move it out of the checkpoint)"]
    with pytest.warns(UserWarning, match="extra.pt: not in the manifest"):
        assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000010"


def test_only_finite_checkpoints_are_good_and_pruning_keeps_the_newest_one(tmp_path):
    """Checkpoints saved during a bad streak (``meta.finite`` false) are never "the last good one": resume and
    :func:`newest_good_checkpoint` pass over them, and pruning keeps the newest finite one however many
    non-finite ones follow it. A manifest without the field counts as finite."""
    _save(tmp_path, 10)  # no field: written before the check existed
    _save(tmp_path, 20, finite=True)
    for s in (30, 40, 50):
        _save(tmp_path, s, keep_last=2, finite=False)
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == ["step_0000020", "step_0000040", "step_0000050"]
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step_0000020"
    assert is_finite_checkpoint(tmp_path / "step_0000020") and not is_finite_checkpoint(tmp_path / "step_0000050")
    with pytest.warns(UserWarning, match="step_0000050 is not usable .*weights are not all finite"):
        assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step_0000020"
    _save(tmp_path, 60, keep_last=2, finite=True)  # a good one again: the old good one may go now
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == ["step_0000050", "step_0000060"]
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step_0000060"
    assert newest_good_checkpoint(tmp_path / "nothing") is None


def test_weights_finite_is_one_flag_over_all_parameters():
    import torch

    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert weights_finite(m)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with torch.no_grad():
            m[1].bias[1] = bad
        assert not weights_finite(m)
        with torch.no_grad():
            m[1].bias[1] = 0.0
    assert weights_finite(torch.nn.Module())


def test_free_space_below_the_last_checkpoint_is_refused_before_writing(tmp_path, monkeypatch):
    assert check_free_space(tmp_path) is None  # nothing to compare with yet
    last = _save(tmp_path, 10)
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file() and p.name != "manifest.json")
    usage = ckpt.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=size - 1))
    with pytest.raises(CheckpointWriteError, match=f"no space left on {tmp_path}: .* free, the last checkpoint "
                                                   f"\\(step_0000010\\) takes") as e:
        check_free_space(tmp_path)
    assert e.value.path == str(tmp_path) and "no space left" in e.value.reason
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=size))
    check_free_space(tmp_path)


def test_lowering_keep_last_makes_room_for_the_next_save(tmp_path, monkeypatch):
    """The disk-full message suggested lowering checkpoint.keep_last, which did nothing (the pruning runs only
    after a successful save). Now a save short of space first deletes what its own pruning would delete after
    it (``make_room``: never the newest checkpoint, the newest finite one, or one named in ``keep``), and the
    message names the keep_last that makes room: the sequence of a save with keep_last=4, then a resume with
    the keep_last the message gives."""
    from nvfp4_train.checkpoint import make_room

    for s in (10, 20, 30, 40):
        _save(tmp_path, s, keep_last=4)
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and f.name != "manifest.json")
             for p in list_checkpoints(tmp_path)}
    usage = ckpt.shutil.disk_usage(tmp_path)
    free = {"bytes": sizes["step_0000040"] - sizes["step_0000010"] - 1}  # one deleted checkpoint is not enough
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=free["bytes"]))
    real_rmtree = ckpt.shutil.rmtree

    def deleting(p, ignore_errors=False):  # the file system gets the deleted bytes back
        if Path(p).exists():
            free["bytes"] += sizes.get(Path(p).name.removeprefix(".trash_"), 0)
        real_rmtree(p, ignore_errors=ignore_errors)

    monkeypatch.setattr(ckpt.shutil, "rmtree", deleting)
    assert [p.name for p in make_room(tmp_path, 4)] == ["step_0000010"]  # what the save's pruning deletes after it
    with pytest.raises(CheckpointWriteError) as e:
        check_free_space(tmp_path)
    assert e.value.reason.endswith("the earlier checkpoints are intact: free space, or resume with "
                                   "checkpoint.keep_last=3 (the next save then first deletes step_0000020)")
    with pytest.raises(CheckpointWriteError, match=r"keep_last=2 \(the next save then first deletes step_0000030\)$"):
        check_free_space(tmp_path, keep=("step_0000020",))  # a protected one is never counted as room
    assert [p.name for p in make_room(tmp_path, 3)] == ["step_0000020"]  # the resume with keep_last=3
    check_free_space(tmp_path)  # room now
    assert make_room(tmp_path, 1) == [] and [p.name for p in list_checkpoints(tmp_path)] == ["step_0000030",
                                                                                             "step_0000040"]
    free["bytes"] = 0
    assert [p.name for p in make_room(tmp_path, 1)] == ["step_0000030"]  # never the newest (latest, finite) one
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000040"]
    with pytest.raises(CheckpointWriteError, match="the earlier checkpoints are intact: free space, then resume$"):
        check_free_space(tmp_path)


def test_pruning_keeps_the_checkpoints_it_is_told_to(tmp_path):
    """The trainer passes the checkpoint a divergence report would name (``keep``): pruning never deletes it."""
    for s in (10, 20, 30, 40):
        _save(tmp_path, s, keep_last=4)
    assert [p.name for p in prune_checkpoints(tmp_path, 1, keep=("step_0000020",))] == ["step_0000010",
                                                                                        "step_0000030"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000020", "step_0000040"]


@pytest.mark.parametrize("code, words", [("ENOSPC", "no space left on"), ("EDQUOT", "no space left on"),
                                         ("EFBIG", "file-size limit"), ("EROFS", "read-only file system")])
def test_a_writer_failure_is_named_through_its_wrapper(tmp_path, code, words):
    """megatron-core and torch wrap the OS error (``RuntimeError: Worker failure``); the cause is found."""
    import errno

    err = getattr(errno, code)
    try:
        try:
            raise OSError(err, os.strerror(err))
        except OSError as e:
            raise RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos") from e
    except RuntimeError as wrapped:
        reason = ckpt._write_failure(tmp_path, wrapped)
    assert words in reason and str(tmp_path) in reason and "partial one was removed" in reason


def test_a_writer_failure_without_an_os_error_is_named_from_the_file_system(tmp_path, monkeypatch):
    """megatron-core 0.16.1's save raises torch's ``CheckpointException`` holding each rank's ``RuntimeError:
    Worker failure`` (the worker's OSError is lost): the reason comes from the free space and the limit."""
    import resource

    from torch.distributed.checkpoint.api import CheckpointException

    e = CheckpointException("write", {0: (RuntimeError("Worker failure: unexpected pos 704 vs 598"), None)})
    usage = ckpt.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    assert ckpt._write_failure(tmp_path, e).startswith(f"no space left on {tmp_path} (4.0 KiB free) (RuntimeError: "
                                                       f"Worker failure: unexpected pos 704 vs 598)")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=1 << 40))
    monkeypatch.setattr(resource, "getrlimit", lambda r: (4 << 20, resource.RLIM_INFINITY))
    assert "file-size limit of 4.0 MiB" in ckpt._write_failure(tmp_path, e)


def test_check_writable_before_the_first_step(tmp_path, monkeypatch):
    check_writable(tmp_path / "a" / "b")  # created
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointWriteError, match=f"{tmp_path / 'file'} is a file, not a directory, found before "
                                                   f"the first step"):
        check_writable(tmp_path / "file")
    with pytest.raises(CheckpointWriteError, match=f"{tmp_path / 'file'} is a file, not a directory"):
        check_writable(tmp_path / "file" / "below")
    import errno

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(ckpt.os, "open", read_only)  # root ignores file modes: a read-only mount, simulated
    with pytest.raises(CheckpointWriteError, match="is on a read-only file system, found before the first step"):
        check_writable(tmp_path / "a")
