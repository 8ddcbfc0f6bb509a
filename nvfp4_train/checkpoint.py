"""Checkpoints that survive a crash at any moment, written with megatron-core's dist-checkpointing.

Layout of ``<checkpoint dir>`` (default ``<run_dir>/checkpoints``)::

    step_0000100/
        dist/                 megatron dist-checkpoint: model and distributed-optimizer state (sharded,
                              reshardable over TP/PP for the model, over DP for the optimizer: see below)
        rng/rank_00000.pt     python, numpy, torch CPU, CUDA and megatron-tracker RNG states of each rank
                              (tensors, tuples and numbers only: ``torch.load(weights_only=True)`` reads it)
        trainer_state.json    step, consumed samples and tokens, skipped steps, schedule, parallel layout
        config.yaml           the resolved config of the run that wrote it
        manifest.json         size and sha256 of every file above, and ``meta.finite`` (were all model
                              weights finite at save time): written LAST
    latest                    the name of the newest complete checkpoint (replaced atomically)

Saving (all ranks): write everything into ``.tmp_step_0000100/``, hash the files (spread over the ranks, and
within a rank over threads, one whole file each), write ``manifest.json`` (via a temporary name and
``os.replace``), rename the directory to ``step_0000100``, replace ``latest``, delete all but the newest
``keep_last`` and the newest finite one (each renamed to ``.trash_*`` first). A crash at any point leaves the
previous checkpoints and ``latest`` untouched (a stale ``.tmp_*`` or ``.trash_*`` is removed by the next
save). A save first checks the free space against the last checkpoint's size (when it is short, it first
deletes what its own pruning would delete after it: :func:`make_room`); a failed write removes the partial
``.tmp_*`` and raises :class:`CheckpointWriteError` (``train.py`` exits 4).

Loading verifies the manifest first (every file present and none it does not list, sizes and, by default,
sha256) and names the first bad, missing or added file. ``resume=auto`` tries the checkpoints newest first
(``latest`` names the newest; it is for people and tools), skips those whose weights were not finite, and
warns for each one it has to skip (:func:`newest_good_checkpoint` is the same choice, quietly). With
``checkpoint.trust=false`` (the default) nothing a checkpoint holds is unpickled outside an allow-list
(``nvfp4_train.mcore_compat.safe_load``; docs/reliability.md, threat model). A checkpoint of another model
(a different ``ModelConfig``) is a :class:`CheckpointMismatch` (a ``ValueError``), not a fallback.

Resharding: megatron reshards the model state between any TP/PP/DP layouts. The distributed-optimizer state
is saved in megatron-core's ``fully_reshardable`` format by default (``checkpoint.optim_format``): per
parameter, gathered on DP rank 0 at save time, loadable under any layout. megatron-core 0.16.1 cannot load
that format with torch's Adam (``KeyError: 'step'``: ``mcore_compat.optimizer`` loads it in two parts
instead). ``dp_reshardable`` (each rank's flat shard, no gather) loads under another DP size only; under
another TP/PP the model weights are loaded and the FP32 master weights restart from them with fresh Adam
moments (a warning says so). (Its ``fully_sharded_model_space`` format is refused by dist-checkpointing:
``ShardedTensor.flattened_range is not supported``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nvfp4_train.mcore_compat.dist_ckpt import set_write_results_queue, write_results_queue_set
from nvfp4_train.mcore_compat.optimizer import init_optimizer_state as _init_optimizer_state
from nvfp4_train.mcore_compat.optimizer import load_optimizer_state as _load_optimizer_state

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointWriteError",
    "check_writable",
    "check_free_space",
    "make_room",
    "weights_finite",
    "is_finite_checkpoint",
    "newest_good_checkpoint",
    "MANIFEST",
    "step_dir_name",
    "list_checkpoints",
    "write_manifest",
    "verify_checkpoint",
    "commit_checkpoint",
    "prune_checkpoints",
    "resume_candidates",
    "find_resume_checkpoint",
    "model_mismatch",
    "start_checkpoint_writer",
    "save_checkpoint",
    "load_checkpoint",
]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "nvfp4_train-checkpoint-1"
OPTIM_FORMATS = ("fully_reshardable", "dp_reshardable")
_STEP_RE = re.compile(r"^step_(\d{7,})$")


@dataclass(kw_only=True)
class CheckpointConfig:
    """When and where checkpoints are written, and what a run resumes from (the ``checkpoint`` section)."""

    dir: str | None = None
    """Checkpoint directory, shared by all ranks. None: ``<run_dir>/checkpoints``."""
    interval: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM/SIGUSR1/SIGINT)."""
    keep_last: int = 3
    """Keep this many newest checkpoints (older ones are deleted after a successful save, or before a save
    when the free space is short of what the last checkpoint takes)."""
    resume: str = "auto"
    """``auto``: the newest good checkpoint in ``dir`` if any (else start fresh); ``none``: start fresh (an
    existing checkpoint directory is then an error, to never mix two runs); a path: a checkpoint directory
    (``.../step_0000100``) or a checkpoint root (its newest good one)."""
    save_at_end: bool = True
    """Save after the last step."""
    save_on_signal: bool = True
    """On SIGTERM/SIGUSR1/SIGINT (Ctrl-C): finish the current step, save, exit cleanly. False: they end the
    process at once (their default action)."""
    verify: str = "sha256"
    """What loading checks against the manifest: ``sha256`` (sizes and checksums) or ``size`` (sizes only)."""
    optim_format: str = "fully_reshardable"
    """Distributed-optimizer state format (megatron-core's names): ``fully_reshardable`` (per parameter,
    gathered on DP rank 0 at save; loads under any TP/PP/DP) or ``dp_reshardable`` (each rank's flat shard,
    no gather; loads under another DP size only, another TP/PP restarts the optimizer state)."""
    trust: bool = False
    """False: loading unpickles nothing outside an allow-list (tensors, containers, numbers, strings, and the
    classes of torch's distributed-checkpoint metadata); a checkpoint file naming any other class is refused
    with an error naming the file and the class (docs/reliability.md, threat model). True: torch's and
    megatron-core's permissive loads, which can run code from the files: only for checkpoints you wrote
    yourself (e.g. an older save whose RNG file holds numpy arrays)."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval={self.interval} must be >= 0 (0: only at the end / on signal)")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={self.keep_last} must be >= 1")
        if self.verify not in ("sha256", "size"):
            raise ValueError(f"checkpoint.verify={self.verify!r} is not one of sha256, size")
        if self.optim_format not in OPTIM_FORMATS:
            raise ValueError(f"checkpoint.optim_format={self.optim_format!r} is not one of {OPTIM_FORMATS}")
        if not self.resume:
            raise ValueError("checkpoint.resume is empty: use auto, none or a checkpoint path")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (incomplete, corrupt, missing)."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint that does not fit this run: written for another model (a ``ModelConfig`` field differs)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (no space, a file-size limit, a read-only directory). The
    partial temporary directory is removed and every earlier checkpoint is intact; ``train.py`` exits 4 with
    this one-line message. ``path``: what could not be written; ``reason``: why, and the fix."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"cannot write {path}: {reason}")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def _step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Committed checkpoint directories under ``root``, oldest first (complete or not: verify to know)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


# ------------------------------------------------------------------------------------------------------
# Manifest: sizes and checksums, hashing spread over the ranks


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _files_of(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


_HASH_BUFFER = 1 << 22  # bytes read per hashlib update (it releases the GIL for buffers over 2 KiB)


def _default_hash_threads() -> int:
    """The CPUs this process may run on (a Slurm or taskset mask, not the whole host), at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_BUFFER):
            h.update(chunk)
    return h.hexdigest()


