"""Our Mamba-2 mixer and block for megatron-core (megatron's own needs Transformer Engine and a compiled
mamba-ssm, and creates its parameters on CUDA).

Layout and tensor-parallel sharding follow megatron-core's ``MambaMixer`` so that checkpoints use the same
keys and reshard the same way: ``in_proj`` is column-parallel and each TP rank's shard holds its own
``[z, x, B, C, dt]`` (heads and B/C groups are split over TP ranks, never within), ``conv1d`` holds the
rank's ``[x, B, C]`` channels, ``A_log``/``D``/``dt_bias`` one value per local head, ``norm.weight`` the
rank's ``d_inner`` channels (the gated norm is grouped by B/C group, so TP does not change it), and
``out_proj`` is row-parallel. Under sequence parallelism the column layer gathers the sequence and the row
layer reduce-scatters it, as in megatron.

Computation on ``[s, b, h]`` (megatron's sequence-first layout)::

    z, xBC, dt = split(in_proj(h))                # quantized GEMM (the layer's recipe)
    x, B, C    = split(silu(causal_conv1d(xBC)))  # high precision
    y          = ssd_scan(x, dt, A=-exp(A_log), B, C, D, dt_bias, softplus)   # high precision (fp32 inside)
    y          = gated_rmsnorm(y, z)              # rmsnorm(y * silu(z)) * w, per B/C group
    out        = out_proj(y)                      # quantized GEMM

The three middle lines are one op, ``ops.mamba_conv_scan_norm``: on CUDA with ``fused=True`` (the default) and
mamba-ssm plus causal-conv1d's CUDA extension installed, ONE autograd op (mamba-ssm's fused training op laid out
sequence-first, ``ops._ConvScanNormFn``); otherwise the three ops in sequence (mamba-ssm's Triton kernels and
causal-conv1d's on CUDA, pure-PyTorch float32 versions on CPU: the CPU path, unchanged by ``fused``). in_proj and
out_proj stay our own layers either way. Both paths compute the same: mamba-ssm's norm with
``norm_before_gate=False`` is ours (rmsnorm of y * silu(z), per group of d_inner / ngroups channels, the gate
inside), and both receive this rank's shards from the one call in :meth:`MambaMixer.forward`.

What the fused path removes, per Mamba layer and micro-batch (predicted; ``small`` at micro-batch 8 x seq
2048: T = 16384 tokens, in_proj width w = 3088 = z 1024 + xBC 2048 + dt 16, d = 1024, bf16; bytes read +
written, at ~4 TB/s):

=================================  ====================================  ======================  ========
path                               glue kernels (copies, cats)           bytes                   time
=================================  ====================================  ======================  ========
unfused, before this change        fwd: z copy, y transpose;             4T(3d + cd + w)         134 us
                                   bwd: dy copy, cat(dx, dB, dC),        = 537 MB
                                   cat(dz, dxBC, ddt)
unfused now (norm after the        fwd: y transpose; bwd: the two cats   4T(d + cd + w)          101 us
transpose, z read in place)                                              = 403 MB
fused (``_ConvScanNormFn``)        fwd: y transpose; bwd: none (the      4Td = 67 MB             17 us
                                   kernels write into dzxbcdt in place)
mamba-ssm's batch-first op, as     fwd: zxbcdt and y transposes; bwd:    4T(2w + 2d) + 4T cd     168 us
megatron calls it                  dy and dzxbcdt transposes, conv       = 672 MB
                                   recomputed
=================================  ====================================  ======================  ========

Over a ``small`` step (12 Mamba layers x 4 micro-batches) the fused path moves ~23 GB less than the unfused
path did (6.4 ms -> 0.8 ms at 4 TB/s) and launches 4 x 48 = 192 fewer kernels (of ~10,100); the conv, scan
and norm kernels themselves are the same in every row. Transposing at the narrow ends instead (in_proj fed
[b, s, h], 4T x 512 each way) would reorder the tokens inside in_proj's and out_proj's weight-gradient GEMMs,
whose quantized operands are blocked along the tokens, and is impossible under sequence parallelism.

Incremental decoding (:mod:`nvfp4_train.models.decode`) gives the mixer a :class:`MambaDecodeCache` for the length of
one generation (``decode_cache``; None, the default, in training and every full-sequence forward). The core then runs
with the layer's recurrent state: the first chunk (the prompt) through ``ops.mamba_conv_scan_norm_chunk``, which
also returns the conv inputs of the last ``width - 1`` positions and the SSM state; each later single position
through ``ops.mamba_conv_scan_norm_step`` (causal-conv1d's ``causal_conv1d_update`` and mamba-ssm's
``selective_state_update`` on CUDA, their PyTorch steps otherwise), which updates both in place.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from nvfp4_train.models.layers import param_device
from nvfp4_train.models.mamba.ops import (
    init_A_log,
    init_D,
    init_dt_bias,
    mamba_conv_scan_norm,
    mamba_conv_scan_norm_chunk,
    mamba_conv_scan_norm_step,
)

__all__ = ["MambaMixer", "MambaMixerSubmodules", "MambaLayer", "MambaLayerSubmodules", "MambaDecodeCache"]


class MambaDecodeCache:
    """The recurrent state of one Mamba mixer for the positions decoded so far: ``conv`` [b, conv channels,
    width - 1] (the conv inputs of the last width - 1 positions, in in_proj's output dtype) and ``ssm``
    [b, heads, headdim, state] (float32; float64 in a float64 model); both None before the first position."""

    def __init__(self) -> None:
        self.length = 0
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None


@dataclass
class MambaMixerSubmodules:
    in_proj: ModuleSpec | type
    out_proj: ModuleSpec | type


@dataclass
class MambaLayerSubmodules:
    norm: ModuleSpec | type
    mixer: ModuleSpec | type


class _GatedNorm(torch.nn.Module):
    """Holds the gated RMSNorm's weight under the key megatron uses (``mixer.norm.weight``)."""

    def __init__(self, size: int, *, device, dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, device=device, dtype=dtype))


