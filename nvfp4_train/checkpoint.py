"""Checkpoints that survive a crash at any moment, written with megatron-core's dist-checkpointing.

Layout of ``<checkpoint dir>`` (default ``<run_dir>/checkpoints``)::

    step_0000100/
        dist/                 megatron dist-checkpoint: model and distributed-optimizer state (sharded,
                              reshardable over TP/PP for the model, over DP for the optimizer: see below)
        rng/rank_00000.pt     python, numpy, torch CPU, CUDA and megatron-tracker RNG states of each rank
        trainer_state.json    step, consumed samples and tokens, skipped steps, schedule, parallel layout
        config.yaml           the resolved config of the run that wrote it
        manifest.json         size and sha256 of every file above: written LAST
    latest                    the name of the newest complete checkpoint (replaced atomically)

Saving (all ranks): write everything into ``.tmp_step_0000100/``, hash the files (spread over the ranks, and
within a rank over threads, one whole file each), write ``manifest.json`` (via a temporary name and
``os.replace``), rename the directory to ``step_0000100``, replace ``latest``, delete all but the newest
``keep_last``. A crash at any point leaves the previous
checkpoints and ``latest`` untouched (a stale ``.tmp_*`` is removed by the next save).

Loading verifies the manifest first (every file present, sizes and, by default, sha256) and names the first
bad or missing file. ``resume=auto`` tries the checkpoints newest first (``latest`` names the newest; it is for
people and tools) and warns for each one it has to skip. A checkpoint of another model (a different ``ModelConfig``) is a ``ValueError``, not
a fallback.

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
    """Save every this many steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    keep_last: int = 3
    """Keep this many newest checkpoints (older ones are deleted after a successful save)."""
    resume: str = "auto"
    """``auto``: the newest good checkpoint in ``dir`` if any (else start fresh); ``none``: start fresh (an
    existing checkpoint directory is then an error, to never mix two runs); a path: a checkpoint directory
    (``.../step_0000100``) or a checkpoint root (its newest good one)."""
    save_at_end: bool = True
    """Save after the last step."""
    save_on_signal: bool = True
    """On SIGTERM/SIGUSR1: finish the current step, save, exit cleanly."""
    verify: str = "sha256"
    """What loading checks against the manifest: ``sha256`` (sizes and checksums) or ``size`` (sizes only)."""
    optim_format: str = "fully_reshardable"
    """Distributed-optimizer state format (megatron-core's names): ``fully_reshardable`` (per parameter,
    gathered on DP rank 0 at save; loads under any TP/PP/DP) or ``dp_reshardable`` (each rank's flat shard,
    no gather; loads under another DP size only, another TP/PP restarts the optimizer state)."""

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


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and stale ``.tmp_*``/``.trash_*``
    directories. Never deletes the one ``latest`` names. Returns what was deleted."""
    root = Path(root)
    ckpts = list_checkpoints(root)
    latest = _read_latest(root)
    deleted = []
    for p in ckpts[:-keep_last] if keep_last else ckpts:
        if latest is not None and p.name == latest.name:
            continue
        shutil.rmtree(p, ignore_errors=True)
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
                             f"({', '.join(p.name for p in list_checkpoints(root))}): use another experiment.name "
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
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from nvfp4_train.mcore_compat.cuda_on_cpu import cpu_compat_active

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
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
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and not cpu_compat_active():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# ------------------------------------------------------------------------------------------------------
# Save / load of a training state (megatron)


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


_writer_manager = None


def _writer_helper_init() -> None:
    """Runs in the writer helper process: ignore the stop signals, and die with the trainer (Linux)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_checkpoint_writer() -> None:
    """Start megatron-core's checkpoint-writer helper process now, deaf to SIGTERM, SIGUSR1 and SIGINT.

    dist-checkpointing collects its write results through a ``multiprocessing`` Manager queue that it spawns
    at the first save (``filesystem_async._results_queue``). A signal sent to the whole process group
    (Slurm's scancel and time limit, ``timeout``, Ctrl-C) would kill that helper too, and the save the
    trainer does on that very signal would then fail (``BrokenPipeError``/``EOFError``). So the trainer
    creates that queue itself, in a helper that ignores those signals (set before the spawn, inherited
    through its exec, and again in the helper) and is killed when the trainer process dies (a plain
    Manager would outlive a SIGKILLed trainer)."""
    global _writer_manager
    import multiprocessing
    import signal
    from multiprocessing.managers import SyncManager

    if write_results_queue_set():
        return
    sigs = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=_writer_helper_init)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    _writer_manager = manager
    set_write_results_queue(manager.Queue())


