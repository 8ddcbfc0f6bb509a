"""Stochastic-rounding seeds computed on the device (``nvfp4_train.kernels.sr_key.next_call_seeds``) and handed to the
quantizers as 0-d tensors: bitwise the keys, and so the codes, of the host ints (what CUDA graphs replay).

The reference path runs on CPU unmarked; the Triton kernels (the counter kernel and the quantizers compiled
with ``KEY_PTR``) under ``-m triton`` (``TRITON_INTERPRET=1`` on CPU, natively on CUDA)."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.fp4_reference import check_seed, seed_key, seed_key_torch
from nvfp4_train.kernels.fp4_triton import launch_keys
from nvfp4_train.kernels.mxfp4 import quantize_mxfp4, quantize_mxfp4_rowcol
from nvfp4_train.kernels.mxfp4.reference import quantize_mxfp4_ref, quantize_mxfp4_rowcol_ref
from nvfp4_train.kernels.nvfp4 import quantize_nvfp4, quantize_nvfp4_rowcol
from nvfp4_train.kernels.nvfp4.reference import quantize_nvfp4_ref, quantize_nvfp4_rowcol_ref
from nvfp4_train.kernels.sr_key import (
    CALL_OPERANDS,
    OPERANDS,
    call_seed,
    call_seeds_torch,
    next_call_seeds,
    next_call_seeds_ref,
    operand_seed,
    sr_key,
    sr_key_torch,
)

M32 = 2**32


def _rand_u32(gen) -> int:
    return int(torch.randint(0, M32, (1,), generator=gen, dtype=torch.int64))


def _host_seeds(stream: int, call: int) -> list[int]:
    return [operand_seed(call_seed(stream, call), OPERANDS[o]) for o in CALL_OPERANDS]


def test_call_operands_cover_every_operand_once():
    assert sorted(CALL_OPERANDS) == sorted(OPERANDS)


def test_counter_after_k_increments_gives_the_host_keys(gen):
    """A device counter advanced k times gives the seeds, and through seed_key the keys, of the host ints."""
    for _ in range(8):
        stream = _rand_u32(gen)
        start = int(torch.randint(0, 2**40, (1,), generator=gen, dtype=torch.int64))
        counter = torch.tensor(start, dtype=torch.int64)
        for i in range(1, 6):
            seeds = next_call_seeds_ref(counter, stream)
            call = start + i
            assert int(counter) == call
            assert seeds.dtype == torch.int64 and seeds.shape == (6,)
            assert seeds.tolist() == _host_seeds(stream, call)
            assert seed_key_torch(seeds).tolist() == [sr_key(stream, call, OPERANDS[o]) for o in CALL_OPERANDS]
            for j, o in enumerate(CALL_OPERANDS):
                assert int(sr_key_torch(stream, counter, OPERANDS[o])) == sr_key(stream, call, OPERANDS[o])
                assert int(seed_key_torch(seeds[j])) == seed_key(seeds[j].item())


@pytest.mark.parametrize("stream", [0, 1, 2**31 - 1, 2**31, M32 - 1])
@pytest.mark.parametrize("call", [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62])
def test_call_seeds_torch_on_edges(stream, call):
    assert call_seeds_torch(stream, torch.tensor(call)).tolist() == _host_seeds(stream, call)


def test_next_call_seeds_rejects_bad_counters():
    with pytest.raises(TypeError, match="0-d int64"):
        next_call_seeds_ref(torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="0-d int64"):
        next_call_seeds_ref(torch.zeros((), dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="stream"):
        next_call_seeds_ref(torch.zeros((), dtype=torch.int64), M32)


def test_check_seed():
    check_seed(0)
    check_seed(M32 - 1)
    check_seed(torch.tensor(5))
    for bad in (-1, M32, 1.5, True):
        with pytest.raises(ValueError, match="seed must be"):
            check_seed(bad)
    with pytest.raises(ValueError, match="0-d int64"):
        check_seed(torch.tensor([5]))
    with pytest.raises(ValueError, match="0-d int64"):
        check_seed(torch.tensor(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="is on"):
        check_seed(torch.tensor(5), torch.device("meta"))


def test_launch_keys():
    t = torch.tensor(3)
    assert launch_keys(1, 2**31, True, True) == (1, -(2**31), False)
    r, c, kp = launch_keys(t, 0, True, False)  # the unused int key is replaced by the tensor
    assert r is t and c is t and kp
    with pytest.raises(ValueError, match="all as ints or all as seed tensors"):
        launch_keys(t, 7, True, True)


def _x(gen, shape=(32, 64), dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))).to(dtype)


def _same(a, b) -> None:
    for name in ("codes", "scales", "amax"):
        if hasattr(a, name):
            u, v = getattr(a, name), getattr(b, name)
            if u.dtype == torch.float8_e4m3fn:
                u, v = u.view(torch.uint8), v.view(torch.uint8)
            assert torch.equal(u.cpu(), v.cpu()) or (u.is_floating_point() and torch.isnan(u).all()
                                                     and torch.isnan(v).all()), name


NVFP4_MODES = [dict(stochastic=True), dict(stochastic=True, rht=True), dict(stochastic=True, block_2d=True)]
NVFP4_ROWCOL = [dict(row_stochastic=True, col_stochastic=True, col_rht=True),
                dict(row_stochastic=False, col_stochastic=True, col_rht=True),
                dict(row_stochastic=True, col_stochastic=True, block_2d=True)]


def test_reference_quantizers_take_seed_tensors(gen):
    x = _x(gen)
    s1, s2 = _rand_u32(gen), _rand_u32(gen)
    t1, t2 = torch.tensor(s1), torch.tensor(s2)
    for kw in NVFP4_MODES:
        _same(quantize_nvfp4_ref(x, seed=t1, **kw), quantize_nvfp4_ref(x, seed=s1, **kw))
    for kw in NVFP4_ROWCOL:
        for a, b in zip(quantize_nvfp4_rowcol_ref(x, row_seed=t1, col_seed=t2, **kw),
                        quantize_nvfp4_rowcol_ref(x, row_seed=s1, col_seed=s2, **kw)):
            _same(a, b)
    for kw in (dict(), dict(block_2d=True)):
        _same(quantize_mxfp4_ref(x, stochastic=True, seed=t1, **kw),
              quantize_mxfp4_ref(x, stochastic=True, seed=s1, **kw))
    for a, b in zip(quantize_mxfp4_rowcol_ref(x, row_stochastic=True, col_stochastic=True, row_seed=t1, col_seed=t2),
                    quantize_mxfp4_rowcol_ref(x, row_stochastic=True, col_stochastic=True, row_seed=s1, col_seed=s2)):
        _same(a, b)


@pytest.mark.triton
def test_triton_counter_kernel_equals_reference(triton_device, gen):
    for _ in range(4):
        stream = _rand_u32(gen)
        start = int(torch.randint(0, 2**40, (1,), generator=gen, dtype=torch.int64))
        dev = torch.tensor(start, dtype=torch.int64, device=triton_device)
        ref = torch.tensor(start, dtype=torch.int64)
        for _ in range(3):
            got = next_call_seeds(dev, stream)
            want = next_call_seeds_ref(ref, stream)
            assert got.device == dev.device and got.dtype == torch.int64
            assert got.cpu().tolist() == want.tolist()
            assert int(dev) == int(ref)
    edge = torch.tensor(2**32 - 1, dtype=torch.int64, device=triton_device)  # the call index wraps mod 2**32
    assert next_call_seeds(edge, M32 - 1).cpu().tolist() == _host_seeds(M32 - 1, 2**32)


@pytest.mark.triton
def test_triton_quantizers_take_seed_tensors(triton_device, gen):
    """The kernels compiled with KEY_PTR (the seed loaded, seed_key applied in the kernel) give the codes of
    the int path, which the Triton tests compare with the reference."""
    x = _x(gen).to(triton_device)
    s1, s2 = _rand_u32(gen), _rand_u32(gen)
    t1 = torch.tensor(s1, device=triton_device)
    t2 = torch.tensor(s2, device=triton_device)
    for kw in NVFP4_MODES:
        _same(quantize_nvfp4(x, seed=t1, **kw), quantize_nvfp4(x, seed=s1, **kw))
    for kw in NVFP4_ROWCOL:
        for a, b in zip(quantize_nvfp4_rowcol(x, row_seed=t1, col_seed=t2, **kw),
                        quantize_nvfp4_rowcol(x, row_seed=s1, col_seed=s2, **kw)):
            _same(a, b)
    _same(quantize_mxfp4(x, stochastic=True, seed=t1), quantize_mxfp4(x, stochastic=True, seed=s1))
    for a, b in zip(quantize_mxfp4_rowcol(x, row_stochastic=True, col_stochastic=True, row_seed=t1, col_seed=t2),
                    quantize_mxfp4_rowcol(x, row_stochastic=True, col_stochastic=True, row_seed=s1, col_seed=s2)):
        _same(a, b)
