"""The squared ReLU kernels (``kernels/fused/squared_relu.py``): the reference is torch autograd of
``torch.pow(F.relu(x), 2)`` bit for bit (values and gradients); the kernel is the reference bit for bit, and the
non-finite check it runs in the same launch keeps the times, clock and counter of ``track_nonfinite*_ref`` of the
tensor it reads.

Every comparison is of bits (NaN positions equal; a NaN's sign and payload are not specified). Inputs hold edge
values: ±0, subnormals, magnitudes over the whole exponent range (squares and products that underflow fp32 and are
rounded twice for bf16, that overflow; a huge dy times a small x, where the order of the product matters), the
largest finite value, ±Inf and NaN.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.bench.sass import have_nvidia_tools
from nvfp4_train.kernels.fused import nonfinite as nf
from nvfp4_train.kernels.fused import squared_relu as sr
from nvfp4_train.kernels.fused.nonfinite_reference import (
    NEVER,
    NonfiniteCheck,
    track_nonfinite_clocked_ref,
)
from nvfp4_train.kernels.fused.squared_relu_reference import (
    SQUARED_RELU_DTYPES,
    squared_relu_backward_ref,
    squared_relu_forward_ref,
)
from tests.kernels.test_rope import assert_same_bits  # bits equal, NaN positions equal (payloads free)

# Inf and NaN inputs: numpy (the interpreter's arithmetic) warns where IEEE arithmetic gives them
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def draw(shape, dtype: torch.dtype, gen: torch.Generator, bad: str | None = None) -> torch.Tensor:
    """Normals scaled by 2^k, k uniform over the format's whole exponent range and beyond (so subnormals, zeros
    and Infs after the cast too), with ~5% each of +0, -0 and the largest finite value with a random sign; ``bad``:
    one NaN/+Inf/-Inf at a random position, "last" (a drawn one at the last element) or None (finite)."""
    fi = torch.finfo(dtype)
    lo, hi = {torch.bfloat16: (-140, 128), torch.float16: (-28, 16), torch.float32: (-150, 128)}[dtype]
    n = torch.Size(shape).numel()
    k = torch.randint(lo, hi, (n,), generator=gen).to(torch.float64)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(k)
    u = torch.rand(n, generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    x = torch.where(u < 0.05, 0.0, x)
    x = torch.where((u >= 0.05) & (u < 0.10), -0.0, x)
    x = torch.where((u >= 0.10) & (u < 0.15), sign * fi.max, x)
    x = x.clamp(-fi.max, fi.max).to(dtype)  # finite: the non-finite values are placed below
    if n and bad is not None:
        if bad == "last":
            x[-1] = list(BAD.values())[int(torch.randint(3, (), generator=gen))]
        else:
            x[int(torch.randint(n, (), generator=gen))] = BAD[bad]
    return x.reshape(shape)


def _autograd(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``squared_relu`` (its function, not compiled) and torch autograd's gradient of it."""
    from megatron.core.activations import squared_relu

    fn = getattr(squared_relu, "__wrapped__", squared_relu)  # megatron's function without its torch.compile
    xg = x.detach().clone().requires_grad_(True)
    y = fn(xg)
    (dx,) = torch.autograd.grad(y, xg, dy)
    return y.detach(), dx


# ------------------------------------------------------------------------------------------------------------
# CPU tier: the reference is torch's arithmetic
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SQUARED_RELU_DTYPES, ids=str)
def test_reference_is_torch_autograd_bitwise(gen, dtype):
    """Forward and backward against megatron's ``squared_relu`` under eager autograd, on random draws over the whole
    exponent range with NaN/±Inf in x and in dy, and on every pair of edge values."""
    for bad_x, bad_dy in ((None, None), ("nan", "-inf"), ("-inf", "nan"), ("inf", "inf"), ("last", "last")):
        x = draw((6144 + 7,), dtype, gen, bad_x)
        dy = draw((6144 + 7,), dtype, gen, bad_dy)
        y, dx = _autograd(x, dy)
        assert_same_bits(squared_relu_forward_ref(x), y)
        assert_same_bits(squared_relu_backward_ref(x, dy), dx)
    fi = torch.finfo(dtype)
    edges = torch.tensor([0.0, -0.0, fi.smallest_normal / 8, -fi.smallest_normal / 8, fi.smallest_normal, 2.0**-70,
                          0.25, 1.0, 3.0, 255.0, 32768.0, fi.max, -fi.max, -1.0, float("inf"), float("-inf"),
                          float("nan")], dtype=torch.float64).to(dtype)
    x, dy = (t.contiguous() for t in torch.cartesian_prod(edges, edges).unbind(1))  # every (x, dy) pair
    y, dx = _autograd(x, dy)
    assert_same_bits(squared_relu_forward_ref(x), y)
    assert_same_bits(squared_relu_backward_ref(x, dy), dx)


