"""Pure-PyTorch pieces shared by the 4-bit references (NVFP4 and MXFP4). Imports only torch.

E2M1 (FP4) element format: 1 sign, 2 exponent, 1 mantissa bit. Codes 0..7 are
+{0, 0.5, 1, 1.5, 2, 3, 4, 6}; codes 8..15 are the same values negated (code 8 is -0).
Two codes share a byte: element 2j in the LOW nibble, element 2j+1 in the HIGH nibble.

Rounding, applied to an fp32 value ``v`` that the caller has already multiplied by the block's encode scale:

* nearest (RNE, ties to the even code) on ``|v|``: ≤0.25→0, <0.75→0.5, ≤1.25→1, <1.75→1.5, ≤2.5→2,
  <3.5→3, ≤5→4, else 6 (saturating: |v| > 6 gives 6, +Inf gives 6).
* stochastic: ``|v|`` goes to its lower or upper E2M1 neighbour; with ``frac = (|v| - lo) / (hi - lo)``
  (exact in fp32) and 8 random bits ``r`` in [0, 256), it goes up iff ``r < frac * 256``. So
  ``P(up) = ceil(256 frac) / 256``: the expectation exceeds ``|v|`` by less than ``(hi - lo) / 256``
  (the hardware instruction also draws 8 bits per element). Saturates at 6.

In both modes the sign is kept: a negative value that rounds to zero is code 8 (-0), an exact -0.0 gives
code 0 (``v < 0`` is false for it), as in Transformer Engine's reference. NaN gives code 0 (every
comparison is false); callers make NaN visible through the scales instead (see the NVFP4 non-finite policy).

Random bits: a counter-based hash (``mix32``, the "lowbias32" integer finaliser) of the element's linear
index within the tensor being quantized, keyed by the seed. The same seed gives the same bits on every
device; the Triton kernels compute the identical function with uint32 arithmetic.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
_MASK32 = 0xFFFFFFFF
# the sign vector s of the Random Hadamard Transform H = diag(s) * H16 / 4 (one for the run, RECIPE §3)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def e2m1_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 values of the E2M1 codes, indexable by code."""
    pos = list(E2M1_VALUES)
    return torch.tensor(pos + [-v for v in pos], device=device, dtype=dtype)


def e2m1_round_nearest(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled) -> uint8 E2M1 codes, round-to-nearest-even, saturating at 6."""
    assert v.dtype == torch.float32
    m = v.abs()
    idx = (
        (m > 0.25).to(torch.uint8)
        + (m >= 0.75).to(torch.uint8)
        + (m > 1.25).to(torch.uint8)
        + (m >= 1.75).to(torch.uint8)
        + (m > 2.5).to(torch.uint8)
        + (m >= 3.5).to(torch.uint8)
        + (m > 5.0).to(torch.uint8)
    )
    return idx | ((v < 0).to(torch.uint8) << 3)


def _e2m1_lower(m: torch.Tensor) -> torch.Tensor:
    """Index (0..7) of the largest E2M1 magnitude ≤ m (m ≥ 0); 0 for NaN."""
    return (
        (m >= 0.5).to(torch.uint8)
        + (m >= 1.0).to(torch.uint8)
        + (m >= 1.5).to(torch.uint8)
        + (m >= 2.0).to(torch.uint8)
        + (m >= 3.0).to(torch.uint8)
        + (m >= 4.0).to(torch.uint8)
        + (m >= 6.0).to(torch.uint8)
    )


def e2m1_round_stochastic(v: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled) -> uint8 E2M1 codes, stochastic rounding with 8 random bits each.

    ``rbits``: integer tensor of the same shape with values in [0, 256).
    """
    assert v.dtype == torch.float32 and rbits.shape == v.shape
    m = v.abs()
    lo_idx = _e2m1_lower(m)
    li = lo_idx.to(torch.int64)
    # lower neighbour and the gap to the next value: gaps 0.5 (codes 0..3), 1 (4, 5), 2 (6)
    lo = torch.where(li <= 4, li.to(torch.float32) * 0.5, (li - 2).to(torch.float32))
    inv_gap_256 = torch.where(li <= 3, 512.0, torch.where(li <= 5, 256.0, 128.0))
    t = (m - lo) * inv_gap_256  # exact: m - lo by Sterbenz, times a power of two
    up = (rbits.to(torch.float32) < t) & (lo_idx < 7)
    idx = lo_idx + up.to(torch.uint8)
    return idx | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (unpacked, 0..15) -> fp32 values."""
    return e2m1_table(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (0..15) -> [..., K/2] bytes; element 2j in the low nibble."""
    assert codes.shape[-1] % 2 == 0
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on uint32 values held in an int64 tensor."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def seed_key(seed: int) -> int:
    """The per-call key mixed into every element counter (a Python int in [0, 2**32))."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    # mix32 on a Python int (what mix32 computes on a tensor): ~1 us instead of ~70 us of torch ops per call
    x = (seed ^ 0x9E3779B9) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def seed_key_torch(seed: torch.Tensor) -> torch.Tensor:
    """``seed_key`` of int64 tensors holding uint32 seeds (what a kernel computes from a seed it loads)."""
    if seed.dtype != torch.int64:
        raise TypeError(f"seed must be an int64 tensor, got {seed.dtype}")
    return mix32(seed ^ 0x9E3779B9)


def check_seed(seed, device: torch.device | None = None) -> None:
    """A quantizer's ``seed``: an int in [0, 2**32), or a 0-d int64 tensor holding one on the device of the tensor
    being quantized (a seed computed on the device, e.g. ``nvfp4_train.kernels.sr_key.next_call_seeds``: a CUDA graph can
    replay it with a new value, where an int would be frozen into the captured launch)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.dim() != 0:
            raise ValueError(f"a seed tensor must be 0-d int64 (a uint32 value), got {seed.dtype} of shape "
                             f"{tuple(seed.shape)}")
        if device is not None and seed.device != device:
            raise ValueError(f"the seed tensor is on {seed.device}, the tensor to quantize on {device}")
        return
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32) or a 0-d int64 tensor, got {seed!r}")


def kernel_key(seed):
    """What the quantize kernels receive for ``seed``: ``seed_key(seed)`` of an int (computed on the host), a seed
    tensor itself (the kernel loads it and applies ``seed_key``: ``KEY_PTR``)."""
    return seed if isinstance(seed, torch.Tensor) else seed_key(seed)


def random_bits8(rows: int, cols: int, seed, device: torch.device | str = "cpu") -> torch.Tensor:
    """8 random bits for each element of a [rows, cols] tensor: the top byte of
    ``mix32((row * cols + col + seed_key(seed)) mod 2**32)``. ``seed``: an int, or a 0-d int64 tensor holding
    one (``check_seed``): the same bits."""
    idx = torch.arange(rows * cols, dtype=torch.int64, device=device).view(rows, cols)
    key = seed_key_torch(seed) if isinstance(seed, torch.Tensor) else seed_key(seed)
    return mix32(idx + key) >> 24


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to ``dtype`` (round-to-nearest-even) and back to fp32."""
    return x.to(dtype).to(torch.float32) if dtype != torch.float32 else x
