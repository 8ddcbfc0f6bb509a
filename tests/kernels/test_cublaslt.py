"""The cuBLASLt GEMM with alpha read from device memory (kernels/cublaslt.py), the NVFP4 "cublas" engine's GEMM on
CUDA: ``D = round(fl32(alpha * A @ B^T))``.

Exactness is checked on dyadic inputs whose every partial sum is exact in fp32 (so every summation order, split-K
included, gives the same accumulator) against float64 sums, with alphas that make ``fl32(alpha * acc)`` round.
The engine's tests over NVFP4 operands (large K, split-K, NaN scales) are in test_nvfp4_gemm_cublas.py. ``gpu``
tests need CUDA; the unmarked ones (argument errors) launch nothing.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.cublaslt import matmul_device_alpha, supported_dtypes
from tests.cuda_graphs import capture


def dyadic(gen: torch.Generator, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Multiples of 1/8 in [-4, 4]: products are multiples of 2^-6 below 16, so with K <= 2^14 every partial sum
    is a multiple of 2^-6 below 2^18, exact in fp32 (24 bits)."""
    return (torch.randint(-32, 33, (rows, k), generator=gen) / 8).to(dtype)


def expected(a: torch.Tensor, b: torch.Tensor, alpha: float, out_dtype: torch.dtype) -> torch.Tensor:
    acc = (a.double() @ b.double().t()).float()  # exact (see dyadic)
    return (acc * torch.tensor(alpha, dtype=torch.float32)).to(out_dtype)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.cpu()
    bits = torch.int32 if want.dtype == torch.float32 else torch.int16
    return got.dtype == want.dtype and torch.equal((got + 0.0).view(bits), (want + 0.0).view(bits))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16), (torch.float16, torch.float32)])
def test_exact_with_device_alpha(gen, dtype, out_dtype):
    """Odd shapes, a K that splits, alphas that round; the output buffer prefilled with NaN is not read (beta = 0)."""
    for M, N, K in ((37, 29, 80), (300, 520, 432), (64, 64, 12288), (1, 1, 16)):
        a, b = dyadic(gen, M, K, dtype), dyadic(gen, N, K, dtype)
        for alpha in (1.0, 0.37, 3.0e-5, float(torch.rand((), generator=gen)) * 0.1):  # no fp16 overflow
            al = torch.tensor([alpha], dtype=torch.float32, device="cuda")
            out = torch.full((M, N), float("nan"), dtype=out_dtype, device="cuda")
            got = matmul_device_alpha(a.cuda(), b.cuda(), al, out_dtype, out=out)
            assert got.data_ptr() == out.data_ptr()
            assert same_bits(got, expected(a, b, alpha, out_dtype)), (M, N, K, alpha)
        assert same_bits(matmul_device_alpha(a.cuda(), b.cuda(), None, out_dtype), expected(a, b, 1.0, out_dtype))


@pytest.mark.gpu
def test_strided_and_unaligned_operands(gen):
    """Row strides larger than K and operands that start at 16- or 32-byte offsets (views into one buffer) give the
    same bits."""
    K = 64
    big_a = dyadic(gen, 50, K + 24, torch.bfloat16).cuda()
    big_b = dyadic(gen, 41, K, torch.bfloat16).cuda()
    alpha = torch.tensor([0.7], device="cuda")
    for a, b in ((big_a[:, :K], big_b), (big_a[1:, 8:8 + K], big_b[1:]), (big_a[3:, :K], big_b[5:])):
        got = matmul_device_alpha(a, b, alpha, torch.bfloat16)
        assert same_bits(got, expected(a.cpu(), b.cpu(), 0.7, torch.bfloat16))