def test_the_order_of_the_gradients_product_is_torchs():
    """dy * (2 * r), not (dy * 2) * r: a dy near the largest value times a small r stays finite (doubling dy first
    would overflow); a square below fp32's normal range is rounded in fp32, then to bf16."""
    big = torch.finfo(torch.bfloat16).max
    x = torch.tensor([0.25, 2.0**-70, 2.0**-66], dtype=torch.bfloat16)
    dy = torch.tensor([big, 1.0, 1.0], dtype=torch.bfloat16)
    dx = squared_relu_backward_ref(x, dy)
    assert torch.isfinite(dx[0]) and float(dx[0]) == float(torch.tensor(big * 0.5, dtype=torch.bfloat16))
    y = squared_relu_forward_ref(x)
    assert float(y[1]) == 0.0  # 2^-140: an fp32 subnormal that bf16 cannot hold
    assert float(y[2]) == 2.0**-132  # 2^-132: a bf16 subnormal, exact
    assert_same_bits(y, _autograd(x, dy)[0])


def test_reference_check_is_the_non_finite_reference(gen):
    """The reference's check of x (forward) and dy (backward) is ``track_nonfinite*_ref`` of that tensor: a -Inf
    in x is found although relu makes it 0."""
    x = torch.randn(300, generator=gen).bfloat16()
    x[int(torch.randint(300, (), generator=gen))] = float("-inf")
    dy = torch.randn(300, generator=gen).bfloat16()
    c = NonfiniteCheck(None, now=7)
    y = squared_relu_forward_ref(x, c)
    assert torch.isfinite(y).all() and float(c.kept) == 7.0
    clock = torch.tensor(3.0, dtype=torch.float64)
    c = NonfiniteCheck(torch.tensor(float(NEVER), dtype=torch.float64), clock=clock)
    squared_relu_backward_ref(x, dy, c)
    assert float(clock) == 4.0 and float(c.kept) == float(NEVER)


def test_errors_name_the_value_and_the_fix():
    x = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="torch.float64"):
        sr.squared_relu_forward(x.double())
    with pytest.raises(ValueError, match="dy must be x's shape"):
        sr.squared_relu_backward(x, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="new_arrivals"):
        sr.squared_relu_forward_triton(x, NonfiniteCheck(None, None, now=1))
    with pytest.raises(ValueError, match="kept is a torch.float32"):
        sr.squared_relu_forward_triton(x, NonfiniteCheck(torch.zeros(()), nf.new_arrivals("cpu")))
    with pytest.raises(ValueError, match="contiguous"):
        sr.squared_relu_forward_triton(torch.zeros(4, 6, dtype=torch.bfloat16).t())


# ------------------------------------------------------------------------------------------------------------
# Triton tier: the kernel against the reference
# ------------------------------------------------------------------------------------------------------------


def _checks(dev, gen, clocked: bool) -> tuple[NonfiniteCheck, NonfiniteCheck]:
    """The same check twice (for the kernel, for the reference): host clock with a fresh or an earlier kept time,
    or the device clock from a random start with kept before or after it, or never."""
    arrivals = nf.new_arrivals(dev)
    if clocked:
        start = float(int(torch.randint(2**20, (), generator=gen)))
        prev = (start - 1, start + 5, float(NEVER))[int(torch.randint(3, (), generator=gen))]
        make = lambda: NonfiniteCheck(torch.tensor(prev, dtype=torch.float64, device=dev), arrivals,  # noqa: E731
                                      clock=torch.tensor(start, dtype=torch.float64, device=dev))
    else:
        now = int(torch.randint(2**40, (), generator=gen))
        prev = (None, now - 3, now + 3, NEVER)[int(torch.randint(4, (), generator=gen))]
        make = lambda: NonfiniteCheck(  # noqa: E731
            None if prev is None else torch.tensor(float(prev), dtype=torch.float64, device=dev), arrivals, now=now)
    return make(), make()


