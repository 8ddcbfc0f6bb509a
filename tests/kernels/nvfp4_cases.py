"""Edge-case inputs for the NVFP4 quantizer tests (shared by the reference and Triton tests).

Most cases put one element of 2688 (= 6 * 448) in its own block, so the tensor scale S_enc is exactly 1 and
``c = fp32(1/6)``; a block whose amax is 6 then gets the block scale e4m3(6 * fp32(1/6)) = 1.0 and an encode
scale of exactly 1, so its values reach the E2M1 rounding unchanged: that is how the exact ties are hit.
"""

from __future__ import annotations

import torch

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def ties_tensor() -> torch.Tensor:
    """[16, 32]: row 0 block 0 holds 2688; every other block has amax 6 and holds all RNE ties, both signs,
    plus the values just beside the ties (one fp32 ulp away)."""
    x = torch.zeros(16, 32)
    x[0, 0] = 2688.0
    vals = []
    for t in TIES:
        lo = torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item()
        hi = torch.nextafter(torch.tensor(t), torch.tensor(10.0)).item()
        vals += [t, -t, lo, hi, -lo, -hi]
    vals += [6.0, -6.0, 0.0, -0.0, 0.1, -0.1]
    flat = torch.tensor(vals)
    for r in range(16):
        for b in range(2):
            if r == 0 and b == 0:
                continue
            blk = flat.roll(r * 3 + b * 7)[:15]
            x[r, b * 16 : b * 16 + 15] = blk
            x[r, b * 16 + 15] = 6.0  # block amax 6 -> encode scale 1
    return x


def subnormal_scales_tensor() -> torch.Tensor:
    """Blocks whose E4M3 scale is subnormal, exactly half the smallest subnormal (ties to 0), just above it,
    and zero; S_enc = 1."""
    x = torch.zeros(8, 64)
    x[0, 0] = 2688.0
    amaxes = [6 * 2.0**-7, 6 * 2.0**-8, 6 * 2.0**-9, 6 * 2.0**-10, 6 * 2.0**-11, 6 * 2.0**-20, 6 * 3 * 2.0**-9]
    g = torch.Generator().manual_seed(0)
    i = 0
    for r in range(8):
        for b in range(4):
            if r == 0 and b == 0:
                continue
            a = amaxes[i % len(amaxes)]
            i += 1
            blk = (torch.rand(16, generator=g) * 2 - 1) * a
            blk[i % 16] = a if i % 2 else -a
            x[r, b * 16 : (b + 1) * 16] = blk
    return x


def saturation_tensor(gen: torch.Generator) -> torch.Tensor:
    """Blocks whose block amax makes the E4M3 scale round DOWN, so x * enc exceeds 6 and saturates."""
    x = torch.randn(32, 48, generator=gen)
    # a block amax of 6.3 -> s = 6.3 * fp32(1/6) ~ 1.05, which rounds DOWN to 1.0 in E4M3 (grid 1, 1.125):
    # the encode scale is 1 and the block's amax element lands at 6.3 -> saturates to 6.
    x[:, ::16] = 6.3
    x[0, 1] = 2688.0
    return x


def outlier_tensor(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(48, 80, generator=gen)
    x[17, 33] = 3.0e4
    return x.to(dtype)


def nonfinite_tensors(gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(32, 32, generator=gen)
        x[5, 7] = bad
        out.append(x)
    return out
