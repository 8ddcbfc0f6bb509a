"""What ``pyproject.toml`` cannot declare: the YAML config tree, kept at the top of the repository as
``configs/``, ships inside the wheel as the package data of ``nvfp4_train.configs`` (so an installed wheel
composes configs on its own and installs no top-level ``configs``). Everything else is in ``pyproject.toml``."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["kernels", "kernels.*", "models", "models.*", "nvfp4_train",
                                              "nvfp4_train.*"]) + ["nvfp4_train.configs"],
    package_dir={"nvfp4_train.configs": "configs"},
    package_data={"nvfp4_train": ["data/tokenizer.json"], "nvfp4_train.configs": ["*.yaml", "*/*.yaml"]},
)