def _same_check(k: NonfiniteCheck, r: NonfiniteCheck) -> None:
    assert (k.kept is None) == (r.kept is None)
    if k.kept is not None:
        assert k.kept.dtype == torch.float64 and k.kept.dim() == 0
        assert int(k.kept.cpu().view(torch.int64)) == int(r.kept.cpu().view(torch.int64))
    if k.clock is not None:
        assert int(k.clock.cpu().view(torch.int64)) == int(r.clock.cpu().view(torch.int64))
    assert int(k.arrivals.cpu()) == 0


@pytest.mark.triton
@pytest.mark.parametrize("dtype", SQUARED_RELU_DTYPES, ids=str)
def test_kernel_matches_reference_bitwise(triton_device, gen, dtype):
    """Forward and backward, odd sizes (6144 * 3 + 7: the last tile partial; tiles of 64 elements: many per
    program), without the check and with it on either clock, the checked tensor finite or with a NaN/+Inf/-Inf
    somewhere or at its last element: y/dx bitwise the reference's, the kept time, clock and counter too."""
    dev = triton_device
    cases = [((6144 * 3 + 7,), sr.BLOCK), ((3, 5, 129), sr.BLOCK), ((7,), sr.BLOCK), ((3, 5, 129), 64)]
    bads = [None, "nan", "inf", "-inf", "last"]
    for shape, block in cases:
        for backward in (False, True):
            for mode in ("none", "host", "device"):
                bad = bads[int(torch.randint(len(bads), (), generator=gen))]
                x = draw(shape, dtype, gen, None if backward else bad).to(dev)
                dy = draw(shape, dtype, gen, bad).to(dev) if backward else None
                kc, rc = _checks(dev, gen, mode == "device") if mode != "none" else (None, None)
                if backward:
                    out = sr.squared_relu_backward_triton(x, dy, kc, block=block)
                    want = squared_relu_backward_ref(x, dy, rc)
                else:
                    out = sr.squared_relu_forward_triton(x, kc, block=block)
                    want = squared_relu_forward_ref(x, rc)
                assert_same_bits(out, want)
                if kc is not None:
                    _same_check(kc, rc)


@pytest.mark.triton
def test_checked_launch_equals_the_non_finite_kernel(triton_device, gen):
    """The same tensor checked by the non-finite kernel and by the squared ReLU kernels (its x forward, its dy
    backward): the same kept times and clocks, bit for bit, on both clocks."""
    dev = triton_device
    for bad in (None, "nan", "inf", "-inf", "last"):
        t = draw((2048 + 16,), torch.bfloat16, gen, bad).to(dev)
        other = draw((2048 + 16,), torch.bfloat16, gen).to(dev)
        now = int(torch.randint(2**30, (), generator=gen))
        want = nf.track_nonfinite_triton(None, t, now, nf.new_arrivals(dev))
        for launch in (lambda c: sr.squared_relu_forward_triton(t, c),
                       lambda c: sr.squared_relu_backward_triton(other, t, c)):
            c = NonfiniteCheck(None, nf.new_arrivals(dev), now=now)
            launch(c)
            assert int(c.kept.cpu().view(torch.int64)) == int(want.cpu().view(torch.int64))
            clock = torch.tensor(9.0, dtype=torch.float64, device=dev)
            kept = torch.tensor(float(NEVER), dtype=torch.float64, device=dev)
            rclock, rkept = clock.clone(), kept.clone()
            launch(NonfiniteCheck(kept, nf.new_arrivals(dev), clock=clock))
            track_nonfinite_clocked_ref(rkept, t, rclock)
            assert float(clock) == float(rclock) == 10.0 and float(kept) == float(rkept)


