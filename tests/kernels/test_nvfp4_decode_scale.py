"""The NVFP4 tensor decode scale ``amax / 2688`` and the GEMM factor ``alpha`` are correctly rounded fp32
divisions on every device.

Found on the H200 (2026-11-29): PyTorch's CUDA division by a CPU scalar multiplies by the rounded reciprocal,
which differs from the correctly rounded quotient in the last bit for about a fifth of all inputs, so half of
the random draws of ``test_nvfp4_gemm.py::test_exact_partial_sums`` failed on the GPU (every output 1 ulp
off, every GEMM variant alike) while the CPU reference and the interpreter agreed. The comparison value here
is the float64 quotient rounded to fp32, which IS the correctly rounded fp32 quotient (a double-precision
quotient rounded once more to single precision is never double-rounded wrongly: 53 >= 2 * 24 + 2).
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.kernels.nvfp4.reference import decode_scale, nvfp4_alpha


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the GPU case runs in `make test-gpu`


@pytest.mark.parametrize("device", DEVICES)
def test_decode_scale_is_correctly_rounded(gen, device):
    x = torch.rand(200_000, generator=gen) * 1000 + torch.finfo(torch.float32).tiny
    want = (x.double() / 2688).float()
    got = decode_scale(x.to(device)).cpu()
    assert torch.equal(got, want), int((got != want).sum())
    # what a reciprocal multiplication gives: the check above would see it
    assert not torch.equal(x * (1 / torch.tensor(2688.0)), want)


@pytest.mark.parametrize("device", DEVICES)
def test_alpha_is_product_of_correctly_rounded_quotients(gen, device):
    a, b = (torch.rand(2000, generator=gen) * 100 for _ in range(2))
    want = (a.double() / 2688).float() * (b.double() / 2688).float()
    got = torch.stack([nvfp4_alpha(x.to(device), y.to(device)) for x, y in zip(a, b)]).cpu()
    assert torch.equal(got, want)
