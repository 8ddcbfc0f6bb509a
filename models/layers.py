"""Small building blocks of the hybrid model that megatron-core's local (non-Transformer-Engine) spec lacks.

- :class:`RMSNorm`: megatron's torch-norm wrapper refuses sequence parallelism; this one supports it the way
  megatron expects: under SP each rank normalises its own sequence shard (the norm is per token), and the
  weight carries ``sequence_parallel=True`` so that megatron's gradient finalisation all-reduces its
  gradient over the tensor-parallel group (each rank saw only part of the tokens). With ``fused_backward``
  (``fusion.rms_norm``) its backward is one Triton kernel (:func:`rms_norm_fused_backward`).
- :func:`linear_spec`: the ``ModuleSpec`` of one quantized linear slot, with the recipe the layer precision
  map resolved for (global block, role) baked into its params (quantization is a transform of the config
  tree before the model is built; no module surgery afterwards).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fused.rms_norm import MAX_HIDDEN, rms_norm_backward

__all__ = ["RMSNorm", "RMSNormFunction", "linear_spec", "param_device", "rms_norm_fused_backward"]


def param_device(config: TransformerConfig):
    """Where megatron creates parameters: the CPU under ``use_cpu_initialization``, else the current GPU."""
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def rms_norm_composite(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32, returned in x's dtype, as separate torch ops (autograd
    saves two fp32 copies of x for backward)."""
    v = x.float()
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    return (v * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same arithmetic by ``torch.nn.functional.rms_norm`` when the weight has x's dtype. On CPU it is the
    composite arithmetic of :func:`rms_norm_composite`, bit for bit; on CUDA torch dispatches it to a fused kernel
    each way that accumulates in fp32 and saves only x and the per-row rstd for backward instead of two fp32
    copies of x (tests/models/test_norm.py checks both; the CUDA one is a ``gpu`` test). A weight of another
    dtype (an fp32 weight with bf16 activations) takes the composite path."""
    if weight.dtype == x.dtype:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_composite(x, weight, eps)


_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")
"""torch >= 2.8: ``_fused_rms_norm(input, normalized_shape, weight, eps) -> (output, rstd)``."""


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm as one autograd op: torch's fused forward (``_fused_rms_norm``: the same bits as ``F.rms_norm``),
    which saves x, the weight and the fp32 rstd per row as torch's own node does; backward:
    ``kernels/fused/rms_norm.py``'s ``rms_norm_backward``, dx and the weight gradient in one pass over x and dy (the
    kernel where ``use_triton(x)``, its reference elsewhere). The model calls it through
    :func:`rms_norm_fused_backward`."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        dx, dw = rms_norm_backward(dy.reshape(-1, h), x.reshape(-1, h), rstd.reshape(-1), weight)
        return dx.view(x.shape), dw, None


def rms_norm_fused_backward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` with the backward as one Triton kernel where ``use_triton(x)`` (CUDA; CPU under
    ``TRITON_INTERPRET=1``) and the weight has x's dtype: the forward bit for bit torch's (``_fused_rms_norm``, what
    ``F.rms_norm`` dispatches to), the gradients within the bound of ``docs/numerics.md`` ("Fused step") of
    torch's. Elsewhere :func:`rms_norm` itself (the same autograd as today)."""
    if _FUSED_RMS_NORM and weight.dtype == x.dtype and x.shape[-1] <= MAX_HIDDEN and use_triton(x):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm(x, weight, eps)


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``, computed in float32, returned in x's dtype.

    Signature as megatron builds norms (``build_module(spec, config=, hidden_size=, eps=)``). ``fused_backward``
    (off; the model builder sets it from ``fusion.rms_norm``): the backward as one Triton kernel
    (:func:`rms_norm_fused_backward`)."""

    fused_backward: bool = False

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=param_device(config))
        )
        # megatron all-reduces the grads of params marked so over TP when sequence parallelism is on
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_backward:
            return rms_norm_fused_backward(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        # replicated over TP (no TP axis): every TP rank holds the full weight
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)


def linear_spec(kind: str, recipe, layer_name: str, seed: int, *, block: int | None = None,
                role: str = "") -> ModuleSpec:
    """The spec of one linear slot: our column-/row-parallel quantized layer with its resolved recipe (and the
    global block index and role it was resolved from)."""
    from nvfp4_train.precision.megatron_linear import QuantColumnParallelLinear, QuantRowParallelLinear

    cls = {"column": QuantColumnParallelLinear, "row": QuantRowParallelLinear}[kind]
    return ModuleSpec(module=cls, params={"recipe": recipe, "layer_name": layer_name, "seed": seed, "block": block,
                                        "role": role})
