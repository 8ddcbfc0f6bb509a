"""A run's third-party warnings go to its log file, each once; our own stay on stderr.

megatron-core, torch and mamba-ssm warn about what a user of this project cannot change (Apex or Transformer
Engine not installed, deprecated torch.distributed names megatron calls, ...). ``ThirdPartyWarnings``, installed
by ``train.py`` before anything imports them, writes each distinct such warning once to
``<run dir>/warnings.log`` (held in memory until the run directory is known) and prints one line on stderr
pointing there; megatron's own log records at WARNING go the same way. Where there is no run directory to log
to (``export``, ``evaluate``, ``generate``; a run refused its directory, which writes nothing into it), the
held warnings are only counted, in one line at the end. A warning raised in our packages
(``nvfp4_train`` and the ``kernels/``, ``precision/``, ``models/`` it installs) is shown on one line (``file:line:
Category: message``, without Python's second line quoting the source), except a :class:`RunEventWarning`: the
trainer logs that one as an event of the run and prints it as a note, so it is not shown a second time. With
``python -W ...`` or ``PYTHONWARNINGS`` set, nothing is routed: the user's filters decide.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path

__all__ = ["LOG_NAME", "RunEventWarning", "ThirdPartyWarnings"]

LOG_NAME = "warnings.log"


class RunEventWarning(UserWarning):
    """A warning that the trainer also logs as an event of the run (``metrics.jsonl``) and prints as a note
    (``step N: ...``): a resume that changes the schedule or the precision, a CUDA-graph fallback, a taken-over
    lock. Raised for the code that uses the trainer as a library; under ``train.py`` the note is its one copy."""


def _our_dirs() -> tuple[str, ...]:
    dirs = []
    for pkg in ("nvfp4_train", "nvfp4_train.kernels", "nvfp4_train.precision", "nvfp4_train.models"):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            dirs += [str(Path(p).resolve()) for p in spec.submodule_search_locations]
    return tuple(d.rstrip("/") + "/" for d in dirs)


class ThirdPartyWarnings:
    """Route third-party warnings (``warnings`` and megatron's WARNING log records) to a log file."""

    def __init__(self, stderr=None) -> None:
        self._stderr = stderr
        self._ours = _our_dirs()
        self._seen: set[tuple[str, str]] = set()
        self._held: list[str] = []
        self._file = None
        self._path: Path | None = None
        self._previous = None
        self._handler: logging.Handler | None = None
        self._rank = 0
        self._pointed = False
        self.active = False

    def install(self) -> ThirdPartyWarnings:
        if sys.warnoptions or self.active:
            return self
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        router = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                router._third_party(record.levelname, f"{record.name}: {record.getMessage()}",
                                    f"{record.name}: {record.levelname}: {record.getMessage()}\n")

        self._handler = _Handler(logging.WARNING)
        self._handler.addFilter(lambda r: r.levelno < logging.ERROR)  # errors stay where megatron puts them
        logging.getLogger("megatron").addHandler(self._handler)
        self._megatron_propagate = logging.getLogger("megatron").propagate
        logging.getLogger("megatron").propagate = False
        self.active = True
        return self

    def attach(self, run_dir: Path, rank: int = 0) -> None:
        """From here on, write to ``run_dir/warnings.log`` (what was held first); rank 0 says so once."""
        if not self.active or self._file is not None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._path = run_dir / LOG_NAME
        self._file = open(self._path, "a", buffering=1)
        self._rank = rank
        for text in self._held:
            self._write(text)
        n, self._held = len(self._held), []
        if n:
            self._pointer(n)

    def close(self) -> None:
        """Stop routing. Warnings still held (never :meth:`attach`-ed: a command without a run directory, such
        as ``export``, ``evaluate``, ``generate``, or a run refused its directory) are counted in one line."""
        if not self.active:
            return
        warnings.showwarning = self._previous
        lg = logging.getLogger("megatron")
        lg.removeHandler(self._handler)
        lg.propagate = self._megatron_propagate
        if self._file is not None:
            self._file.close()
        elif self._held and self._rank == 0:
            print(f"({len(self._held)} third-party warning(s) not shown: no run directory to log them to; "
                  f"`python -W default ...` shows them)", file=self._err(), flush=True)
        self.active = False

    # -- internals ----------------------------------------------------------------------------------------
    def _err(self):
        return self._stderr or sys.stderr

    def _pointer(self, n: int) -> None:
        self._pointed = True
        if self._rank == 0:
            print(f"third-party warnings (megatron-core, torch, ...; each once): {self._path}",
                  file=self._err(), flush=True)

    def _write(self, text: str) -> None:
        self._file.write(text if self._rank == 0 else f"[rank {self._rank}] {text}")

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, RunEventWarning):
            return  # the trainer prints it as a note of the run
        if str(Path(filename).resolve()).startswith(self._ours):
            self._previous(message, category, filename, lineno, file, "")  # "": no source line
            return
        self._third_party(category.__name__, str(message),
                          warnings.formatwarning(message, category, filename, lineno, line))

    def _third_party(self, kind: str, message: str, text: str) -> None:
        key = (kind, message)
        if key in self._seen:
            return
        self._seen.add(key)
        if self._file is None:
            self._held.append(text)
            return
        self._write(text)
        if not self._pointed:
            self._pointer(1)
