"""The squared ReLU kernels that also return the raw amax of their output (``squared_relu_*_amax``,
``kernels/fused/squared_relu.py``): the output and the non-finite check are the plain kernels' (the reference's), the
amax is ``nvfp4_amax_ref`` of the output as [M, K] (K = x.shape[-1]), all bit for bit, with the Hadamard-mixed
columnwise amax (``col_rht``) or without it.

Every comparison is of bits (NaN positions equal; a NaN's sign and payload are not specified). Inputs are either
tame (finite squares and products, so the amax is a number that every rounding step decides) or drawn over the
whole exponent range with ±0, subnormals, the largest finite value, squares and products that overflow or underflow
fp32 and NaN/±Inf (``test_squared_relu.draw``); shapes are ragged against the kernel's tiles (M not a multiple of
the tile's rows, K not of its columns) and against the 16-row groups where the mixed amax allows it.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.bench.sass import have_nvidia_tools
from nvfp4_train.kernels.fp4_reference import RHT_SIGNS
from nvfp4_train.kernels.fp8 import fp8_amax
from nvfp4_train.kernels.fused import nonfinite as nf
from nvfp4_train.kernels.fused import squared_relu as sr
from nvfp4_train.kernels.fused.nonfinite_reference import NEVER, NonfiniteCheck
from nvfp4_train.kernels.fused.squared_relu_reference import (
    SQUARED_RELU_AMAX_DTYPES,
    squared_relu_backward_amax_ref,
    squared_relu_backward_ref,
    squared_relu_forward_amax_ref,
    squared_relu_forward_ref,
)
from nvfp4_train.kernels.nvfp4 import nvfp4_amax
from tests.kernels.test_rope import assert_same_bits
from tests.kernels.test_squared_relu import _checks, _same_check, draw

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def tame(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normals times 2^k, k uniform in [-24, 24), with ~5% each of +0 and -0 and ~5% tiny values 2^j, j in
    [-80, -60) (squares that fall below fp32's normal range; bf16 rounds them a second time): every square and
    product of two such values is finite, so the amax is a number."""
    n = torch.Size(shape).numel()
    k = torch.randint(-24, 24, (n,), generator=gen).to(torch.float64)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(k)
    u = torch.rand(n, generator=gen)
    tiny = torch.exp2(torch.randint(-80, -60, (n,), generator=gen).to(torch.float64))
    x = torch.where(u < 0.05, 0.0, x)
    x = torch.where((u >= 0.05) & (u < 0.10), -0.0, x)
    x = torch.where((u >= 0.10) & (u < 0.15), tiny * torch.sign(x), x)
    return x.to(dtype).reshape(shape)


def _both(x, dy, check_k, check_r, col_rht: bool, **cfg):
    """(kernel's (out, amax), reference's (out, amax)) of one direction: backward when dy is given."""
    if dy is None:
        return (sr.squared_relu_forward_amax_triton(x, check_k, col_rht=col_rht, **cfg),
                squared_relu_forward_amax_ref(x, check_r, col_rht=col_rht))
    return (sr.squared_relu_backward_amax_triton(x, dy, check_k, col_rht=col_rht, **cfg),
            squared_relu_backward_amax_ref(x, dy, check_r, col_rht=col_rht))


# ------------------------------------------------------------------------------------------------------------
# CPU tier: the reference
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SQUARED_RELU_AMAX_DTYPES, ids=str)
def test_reference_is_the_plain_reference_and_the_quantizers_amax(gen, dtype):
    """The output and check are ``squared_relu_*_ref``'s; amax[0] is ``fp8_amax`` of the output, and both entries are
    ``nvfp4_amax`` of it as [M, K] (on the reference path; [1] = [0] without col_rht), on tame and edge draws."""
    for make in (tame, lambda s, d, g: draw(s, d, g, "last")):
        x, dy = make((2, 48, 64), dtype, gen), make((2, 48, 64), dtype, gen)
        for col_rht in (False, True):
            c, rc = NonfiniteCheck(None, now=11), NonfiniteCheck(None, now=11)
            y, am = squared_relu_forward_amax_ref(x, c, col_rht=col_rht)
            assert_same_bits(y, squared_relu_forward_ref(x, rc))
            assert float(c.kept) == float(rc.kept)
            dx, am_b = squared_relu_backward_amax_ref(x, dy, col_rht=col_rht)
            assert_same_bits(dx, squared_relu_backward_ref(x, dy))
            for out, a in ((y, am), (dx, am_b)):
                assert a.dtype == torch.float32 and a.shape == (2,)
                assert_same_bits(a, nvfp4_amax(out.reshape(-1, 64), col_rht))
                assert_same_bits(a[0], fp8_amax(out))
                if not col_rht:
                    assert_same_bits(a[1], a[0])


