"""``requirements/cpu-constraints.txt`` never contradicts torch's own pins: ``pip install -c`` of the file with a
torch from PyPI must resolve (a ``triton`` pin other than torch's made it ``ResolutionImpossible``)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

CONSTRAINTS = Path(__file__).resolve().parents[1] / "requirements" / "cpu-constraints.txt"

# torch 2.13.0's PyPI wheel (torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl), its METADATA's Requires-Dist on
# triton, read 2026-12-04 (`pip install --dry-run --no-deps --report`). The CPU wheel the CPU machines install
# (torch 2.13.0+cpu) requires no triton, so the installed torch's metadata alone cannot catch a wrong pin there.
PYPI_TORCH = Version("2.13.0")
PYPI_TORCH_REQUIRES = ['triton==3.7.1; platform_system == "Linux" and python_version < "3.15"']


def pins(text: str) -> dict[str, Version]:
    """``{name: version}`` of the ``name==version`` lines (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: the constraints file pins exact versions"
            out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def contradictions(pinned: dict[str, Version], requires: list[str], environment: dict | None = None) -> list[str]:
    """The requirements among ``requires`` (Requires-Dist lines) whose package is pinned to a version they
    exclude, where their marker holds in ``environment`` (None: this interpreter's)."""
    out = []
    for line in requires:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name not in pinned or (req.marker is not None and not req.marker.evaluate(environment)):
            continue
        if not req.specifier.contains(pinned[name], prereleases=True):
            out.append(f"{line} excludes the pin {name}=={pinned[name]}")
    return out


def test_the_pins_satisfy_what_torch_2_13_0_from_pypi_requires():
    pinned = pins(CONSTRAINTS.read_text())
    assert pinned["torch"] == PYPI_TORCH, "torch's pin changed: record that wheel's Requires-Dist above"
    linux = {"platform_system": "Linux", "python_version": "3.11"}
    assert contradictions(pinned, PYPI_TORCH_REQUIRES, linux) == []
    assert contradictions({"triton": Version("3.9.0")}, PYPI_TORCH_REQUIRES, linux) != []  # the check can fail


def test_the_pins_satisfy_what_the_installed_torch_requires():
    pinned = pins(CONSTRAINTS.read_text())
    installed = Version(importlib.metadata.version("torch"))
    if Version(installed.public) != pinned["torch"]:
        pytest.skip(f"torch {installed} is installed, the constraints pin {pinned['torch']}")
    assert contradictions(pinned, importlib.metadata.requires("torch") or []) == []
