"""The Triton quantizers' ``swizzled=True``: the same codes and amaxes as without it, and the scales the reference
writes in the native GEMM's 128x4-tile layout (``kernels/fp4_layout.py``), zero padding included, bit for bit.
Run under ``TRITON_INTERPRET=1`` (fp32 and bf16 inputs: no dot is involved) or on a GPU."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.mxfp4 import quantize_mxfp4, quantize_mxfp4_ref, quantize_mxfp4_rowcol, quantize_mxfp4_rowcol_ref
from nvfp4_train.kernels.nvfp4 import quantize_nvfp4, quantize_nvfp4_ref, quantize_nvfp4_rowcol, quantize_nvfp4_rowcol_ref

pytestmark = pytest.mark.triton

# Shapes: (144, 80) pads both scale dims of both copies (rows 144 -> 256 and K/16 = 5 -> 8; the columnwise
# copy's 80 rows and M/16 = 9 columns); (128, 128) fits the tiles exactly (no zero fill); MXFP4 (96, 160):
# K/32 = 5 and M/32 = 3 columns


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _same(got, want, what: str) -> None:
    assert got.swizzled and want.swizzled, what
    assert torch.equal(got.codes.cpu(), want.codes), f"{what}: codes"
    assert torch.equal(_u8(got.scales).cpu(), _u8(want.scales)), f"{what}: swizzled scales"
    if hasattr(want, "amax"):
        assert torch.equal(got.amax.cpu(), want.amax), f"{what}: amax"


@pytest.mark.parametrize("m,k,dtype,mode", [
    (144, 80, torch.float32, "1d_rht"), (144, 80, torch.bfloat16, "1d_sr"), (144, 80, torch.float32, "2d"),
    (128, 128, torch.bfloat16, "2d"),
])
def test_nvfp4_rowcol_swizzled_bitwise(triton_device, gen, m, k, dtype, mode):
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    kw = dict(block_2d=mode == "2d", col_rht=mode == "1d_rht", col_stochastic=mode == "1d_sr", col_seed=7)
    want = quantize_nvfp4_rowcol_ref(x, swizzled=True, **kw)
    got = quantize_nvfp4_rowcol(x.to(triton_device), swizzled=True, **kw)
    for g, w, name in zip(got, want, ("row", "col")):  # the reference's codes are those of swizzled=False
        _same(g, w, f"{mode} {name}")


@pytest.mark.parametrize("m,k,rht", [(144, 80, False), (48, 128, True)])
def test_nvfp4_single_swizzled_bitwise(triton_device, gen, m, k, rht):
    x = torch.randn(m, k, generator=gen)
    _same(quantize_nvfp4(x.to(triton_device), rht=rht, swizzled=True),
          quantize_nvfp4_ref(x, rht=rht, swizzled=True), f"rht={rht}")


@pytest.mark.parametrize("m,k,block_2d", [(96, 160, False), (96, 160, True), (128, 128, False)])
def test_mxfp4_swizzled_bitwise(triton_device, gen, m, k, block_2d):
    x = torch.randn(m, k, generator=gen) * 5
    for g, w, name in zip(quantize_mxfp4_rowcol(x.to(triton_device), block_2d=block_2d, swizzled=True),
                          quantize_mxfp4_rowcol_ref(x, block_2d=block_2d, swizzled=True), ("row", "col")):
        _same(g, w, f"block_2d={block_2d} {name}")
    _same(quantize_mxfp4(x.to(triton_device), stochastic=True, seed=3, swizzled=True),
          quantize_mxfp4_ref(x, stochastic=True, seed=3, swizzled=True), "single, stochastic")