def test_errors_name_the_value_and_the_fix_and_leave_the_check_alone():
    """fp16 (one line), fp64, the mixed amax of a row count that is not a multiple of 16, a 0-d x, a strided x for
    the launcher: ValueError before anything runs (the clock does not advance, kept stays None)."""
    x = torch.zeros(40, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float32") as e:
        sr.squared_relu_forward_amax(x.half(), col_rht=False)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        sr.squared_relu_backward_amax_ref(x.half(), x.half(), col_rht=True)
    with pytest.raises(ValueError, match="torch.float64"):
        sr.squared_relu_forward_amax(x.double(), col_rht=False)
    clock = torch.tensor(4.0, dtype=torch.float64)
    c = NonfiniteCheck(torch.tensor(float(NEVER), dtype=torch.float64), clock=clock)
    with pytest.raises(ValueError, match="M = 40 rows"):
        sr.squared_relu_forward_amax(x, c, col_rht=True)
    with pytest.raises(ValueError, match="M = 40 rows"):
        sr.squared_relu_backward_amax(x, x, c, col_rht=True)
    assert float(clock) == 4.0
    c = NonfiniteCheck(None, now=3)
    with pytest.raises(ValueError, match="0-d"):
        sr.squared_relu_forward_amax_ref(torch.tensor(1.0), c, col_rht=False)
    assert c.kept is None
    with pytest.raises(ValueError, match="contiguous"):
        sr.squared_relu_forward_amax_triton(torch.zeros(32, 48, dtype=torch.bfloat16).t(), col_rht=True)
    y, am = sr.squared_relu_forward_amax(x, col_rht=False)  # 40 rows: fine without the mixed amax
    assert y.shape == x.shape and am.tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------------------------
# Triton tier: the kernel against the reference
# ------------------------------------------------------------------------------------------------------------

# (shape, tile overrides): ragged against the default 64x128 tile, a tensor of whole tiles, many small tiles per
# program (the interpreter runs 4 programs) whole and ragged, and row counts that are not multiples of 16
_CASES = [
    ((48, 200), {}),
    ((2, 48, 144), {}),
    ((128, 256), {}),
    ((112, 96), dict(block_m=16, block_k=32)),
    ((80, 100), dict(block_m=32, block_k=32)),
    ((37, 130), {}),
    ((300,), dict(block_m=16, block_k=64)),
]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", SQUARED_RELU_AMAX_DTYPES, ids=str)
def test_amax_kernel_matches_reference_bitwise(triton_device, gen, dtype):
    """Forward and backward, with the mixed amax wherever the rows allow it and without, tame draws and edge draws
    (a NaN/+Inf/-Inf somewhere in the checked tensor, or none), the check off or on either clock: out, amax, the
    kept time, clock and counter bitwise the reference's."""
    dev = triton_device
    bads = [None, "nan", "inf", "-inf", "last"]
    i = 0
    for shape, cfg in _CASES:
        rows = torch.Size(shape[:-1]).numel()
        for backward in (False, True):
            for col_rht in (False, True) if rows % 16 == 0 else (False,):
                i += 1
                mode = ("none", "host", "device")[int(torch.randint(3, (), generator=gen))]
                if i % 2:
                    x = tame(shape, dtype, gen)
                    dy = tame(shape, dtype, gen) if backward else None
                else:
                    bad = bads[int(torch.randint(len(bads), (), generator=gen))]
                    x = draw(shape, dtype, gen, None if backward else bad)
                    dy = draw(shape, dtype, gen, bad) if backward else None
                x = x.to(dev)
                dy = dy.to(dev) if backward else None
                kc, rc = _checks(dev, gen, mode == "device") if mode != "none" else (None, None)
                (out, am), (want, want_am) = _both(x, dy, kc, rc, col_rht, **cfg)
                assert_same_bits(out, want)
                assert am.device == x.device and am.dtype == torch.float32 and am.shape == (2,)
                assert_same_bits(am, want_am)
                if kc is not None:
                    _same_check(kc, rc)


def _group(vals, dtype, dev) -> torch.Tensor:
    """A [32, 48] tensor of dtype: rows 0..len(vals)-1 of column 5 hold ``vals``, everything else 0."""
    t = torch.zeros(32, 48, dtype=torch.float64)
    t[:len(vals), 5] = torch.tensor(vals, dtype=torch.float64)
    return t.to(dtype).to(dev)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", SQUARED_RELU_AMAX_DTYPES, ids=str)
def test_amax_kernel_on_edge_values(triton_device, dtype):
    """Hand-made cases, each against the reference and the value it must have: all zeros (±0); a -Inf x (relu makes
    it 0: finite amax, yet the check finds it); +Inf and NaN (+Inf amax); squares that overflow; a group whose
    mixed values overflow fp32 while the rows stay finite ([2^126, +Inf]); squares that underflow (bf16: 2^-140
    rounds to 0, 2^-132 is a subnormal whose mixed 2^-134 rounds to 0); subnormal x; a gradient that is 0 where
    x <= 0 although dy is NaN there."""
    dev = triton_device
    inf, nan = float("inf"), float("nan")
    bf16 = dtype == torch.bfloat16

    def run(x, dy=None, col_rht=True, expect=None, expect0=None, found=None):
        kc, rc = NonfiniteCheck(None, nf.new_arrivals(dev), now=5), NonfiniteCheck(None, now=5)
        (out, am), (want, want_am) = _both(x, dy, kc, rc, col_rht, block_m=16, block_k=32)
        assert_same_bits(out, want)
        assert_same_bits(am, want_am)
        assert float(kc.kept) == float(rc.kept)
        if expect is not None:
            assert am.cpu().tolist() == expect, (am.cpu().tolist(), expect)
        if expect0 is not None:
            assert float(am[0]) == expect0, (float(am[0]), expect0)
        if found is not None:
            assert (float(kc.kept) == 5.0) == found

    zeros = torch.zeros(32, 48, dtype=dtype, device=dev)
    zeros.view(-1)[::3] = -0.0
    run(zeros, expect=[0.0, 0.0], found=False)
    run(zeros, zeros, expect=[0.0, 0.0], found=False)
    x = _group([1.5, -3.0, float("-inf"), 2.0], dtype, dev)
    run(x, expect0=4.0, found=True)
    run(x, col_rht=False, expect=[4.0, 4.0], found=True)
    run(_group([1.0, inf], dtype, dev), expect=[inf, inf], found=True)
    run(_group([nan, 1.0], dtype, dev), expect=[inf, inf], found=True)
    run(_group([2.0**64, 1.0], dtype, dev), expect=[inf, inf], found=False)  # 2^128 overflows fp32
    # dx_i = s_i 2^126 with the transform's signs s: the first mixed value is 16 * 2^126 / 4 = 2^128
    big_x, big_dy = _group([2.0**62] * 16, dtype, dev), _group([s * 2.0**63 for s in RHT_SIGNS], dtype, dev)
    run(big_x, big_dy, expect=[2.0**126, inf], found=False)
    run(big_x, big_dy, col_rht=False, expect=[2.0**126, 2.0**126])
    # squares below fp32's normal range: bf16 rounds 2^-140 to 0 and keeps 2^-132, whose mixed 2^-134 is half
    # bf16's least subnormal (a tie, to the even 0); fp32 keeps 2^-140 and its mixed 2^-142
    run(_group([2.0**-70], dtype, dev), expect=[0.0, 0.0] if bf16 else [2.0**-140, 2.0**-142])
    run(_group([2.0**-66], dtype, dev), expect=[2.0**-132, 0.0] if bf16 else [2.0**-132, 2.0**-134])
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal x: its square is 0 in both
    run(_group([tiny, -tiny], dtype, dev), expect=[0.0, 0.0])
    # backward: NaN dy where x <= 0 gives +0 (the check still finds it); -Inf dy where x > 0 gives -Inf
    x = _group([-1.0, 0.0, 3.0], dtype, dev)
    run(x, _group([nan, nan, 0.5], dtype, dev), expect0=3.0, found=True)
    run(x, _group([nan, nan, 0.5], dtype, dev), col_rht=False, expect=[3.0, 3.0], found=True)
    run(x, _group([1.0, 1.0, float("-inf")], dtype, dev), expect=[inf, inf], found=True)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", SQUARED_RELU_AMAX_DTYPES, ids=str)
def test_amax_is_the_quantizers_amax_pass_of_the_output(triton_device, gen, dtype):
    """What the fused launch returns is what the consumer's own pass computes from the stored output, on the kernel
    path: ``nvfp4_amax(out, col_rht)`` (``amax_triton`` here) and ``fp8_amax(out)`` for entry 0."""
    dev = triton_device
    for shape in ((96, 80), (2, 16, 144)):
        for make in (tame, lambda s, d, g: draw(s, d, g)):
            x, dy = make(shape, dtype, gen).to(dev), make(shape, dtype, gen).to(dev)
            for col_rht in (False, True):
                for out, am in (sr.squared_relu_forward_amax(x, col_rht=col_rht),
                                sr.squared_relu_backward_amax(x, dy, col_rht=col_rht)):
                    t = out.reshape(-1, shape[-1])
                    assert_same_bits(am, nvfp4_amax(t, col_rht))
                    assert_same_bits(am[0], fp8_amax(t))


@pytest.mark.triton
def test_views_empty_tensors_and_the_dispatch(triton_device, gen):
    """Transposed x and dy go through the dispatching calls (copied; the same bits); an empty tensor launches
    nothing, returns a zero amax on x's device, keeps the host-clock time and advances the device clock; fp16 is
    refused on the kernel path too."""
    dev = triton_device
    x = tame((48, 32), torch.bfloat16, gen).to(dev)
    dy = tame((32, 48), torch.bfloat16, gen).to(dev)
    for got, want in ((sr.squared_relu_forward_amax(x.t(), col_rht=False),
                       squared_relu_forward_amax_ref(x.t(), col_rht=False)),
                      (sr.squared_relu_backward_amax(x.t(), dy, col_rht=True),
                       squared_relu_backward_amax_ref(x.t(), dy, col_rht=True))):
        assert_same_bits(got[0], want[0])
        assert_same_bits(got[1], want[1])
    for shape in ((0, 48), (16, 0)):
        empty = torch.empty(shape, dtype=torch.float32, device=dev)
        c = NonfiniteCheck(torch.tensor(5.0, dtype=torch.float64, device=dev), nf.new_arrivals(dev), now=9)
        y, am = sr.squared_relu_forward_amax(empty, c, col_rht=True)
        assert y.shape == shape and am.device == empty.device and am.tolist() == [0.0, 0.0]
        assert float(c.kept) == 5.0
        clock = torch.tensor(1.0, dtype=torch.float64, device=dev)
        c = NonfiniteCheck(torch.tensor(5.0, dtype=torch.float64, device=dev), nf.new_arrivals(dev), clock=clock)
        _, am = sr.squared_relu_backward_amax(empty, empty, c, col_rht=True)
        assert float(clock) == 2.0 and float(c.kept) == 5.0 and am.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        sr.squared_relu_backward_amax(x.half(), x.half(), col_rht=False)


@pytest.mark.skipif(not have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_amax_kernel_compiles_for_sm90_without_spills():
    """Compiled for sm_90 at the default tile, as the launcher compiles it (fp contraction off), on any machine: no
    local-memory spills in any variant, no fused multiply-add (the transform's multiply and adds are rounded one by
    one, as the reference's), no flush-to-zero multiply or add, 16 rows loaded before the first store."""
    from nvfp4_train.bench import sass

    for kind, backward, check, col_rht, even in ((1, False, True, True, True), (1, True, True, True, False),
                                                 (0, True, False, True, True), (0, False, True, False, False)):
        ptr = "*i16" if kind == 1 else "*fp32"
        listing = sass.compile_sass(
            sr._squared_relu_amax_kernel,
            dict(x_ptr=ptr, dy_ptr=ptr, out_ptr=ptr, amax_ptr="*fp32", M="i32", K="i32", kept_ptr="*fp64",
                 clock_ptr="*fp64", arrivals_ptr="*i32", now="i64"),
            dict(KIND=kind, NATIVE=True, BACKWARD=backward, CHECK=check, CLOCKED=backward, FRESH=False,
                 NEVER_F=float(NEVER), COL_RHT=col_rht, EVEN=even, BM=sr.AMAX_BLOCK_M, BK=sr.AMAX_BLOCK_K),
            divisible=["x_ptr", "dy_ptr", "out_ptr", "amax_ptr", "M", "K", "kept_ptr", "clock_ptr", "arrivals_ptr"],
            num_warps=sr.AMAX_NUM_WARPS, options=dict(enable_fp_fusion=False))
        ops = sass.count_opcodes(listing)
        case = (kind, backward, check, col_rht, even)
        assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, case
        assert ops.get("FFMA", 0) == 0, case
        assert not [line for line in listing.splitlines() if "FMUL.FTZ" in line or "FADD.FTZ" in line], case
        lines = [line for line in listing.splitlines() if "LDG" in line or "STG" in line]
        first_store = next(i for i, line in enumerate(lines) if "STG" in line)
        assert sum("LDG" in line for line in lines[:first_store]) >= 16 * (1 + backward), case
