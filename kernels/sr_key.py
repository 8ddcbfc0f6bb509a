"""The stochastic-rounding key: ONE function from (run seed, layer identity, call index, operand) to the 32-bit
key the quantize kernels mix into every element counter (``docs/numerics.md``, "The stochastic-rounding RNG").

    key = sr_key(layer_stream(block_seed(run_seed, block, slot), layer_name), call, operand)

    stage                              computed                       arithmetic (uint32: every step mod 2**32)
    block_seed(run_seed, block, slot)  once, at model build           (run_seed*1_000_003 + block*16 + slot) mod 2**31
    layer_stream(seed, layer_name)     once, at layer build           seed * 0x9E3779B1 + crc32(layer_name)
    call_seed(stream, call)            every forward (call 1, 2, ...) stream * 1_000_003 + call * 7_919
    operand_seed(call_seed, operand)   every cast                     2 * call_seed + operand  (``OPERANDS``)
    seed_key(operand_seed)             the kernels' entry             lowbias32(operand_seed ^ 0x9E3779B9)

On the device (CUDA graphs, which freeze every host int of a captured launch): a layer keeps its call counter
in a 0-d int64 tensor, and ``next_call_seeds(counter, stream)`` advances it in place and returns the six
operand seeds of that call (``CALL_OPERANDS`` order) as an int64 tensor, in one kernel launch
(``kernels/sr_key_triton.py``; ``next_call_seeds_ref`` is the same in torch ops). The quantizers take such a
seed as a 0-d tensor instead of an int and apply ``seed_key`` in the kernel: bitwise the keys of the host ints.

``block`` is the GLOBAL block index, ``slot`` the linear layer's place in its block (``ROLE_SLOTS``). A layer
built on its own (not by the model) takes its ``seed`` directly as the input of ``layer_stream``. The two
build-time stages are host constants of a layer (the CRC of its name never runs on the device); everything a
step computes is ``sr_key(stream, call, operand)``: integer multiplies, adds, shifts and xors on uint32, which
a Triton kernel reproduces with wrapping uint32 arithmetic from a device step counter (``sr_key_torch`` is the
same on int64 tensors holding uint32 values). The public quantizers take ``operand_seed`` (their ``seed=``
argument) and apply ``seed_key`` themselves.

The constants are the ones every run so far used: the keys, and so training, are bitwise those of earlier
commits. Imports only torch.
"""

from __future__ import annotations

import zlib

import torch

from nvfp4_train.kernels.fp4_reference import _MASK32, _mul32, mix32, seed_key

__all__ = [
    "ROLE_SLOTS",
    "OPERANDS",
    "block_seed",
    "layer_stream",
    "call_seed",
    "operand_seed",
    "sr_key",
    "sr_key_torch",
    "CALL_OPERANDS",
    "call_seeds_torch",
    "next_call_seeds_ref",
    "next_call_seeds",
]

MASK32 = 0xFFFFFFFF

# the place of each linear role in its block (the model's slot numbering: keys differ per slot)
ROLE_SLOTS = {
    "attention.qkv": 0,
    "attention.proj": 1,
    "mlp.fc1": 2,
    "mlp.fc2": 3,
    "mamba.in_proj": 4,
    "mamba.out_proj": 5,
}

# the operand of a linear layer's GEMMs that a cast produces: (tensor, copy) -> offset in operand_seed.
# tensor W, x, dy; copy "row" (reduction along the last dim) or "col" (of the transpose); RECIPE §3.
OPERANDS = {
    ("W", "row"): 0,   # fprop B
    ("W", "col"): 1,   # dgrad B (a second quantization of W only with 1-D weight blocks)
    ("x", "row"): 4,   # fprop A
    ("x", "col"): 5,   # wgrad B
    ("dy", "row"): 8,  # dgrad A
    ("dy", "col"): 9,  # wgrad A
}


# the operands of one call in the order of the seeds ``next_call_seeds`` returns: W, x, dy; row, col each
CALL_OPERANDS = (("W", "row"), ("W", "col"), ("x", "row"), ("x", "col"), ("dy", "row"), ("dy", "col"))


