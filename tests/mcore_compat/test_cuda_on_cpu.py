"""Guard of the one CPU-compatibility module (``nvfp4_train.mcore_compat.cuda_on_cpu``).

It scans the installed megatron-core modules our CPU runs go through for every ``torch.cuda.<name>`` they
use and checks that each is handled (replaced by :data:`CUDA_FUNCTIONS`), harmless on a CPU-only torch
(types, availability queries, lazy seeding), or listed as not reached by our code paths. A megatron-core
upgrade that starts using something new fails here, naming it, instead of failing mid-run on a CPU.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

from nvfp4_train.mcore_compat.cuda_on_cpu import CUDA_FUNCTIONS

# modules of megatron-core on the CPU paths of our tests and `make train`
MODULES = [
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.parallel_state",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.module",
    "megatron.core.models.mamba.mamba_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
]

# harmless on a CPU-only torch: type objects and queries that answer "no CUDA", lazily queued seeding
HARMLESS = {
    "FloatTensor", "HalfTensor", "BFloat16Tensor", "is_available", "device_count", "amp", "manual_seed",
    "manual_seed_all", "OutOfMemoryError", "nvtx", "_lazy_call", "_lazy_init", "device", "random",
    "is_current_stream_capturing", "Event", "Stream", "default_generators",
}
# present in these modules but behind CUDA-only branches (CUDA graphs, streams, memory stats, NCCL)
NOT_REACHED = {
    "CUDAGraph", "graph", "graph_pool_handle", "set_stream", "stream", "default_stream",
    "memory_stats", "max_memory_allocated", "memory_allocated", "reset_peak_memory_stats", "get_device_capability",
    "get_device_properties", "MemPool", "use_mem_pool", "set_device", "ipc_collect", "utilization",
    "temperature", "power_draw", "clock_rate", "memory_reserved", "max_memory_reserved", "get_device_name",
    "get_rng_state_all", "set_rng_state_all", "ExternalStream",
}


def _source(mod: str) -> str:
    spec = importlib.util.find_spec(mod)
    assert spec is not None and spec.origin, f"megatron-core module {mod} not found (upgrade? update MODULES)"
    return Path(spec.origin).read_text()


def test_every_torch_cuda_use_is_known():
    unknown = {}
    for mod in MODULES:
        for name in set(re.findall(r"torch\.cuda\.([A-Za-z_0-9]+)", _source(mod))):
            if name not in CUDA_FUNCTIONS and name not in HARMLESS and name not in NOT_REACHED:
                unknown.setdefault(name, []).append(mod)
    assert not unknown, (
        f"megatron-core uses torch.cuda names the CPU compatibility layer does not know: {unknown}. "
        "Decide for each: handle it in nvfp4_train/mcore_compat/cuda_on_cpu.py, or list it here with the reason."
    )


def test_compat_redirects_cuda_devices_and_types():
    from nvfp4_train.mcore_compat import cuda_on_cpu as cpu_compat

    if not cpu_compat.needs_cpu_compat():
        return  # a CUDA machine runs megatron as written
    assert cpu_compat.enable_cpu_compat()
    t = torch.empty(3, device="cuda")
    assert t.device.type == "cpu"
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert t.cuda() is t
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    torch.cuda.current_stream().wait_event(None)  # megatron-core >= 0.19's DDP grad sync
    # the CPU generator stands in for the CUDA one
    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