def _entry(path: Path, checksums: bool) -> dict:
    entry = {"size": path.stat().st_size}
    if checksums:
        entry["sha256"] = _sha256(path)
    return entry


def _hash_spread(directory: Path, files: list[str], *, checksums: bool,
                 threads: int | None = None) -> dict[str, dict]:
    """{file: {size, sha256}}; with a process group rank r hashes files r, r + world, ... and all ranks get
    the union. Each rank hashes its files in up to ``threads`` threads (default: its CPUs, at most 8),
    one whole file per thread (hashlib releases the GIL while it hashes), so the checksums are those of a
    sequential pass."""
    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    names = files[rank::world]
    threads = _default_hash_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"hash threads={threads} must be >= 1")
    workers = min(threads, len(names)) if checksums else 1
    if workers <= 1:
        mine = {name: _entry(directory / name, checksums) for name in names}
    else:
        # the largest first: the pool's finish time is then close to (total bytes / workers)
        order = sorted(names, key=lambda n: -(directory / n).stat().st_size)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-sha256") as pool:
            got = dict(zip(order, pool.map(lambda n: _entry(directory / n, checksums), order)))
        mine = {name: got[name] for name in names}
    if dist is None:
        return mine
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    out = {}
    for part in gathered:
        out.update(part)
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable(directory: str | os.PathLike) -> None:
    """Create ``directory`` (and its parents) and write, fsync and delete a probe file in it; a read-only or
    full file system, a missing permission or a path that is a file is a :class:`CheckpointWriteError` now,
    before the first training step, rather than at the first save."""
    directory = Path(directory)
    probe = directory / f".write_probe_{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"ok\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointWriteError(directory, f"{_os_reason(e, directory)}, found before the first step: set "
                                              f"experiment.run_dir / checkpoint.dir to a writable directory (or "
                                              f"make this one writable)") from None