@pytest.mark.gpu
def test_no_host_sync_and_graph_replay_reads_alpha(gen):
    """No host synchronization; captured in a CUDA graph, each replay reads the alpha the device holds then."""
    a, b = dyadic(gen, 128, 256, torch.bfloat16).cuda(), dyadic(gen, 96, 256, torch.bfloat16).cuda()
    alpha = torch.tensor([0.5], device="cuda")
    matmul_device_alpha(a, b, alpha, torch.bfloat16)  # plans and workspace outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        matmul_device_alpha(a, b, alpha, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.empty(128, 96, dtype=torch.bfloat16, device="cuda")
    g = capture(lambda: matmul_device_alpha(a, b, alpha, torch.bfloat16, out=out))
    for value in (0.25, 1.7, 3.0e-3):
        alpha.fill_(value)
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(out, expected(a.cpu(), b.cpu(), value, torch.bfloat16)), value


@pytest.mark.gpu
def test_empty_dimensions():
    a = torch.zeros(0, 32, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(5, 32, dtype=torch.bfloat16, device="cuda")
    assert matmul_device_alpha(a, b, None, torch.bfloat16).shape == (0, 5)
    a0, b0 = torch.zeros(3, 0, dtype=torch.bfloat16, device="cuda"), torch.zeros(4, 0, dtype=torch.bfloat16, device="cuda")
    nan = torch.tensor([float("nan")], device="cuda")
    assert torch.equal(matmul_device_alpha(a0, b0, None, torch.float32).cpu(), torch.zeros(3, 4))
    assert matmul_device_alpha(a0, b0, nan, torch.float32).isnan().all()


def test_argument_errors():
    a = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one CUDA device"):
        matmul_device_alpha(a, a, None, torch.bfloat16)
    assert supported_dtypes(torch.bfloat16, torch.float32) and not supported_dtypes(torch.float16, torch.bfloat16)
    assert not supported_dtypes(torch.float32, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("a_t,b_t", [(False, True), (True, False), (True, True)])
def test_transposed_views_read_in_place(gen, a_t, b_t):
    """An operand given as a transposed view (M- or N-contiguous, as ``dy.t()`` and ``x.t()`` reach the Wgrad GEMM)
    is read in place through cuBLAS's transpose flag: the same bits as the row-major operands."""
    for M, N, K in ((37, 29, 80), (256, 192, 1024), (8, 520, 64)):
        a, b = dyadic(gen, M, K, torch.bfloat16), dyadic(gen, N, K, torch.bfloat16)
        ga = a.t().contiguous().cuda().t() if a_t else a.cuda()
        gb = b.t().contiguous().cuda().t() if b_t else b.cuda()
        assert ga.is_contiguous() != a_t and gb.is_contiguous() != b_t
        alpha = torch.tensor([0.37], device="cuda")
        for out_dtype in (torch.bfloat16, torch.float32):
            assert same_bits(matmul_device_alpha(ga, gb, alpha, out_dtype), expected(a, b, 0.37, out_dtype)), (M, N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_adds_into_out(gen, out_dtype):
    """``accumulate=True``: D = alpha * acc + C in the epilogue. With alpha a power of two (an exact product) and
    dyadic C (every sum exact in fp32, see dyadic), D is exact whether cuBLASLt rounds once (FMA) or twice; in
    bf16 the one rounding of that exact fp32 value. Transposed views as the Wgrad GEMM passes them."""
    for M, N, K in ((37, 29, 80), (300, 520, 4096)):
        a, b = dyadic(gen, M, K, torch.bfloat16), dyadic(gen, N, K, torch.bfloat16)
        c = dyadic(gen, M, N, torch.float32)
        for alpha in (1.0, 0.5, 2.0 ** -10):
            out = c.to(out_dtype).cuda()
            al = torch.tensor([alpha], device="cuda")
            got = matmul_device_alpha(a.t().contiguous().cuda().t(), b.cuda(), al, out_dtype, out=out, accumulate=True)
            assert got.data_ptr() == out.data_ptr()
            acc = (a.double() @ b.double().t()) * alpha + c.to(out_dtype).double()
            assert same_bits(got, acc.float().to(out_dtype)), (M, N, K, alpha)


@pytest.mark.gpu
def test_accumulate_needs_out():
    a = torch.zeros(2, 4, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="accumulate=True adds into out"):
        matmul_device_alpha(a, a, None, torch.float32, accumulate=True)
