"""The hybrid model on a CUDA device (mamba-ssm's Triton SSD scan, our Triton quantizers/GEMMs)."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.models.config import model_config
from nvfp4_train.precision.layer_map import LayerPrecisionMap
from tests.precision.mcore_util import megatron_single_rank

pytestmark = pytest.mark.gpu


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _build(mc, recipe, *, cpu_init: bool, dtype=torch.bfloat16, **kw):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = transformer_config(mc, params_dtype=dtype, use_cpu_initialization=cpu_init)
    return build_model(mc, LayerPrecisionMap(mc.pattern, recipe, **kw), config=cfg, seq_length=256)


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4"])
def test_forward_backward_on_gpu(single_rank, size, recipe):
    mc = model_config(size)
    model = _build(mc, recipe, cpu_init=False)
    assert all(p.is_cuda for p in model.parameters())
    # fixed tokens (drawn on the CPU, the same on every machine): the bound below cannot fail by chance
    ids = torch.randint(0, mc.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(256, device="cuda")[None].expand(2, 256)
    loss = model(ids, pos, None, labels=ids).float().mean()
    ln_v = torch.log(torch.tensor(float(mc.vocab_size))).item()
    assert abs(loss.item() - ln_v) < 0.5  # an untrained model predicts ~uniformly
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpu_model_matches_cpu_model(single_rank):
    """Same fp32 weights on both devices (bf16 recipe): the CUDA path (mamba-ssm Triton scan in TF32, cuBLAS,
    SDPA-free megatron attention) gives the CPU path's losses to within TF32 rounding (10 mantissa bits:
    relative 2^-11 ~ 5e-4 per product, averaged over K-long sums; we allow 1e-2 on the per-token loss)."""
    mc = model_config("tiny")
    cpu = _build(mc, "bf16", cpu_init=True, dtype=torch.float32)
    gpu = _build(mc, "bf16", cpu_init=True, dtype=torch.float32).cuda()
    gpu.load_state_dict({k: v.cuda() if torch.is_tensor(v) else v for k, v in cpu.state_dict().items()})
    ids = torch.randint(0, mc.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))  # fixed tokens
    pos = torch.arange(256)[None].expand(2, 256)
    with torch.no_grad():
        a = cpu(ids, pos, None, labels=ids)
        b = gpu(ids.cuda(), pos.cuda(), None, labels=ids.cuda()).cpu()
    rel = ((a - b).abs() / a.abs()).max().item()
    assert rel < 1e-2, rel
