"""nvfp4_train.bench.rms_norm (scripts/bench_rms_norm.py) in its quick mode: every implementation is checked
against its bound and timed, a row each (under the interpreter the kernel itself runs on the CPU)."""

from __future__ import annotations

import argparse

import pytest

from nvfp4_train.bench import rms_norm


@pytest.mark.triton
def test_quick_run_checks_and_times_every_implementation():
    rows, ok = rms_norm.run(argparse.Namespace(quick=True, seed=0, dtype="bfloat16", shapes=None))
    assert ok
    assert [(r["rows"], r["hidden"], r["impl"]) for r in rows] == [
        (*rms_norm._shape(s), impl) for s in rms_norm.QUICK_SHAPES for impl in ("torch", "ours")]
    assert all(r["within_bound"] and r["bwd_us"] > 0 and r["fwd_bwd_us"] > 0 for r in rows)
