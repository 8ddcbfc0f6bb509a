"""The blocks' RMSNorm: torch's rms_norm (fused on CUDA) against the fp32 composite it replaced."""

import pytest
import torch

from nvfp4_train.models.layers import rms_norm, rms_norm_composite


def _saved_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """The output of ``fn(*args)`` and the bytes autograd saved for its backward (each storage once)."""
    seen: set = set()
    total = 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*args)
    return y, total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 768), (33, 1280)])
def test_rms_norm_bitwise_equals_composite_on_cpu(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x[0, ..., :3] = 0  # a partly zero row
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    outs = []
    for fn in (rms_norm, rms_norm_composite):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-5)
        gx, gw = torch.autograd.grad(y, (xi, wi), dy)
        outs.append((y, gx, gw))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b)


def test_mixed_dtype_weight_takes_the_composite_path():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.rand(64) + 0.5  # fp32 weight, bf16 activations
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_composite(x, w, 1e-5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_on_gpu_saves_less_and_matches():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 768, generator=g) * 3).to(torch.bfloat16).cuda().requires_grad_()
    w = (torch.rand(768, generator=g) + 0.5).to(torch.bfloat16).cuda().requires_grad_()
    y, fused = _saved_bytes(rms_norm, x, w, 1e-5)
    y_ref, composite = _saved_bytes(rms_norm_composite, x, w, 1e-5)
    x_bytes = x.numel() * x.element_size()
    # fused: x, the weight and one fp32 rstd per row; the composite keeps two fp32 copies of x
    assert fused <= x_bytes + w.numel() * 2 + x.shape[0] * 4 + 1024, (fused, composite)
    assert composite >= 4 * x_bytes
    # same fp32 arithmetic up to the order of the row sum: at most one bf16 rounding step apart
    diff = (y.float() - y_ref.float()).abs()
    assert (diff <= y_ref.float().abs() * 2**-7 + 1e-30).all()
