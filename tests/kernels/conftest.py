"""Fixtures of the kernel tests."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(autouse=True, scope="session")
def _interpreter_skips_dropped_overflow_checks():
    """Under the Triton interpreter, every integer add/sub/mul first builds an int64 overflow check whose
    assert is dropped unless the ``debug`` option is set (``device_assert`` returns early): a third of a
    quantize kernel's interpreted time for nothing. Off for the session while ``debug`` is off; the results
    are the same (the check has no other effect)."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    b = getattr(interpreter, "interpreter_builder", None)  # triton 3.7 ... 3.9
    saved = getattr(b, "options", None)
    knobs = getattr(triton, "knobs", None)
    if (saved is None or not hasattr(saved, "sanitize_overflow") or knobs is None
            or not knobs.runtime.interpret or saved.debug):
        yield
        return
    b.options = dataclasses.replace(saved, sanitize_overflow=False)
    try:
        yield
    finally:
        b.options = saved
