"""What ``pyproject.toml`` cannot declare: the repository keeps each layer in a folder of its own at the top
(``kernels/``, ``precision/``, ``models/``, the trainer ``nvfp4_train/``) and the YAML config tree as
``configs/``; all of them install under the one namespace ``nvfp4_train`` (``nvfp4_train.kernels``,
``nvfp4_train.precision``, ``nvfp4_train.models``, ``nvfp4_train.configs`` with the YAML files as package data),
so the wheel installs no top-level package but ``nvfp4_train``. An editable install (``make install``) maps each
of them to its folder. Everything else is in ``pyproject.toml``."""

from pathlib import Path

from setuptools import find_packages, setup

# package -> the repository folder it is installed from
LAYERS = {"nvfp4_train.kernels": "kernels", "nvfp4_train.precision": "precision", "nvfp4_train.models": "models"}

packages = find_packages(include=["nvfp4_train", "nvfp4_train.*"])
for pkg, folder in LAYERS.items():
    packages += [pkg] + [f"{pkg}.{sub}" for sub in find_packages(where=folder)]

# The YAML tree: each config group (configs/model/, ...) is a data-only package of its own, so that setuptools
# ships its files without warning that a folder of package data is not a declared package.
CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_GROUPS = sorted(d.name for d in CONFIG_DIR.iterdir() if d.is_dir() and any(d.glob("*.yaml")))
config_packages = ["nvfp4_train.configs"] + [f"nvfp4_train.configs.{group}" for group in CONFIG_GROUPS]

setup(
    packages=packages + config_packages,
    package_dir={**LAYERS, "nvfp4_train.configs": "configs"},
    package_data={"nvfp4_train": ["data/tokenizer.json"], **{pkg: ["*.yaml"] for pkg in config_packages}},
)
