"""The fused Triton NVFP4 quantizer against the reference, bit for bit (codes, scales, amax).

Runs under TRITON_INTERPRET=1 on CPU (``make test``) and natively on CUDA (``make test-gpu``).
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.nvfp4 import quantize_nvfp4, quantize_nvfp4_rowcol
from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor, quantize_nvfp4_ref, quantize_nvfp4_rowcol_ref
from tests.kernels.nvfp4_cases import (
    nonfinite_tensors,
    outlier_tensor,
    saturation_tensor,
    subnormal_scales_tensor,
    ties_tensor,
)

pytestmark = pytest.mark.triton


def assert_same(got: NVFP4Tensor, ref: NVFP4Tensor) -> None:
    assert got.codes.shape == ref.codes.shape and got.scales.shape == ref.scales.shape
    assert got.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(got.codes.cpu(), ref.codes), "codes differ"
    assert torch.equal(got.scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8)), "scales differ"
    assert torch.equal(got.amax.cpu(), ref.amax) or (torch.isnan(got.amax).item() and torch.isnan(ref.amax).item())
    assert got.block_2d == ref.block_2d


MODES = [
    dict(),
    dict(block_2d=True),
    dict(rht=True),
    dict(stochastic=True, seed=5),
    dict(stochastic=True, seed=2**31 + 12345),
    dict(rht=True, stochastic=True, seed=77),
    dict(block_2d=True, stochastic=True, seed=3),
    dict(block_2d=True, rht=True),  # the "RHT on every GEMM" ablation's weight
]


def check_all_modes(x: torch.Tensor, device: str) -> None:
    xd = x.to(device)
    for kw in MODES:
        if kw.get("block_2d") and x.shape[0] % 16:
            continue
        assert_same(quantize_nvfp4(xd, **kw), quantize_nvfp4_ref(x, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(33, 48), (16, 16), (80, 208), (7, 32)])
def test_random_odd_shapes(triton_device, gen, dtype, shape):
    x = (torch.randn(*shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen) * 2)).to(dtype)
    check_all_modes(x, triton_device)


@pytest.mark.parametrize(
    "make",
    [
        lambda g: ties_tensor(),
        lambda g: subnormal_scales_tensor(),
        lambda g: saturation_tensor(g),
        lambda g: torch.zeros(32, 64),
        lambda g: torch.cat([torch.zeros(16, 32), torch.randn(16, 32, generator=g)]),  # all-zero blocks
        lambda g: outlier_tensor(g, torch.bfloat16),
        lambda g: outlier_tensor(g, torch.float32),
        lambda g: (torch.randn(32, 48, generator=g) * 1e-38).float(),  # fp32 subnormal inputs
        lambda g: (torch.randn(32, 48, generator=g) * 1e-38).bfloat16(),  # bf16 subnormal inputs
        lambda g: torch.randn(32, 48, generator=g) * 3e38,  # near FLT_MAX (S_enc underflow side)
    ],
    ids=["ties", "subnormal_scales", "saturation", "zeros", "zero_blocks", "outlier_bf16", "outlier_fp32",
         "subnormal_fp32", "subnormal_bf16", "huge"],
)
def test_edge_inputs(triton_device, gen, make):
    check_all_modes(make(gen), triton_device)


def test_nonfinite_inputs(triton_device, gen):
    for x in nonfinite_tensors(gen):
        check_all_modes(x, triton_device)
        q = quantize_nvfp4(x.to(triton_device))
        assert torch.isnan(q.amax).item()


def test_non_contiguous_input(triton_device, gen):
    base = torch.randn(64, 96, generator=gen).bfloat16()
    x = base[:, 16:80]  # strided rows
    xt = base.t()[16:48]  # a transposed view
    for v in (x, xt):
        assert not v.is_contiguous()
        for kw in MODES[:4]:
            assert_same(quantize_nvfp4(v.to(triton_device), **kw), quantize_nvfp4_ref(v, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 80), (64, 16), (16, 144)])
def test_rowcol_fused(triton_device, gen, dtype, shape):
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    for kw in [
        dict(col_rht=True),
        dict(col_rht=True, row_stochastic=True, col_stochastic=True, row_seed=1, col_seed=2),
        dict(col_rht=False),
        dict(block_2d=True),
        dict(block_2d=True, row_stochastic=True, col_stochastic=True, row_seed=9, col_seed=9),
    ]:
        got = quantize_nvfp4_rowcol(x.to(triton_device), **kw)
        ref = quantize_nvfp4_rowcol_ref(x, **kw)
        assert_same(got[0], ref[0])
        assert_same(got[1], ref[1])


def test_supplied_amax(triton_device, gen):
    x = torch.randn(32, 64, generator=gen).bfloat16()
    amax = torch.tensor(10.0)
    assert_same(quantize_nvfp4(x.to(triton_device), amax=amax.to(triton_device)), quantize_nvfp4_ref(x, amax=amax))
    row, col = quantize_nvfp4_rowcol(x.to(triton_device), col_rht=True, row_amax=amax.to(triton_device))
    rrow, rcol = quantize_nvfp4_rowcol_ref(x, col_rht=True, row_amax=amax)
    assert_same(row, rrow)
    assert_same(col, rcol)


def test_errors_name_the_problem(triton_device):
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(16, 40, device=triton_device))
    with pytest.raises(ValueError, match="token dim"):
        quantize_nvfp4_rowcol(torch.randn(24, 32, device=triton_device))


def test_amax_and_supplied_raw_amax(triton_device, gen):
    from nvfp4_train.kernels.nvfp4 import nvfp4_amax, nvfp4_amax_ref

    for x in [torch.randn(32, 48, generator=gen).bfloat16(), *nonfinite_tensors(gen)]:
        for col_rht in (False, True):
            got = nvfp4_amax(x.to(triton_device), col_rht)
            ref = nvfp4_amax_ref(x, col_rht)
            assert torch.equal(got.cpu(), ref)
            # quantizing with the raw amax supplied equals quantizing without it (Inf -> NaN policy)
            row, col = quantize_nvfp4_rowcol(x.to(triton_device), col_rht=col_rht, row_amax=got[0], col_amax=got[1])
            rrow, rcol = quantize_nvfp4_rowcol_ref(x, col_rht=col_rht)
            assert_same(row, rrow)
            assert_same(col, rcol)


ROWCOL_MODES = [
    dict(col_rht=True),
    dict(col_rht=True, row_stochastic=True, col_stochastic=True, row_seed=3, col_seed=2**32 - 1),
    dict(block_2d=True),
    dict(block_2d=True, row_stochastic=True, col_stochastic=True, row_seed=4, col_seed=4),
]


def test_whole_tiles(triton_device, gen):
    """The kernel on a shape made of whole default tiles (its unmasked path), with rows of very different
    magnitudes (subnormal and saturating block scales in one tensor)."""
    from nvfp4_train.kernels.fp4_reference import seed_key
    from nvfp4_train.kernels.nvfp4.quantize import QUANTIZE_CONFIG, quantize_nvfp4_rowcol_triton

    m, k = 2 * QUANTIZE_CONFIG["block_m"], 2 * QUANTIZE_CONFIG["block_k"]
    x = (torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 4)).bfloat16()
    for kw in ROWCOL_MODES:
        ref_row, ref_col = quantize_nvfp4_rowcol_ref(x, **kw)
        rc, rs, cc, cs, am = quantize_nvfp4_rowcol_triton(
            x.to(triton_device), write_col=True, block_2d=kw.get("block_2d", False),
            col_rht=kw.get("col_rht", False), row_stochastic=kw.get("row_stochastic", False),
            col_stochastic=kw.get("col_stochastic", False), row_key=seed_key(kw.get("row_seed", 0)),
            col_key=seed_key(kw.get("col_seed", 0)),
        )
        block_2d = kw.get("block_2d", False)
        assert_same(NVFP4Tensor(rc, rs.view(torch.float8_e4m3fn), am[0], block_2d), ref_row)
        assert_same(NVFP4Tensor(cc, cs.view(torch.float8_e4m3fn), am[1], block_2d), ref_col)
