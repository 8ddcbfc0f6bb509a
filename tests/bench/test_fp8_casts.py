"""nvfp4_train.bench.fp8_casts (scripts/bench_fp8_casts.py): its bit-for-bit check catches one flipped bit, and under
the interpreter every configuration of the quick sweep runs and matches the reference."""

from __future__ import annotations

import argparse

import pytest
import torch

from nvfp4_train.bench import fp8_casts


@pytest.mark.parametrize("mode", ["rowcol", "row", "tile", "tensor"])
def test_same_catches_one_flipped_bit(mode):
    x = (torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    ref = fp8_casts._reference(x, mode)
    assert fp8_casts._same([t.clone() for t in ref], ref)
    for i in range(len(ref)):  # each output in turn: one bit of its first element
        out = [t.clone() for t in ref]
        out[i] = ref[i].contiguous().clone()
        out[i].view(-1).view(torch.uint8)[0] ^= 1
        assert not fp8_casts._same(out, ref)


@pytest.mark.triton
def test_quick_sweep_runs_every_configuration():
    rows, ok = fp8_casts.run(argparse.Namespace(quick=True, seed=0))
    assert ok
    assert len(rows) == 2 * len(fp8_casts.QUICK_CASES)
    assert all("error" not in r for r in rows)
