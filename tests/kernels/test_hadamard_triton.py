"""The Triton RHT kernel (``nvfp4_train.kernels.hadamard``) against ``hadamard16_ref``, bit for bit, and the MXFP4 Wgrad
operand cast that uses it.

``triton``-marked tests run under TRITON_INTERPRET=1 on CPU (``make test``) or natively on CUDA
(``make test-gpu``); the ``gpu`` test needs CUDA. NaN: the positions must agree, the NaN bits are not
compared (see ``kernels/hadamard.py``); every other element must have the same bits.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.hadamard import hadamard16, hadamard16_triton
from nvfp4_train.kernels.mxfp4 import quantize_mxfp4
from nvfp4_train.kernels.nvfp4.reference import hadamard16_ref
from nvfp4_train.precision.operand import cast_one
from nvfp4_train.precision.recipe import OperandCast

# the interpreter evaluates Inf - Inf etc. with numpy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DTYPES = [torch.bfloat16, torch.float32]
BF16_MAX = 3.3895313892515355e38


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def assert_same(got: torch.Tensor, x: torch.Tensor) -> None:
    """``got`` is ``hadamard16_ref(x).to(x.dtype)`` bit for bit (NaN: same positions), contiguous."""
    ref = hadamard16_ref(x.cpu()).to(x.dtype)
    got = got.cpu()
    assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
    nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
    assert torch.equal(nan_got, nan_ref), "NaN positions differ"
    ok = torch.where(nan_ref, 0, bits(got)) == torch.where(nan_ref, 0, bits(ref))
    assert ok.all(), f"{int((~ok).sum())} elements differ, first at {(~ok).nonzero()[0].tolist()}"


def layout(base: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``base`` [R, C] as itself, or as the transposed view of a contiguous [C, R] copy (strides (1, R))."""
    return base.t().contiguous().t() if transposed else base


def special_tensor(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values with NaN, +-Inf, +-0, subnormals and values near the bf16 maximum at random positions
    (a few of each, so most groups stay finite), one row of all-near-max values (the fp32 sums overflow),
    one row of exact ties for the bf16 rounding (small integers: the sums times 1/4 land on halfway points)
    and one group of signed zeros."""
    tiny = 1e-39 if dtype == torch.bfloat16 else 1e-41  # subnormal in bf16 / fp32
    x = torch.randn(rows, cols, generator=gen)
    flat = x.view(-1)
    specials = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, BF16_MAX * 0.99, -BF16_MAX * 0.98]
    pos = torch.randperm(flat.numel(), generator=gen)
    n = 0
    for v in specials:
        flat[pos[n:n + 2]] = v
        n += 2
    sub = pos[n:n + cols]
    flat[sub] = torch.randn(sub.numel(), generator=gen) * tiny
    x[rows // 2] = BF16_MAX * (0.5 + torch.rand(cols, generator=gen) / 2)
    x[rows // 3] = torch.randint(-256, 257, (cols,), generator=gen).float()
    x[rows // 4, :16] = torch.where(torch.rand(16, generator=gen) < 0.5, 0.0, -0.0)  # a group of +-0
    return x.to(dtype)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [16, 48, 1024])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_random_matches_reference(triton_device, gen, dtype, cols, transposed):
    base = torch.randn(37, cols, generator=gen) * torch.exp(torch.randn(37, 1, generator=gen) * 3)
    x = layout(base.to(dtype).to(triton_device), transposed)
    assert x.is_contiguous() != transposed
    assert_same(hadamard16_triton(x), x)
    assert_same(hadamard16(x), x)  # the dispatcher takes the kernel here


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_special_values(triton_device, gen, dtype, transposed):
    x = layout(special_tensor(37, 48, dtype, gen).to(triton_device), transposed)
    ref = hadamard16_ref(x.cpu())
    assert torch.isnan(ref).any() and torch.isinf(ref).any() and (ref == 0).any()  # the cases occur
    assert_same(hadamard16_triton(x), x)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_tiles_and_empty(triton_device, gen, dtype):
    """Several programs along both dims (tiles of 16 x 16 over [40, 80]), and a tensor without rows."""
    x = layout(special_tensor(40, 80, dtype, gen).to(triton_device), True)
    assert_same(hadamard16_triton(x, block_r=16, block_c=16), x)
    e = torch.empty(0, 32, dtype=dtype, device=triton_device)
    assert hadamard16_triton(e).shape == (0, 32)


@pytest.mark.triton
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_wgrad_operand_matches_reference_composition(triton_device, gen, rounding, dtype):
    """cast_one of t^T (the Wgrad operand, hadamard) through the kernel == quantize_mxfp4 of
    hadamard16_ref(t^T), codes and scales, with a NaN and an Inf in t."""
    t = (torch.randn(64, 48, generator=gen) * 4).to(dtype)
    t[3, 7] = float("nan")
    t[40, 20] = float("inf")
    t = t.to(triton_device)
    cast = OperandCast(format="mxfp4", block=(1, 32), rounding=rounding, hadamard=True)
    got = cast_one(t.t(), cast, seed=11)
    assert got.format == "mxfp4"
    ref = quantize_mxfp4(hadamard16_ref(t.t()).to(dtype), stochastic=rounding == "stochastic", seed=11)
    assert torch.equal(got.data.codes.cpu(), ref.codes.cpu())
    assert torch.equal(got.data.scales.cpu(), ref.scales.cpu())
    assert (got.data.scales == 0xFF).any()  # the non-finite blocks are there


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large(dtype):
    g = torch.Generator().manual_seed(1234)
    base = special_tensor(4096 + 37, 2048, dtype, g)
    for transposed in (False, True):
        x = layout(base, transposed).cuda()
        assert_same(hadamard16_triton(x), x)
        assert_same(hadamard16(x), x)


@pytest.mark.parametrize(
    "x, err, msg",
    [
        (torch.zeros(4, 32, dtype=torch.float16), TypeError, "bfloat16 or float32"),
        (torch.zeros(2, 4, 32), ValueError, "2-D"),
        (torch.zeros(4, 24), ValueError, "mixes groups of 16; last dim is 24"),
    ],
    ids=["fp16", "3d", "ragged_cols"],
)
def test_input_checks(x, err, msg):
    """The same errors on both paths (checked before dispatching)."""
    with pytest.raises(err, match=msg):
        hadamard16(x)
    with pytest.raises(err, match=msg):
        hadamard16_triton(x)
    if err is ValueError and x.dim() == 2:
        with pytest.raises(ValueError, match=msg):  # the reference's own message
            hadamard16_ref(x)
