"""``next_call_seeds`` in one Triton launch: advance a layer's device call counter and write the six operand
seeds of that call (``kernels/sr_key.py``; ``next_call_seeds_ref`` is the reference, bitwise the same).

One program of one warp: the counter is loaded, incremented and stored back by the same thread block, so a
CUDA graph that replays the launch advances the counter every time it runs. Every step is wrapping uint32
arithmetic, as in ``sr_key``: ``call_seed = stream * 1_000_003 + call * 7_919``, then ``2 * call_seed +
operand`` for the operand offsets 0, 1, 4, 5, 8, 9 (``CALL_OPERANDS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_triton import key_arg

__all__ = ["next_call_seeds_triton"]


@triton.jit(do_not_specialize=["stream_term"])
def _next_call_seeds_kernel(counter_ptr, out_ptr, stream_term):
    call = tl.load(counter_ptr) + 1
    tl.store(counter_ptr, call)
    s = stream_term.to(tl.uint32) + call.to(tl.uint32) * 7919  # call_seed, mod 2**32
    j = tl.arange(0, 8)
    op = ((j // 2) * 4 + j % 2).to(tl.uint32)  # 0, 1, 4, 5, 8, 9 (CALL_OPERANDS' offsets in OPERANDS)
    seeds = s * 2 + op
    tl.store(out_ptr + j, seeds.to(tl.int64), mask=j < 6)


def next_call_seeds_triton(counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Checked by the caller (``nvfp4_train.kernels.sr_key.next_call_seeds``): ``counter`` a 0-d int64 tensor, ``stream`` a
    uint32."""
    out = torch.empty(6, dtype=torch.int64, device=counter.device)
    # the stream's term of call_seed, a host constant of the layer (the same in every replay)
    _next_call_seeds_kernel[(1,)](counter, out, key_arg((stream * 1_000_003) & 0xFFFFFFFF), num_warps=1)
    return out
