"""The stochastic-rounding key function (kernels/sr_key.py): the torch version (what a device kernel computes
from a step counter) equals the plain-Python one on edge values, and the stages compose to the keys every
earlier run used (transcribed below from the formulas they replaced)."""

import zlib

import pytest
import torch

from nvfp4_train.kernels.fp4_reference import seed_key
from nvfp4_train.kernels.sr_key import (
    OPERANDS,
    ROLE_SLOTS,
    block_seed,
    call_seed,
    layer_stream,
    operand_seed,
    sr_key,
    sr_key_torch,
)

M32 = 2**32
EDGE_STREAMS = [0, 1, 7_919, 2**31 - 1, 2**31, M32 - 2, M32 - 1, seed_key(0), 0x9E3779B9]
EDGE_CALLS = [0, 1, 2, 3, 1_000, 2**31 - 1, 2**31, M32 - 1, M32, 2**40 + 5, 2**62]


def _lowbias32(x: int) -> int:
    x %= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) % M32
    x ^= x >> 15
    x = (x * 0x846CA68B) % M32
    return x ^ (x >> 16)


def _old_key(run_seed: int, block: int, slot: int, name: str, call: int, tensor_offset: int, copy: int) -> int:
    """The key as the six places computed it before kernels/sr_key.py (arbitrary-precision integers)."""
    spec = (run_seed * 1_000_003 + block * 16 + slot) % 2**31           # models/hybrid.py _seed
    layer = (spec * 0x9E3779B1 + zlib.crc32(name.encode())) % M32       # megatron_linear._layer_seed
    call_s = (layer * 1_000_003 + call * 7_919) % M32                    # LinearContext.next_seed
    s = ((call_s + tensor_offset) * 2 + copy) % M32                      # Function offsets, operand._seed
    return _lowbias32(s ^ 0x9E3779B9)                                    # fp4_reference.seed_key


def test_operands_are_the_old_offsets():
    # W at +0, x at +2, dy at +4 of the call seed, then 2 * s + (0 row, 1 col)
    for (tensor, copy), op in OPERANDS.items():
        assert op == 2 * {"W": 0, "x": 2, "dy": 4}[tensor] + {"row": 0, "col": 1}[copy]
    assert len(set(OPERANDS.values())) == len(OPERANDS)


@pytest.mark.parametrize("run_seed", [0, 1, 1234, 2**31 - 1, M32 - 1])
def test_stages_compose_to_the_old_keys(run_seed):
    for block in (0, 1, 61, 2**20):
        for role, slot in ROLE_SLOTS.items():
            name = f"blocks.{block}.{role}"
            stream = layer_stream(block_seed(run_seed, block, slot), name)
            for call in (1, 2, 3, 10_007, M32 - 1, M32):
                for (tensor, copy), op in OPERANDS.items():
                    off = {"W": 0, "x": 2, "dy": 4}[tensor]
                    want = _old_key(run_seed, block, slot, name, call, off, copy == "col")
                    assert sr_key(stream, call, op) == want
                    assert seed_key(operand_seed(call_seed(stream, call), op)) == want


@pytest.mark.parametrize("operand", sorted(OPERANDS.values()))
def test_torch_version_equals_python(operand):
    calls = torch.tensor(EDGE_CALLS, dtype=torch.int64)
    for stream in EDGE_STREAMS:
        got = sr_key_torch(stream, calls, operand)
        assert got.dtype == torch.int64
        assert got.tolist() == [sr_key(stream, c, operand) for c in EDGE_CALLS]
        assert ((got >= 0) & (got < M32)).all()


def test_torch_version_on_random_counters(gen):
    calls = torch.randint(0, 2**62, (4096,), generator=gen, dtype=torch.int64)
    stream = int(torch.randint(0, M32, (1,), generator=gen))
    got = sr_key_torch(stream, calls, OPERANDS[("dy", "col")])
    assert got.tolist() == [sr_key(stream, c, OPERANDS[("dy", "col")]) for c in calls.tolist()]


def test_layer_stream_rejects_bad_seeds():
    for bad in (-1, M32, 1.0, True):
        with pytest.raises(ValueError, match=r"seed=.* must be an int in \[0, 2\*\*32\)"):
            layer_stream(bad, "blocks.0.mlp.fc1")


def test_sr_key_torch_needs_int64():
    with pytest.raises(TypeError, match="int64"):
        sr_key_torch(0, torch.zeros(3, dtype=torch.int32), 0)
