"""Loading checkpoint files without unpickling arbitrary objects (megatron-core 0.16.1, torch 2.13).

A pickle names the callables it runs (its GLOBALs): a checkpoint from a stranger can name ``os.system``.
Three places of the resume path unpickle with torch's or Python's permissive loaders:

- torch 2.13 ``FileSystemReader.read_metadata`` reads ``dist/.metadata`` with ``pickle.load`` (reached
  through megatron-core 0.16.1's ``dist_checkpointing.load``, ``CachedMetadataFileSystemReader``);
- torch 2.13 ``DefaultLoadPlanner.load_bytes`` reads every byte item of the ``.distcp`` shards (megatron's
  ``_extra_state`` entries, its ``ShardedObject`` s) with ``torch.load(weights_only=False)``
  (megatron-core 0.16.1's ``MCoreLoadPlanner`` inherits it);
- megatron-core 0.16.1 reads ``dist/common.pt`` and sharded-object ``*.pt`` files with ``torch.load``'s
  default, which is ``weights_only=True`` unless the environment sets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``.

"torch's ``weights_only`` allow-list" below is what ``torch.load(weights_only=True)`` accepts in the
process: torch's own (tensors, containers, numbers, strings, dtypes) plus what megatron-core 0.16.1
registers when it is imported (``megatron.core.safe_globals.SAFE_GLOBALS``: numpy arrays and dtypes,
``argparse.Namespace``, ``SimpleNamespace``, ``PosixPath``, ``BytesIO``, a few of its enums and config
dataclasses). None of those runs code when unpickled; each is rebuilt by the same restricted unpickler.

:func:`restricted_checkpoint_loading` replaces the first two, for the duration of a ``with`` block, by loads
that accept only an allow-list (:data:`DCP_METADATA_GLOBALS` and torch dtypes for the metadata; torch's own
``weights_only`` allow-list for byte items), and :func:`check_torch_file` scans a ``torch.save`` file's
GLOBALs without running them (used for ``common.pt``, the ``*.pt`` objects and our RNG files). Anything else
is an :class:`UntrustedPickleError` naming the file and the class. Nothing is patched at import; the
checkpoint loader installs the block around its ``dist_checkpointing.load`` only when
``checkpoint.trust=false``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "DCP_METADATA_GLOBALS",
    "UntrustedPickleError",
    "first_pickle_global",
    "restricted_unpickle",
    "check_torch_file",
    "safe_torch_load",
    "restricted_checkpoint_loading",
    "untrusted_cause",
]

DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})
"""What torch 2.13's distributed-checkpoint ``.metadata`` pickles (as megatron-core 0.16.1 saves it: the
metadata, its storage index, the coordinator's save plan), besides torch dtypes (``torch.bfloat16``, ...)."""


class UntrustedPickleError(ValueError):
    """A checkpoint or cache file whose pickle names a global outside the allow-list (never run)."""

    def __init__(self, path: str | os.PathLike, name: str, what: str = "") -> None:
        self.path, self.name = str(path), name
        super().__init__(
            f"{path}{f' ({what})' if what else ''} holds a pickled {name}, which is not in the allow-list of "
            f"what this file may hold: refusing to load it (it could run code). Use checkpoints only from "
            f"sources you trust; set checkpoint.trust=true only for a checkpoint you wrote yourself")
        self._what = what

    def __reduce__(self):  # torch's distributed checkpoint re-raises a rank's error from a pickled copy
        return (type(self), (self.path, self.name, self._what))


def _is_allowed_metadata_global(module: str, name: str) -> bool:
    if (module, name) in DCP_METADATA_GLOBALS:
        return True
    if module == "torch":
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    return False


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, *, path: str, allowed, what: str) -> None:
        super().__init__(file)
        self._path, self._allowed, self._what = path, allowed, what

    def find_class(self, module: str, name: str):
        if not self._allowed(module, name):
            raise UntrustedPickleError(self._path, f"{module}.{name}", self._what)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UntrustedPickleError(self._path, f"persistent id {str(pid)[:40]!r}", self._what)


def restricted_unpickle(file, *, path: str | os.PathLike, allowed=_is_allowed_metadata_global, what: str = ""):
    """``pickle.load(file)`` that resolves only the globals ``allowed(module, name)`` accepts (default: the
    distributed-checkpoint metadata's); the first other one is an :class:`UntrustedPickleError` naming
    ``path`` and it, before anything it names is called."""
    return _RestrictedUnpickler(file, path=str(path), allowed=allowed, what=what).load()


