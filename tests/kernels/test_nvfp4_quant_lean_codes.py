"""The E2M1 code functions of the NVFP4 quantize kernel (``kernels/fp4_triton.py``) against the
reference rounding, bit for bit, on the values where rounding can go wrong: every tie and the few ulps around
it, the subnormals, both zeros, saturation, +-Inf.

Runs under TRITON_INTERPRET=1 on CPU (the bit-arithmetic paths) and natively on CUDA (the GPU paths: add.rp,
the byte permutes).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from nvfp4_train.kernels.fp4_reference import e2m1_round_nearest, e2m1_round_stochastic
from nvfp4_train.kernels.fp4_triton import e2m1_code_rne_lowbyte, e2m1_code_sr_lean

pytestmark = pytest.mark.triton


@triton.jit
def _codes_kernel(y_ptr, r_ptr, rne_ptr, sr_ptr, n, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    y = tl.load(y_ptr + i, mask=mask, other=0.0)
    r = tl.load(r_ptr + i, mask=mask, other=0)
    tl.store(rne_ptr + i, e2m1_code_rne_lowbyte(y).to(tl.int32, bitcast=True), mask=mask)
    tl.store(sr_ptr + i, e2m1_code_sr_lean(y, r, NATIVE), mask=mask)


def edge_values() -> torch.Tensor:
    """fp32 values around every E2M1 value and tie (+-40 ulps), the smallest subnormals and normals, both
    zeros, saturation and infinities, both signs."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    bits = points.view(torch.int32)[:, None] + torch.arange(-40, 41, dtype=torch.int32)[None, :]
    bits = bits[bits >= 0]
    special = torch.tensor([0, 1, 2, 3, 0x7FFFFF, 0x800000, 0x800001, 0x7F800000, 0x7F7FFFFF], dtype=torch.int32)
    pos = torch.cat([bits, special]).view(torch.float32)
    return torch.cat([pos, -pos, torch.tensor([1e30, -1e30, 6.0001, -6.0001])])


def test_lean_codes_equal_reference(triton_device, gen):
    y = edge_values()
    y = torch.cat([y, torch.randn(4096, generator=gen) * 3, torch.rand(1024, generator=gen) * 1e-37])
    n = y.numel()
    for r in (torch.zeros(n, dtype=torch.int32), torch.full((n,), 255, dtype=torch.int32),
              torch.randint(0, 256, (n,), generator=gen, dtype=torch.int32)):
        rne = torch.empty(n, dtype=torch.int32, device=triton_device)
        sr = torch.empty(n, dtype=torch.int32, device=triton_device)
        _codes_kernel[(triton.cdiv(n, 1024),)](y.to(triton_device), r.to(triton_device), rne, sr, n,
                                               NATIVE=triton_device != "cpu", BLOCK=1024)
        rne, sr = rne.cpu(), sr.cpu()
        # the RNE code sits in the low nibble; bits 4..22 are zero (the packing relies on it)
        assert torch.equal(rne & 0x7FFFF0, torch.zeros_like(rne))
        assert torch.equal(rne & 0xF, e2m1_round_nearest(y).to(torch.int32))
        assert torch.equal(sr, e2m1_round_stochastic(y, r.to(torch.int64)).to(torch.int32))