@pytest.mark.triton
def test_views_empty_tensors_and_the_dispatch(triton_device, gen):
    """A transposed x and dy go through the dispatching calls (copied, the same bits); an empty tensor launches
    nothing, keeps the host-clock time and advances the device clock; fp64 goes to the reference."""
    dev = triton_device
    x = draw((33, 65), torch.bfloat16, gen, "nan").to(dev)
    dy = draw((65, 33), torch.bfloat16, gen).to(dev)
    assert_same_bits(sr.squared_relu_forward(x.t()), squared_relu_forward_ref(x.t()))
    assert_same_bits(sr.squared_relu_backward(x.t(), dy), squared_relu_backward_ref(x.t(), dy))
    empty = torch.empty(0, 3, dtype=torch.bfloat16, device=dev)
    c = NonfiniteCheck(torch.tensor(5.0, dtype=torch.float64, device=dev), nf.new_arrivals(dev), now=9)
    assert sr.squared_relu_forward(empty, c).shape == (0, 3) and float(c.kept) == 5.0
    clock = torch.tensor(1.0, dtype=torch.float64, device=dev)
    c = NonfiniteCheck(torch.tensor(5.0, dtype=torch.float64, device=dev), nf.new_arrivals(dev), clock=clock)
    sr.squared_relu_backward(empty, empty, c)
    assert float(clock) == 2.0 and float(c.kept) == 5.0
    x64 = draw((40,), torch.float32, gen).to(dev).double()
    with pytest.raises(ValueError, match="float64"):
        sr.squared_relu_forward(x64)


@pytest.mark.skipif(not have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_kernel_compiles_for_sm90_with_wide_accesses_and_one_atomic():
    """Compiled for sm_90 on any machine (no GPU needed): 16-byte loads and stores (8 bf16 a thread), one atomic per
    program with the check and none without it, and no flush-to-zero multiply (subnormal products are kept, as
    torch's and Inductor's are)."""
    from nvfp4_train.bench import sass

    for backward, check, clocked in ((False, True, False), (True, True, True), (True, False, False)):
        listing = sass.compile_sass(
            sr._squared_relu_kernel,
            dict(x_ptr="*i16", dy_ptr="*i16", out_ptr="*i16", n="i32", kept_ptr="*fp64", clock_ptr="*fp64",
                 arrivals_ptr="*i32", now="i64"),
            dict(KIND=1, NATIVE=True, BACKWARD=backward, CHECK=check, CLOCKED=clocked, FRESH=False,
                 NEVER_F=float(NEVER), BLOCK=sr.BLOCK),
            divisible=["x_ptr", "dy_ptr", "out_ptr", "n", "kept_ptr", "clock_ptr", "arrivals_ptr"],
            num_warps=sr.NUM_WARPS)
        ops = sass.count_opcodes(listing)
        assert "LDG.E.128" in listing and "STG.E.128" in listing, (backward, check)
        assert ops.get("ATOMG", 0) == int(check), (backward, check)
        assert not [line for line in listing.splitlines() if "FMUL.FTZ" in line or "FADD.FTZ" in line]


# ------------------------------------------------------------------------------------------------------------
# GPU tier: against megatron's compiled squared_relu
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SQUARED_RELU_DTYPES, ids=str)
def test_kernel_equals_megatrons_compiled_squared_relu_on_cuda(gen, dtype):
    """On CUDA: the kernel against megatron's ``squared_relu`` as the GPU runs it (``torch.compile``: Inductor's
    Triton kernels) and against eager CUDA autograd, bit for bit, forward and backward, at a 1.2b-like width. fp16:
    Inductor keeps ``2 * r`` in fp32 where eager rounds it to fp16 (docstring of ``squared_relu_reference.py``), so
    there the compiled comparison leaves out x >= 32768, where the two differ."""
    from megatron.core.activations import squared_relu

    x = draw((4099, 771), dtype, gen, "nan").cuda()
    x.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), -0.0], dtype=dtype)
    dy = draw((4099, 771), dtype, gen, "-inf").cuda()
    xc = x.clone().requires_grad_(True)
    yc = squared_relu(xc)
    (dxc,) = torch.autograd.grad(yc, xc, dy)
    ye, dxe = _autograd(x, dy)
    y, dx = sr.squared_relu_forward(x), sr.squared_relu_backward(x, dy)
    assert_same_bits(y, ye)
    assert_same_bits(dx, dxe)
    assert_same_bits(y, yc.detach())
    keep = x < 32768 if dtype == torch.float16 else torch.ones_like(x, dtype=torch.bool)
    assert_same_bits(dx[keep], dxc[keep])