def first_pickle_global(path: str | os.PathLike) -> str | None:
    """The first global a pickle file names (``module.name``), found without running it; None when it
    names none or is no pickle."""
    try:
        with open(path, "rb") as f:
            restricted_unpickle(f, path=path, allowed=lambda m, n: False)
    except UntrustedPickleError as e:
        return e.name
    except Exception:  # not a pickle, truncated, ...: it names nothing we could report
        return None
    return None


def check_torch_file(f, *, path: str | os.PathLike, what: str = "") -> None:
    """Raise :class:`UntrustedPickleError` when the ``torch.save`` file ``f`` (a path or a binary file object,
    rewound afterwards) names a global outside torch's ``weights_only`` allow-list. The scan disassembles the
    pickle (torch's ``get_unsafe_globals_in_checkpoint``); it runs nothing. A file that is not a
    ``torch.save`` archive (a bare pickle) is scanned with a refusing unpickler instead."""
    import torch

    pos = f.tell() if hasattr(f, "tell") else None
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except ValueError:  # not a zip archive: the legacy torch.save format or a bare pickle
        if pos is not None:
            f.seek(pos)
            restricted_unpickle(f, path=path, allowed=lambda m, n: False, what=what)
        else:
            with open(f, "rb") as fh:
                restricted_unpickle(fh, path=path, allowed=lambda m, n: False, what=what)
        unsafe = []
    finally:
        if pos is not None:
            f.seek(pos)
    if unsafe:
        raise UntrustedPickleError(path, unsafe[0], what)


def safe_torch_load(path: str | os.PathLike, *, trust: bool):
    """``torch.load`` of a file of ours: with ``trust=False`` only what torch's ``weights_only`` unpickler
    accepts (tensors, containers, numbers, strings), else an :class:`UntrustedPickleError` naming the file
    and the class; ``trust=True``: any object (``weights_only=False``), for files you wrote yourself."""
    import torch

    if trust:
        return torch.load(path, weights_only=False)
    with open(path, "rb") as f:
        check_torch_file(f, path=path)
        return torch.load(f, weights_only=True)


def _read_metadata_restricted(self, *args, **kwargs):
    """torch 2.13 ``FileSystemReader.read_metadata`` with a restricted unpickler instead of ``pickle.load``."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as f:
        metadata = restricted_unpickle(f, path=path, what="distributed-checkpoint metadata")
    if not isinstance(metadata, Metadata):
        raise UntrustedPickleError(path, type(metadata).__qualname__, "distributed-checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes_restricted(self, read_item, value: io.BytesIO) -> None:
    """torch 2.13 ``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (after a scan that names the
    shard file and the class) instead of ``weights_only=False``."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element

    info = getattr(self.metadata, "storage_data", {}).get(read_item.storage_index) if self.metadata else None
    where = f"{_CURRENT_DIR[-1] if _CURRENT_DIR else '.'}/{info.relative_path}" if info else "a .distcp shard"
    check_torch_file(value, path=where, what=f"item {read_item.dest_index.fqn}")
    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


_CURRENT_DIR: list[str] = []


def untrusted_cause(exc: BaseException) -> UntrustedPickleError | None:
    """The :class:`UntrustedPickleError` behind ``exc``, if any: torch 2.13's distributed checkpoint gathers
    each rank's read error and raises a ``CheckpointException`` holding them (``.failures``: rank ->
    (exception, traceback)), which megatron-core 0.16.1 may wrap again."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UntrustedPickleError):
            return e
        for failure in (getattr(e, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                todo.append(inner)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return None


@contextlib.contextmanager
def restricted_checkpoint_loading(checkpoint_dir: str | os.PathLike) -> Iterator[None]:
    """Within the block, torch's distributed-checkpoint reader unpickles ``.metadata`` with only
    :data:`DCP_METADATA_GLOBALS` and loads byte items with ``weights_only=True``; and first every
    ``*.pt`` file of ``checkpoint_dir`` (megatron-core's ``common.pt`` and sharded objects) is scanned with
    :func:`check_torch_file`. For torch 2.13 / megatron-core 0.16.1 (the method names and bodies replaced
    are theirs); restored on exit, also on error. Not re-entrant across threads: the checkpoint loader calls
    it from the main thread."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    checkpoint_dir = Path(checkpoint_dir)
    for p in sorted(checkpoint_dir.rglob("*.pt")):
        with open(p, "rb") as f:
            check_torch_file(f, path=p)
    saved = (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes)
    FileSystemReader.read_metadata = _read_metadata_restricted
    DefaultLoadPlanner.load_bytes = _load_bytes_restricted
    _CURRENT_DIR.append(str(checkpoint_dir))
    try:
        yield
    finally:
        _CURRENT_DIR.pop()
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved
