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
from nvfp4_train.precision.telemetry import LayerTelemetry, probe_grad

__all__ = ["RMSNorm", "RMSNormFunction", "hand_input_grad_check_to_norm", "linear_spec", "param_device",
           "rms_norm_fused_backward"]


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


_INPUT_GRAD = 1  # LayerTelemetry's check slot of a layer's input gradient


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm as one autograd op: torch's fused forward (``_fused_rms_norm``: the same bits as ``F.rms_norm``),
    which saves x, the weight and the fp32 rstd per row as torch's own node does; backward:
    ``kernels/fused/rms_norm.py``'s ``rms_norm_backward``, dx and the weight gradient in one pass over x and dy (the
    kernel where ``use_triton(x)``, its reference elsewhere), with ``consumer``'s input-gradient check of dy in the
    same launch (``consumer``: the LayerTelemetry of the one layer that reads the norm's output, or None). The model
    calls it through :func:`rms_norm_fused_backward`."""

    @staticmethod
    def forward(ctx, x, weight, eps, consumer: LayerTelemetry | None = None):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.consumer = consumer
        # as the consumer's probe: dy is checked when the check was on at forward and still is at backward
        ctx.check_dy = consumer is not None and consumer.check_nonfinite
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        dy2 = dy.reshape(-1, h)

        def launch(check):
            return rms_norm_backward(dy2, x.reshape(-1, h), rstd.reshape(-1), weight, check=check)

        dx, dw = ctx.consumer.check_by(_INPUT_GRAD, dy2, launch) if ctx.check_dy else launch(None)
        return dx.view(x.shape), dw, None, None


def rms_norm_fused_backward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            consumer: LayerTelemetry | None = None) -> torch.Tensor:
    """:func:`rms_norm` with the backward as one Triton kernel where ``use_triton(x)`` (CUDA; CPU under
    ``TRITON_INTERPRET=1``) and the weight has x's dtype: the forward bit for bit torch's (``_fused_rms_norm``, what
    ``F.rms_norm`` dispatches to), the gradients within the bound of ``docs/numerics.md`` ("Fused step") of
    torch's. Elsewhere :func:`rms_norm` itself (the same autograd as today). ``consumer``: the telemetry of the layer
    that reads the output, whose input-gradient check the norm runs (in the backward kernel, else by a probe on the
    output: the same tensor at the same point)."""
    if _FUSED_RMS_NORM and weight.dtype == x.dtype and x.shape[-1] <= MAX_HIDDEN and use_triton(x):
        return RMSNormFunction.apply(x, weight, eps, consumer)
    y = rms_norm(x, weight, eps)
    return y if consumer is None else probe_grad(y, consumer)


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``, computed in float32, returned in x's dtype.

    Signature as megatron builds norms (``build_module(spec, config=, hidden_size=, eps=)``). ``fused_backward``
    (off; the model builder sets it from ``fusion.rms_norm``): the backward as one Triton kernel
    (:func:`rms_norm_fused_backward`), which also runs the non-finite check of ``consumer`` (the telemetry of the
    one layer reading the output; :func:`hand_input_grad_check_to_norm`)."""

    fused_backward: bool = False
    consumer: LayerTelemetry | None = None

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
            return rms_norm_fused_backward(x, self.weight, self.eps, self.consumer)
        y = rms_norm(x, self.weight, self.eps)
        return y if self.consumer is None else probe_grad(y, self.consumer)  # the check it took over

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        # replicated over TP (no TP axis): every TP rank holds the full weight
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)


def hand_input_grad_check_to_norm(norm: torch.nn.Module, consumer: torch.nn.Module) -> bool:
    """Let ``norm`` (an :class:`RMSNorm` with ``fused_backward``) run the input-gradient check of ``consumer``, the
    only layer that reads its output (a quantized linear layer with ``quant_telemetry``): the norm's backward reads
    that gradient anyway. Returns whether it did (False: not such a pair, nothing changed)."""
    tel = getattr(consumer, "quant_telemetry", None)
    if not (isinstance(norm, RMSNorm) and norm.fused_backward and isinstance(tel, LayerTelemetry)):
        return False
    norm.consumer = tel
    tel.input_grad_check_by_producer = True
    return True


def linear_spec(kind: str, recipe, layer_name: str, seed: int, *, block: int | None = None,
                role: str = "") -> ModuleSpec:
    """The spec of one linear slot: our column-/row-parallel quantized layer with its resolved recipe (and the
    global block index and role it was resolved from)."""
    from nvfp4_train.precision.megatron_linear import QuantColumnParallelLinear, QuantRowParallelLinear

    cls = {"column": QuantColumnParallelLinear, "row": QuantRowParallelLinear}[kind]
    return ModuleSpec(module=cls, params={"recipe": recipe, "layer_name": layer_name, "seed": seed, "block": block,
                                        "role": role})
