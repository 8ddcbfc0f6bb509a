"""nvfp4_train.mcore_compat.jit: megatron-core's fused helpers compiled at their first call, not at import."""

from __future__ import annotations

import subprocess
import sys

import torch

from nvfp4_train.mcore_compat import jit
from tests.trainer.runs import ROOT, env


def test_compile_on_first_call_compiles_once_at_the_first_call(monkeypatch):
    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda x: fn(x) + 1  # tells the compiled function's result apart

    monkeypatch.setattr(torch, "compile", fake_compile)

    def square(x):
        """doc"""
        return x * x

    f = jit.compile_on_first_call(square)
    assert compiled == [] and f.__name__ == "square" and f.__doc__ == "doc"
    assert f(3) == 10 and f(4) == 17
    assert compiled == [square]


def test_disable_and_enable_switch_the_decorator():
    try:
        jit.disable_jit_fuser()
        assert jit.jit_fuser is jit.noop_decorator
    finally:
        jit.enable_jit_fuser()
    assert jit.jit_fuser is jit.compile_on_first_call


def test_importing_megatron_after_nvfp4_train_imports_no_inductor():
    """In a fresh process: ``import nvfp4_train`` installs the module as ``megatron.core.jit``; megatron-core's
    import then neither builds a compiled function nor imports Inductor, and its helpers are wrapped lazily."""
    code = """
import sys
import nvfp4_train
import megatron.core.tensor_parallel
from megatron.core import activations, jit
from nvfp4_train.mcore_compat import jit as ours
assert jit is ours and jit.jit_fuser is ours.compile_on_first_call, jit
assert "torch._inductor.compile_fx" not in sys.modules
assert activations.squared_relu.__wrapped__.__name__ == "squared_relu"
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout[-2000:] + p.stderr[-3000:]
