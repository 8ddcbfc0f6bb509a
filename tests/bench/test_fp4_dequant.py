"""nvfp4_train.bench.fp4_dequant (scripts/bench_fp4_dequant.py): its bit-for-bit check catches one flipped bit (its quick
sweep runs in tests/bench/test_sweep.py)."""

from __future__ import annotations

import torch

from nvfp4_train.bench import fp4_dequant


def test_same_catches_one_flipped_bit():
    g = torch.Generator().manual_seed(0)
    a, b = fp4_dequant._operand(32, 64, g, torch.device("cpu")), fp4_dequant._operand(16, 64, g, torch.device("cpu"))
    ref = fp4_dequant._reference(a, b)
    assert fp4_dequant._same([t.clone() for t in ref], ref)
    for i in range(2):
        out = [t.clone() for t in ref]
        out[i].view(-1).view(torch.int16)[5] ^= 1
        assert not fp4_dequant._same(out, ref)