def _os_reason(e: BaseException, where: Path) -> str:
    import errno

    code = getattr(e, "errno", None)
    if code in (errno.EEXIST, errno.ENOTDIR):
        blocker = next((p for p in (where, *where.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return f"{blocker} is a file, not a directory"
    if code == errno.ENOSPC or code == errno.EDQUOT:
        return f"no space left on {where}"
    if code == errno.EFBIG:
        return f"a file exceeds the file-size limit on {where} (ulimit -f)"
    if code == errno.EROFS:
        return f"{where} is on a read-only file system"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied on {where}"
    return f"{type(e).__name__}: {e}"


def _checkpoint_bytes(directory: Path) -> int:
    """Total size of a committed checkpoint, from its manifest (0 when unreadable)."""
    try:
        return sum(int(e["size"]) for e in read_manifest(directory)["files"].values())
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return 0


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _space_short(root: Path) -> tuple[int, int, Path] | None:
    """(free bytes, bytes the next checkpoint needs, the newest checkpoint) when the file system of ``root``
    has less free space than the newest committed checkpoint takes (the next one is as large); None when it
    has enough, or before the first checkpoint (nothing to compare with)."""
    ckpts = list_checkpoints(root)
    need = _checkpoint_bytes(ckpts[-1]) if ckpts else 0
    if not need:
        return None
    free = shutil.disk_usage(root).free
    return (free, need, ckpts[-1]) if free < need else None


def make_room(root: str | os.PathLike, keep_last: int, *, keep: tuple[str, ...] = ()) -> list[Path]:
    """Before a save, when the free space is short of what the newest checkpoint takes: delete the
    checkpoints that the pruning after this save would delete anyway (all but the newest ``keep_last - 1``,
    never the one ``latest`` names, the newest finite one or those named in ``keep``; see
    :func:`prune_checkpoints`). Returns what was deleted (nothing when the space suffices). So lowering
    ``checkpoint.keep_last`` makes room for the next save; a save that then fails leaves one checkpoint fewer
    than ``keep_last``, each intact."""
    root = Path(root)
    if _space_short(root) is None:
        return []
    return prune_checkpoints(root, keep_last - 1, keep=keep)


def check_free_space(root: str | os.PathLike, *, keep: tuple[str, ...] = ()) -> None:
    """Raise :class:`CheckpointWriteError` ("no space left on <root>") when the file system of ``root`` has
    less free space than the newest committed checkpoint takes (the next one is as large). The message says
    which ``checkpoint.keep_last``, if any, would make room (:func:`make_room` deletes before the next save
    what that value prunes); ``keep``: names it never deletes. Nothing to compare with before the first
    checkpoint."""
    root = Path(root)
    short = _space_short(root)
    if short is None:
        return
    free, need, newest = short
    fix = "free space, then resume"
    for keep_last in range(len(list_checkpoints(root)), 0, -1):  # the largest keep_last that makes room
        doomed = _prunable(root, keep_last - 1, keep=keep)
        if doomed and free + sum(_checkpoint_bytes(p) for p in doomed) >= need:
            fix = (f"free space, or resume with checkpoint.keep_last={keep_last} (the next save then first deletes "
                   f"{', '.join(p.name for p in doomed)})")
            break
    raise CheckpointWriteError(root, f"no space left on {root}: {_bytes(free)} free, the last checkpoint "
                                     f"({newest.name}) takes {_bytes(need)}; the earlier checkpoints are "
                                     f"intact: {fix}")


def _write_failure(root: Path, e: BaseException) -> str:
    """Why a save failed, in words: the OS error when there is one, else (megatron's and torch's writers
    wrap it: ``RuntimeError: Worker failure``, ``unexpected pos``) what the file system says now."""
    import resource

    e = _rank_failure(e)
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None and getattr(cause, "errno", None) is not None:
        reason = _os_reason(cause, root)
    else:
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = None
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if free is not None and free < (1 << 20):
            reason = f"no space left on {root} ({_bytes(free)} free)"
        elif limit != resource.RLIM_INFINITY:
            reason = f"a file exceeds the file-size limit of {_bytes(limit)} on {root} (ulimit -f)"
        else:
            reason = f"writing under {root} failed"
        reason += f" ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return reason + "; the earlier checkpoints are intact, the partial one was removed"


def _rank_failure(e: BaseException) -> BaseException:
    """The first rank's error inside torch's ``CheckpointException`` (``.failures``: rank -> exception, or
    (exception, traceback)), which megatron-core 0.16.1's save raises for its writers' failures."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return _rank_failure(inner)
    return e


def write_manifest(directory: str | os.PathLike, *, step: int, meta: dict, threads: int | None = None) -> dict:
    """Hash every file of ``directory`` (collective when a process group exists; ``threads`` hashing threads
    per rank, default: its CPUs, at most 8) and, on rank 0, write ``manifest.json``. Returns the
    manifest."""
    directory = Path(directory)
    dist = _dist()
    files = _files_of(directory) if (dist is None or dist.get_rank() == 0) else None
    if dist is not None:
        box = [files]
        dist.broadcast_object_list(box, src=0)
        files = box[0]
    entries = _hash_spread(directory, files, checksums=True, threads=threads)
    manifest = {"format": FORMAT, "step": step, "files": {k: entries[k] for k in files}, "meta": meta}
    if dist is None or dist.get_rank() == 0:
        _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    return manifest


def verify_checkpoint(directory: str | os.PathLike, *, checksums: bool = True,
                      threads: int | None = None) -> list[str]:
    """Problems of a checkpoint directory (empty: good): no manifest, a missing file, a wrong size or
    checksum, each naming the file. Collective when a process group exists (the hashing is spread; and over
    ``threads`` threads per rank, as in :func:`write_manifest`)."""
    directory = Path(directory)
    dist = _dist()
    problems: list[str] = []
    manifest = None
    if dist is None or dist.get_rank() == 0:
        try:
            manifest = read_manifest(directory)
        except CheckpointError as e:
            problems.append(str(e))
    if dist is not None:
        box = [(manifest, problems)]
        dist.broadcast_object_list(box, src=0)
        manifest, problems = box[0]
    if problems:
        return problems
    expected = manifest["files"]
    present = []
    if dist is None or dist.get_rank() == 0:
        for name in _files_of(directory):
            if name not in expected:  # a checkpoint is exactly its manifest: the loaders look files up by name
                problems.append(f"{directory / name}: not in the manifest (added after the save; move it out "
                                f"of the checkpoint)")
        for name, entry in sorted(expected.items()):
            p = directory / name
            if not p.is_file():
                problems.append(f"{p}: missing")
            elif p.stat().st_size != entry["size"]:
                problems.append(f"{p}: {p.stat().st_size} bytes, the manifest says {entry['size']} (truncated or "
                                f"overwritten)")
            else:
                present.append(name)
    if dist is not None:  # rank 0 looked (shared file system); every rank gets its answer
        box = [(problems, present)]
        dist.broadcast_object_list(box, src=0)
        problems, present = box[0]
    if problems or not checksums:
        return problems
    got = _hash_spread(directory, present, checksums=True, threads=threads)
    for name in present:
        if got[name]["sha256"] != expected[name].get("sha256"):
            problems.append(f"{directory / name}: sha256 {got[name]['sha256'][:12]}… differs from the manifest's "
                            f"{str(expected[name].get('sha256'))[:12]}… (corrupt)")
    return problems


# ------------------------------------------------------------------------------------------------------
# Commit, prune, choose what to resume from (rank 0 does the file-system work)


def commit_checkpoint(tmp_dir: str | os.PathLike, root: str | os.PathLike, step: int) -> Path:
    """Rename a fully written ``tmp_dir`` (manifest included) to ``root/step_XXXXXXX`` and point ``latest``
    at it. An existing directory of that name (an incomplete leftover) is replaced."""
    tmp_dir, root = Path(tmp_dir), Path(root)
    if not (tmp_dir / MANIFEST).is_file():
        raise CheckpointError(f"{tmp_dir}: refusing to commit a checkpoint without {MANIFEST}")
    final = root / step_dir_name(step)
    if final.exists():
        trash = root / f".trash_{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp_dir, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name + "\n")
    _fsync_dir(root)
    return final


def _prunable(root: Path, keep_last: int, *, keep: tuple[str, ...] = ()) -> list[Path]:
    """The committed checkpoints :func:`prune_checkpoints` would delete, oldest first."""
    ckpts = list_checkpoints(root)
    kept = {p.name for p in (ckpts[-keep_last:] if keep_last > 0 else [])} | set(keep)
    latest = _read_latest(root)
    if latest is not None:
        kept.add(latest.name)
    good = next((p for p in reversed(ckpts) if is_finite_checkpoint(p)), None)
    if good is not None:
        kept.add(good.name)
    return [p for p in ckpts if p.name not in kept]


def prune_checkpoints(root: str | os.PathLike, keep_last: int, *, keep: tuple[str, ...] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and stale ``.tmp_*``/``.trash_*``
    directories. Never deletes the one ``latest`` names, nor the newest one with finite weights
    (:func:`is_finite_checkpoint`), so checkpoints written during a bad streak never push out the last good
    one, nor those named in ``keep`` (the trainer's checkpoint to recover from after a divergence). Each is
    first renamed to ``.trash_step_N`` (atomic), then deleted: a kill mid-delete leaves a ``.trash_*`` (removed
    by the next prune), never a half-deleted ``step_N``. Returns what was deleted."""
    root = Path(root)
    deleted = []
    for p in _prunable(root, keep_last, keep=keep):
        trash = root / f".trash_{p.name}"
        shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(p, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(p)
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir() and (p.name.startswith(".tmp_step_") or p.name.startswith(".trash_")):
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted


def _read_latest(root: Path) -> Path | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _STEP_RE.match(name) else None


def resume_candidates(root: str | os.PathLike) -> list[Path]:
    """What ``resume=auto`` tries, in order: every committed checkpoint, newest first. That is the one
    ``latest`` names, unless a crash hit between a rename and the pointer update (then the renamed directory
    is complete, manifest included, and newer)."""
    return list_checkpoints(root)[::-1]


def find_resume_checkpoint(resume: str, root: str | os.PathLike, *, checksums: bool = True) -> Path | None:
    """The checkpoint to resume from (None: start fresh), warning about every candidate skipped.

    ``resume`` is ``auto``, ``none`` or a path (a checkpoint directory, or a root holding ``step_*``).
    Raises CheckpointError when checkpoints exist but none is good, or when an explicit checkpoint
    directory is bad; raises ValueError for ``none`` with existing checkpoints in ``root``.
    """
    root = Path(root)
    if resume == "none":
        if list_checkpoints(root):
            raise ValueError(f"checkpoint.resume=none but {root} already holds checkpoints "
                             f"({', '.join(p.name for p in list_checkpoints(root))}): use another experiment.run_dir "
                             f"or checkpoint.dir, delete them, or resume (checkpoint.resume=auto)")
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.exists():
            raise CheckpointError(f"checkpoint.resume={resume!r}: no such file or directory")
        if _step_of(path) is not None or (path / MANIFEST).exists():
            problems = verify_checkpoint(path, checksums=checksums)
            if problems:
                raise CheckpointError(f"checkpoint {path} is not usable: {problems[0]}"
                                      + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
            return path
        root = path
    candidates = resume_candidates(root)
    if not candidates:
        if resume != "auto":
            raise CheckpointError(f"checkpoint.resume={resume!r}: no step_* checkpoints there")
        return None
    for i, path in enumerate(candidates):
        problems = verify_checkpoint(path, checksums=checksums)
        if not problems and not is_finite_checkpoint(path):
            problems = [f"{path / MANIFEST}: its weights are not all finite (saved during a bad streak)"]
        if not problems:
            if i:
                warnings.warn(f"resuming from {path}, an older checkpoint: the newer ones are not usable",
                              stacklevel=2)
            return path
        nxt = f"trying {candidates[i + 1].name}" if i + 1 < len(candidates) else "no older checkpoint left"
        warnings.warn(f"checkpoint {path} is not usable ({problems[0]}"
                      + (f"; {len(problems) - 1} more problems" if len(problems) > 1 else "") + f"): {nxt}",
                      stacklevel=2)
    raise CheckpointError(f"{root}: none of the {len(candidates)} checkpoints is usable (see the warnings); "
                          f"delete them or use checkpoint.resume=PATH/none with a new checkpoint.dir")


def is_finite_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the manifest of checkpoint ``path`` records all model weights finite at save time (``meta.finite``,
    from :func:`weights_finite`). A manifest without the field (written before the check existed, or by a
    tool) counts as finite; an unreadable one does not."""
    try:
        return read_manifest(path).get("meta", {}).get("finite", True) is not False
    except (CheckpointError, OSError):
        return False


def newest_good_checkpoint(root: str | os.PathLike, *, checksums: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (:func:`verify_checkpoint`) and holds finite weights
    (:func:`is_finite_checkpoint`): "the last good checkpoint" of a stop report and what ``resume=auto`` picks
    (which in addition warns about each one it skips). None when there is none. Collective when a process
    group exists (the verification is)."""
    for path in resume_candidates(root):
        if is_finite_checkpoint(path) and not verify_checkpoint(path, checksums=checksums):
            return path
    return None


def model_mismatch(saved: dict, current: dict) -> list[str]:
    """Architecture fields that differ between a checkpoint's model config and this run's (``name`` and the
    speed-only ``mamba_chunk_size`` do not count)."""
    ignore = {"name", "mamba_chunk_size"}
    keys = sorted((set(saved) | set(current)) - ignore)
    return [f"{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}" for k in keys
            if saved.get(k) != current.get(k)]


# ------------------------------------------------------------------------------------------------------
# RNG states


def rng_state() -> dict:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` reads: tensors, tuples, ints,
    floats, strings (numpy's key array as an int64 tensor, not a pickled ``ndarray``)."""
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from nvfp4_train.mcore_compat.cuda_on_cpu import cpu_compat_active

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
             "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and not cpu_compat_active():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from nvfp4_train.mcore_compat.cuda_on_cpu import cpu_compat_active

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    if isinstance(keys, torch.Tensor):  # our form; older saves hold the ndarray itself
        keys = keys.numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and not cpu_compat_active():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# ------------------------------------------------------------------------------------------------------
# Save / load of a training state (megatron)


def weights_finite(module) -> bool:
    """Whether every parameter of ``module`` is finite on every rank: one reduction per tensor, one
    all-reduce (MIN) of the result when a process group exists. Recorded in the manifest at save time."""
    import torch

    flags = [torch.isfinite(p.detach()).all() for p in module.parameters()]
    if not flags:
        return True
    ok = torch.stack(flags).all().to(torch.int32)
    dist = _dist()
    if dist is not None:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _first_error(err: str | None) -> str | None:
    """The first rank's error (in rank order) of a save phase, on every rank (collective with a process
    group), so that all ranks stop together instead of waiting for each other at the next barrier."""
    dist = _dist()
    if dist is None:
        return err
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((e for e in errs if e is not None), None)


class _PhaseClock:
    """Adds the seconds since the previous lap to ``timings[name]`` (does nothing without a dict)."""

    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.timings is not None:
            now = time.perf_counter()
            self.timings[name] = self.timings.get(name, 0.0) + now - self.t
            self.t = now


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def _sharded_state(ddp, optimizer, *, is_loading: bool, optim_format: str) -> dict:
    model_sd = ddp.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": optim_format}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def start_checkpoint_writer() -> None:
    """Give megatron-core's dist-checkpointing an in-process queue for its write results.

    Its writer reports through the module global ``filesystem_async._results_queue``, which megatron-core fills
    at the first save with a ``multiprocessing`` Manager queue served by a helper process it spawns. Our saves are
    synchronous: in megatron-core 0.16.1–0.19.2 the writer's parallel workers (forked processes in 0.16.1, threads
    in 0.19) report to a local queue, and only the calling process puts the collected results into this one and
    reads them back, in the same save. A plain ``queue.Queue`` therefore does the same work with no helper
    process: none to be killed by a signal sent to the whole process group (Slurm, ``timeout``, Ctrl-C) before
    the save that signal asks for, none to outlive a SIGKILLed trainer, and none to hang: on an H200 shared by
    nine trainers (2026-12-04), seven hung forever in the Manager queue's ``put`` at their final save."""
    import queue

    if not write_results_queue_set():
        set_write_results_queue(queue.Queue())


def save_checkpoint(root: str | os.PathLike, *, step: int, ddp, optimizer, trainer_state: dict, config_yaml: str,
                    meta: dict, keep_last: int, optim_format: str = "fully_reshardable",
                    rank_extra: dict | None = None, timings: dict[str, float] | None = None,
                    hash_threads: int | None = None, keep: tuple[str, ...] = ()) -> Path:
    """Save a training state as ``root/step_XXXXXXX`` (collective: every rank calls it). See the module
    docstring for the order that keeps the previous checkpoints safe. ``rank_extra`` is saved with this
    rank's RNG states (e.g. the quantized layers' stochastic-rounding counters). ``timings``, when given,
    receives this rank's seconds per phase (``prepare``, ``sharded_state``, ``dist_save``, ``rng_trainer``,
    ``manifest``, ``commit``; a phase ends with the barrier that follows it). ``hash_threads``: see
    :func:`write_manifest`. The manifest's ``meta.finite`` records :func:`weights_finite`. ``keep``: names of
    checkpoints the pruning must not delete (besides the newest ``keep_last``, ``latest`` and the newest finite
    one).

    When the free space is short of what the last checkpoint takes, the checkpoints this save's pruning would
    delete are deleted first (:func:`make_room`). Raises :class:`CheckpointWriteError` (on every rank) when
    the space is still short (:func:`check_free_space`, before anything is written) or when writing fails (no
    space, a file-size limit, permissions): the partial ``.tmp_step_*`` is then removed and the earlier
    checkpoints stay as they were. (A writer failure inside megatron-core's collective save on some ranks
    only can still leave the others waiting in it: the free-space check is what prevents the common case.)"""
    import torch
    from megatron.core import dist_checkpointing

    clock = _PhaseClock(timings)
    root = Path(root)
    rank = _rank()
    tmp = root / f".tmp_{step_dir_name(step)}"

    def fail_if(err: str | None) -> None:
        err = _first_error(err)
        if err is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(tmp, err)

    err = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            make_room(root, keep_last, keep=keep)
            check_free_space(root, keep=keep)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "dist").mkdir(parents=True)
            (tmp / "rng").mkdir()
        except CheckpointWriteError as e:
            err = e.reason
        except OSError as e:
            err = _write_failure(root, e)
    fail_if(err)
    clock.lap("prepare")
    meta = {**meta, "optim_format": optim_format, "finite": weights_finite(ddp.module)}
    state = _sharded_state(ddp, optimizer, is_loading=False, optim_format=optim_format)
    clock.lap("sharded_state")
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(state, str(tmp / "dist"))
    except (OSError, RuntimeError, CheckpointException) as e:  # megatron-core 0.16.1: CheckpointException of
        err = _write_failure(root, e)  # its writers' "RuntimeError: Worker failure" (the OSError is lost)
    del state
    fail_if(err)
    clock.lap("dist_save")
    try:
        torch.save({**rng_state(), "extra": rank_extra or {}}, tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            _write_atomic(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1, sort_keys=True))
            _write_atomic(tmp / "config.yaml", config_yaml)
    except (OSError, RuntimeError) as e:  # torch.save: "[enforce fail at inline_container.cc] unexpected pos"
        err = _write_failure(root, e)
    fail_if(err)
    clock.lap("rng_trainer")
    try:
        write_manifest(tmp, step=step, meta=meta, threads=hash_threads)
    except OSError as e:
        err = _write_failure(root, e)
    fail_if(err)
    clock.lap("manifest")
    final = root / step_dir_name(step)
    if rank == 0:
        final = commit_checkpoint(tmp, root, step)
        prune_checkpoints(root, keep_last, keep=keep)
    _barrier()
    clock.lap("commit")
    return final


def load_checkpoint(path: str | os.PathLike, *, ddp, optimizer, layout: dict, model_config: dict,
                    timings: dict[str, float] | None = None, trust: bool = False) -> dict:
    """Load a verified checkpoint into ``ddp`` and ``optimizer``; restore this rank's RNG states when the
    parallel layout is the same. Returns the trainer state (with ``resharded`` set when TP/PP differ, and this
    rank's ``rank_extra`` when the layout is the same, else None). ``timings``, when given, receives this
    rank's seconds per phase (``prepare``, ``sharded_state``, ``dist_load``, ``model_load``, ``optim_load``,
    ``rng``). ``trust`` (``checkpoint.trust``): False reads every pickled part through an allow-list
    (``nvfp4_train.mcore_compat.safe_load``) and raises its ``UntrustedPickleError`` (a ``ValueError``
    naming the file and the class) for anything else; True loads as torch and megatron-core do."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from nvfp4_train.mcore_compat.safe_load import (restricted_checkpoint_loading, restricted_unpickle,
                                                    safe_torch_load, untrusted_cause)

    def dist_load(sharded: dict) -> dict:
        if trust:
            return dist_checkpointing.load(sharded, str(path / "dist"))
        # read .metadata through the allow-list before torch does: torch reads it on one rank, and a refusal
        # there reaches the caller as an AssertionError ("metadata is None; global metadata read failed")
        # after it retried the file per rank, with the refusal only in its text
        metadata = path / "dist" / ".metadata"
        if metadata.is_file():
            with open(metadata, "rb") as f:
                restricted_unpickle(f, path=metadata, what="distributed-checkpoint metadata")
        try:
            with restricted_checkpoint_loading(path / "dist"):
                return dist_checkpointing.load(sharded, str(path / "dist"))
        except (Exception, CheckpointException) as e:  # a refusal reaches us wrapped in torch's per-rank
            # CheckpointException, a BaseException
            refused = untrusted_cause(e)
            if refused is None or refused is e:
                raise
            raise refused from None

    clock = _PhaseClock(timings)
    path = Path(path)
    manifest = read_manifest(path)
    meta = manifest.get("meta", {})
    diff = model_mismatch(meta.get("model", {}), model_config)
    if diff:
        raise CheckpointMismatch(
            f"checkpoint {path} was written for another model ({meta.get('model', {}).get('name')!r}; this run: "
            f"{model_config.get('name')!r}): " + "; ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
            + ". Resume with the checkpoint's model config, or start a new run (another experiment.run_dir, "
              "or checkpoint.resume=none with a new checkpoint.dir)")
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    saved_layout = meta.get("layout", {})
    same_model_layout = (saved_layout.get("tp"), saved_layout.get("pp")) == (layout["tp"], layout["pp"])
    optim_format = meta.get("optim_format", "dp_reshardable")
    clock.lap("prepare")
    if same_model_layout or optim_format == "fully_reshardable":
        _init_optimizer_state(optimizer)
        sharded = _sharded_state(ddp, optimizer, is_loading=True, optim_format=optim_format)
        clock.lap("sharded_state")
        state = dist_load(sharded)
        del sharded
        clock.lap("dist_load")
        ddp.module.load_state_dict(state["model"])
        clock.lap("model_load")
        _load_optimizer_state(optimizer, state["optimizer"], optim_format)
        clock.lap("optim_load")
    else:
        model_sd = ddp.module.sharded_state_dict()
        clock.lap("sharded_state")
        state = dist_load({"model": model_sd})
        clock.lap("dist_load")
        ddp.module.load_state_dict(state["model"])
        clock.lap("model_load")
        optimizer.reload_model_params()
        clock.lap("optim_load")
        if _rank() == 0:
            warnings.warn(
                f"checkpoint {path} was saved with tp={saved_layout.get('tp')}, pp={saved_layout.get('pp')} and a "
                f"dp_reshardable optimizer state; this run has tp={layout['tp']}, pp={layout['pp']}: the model "
                f"weights are resharded, but that optimizer state reshards only over DP, so the FP32 master weights "
                f"restart from the bf16 weights and the Adam moments from zero", stacklevel=2)
    trainer_state["resharded"] = not same_model_layout
    trainer_state["rank_extra"] = None
    if saved_layout == layout:
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        saved_rng = safe_torch_load(rng_file, trust=trust)
        set_rng_state(saved_rng)
        trainer_state["rank_extra"] = saved_rng.get("extra")
    elif _rank() == 0:
        warnings.warn(f"checkpoint {path}: parallel layout {saved_layout} differs from this run's {layout}; RNG "
                      f"states are not restored (the run continues from its seeds)", stacklevel=2)
    clock.lap("rng")
    return trainer_state