def _check_u32(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MASK32:
        raise ValueError(f"{name}={v!r} must be an int in [0, 2**32)")


def block_seed(run_seed: int, block: int, slot: int) -> int:
    """The seed of the linear layer in ``slot`` (``ROLE_SLOTS``) of GLOBAL block ``block`` (a 31-bit int)."""
    return (run_seed * 1_000_003 + block * 16 + slot) & 0x7FFFFFFF


def layer_stream(seed: int, layer_name: str) -> int:
    """The layer's stream constant from its seed (``block_seed``, or a seed given directly) and its name."""
    _check_u32("seed", seed)
    return (seed * 0x9E3779B1 + zlib.crc32(layer_name.encode())) & MASK32


def call_seed(stream: int, call: int) -> int:
    """The seed of the layer's ``call``-th forward (1 for the first; its backward reuses it)."""
    return (stream * 1_000_003 + call * 7_919) & MASK32


def operand_seed(call_seed_: int, operand: int) -> int:
    """The quantizers' ``seed=`` of one operand of that call (``operand``: a value of ``OPERANDS``)."""
    return (call_seed_ * 2 + operand) & MASK32


def sr_key(stream: int, call: int, operand: int) -> int:
    """The kernels' 32-bit key of ``operand`` in the layer's ``call``-th forward/backward (plain Python ints)."""
    return seed_key(operand_seed(call_seed(stream, call), operand))


def sr_key_torch(stream: int, call: torch.Tensor, operand: int) -> torch.Tensor:
    """``sr_key`` of an int64 tensor of call indices (e.g. a device step counter), as int64 uint32 values: the
    arithmetic a device kernel runs (every product kept below 2**63 by splitting it, see ``_mul32``)."""
    if call.dtype != torch.int64:
        raise TypeError(f"call must be an int64 tensor, got {call.dtype}")
    s = (_mul32(torch.full_like(call, stream & MASK32), 1_000_003) + _mul32(call & _MASK32, 7_919)) & _MASK32
    s = (s * 2 + operand) & _MASK32
    return mix32(s ^ 0x9E3779B9)


def _call_seed_torch(stream: int, call: torch.Tensor) -> torch.Tensor:
    return (_mul32(torch.full_like(call, stream & MASK32), 1_000_003) + _mul32(call & _MASK32, 7_919)) & _MASK32


def call_seeds_torch(stream: int, call: torch.Tensor) -> torch.Tensor:
    """int64 [*call.shape, 6]: the ``operand_seed`` of each operand of ``CALL_OPERANDS`` in the layer's ``call``-th
    forward/backward (``call``: an int64 tensor of call indices), as uint32 values."""
    if call.dtype != torch.int64:
        raise TypeError(f"call must be an int64 tensor, got {call.dtype}")
    s = _call_seed_torch(stream, call)
    ops = torch.tensor([OPERANDS[o] for o in CALL_OPERANDS], dtype=torch.int64, device=call.device)
    return (s.unsqueeze(-1) * 2 + ops) & _MASK32


def _check_counter(counter: torch.Tensor) -> None:
    if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int64 or counter.dim() != 0:
        raise TypeError(f"the call counter must be a 0-d int64 tensor, got {counter!r}")


def next_call_seeds_ref(counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Advance the layer's call counter (a 0-d int64 tensor) by one, in place, and return the operand seeds of
    that call: int64 [6], ``operand_seed(call_seed(stream, counter), operand)`` for ``CALL_OPERANDS``."""
    _check_counter(counter)
    _check_u32("stream", stream)
    counter.add_(1)
    return call_seeds_torch(stream, counter)


def next_call_seeds(counter: torch.Tensor, stream: int) -> torch.Tensor:
    """``next_call_seeds_ref`` in one Triton launch where ``use_triton(counter)`` (``kernels/sr_key_triton.py``;
    the same values); the reference otherwise."""
    from nvfp4_train.kernels._dispatch import use_triton

    if not use_triton(counter):
        return next_call_seeds_ref(counter, stream)
    _check_counter(counter)
    _check_u32("stream", stream)
    from nvfp4_train.kernels.sr_key_triton import next_call_seeds_triton

    return next_call_seeds_triton(counter, stream)
