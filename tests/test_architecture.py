"""The layers' import directions (docs/architecture.md), read from every import statement with ``ast``:
nvfp4_train.kernels (``kernels/``) -> nvfp4_train.precision (``precision/``) -> nvfp4_train.models (``models/``)
-> the trainer (``nvfp4_train/``) -> nvfp4_train.bench / nvfp4_train.experiments; and no code imports the
folders by their bare names (``kernels``, ``models``, ``precision``): they install only under ``nvfp4_train``."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folder -> (its package, the packages of ours it may import besides its own)
LOWER = ("nvfp4_train.kernels", "nvfp4_train.precision", "nvfp4_train.models")
LAYERS = {
    "kernels": ("nvfp4_train.kernels", ()),
    "precision": ("nvfp4_train.precision", ("nvfp4_train.kernels", "nvfp4_train.mcore_compat")),
    "models": ("nvfp4_train.models", ("nvfp4_train.kernels", "nvfp4_train.precision", "nvfp4_train.mcore_compat")),
}
ABOVE_TRAINER = ("nvfp4_train.bench", "nvfp4_train.experiments")


def _under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def _package_of(path: Path) -> str:
    """The dotted package ``path`` (a .py file of one of the four folders) is installed in."""
    rel = path.relative_to(ROOT)
    top, parts = rel.parts[0], list(rel.with_suffix("").parts[1:])
    base = "nvfp4_train" if top == "nvfp4_train" else LAYERS[top][0]
    mod = ".".join([base, *parts])
    return mod.removesuffix(".__init__") if path.name == "__init__.py" else mod.rpartition(".")[0]


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``path``, relative ones resolved (a name
    imported from a package counts as the package: ``from nvfp4_train import models`` -> nvfp4_train.models).
    ``source``: the text to read as that file's (default: the file's)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(path).split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _py_files(*folders: str) -> list[Path]:
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *folders], capture_output=True,
                             text=True, check=True).stdout.split("\0")
    return [ROOT / f for f in tracked if f.endswith(".py")]


def test_each_layer_imports_only_the_layers_below_it():
    offenders = []
    for folder, (own, allowed) in LAYERS.items():
        for path in _py_files(folder):
            for line, name in imports(path):
                if _under(name, "nvfp4_train") and not any(_under(name, p) for p in (own, *allowed)):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    for path in _py_files("nvfp4_train"):
        if any(_under(_package_of(path), p) for p in ABOVE_TRAINER):
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in imports(path)
                      if any(_under(name, p) for p in ABOVE_TRAINER)]
    assert not offenders, "\n".join(offenders)


def test_nothing_imports_the_folders_by_their_bare_names():
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in _py_files(".")
                 for line, name in imports(path) if name.split(".")[0] in ("kernels", "models", "precision")]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_a_wrong_direction():
    """The parser resolves what a layer's file could say: a relative import climbing out of its package, a
    module imported from a package, a plain import, a sibling; the first check flags the first three."""
    src = ("from ..models import build\nfrom nvfp4_train import trainer\nimport nvfp4_train.models.pattern\n"
           "from . import layer_map\n")
    names = [n for _, n in imports(ROOT / "precision" / "recipe.py", src)]
    assert names == ["nvfp4_train.models.build", "nvfp4_train.trainer", "nvfp4_train.models.pattern",
                     "nvfp4_train.precision.layer_map"]