class MambaMixer(MegatronModule):
    """Mamba-2 mixer: ``[s, b, h] -> ([s, b, h], bias=None)``.

    ``fused``: run conv + scan + gated norm as one autograd op on CUDA when mamba-ssm and causal-conv1d's CUDA
    extension are installed (module docstring); False: the three ops in sequence. No effect on CPU.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaMixerSubmodules,
        *,
        d_model: int,
        num_heads: int,
        head_dim: int,
        num_groups: int,
        state_dim: int,
        conv_kernel: int = 4,
        conv_bias: bool = True,
        chunk_size: int = 128,
        norm_epsilon: float = 1e-5,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        fused: bool = True,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("MambaMixer needs pg_collection (process groups are passed explicitly)")
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        for name, value in (("mamba_num_heads", num_heads), ("mamba_num_groups", num_groups)):
            if value % tp:
                raise ValueError(f"{name}={value} must be divisible by the tensor-parallel size {tp} "
                                 f"(TP shards whole heads and whole B/C groups)")
        if num_heads % num_groups:
            raise ValueError(f"mamba_num_groups={num_groups} must divide mamba_num_heads={num_heads}")
        self.layer_number = layer_number
        self.fused = fused
        self.head_dim, self.state_dim, self.chunk_size, self.eps = head_dim, state_dim, chunk_size, norm_epsilon
        self.d_inner = num_heads * head_dim
        self.nheads_local = num_heads // tp
        self.ngroups_local = num_groups // tp
        self.d_inner_local = self.nheads_local * head_dim
        in_width = 2 * self.d_inner + 2 * num_groups * state_dim + num_heads  # z x B C dt (all ranks)
        self.in_proj = build_module(
            submodules.in_proj, d_model, in_width, config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        conv_dim = self.d_inner_local + 2 * self.ngroups_local * state_dim  # x B C (this rank)
        dev = param_device(config)
        # TP-sharded parameters draw from megatron's model-parallel RNG stream on GPU (distinct per TP rank);
        # CPU initialisation draws from the default CPU stream, as megatron's own layers do there
        fork = contextlib.nullcontext() if config.use_cpu_initialization else get_cuda_rng_tracker().fork()
        with fork:
            self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=conv_bias,
                                          padding=conv_kernel - 1, device=dev, dtype=config.params_dtype)
            if config.perform_initialization:
                torch.nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))  # torch's Conv1d default
            self.dt_bias = torch.nn.Parameter(
                init_dt_bias(self.nheads_local, dt_min, dt_max, dt_init_floor, device=dev, dtype=config.params_dtype)
            )
            self.A_log = torch.nn.Parameter(
                init_A_log(self.nheads_local, A_init_range, device=dev, dtype=config.params_dtype))
        # all parameters in params_dtype, as megatron's bf16 wrapper leaves them: the optimizer keeps fp32
        # master copies, and the scan reads A_log, D and dt_bias in fp32
        self.D = torch.nn.Parameter(init_D(self.nheads_local, device=dev, dtype=config.params_dtype))
        self.norm = _GatedNorm(self.d_inner_local, device=dev, dtype=config.params_dtype)
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            if p is not None:
                setattr(p, "tensor_model_parallel", True)
        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, d_model, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group,
        )
        self.decode_cache: MambaDecodeCache | None = None  # set only while decoding (nvfp4_train.models.decode)

    def forward(self, hidden_states: torch.Tensor, **_unused) -> tuple[torch.Tensor, None]:
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, w] (the full sequence under SP)
        if self.decode_cache is not None:
            return self.out_proj(self._decode_core(zxbcdt, self.decode_cache))
        y = mamba_conv_scan_norm(
            zxbcdt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias.float(),
            -torch.exp(self.A_log.float()), self.D.float(), self.norm.weight, headdim=self.head_dim,
            ngroups=self.ngroups_local, chunk_size=self.chunk_size, eps=self.eps, fused=self.fused,
        )  # [s, b, d]: this rank's heads and groups
        return self.out_proj(y)

    def _decode_core(self, zxbcdt: torch.Tensor, cache: MambaDecodeCache) -> torch.Tensor:
        """The core with ``cache``'s state (module docstring): one position after others steps, else a chunk."""
        params = (self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias.float(), -torch.exp(self.A_log.float()),
                  self.D.float(), self.norm.weight)
        if cache.length and zxbcdt.shape[0] == 1:
            y = mamba_conv_scan_norm_step(zxbcdt, *params, headdim=self.head_dim, ngroups=self.ngroups_local,
                                          eps=self.eps, conv_state=cache.conv, ssm_state=cache.ssm)
        else:
            y, cache.conv, cache.ssm = mamba_conv_scan_norm_chunk(
                zxbcdt, *params, headdim=self.head_dim, ngroups=self.ngroups_local, chunk_size=self.chunk_size,
                eps=self.eps, conv_state=cache.conv, ssm_state=cache.ssm)
        cache.length += zxbcdt.shape[0]
        return y

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron-core's checkpoint layout for a Mamba mixer: per-head tensors and conv channels sharded
        over TP on dim 0, and in_proj / conv1d split into their z/x/B/C/dt parts so that a checkpoint
        reshards across TP sizes (each rank's shard interleaves its own parts)."""
        from megatron.core.ssm.mamba_mixer import _split_tensor_factory  # megatron's own resharding helper
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sd = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0, "D": 0}, sharded_offsets)
        conv = self.conv1d.state_dict(prefix="", keep_vars=True)
        sd.update(make_sharded_tensors_for_checkpoint(conv, f"{prefix}conv1d.", {"weight": 0, "bias": 0},
                                                      sharded_offsets))
        sd.update(make_sharded_tensors_for_checkpoint(self.norm.state_dict(prefix="", keep_vars=True),
                                                      f"{prefix}norm.", {"weight": 0}, sharded_offsets))
        for name in ("in_proj", "out_proj"):
            sd.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets,
                                                 metadata))
        d, g, n, h = self.d_inner_local, self.ngroups_local, self.state_dim, self.nheads_local
        sd[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            sd[f"{prefix}in_proj.weight"], [d, d, g * n, g * n, h], ["z", "x", "B", "C", "dt"], 0
        )
        for key in ("conv1d.weight", "conv1d.bias"):
            if f"{prefix}{key}" in sd:
                sd[f"{prefix}{key}"] = _split_tensor_factory(sd[f"{prefix}{key}"], [d, g * n, g * n],
                                                             ["x", "B", "C"], 0)
        return sd


class MambaLayer(MegatronModule):
    """One ``M`` block: ``x + mixer(RMSNorm(x))`` on ``[s, b, h]``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaLayerSubmodules,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
        **_unused,
    ) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)
        self.mixer = build_module(submodules.mixer, config=config, d_model=config.hidden_size,
                                  layer_number=layer_number, pg_collection=pg_collection)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_unused) -> torch.Tensor:
        out, bias = self.mixer(self.norm(hidden_states))
        if bias is not None:
            out = out + bias
        return hidden_states + out
