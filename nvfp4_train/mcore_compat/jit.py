"""megatron-core's ``jit_fuser``, compiling each fused helper at its first call instead of at its definition.

megatron-core 0.16.1 ... 0.19.x: ``megatron/core/jit.py`` sets ``jit_fuser = torch.compile``, and its fused
elementwise helpers (``squared_relu``, bias-dropout-add, ...) are decorated with it where they are defined, i.e.
while ``import megatron.core`` runs. ``torch.compile(fn)`` imports TorchDynamo and Inductor right away, so every
process that imports megatron-core paid for them whether or not it ever called a fused helper (seconds of its start
and of its exit on our 2-core CPU machines, ``docs/architecture.md``). :func:`install` registers this
module as ``megatron.core.jit`` before megatron-core is first imported; its ``jit_fuser`` returns a function that
calls ``torch.compile(fn)`` once, at the first call, and the compiled function from then on: the same compiled
function, built when it is first needed. The module has the names megatron's has (``jit_fuser``,
``noop_decorator``, ``enable_jit_fuser``, ``disable_jit_fuser``); megatron-core uses only
``from megatron.core.jit import jit_fuser``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Callable

__all__ = ["jit_fuser", "noop_decorator", "enable_jit_fuser", "disable_jit_fuser", "compile_on_first_call",
           "install"]


def noop_decorator(func: Callable) -> Callable:
    """No-op decorator (megatron's name)."""
    return func


def compile_on_first_call(fn: Callable) -> Callable:
    """``fn`` wrapped so that ``torch.compile(fn)`` is built at the first call and used for every call."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


jit_fuser: Callable[[Callable], Callable] = compile_on_first_call


def enable_jit_fuser() -> None:
    """Fused helpers compiled (at their first call), as megatron's default."""
    global jit_fuser
    jit_fuser = compile_on_first_call


def disable_jit_fuser() -> None:
    """Fused helpers run eagerly (megatron's ``disable_jit_fuser``)."""
    global jit_fuser
    jit_fuser = noop_decorator


def install() -> bool:
    """Make this module ``megatron.core.jit`` unless megatron-core is already imported (then nothing changes)
    or not installed. True when it is installed now or was before."""
    if sys.modules.get("megatron.core.jit") is sys.modules[__name__]:
        return True
    if "megatron.core" in sys.modules or importlib.util.find_spec("megatron") is None:
        return False
    sys.modules["megatron.core.jit"] = sys.modules[__name__]
    return True
