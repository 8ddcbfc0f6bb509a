"""nvfp4_train.bench.fp8_casts (scripts/bench_fp8_casts.py): its bit-for-bit check catches one flipped bit (its quick
sweep runs in tests/bench/test_sweep.py)."""

from __future__ import annotations

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

