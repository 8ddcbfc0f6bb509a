"""The planted pickle payload of the untrusted-file tests (``docs/reliability.md``, threat model)."""

from __future__ import annotations

import os
from pathlib import Path


class Payload:
    """Unpickling this runs ``touch <marker>`` (``os.system``, pickled as ``posix.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
