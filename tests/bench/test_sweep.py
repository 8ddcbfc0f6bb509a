"""nvfp4_train.bench.sweep through its two sweeps (the FP8 casts, the FP4 dequantize launch): under the interpreter
every configuration of each quick sweep runs and matches its reference bit for bit, and a row is written for each."""

from __future__ import annotations

import argparse

import pytest

from nvfp4_train.bench import fp4_dequant, fp8_casts


@pytest.mark.triton
@pytest.mark.parametrize("sweep", [fp8_casts, fp4_dequant], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_quick_sweep_runs_every_configuration(sweep):
    rows, ok = sweep.run(argparse.Namespace(quick=True, seed=0))
    assert ok
    assert len(rows) == 2 * len(sweep.QUICK_CASES)
    assert all("error" not in r for r in rows)