def save_checkpoint(root: str | os.PathLike, *, step: int, ddp, optimizer, trainer_state: dict, config_yaml: str,
                    meta: dict, keep_last: int, optim_format: str = "fully_reshardable",
                    rank_extra: dict | None = None, timings: dict[str, float] | None = None,
                    hash_threads: int | None = None) -> Path:
    """Save a training state as ``root/step_XXXXXXX`` (collective: every rank calls it). See the module
    docstring for the order that keeps the previous checkpoints safe. ``rank_extra`` is saved with this
    rank's RNG states (e.g. the quantized layers' stochastic-rounding counters). ``timings``, when given,
    receives this rank's seconds per phase (``prepare``, ``sharded_state``, ``dist_save``, ``rng_trainer``,
    ``manifest``, ``commit``; a phase ends with the barrier that follows it). ``hash_threads``: see
    :func:`write_manifest`."""
    import torch
    from megatron.core import dist_checkpointing

    clock = _PhaseClock(timings)
    root = Path(root)
    rank = _rank()
    tmp = root / f".tmp_{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier()
    clock.lap("prepare")
    state = _sharded_state(ddp, optimizer, is_loading=False, optim_format=optim_format)
    clock.lap("sharded_state")
    dist_checkpointing.save(state, str(tmp / "dist"))
    del state
    clock.lap("dist_save")
    torch.save({**rng_state(), "extra": rank_extra or {}}, tmp / "rng" / f"rank_{rank:05d}.pt")
    meta = {**meta, "optim_format": optim_format}
    if rank == 0:
        _write_atomic(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1, sort_keys=True))
        _write_atomic(tmp / "config.yaml", config_yaml)
    _barrier()
    clock.lap("rng_trainer")
    write_manifest(tmp, step=step, meta=meta, threads=hash_threads)
    _barrier()
    clock.lap("manifest")
    final = root / step_dir_name(step)
    if rank == 0:
        final = commit_checkpoint(tmp, root, step)
        prune_checkpoints(root, keep_last)
    _barrier()
    clock.lap("commit")
    return final


def load_checkpoint(path: str | os.PathLike, *, ddp, optimizer, layout: dict, model_config: dict,
                    timings: dict[str, float] | None = None) -> dict:
    """Load a verified checkpoint into ``ddp`` and ``optimizer``; restore this rank's RNG states when the
    parallel layout is the same. Returns the trainer state (with ``resharded`` set when TP/PP differ, and this
    rank's ``rank_extra`` when the layout is the same, else None). ``timings``, when given, receives this
    rank's seconds per phase (``prepare``, ``sharded_state``, ``dist_load``, ``model_load``, ``optim_load``,
    ``rng``)."""
    import torch
    from megatron.core import dist_checkpointing

    clock = _PhaseClock(timings)
    path = Path(path)
    manifest = read_manifest(path)
    meta = manifest.get("meta", {})
    diff = model_mismatch(meta.get("model", {}), model_config)
    if diff:
        raise ValueError(
            f"checkpoint {path} was written for another model ({meta.get('model', {}).get('name')!r}; this run: "
            f"{model_config.get('name')!r}): " + "; ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
            + ". Resume with the checkpoint's model config, or start a new run (another experiment.name or "
              "checkpoint.resume=none with a new checkpoint.dir)")
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    saved_layout = meta.get("layout", {})
    same_model_layout = (saved_layout.get("tp"), saved_layout.get("pp")) == (layout["tp"], layout["pp"])
    optim_format = meta.get("optim_format", "dp_reshardable")
    clock.lap("prepare")
    if same_model_layout or optim_format == "fully_reshardable":
        _init_optimizer_state(optimizer)
        sharded = _sharded_state(ddp, optimizer, is_loading=True, optim_format=optim_format)
        clock.lap("sharded_state")
        state = dist_checkpointing.load(sharded, str(path / "dist"))
        del sharded
        clock.lap("dist_load")
        ddp.module.load_state_dict(state["model"])
        clock.lap("model_load")
        _load_optimizer_state(optimizer, state["optimizer"], optim_format)
        clock.lap("optim_load")
    else:
        model_sd = ddp.module.sharded_state_dict()
        clock.lap("sharded_state")
        state = dist_checkpointing.load({"model": model_sd}, str(path / "dist"))
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
        saved_rng = torch.load(rng_file, weights_only=False)
        set_rng_state(saved_rng)
        trainer_state["rank_extra"] = saved_rng.get("extra")
    elif _rank() == 0:
        warnings.warn(f"checkpoint {path}: parallel layout {saved_layout} differs from this run's {layout}; RNG "
                      f"states are not restored (the run continues from its seeds)", stacklevel=2)
    clock.lap("rng")
    return trainer_state
