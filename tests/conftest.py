"""Test tiers (see pyproject markers):

- unmarked: CPU unit tests (pure PyTorch references, layers, configs).
- ``triton``: Triton kernels. Under ``TRITON_INTERPRET=1`` they run on CPU tensors (``make test``); on a
  CUDA machine without the flag they run natively (``make test-gpu``). Otherwise they are skipped.
- ``dist``: two gloo ranks.
- ``gpu``: needs CUDA, skipped without it.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_device() -> str | None:
    if INTERPRET:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


def pytest_collection_modifyitems(config, items):
    dev = _triton_device()
    skip_triton = pytest.mark.skip(reason="Triton tests need TRITON_INTERPRET=1 or a CUDA device")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "triton" in item.keywords and dev is None:
            item.add_marker(skip_triton)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def triton_device() -> str:
    """Device on which Triton kernels run in this process: 'cpu' under the interpreter, else 'cuda'."""
    dev = _triton_device()
    assert dev is not None
    return dev


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator per test: inputs are new random draws for every test function, and
    the seed is printed on failure so a failing draw can be reproduced: TEST_GEN_SEED=<seed> replays it."""
    fixed = os.environ.get("TEST_GEN_SEED")
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    print(f"[gen seed {seed}]")
    return g


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """A run directory of the hybrid ``tiny`` trained three steps by ``train.py`` (tests/export/conftest.py),
    once per session for every test that reads it (export, evaluation, gradient fidelity)."""
    from tests.export.conftest import train_tiny

    return train_tiny(tmp_path_factory.mktemp("export_tiny"))
