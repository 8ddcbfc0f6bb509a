"""The optional-package loaders: absent packages give (None, reason); mamba-ssm's Triton submodules load
without running the package __init__ that needs the Mamba-1 CUDA extension."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch

from nvfp4_train.models.mamba import _import
from nvfp4_train.models.mamba._import import load_causal_conv1d, load_mamba_ssm
from nvfp4_train.models.mamba.ops import ssd_scan


@pytest.fixture
def fresh_loaders():
    load_mamba_ssm.cache_clear()
    load_causal_conv1d.cache_clear()
    yield
    load_mamba_ssm.cache_clear()
    load_causal_conv1d.cache_clear()


def _drop(prefix):
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]


def test_absent_packages_give_none_and_a_reason(fresh_loaders, monkeypatch):
    # sys.modules[name] = None is how Python marks a module as unimportable (find_spec returns None)
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    assert load_mamba_ssm() == (None, "mamba-ssm is not installed")
    assert load_causal_conv1d() == (None, "causal-conv1d is not installed")
    x = torch.randn(1, 5, 2, 3)
    out = ssd_scan(x, torch.rand(1, 5, 2), -torch.ones(2), torch.randn(1, 5, 1, 4), torch.randn(1, 5, 1, 4), 4)
    assert out.shape == x.shape  # the CPU path needs neither package


def test_this_environment(fresh_loaders):
    """Whatever is installed here, the loaders answer without raising; absent means None."""
    for pkg, loader in (("mamba_ssm", load_mamba_ssm), ("causal_conv1d", load_causal_conv1d)):
        ops, reason = loader()
        assert isinstance(reason, str) and reason
        if importlib.util.find_spec(pkg) is None:
            assert ops is None


_FAKE_INIT = '''
"""A stand-in for mamba-ssm's __init__: it imports the Mamba-1 CUDA module first, as the real one does."""
import selective_scan_cuda  # noqa: F401
RAN_INIT = True
'''
_FAKE_SSD = '''
from mamba_ssm.ops.triton.helper import tag

def mamba_chunk_scan_combined(*args, **kwargs):
    return tag
'''


def _fake_mamba(root, *, broken_norm=False):
    """A package laid out like mamba-ssm 2.3.2: __init__ needs selective_scan_cuda; the Triton submodules
    import each other by absolute name."""
    files = {
        "mamba_ssm/__init__.py": _FAKE_INIT,
        "mamba_ssm/ops/__init__.py": "",
        "mamba_ssm/ops/triton/__init__.py": "",
        "mamba_ssm/ops/triton/helper.py": "tag = 'fake ssd'\n",
        "mamba_ssm/ops/triton/ssd_combined.py": _FAKE_SSD,
        "mamba_ssm/ops/triton/layernorm_gated.py": (
            "raise ImportError('no einops here')\n" if broken_norm
            else "def rmsnorm_fn(*a, **k):\n    return 'fake norm'\n"
        ),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_mamba_env(fresh_loaders, monkeypatch, tmp_path):
    if "mamba_ssm" in sys.modules or "selective_scan_cuda" in sys.modules:
        pytest.skip("a real mamba_ssm is already imported in this process")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_import, "_MAMBA_TRITON_DEPS", ("packaging",))  # the fake needs no einops/triton
    yield tmp_path
    _drop("mamba_ssm")
    importlib.invalidate_caches()


def test_loads_triton_submodules_without_the_package_init(fake_mamba_env):
    _fake_mamba(fake_mamba_env)
    ops, reason = load_mamba_ssm()
    assert ops is not None, reason
    assert ops.bare_package and "without its package __init__" in reason
    assert ops.mamba_chunk_scan_combined() == "fake ssd" and ops.rmsnorm_fn() == "fake norm"
    pkg = sys.modules["mamba_ssm"]
    assert not hasattr(pkg, "RAN_INIT")  # __init__ never ran ...
    assert pkg.__path__ == [str(fake_mamba_env / "mamba_ssm")]  # ... yet it is the real package directory
    assert "selective_scan_cuda" not in sys.modules  # and no stand-in was registered for the CUDA module
    with pytest.raises(ImportError):
        importlib.import_module("selective_scan_cuda")


def test_failed_load_leaves_no_half_imported_package(fake_mamba_env):
    _fake_mamba(fake_mamba_env, broken_norm=True)
    ops, reason = load_mamba_ssm()
    assert ops is None and "no einops here" in reason
    assert not [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]


def test_missing_triton_dependency_is_reported(fresh_loaders, monkeypatch, tmp_path):
    if "mamba_ssm" in sys.modules:
        pytest.skip("a real mamba_ssm is already imported in this process")
    _fake_mamba(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_import, "_MAMBA_TRITON_DEPS", ("packaging", "surely_not_installed_dep"))
    ops, reason = load_mamba_ssm()
    assert ops is None and "surely_not_installed_dep" in reason
    assert "mamba_ssm" not in sys.modules
