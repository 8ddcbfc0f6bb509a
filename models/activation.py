"""The MLP's squared ReLU as one kernel per direction that also runs two of the per-layer non-finite checks
(``fusion.activation``).

megatron's ``MLP`` computes ``fc2(activation_func(fc1(h)))``. The non-finite check of the quantized layers
(``nvfp4_train.precision.telemetry``) reads fc1's output right after fc1 (``check_output``) and fc2's input
gradient right when it reaches fc2's input (``probe_input_grad``): exactly the tensors the activation reads, x
forward and dy backward, and nothing is checked between those points and the activation. :class:`CheckedSquaredReLU`
is the activation of one MLP: its forward is ``kernels/fused/squared_relu.py``'s kernel with fc1's output check
(``LayerTelemetry.check_by``, slot 0) in the same launch, its backward the gradient kernel with fc2's input-gradient
check (slot 1); :func:`install_checked_squared_relu` puts it into an MLP and hands the two layers' checks to it
(``output_check_by_consumer``, ``input_grad_check_by_producer``), so each tensor is checked once, at the same point
of the clock order, with the same kept times and answers (``nonfinite_events``, ``first_nonfinite_layer``), on
either clock (the device clock advances by one per check, as before; nothing is allocated per call: CUDA graphs
capture it). Where Triton does not run (a CPU without ``TRITON_INTERPRET=1``) the same is computed by the reference:
torch's squared ReLU and the non-finite check's torch reference.

Where the neighbouring layers quantize with a tensor amax (``precision.operand.pair_amax_rht``: NVFP4 1x16 with
or without the Hadamard-mixed columnwise copy, FP8 per-tensor scaling), the same kernels also compute the raw amax
of what they write, fc2's input forward and fc1's output gradient backward, and record it on that tensor
(``operand.attach_amax``); the layer's quantizer then skips its own amax pass over it (``nvfp4_amax`` bit for bit:
the same scales and codes).

The values are megatron's ``squared_relu`` and torch autograd's gradient of it, bit for bit
(``squared_relu_reference.py``, ``docs/numerics.md``, "Fused step"); backward reads the saved x (fc1's output, the
one tensor the unfused path saves too: relu's output).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from nvfp4_train.kernels.fused.squared_relu import (
    squared_relu_backward,
    squared_relu_backward_amax,
    squared_relu_forward,
    squared_relu_forward_amax,
)
from nvfp4_train.precision.operand import attach_amax, pair_amax_rht
from nvfp4_train.precision.telemetry import LayerTelemetry

__all__ = ["CheckedSquaredReLU", "checked_squared_relu_fits", "install_checked_squared_relu"]

_OUTPUT, _INPUT_GRAD = 0, 1  # LayerTelemetry's check slots (directions)


def _forward(x: torch.Tensor, check, rht: bool | None):
    if rht is None:
        return squared_relu_forward(x, check), None
    return squared_relu_forward_amax(x, check, col_rht=rht)


def _backward(x: torch.Tensor, dy: torch.Tensor, check, rht: bool | None):
    if rht is None:
        return squared_relu_backward(x, dy, check), None
    return squared_relu_backward_amax(x, dy, check, col_rht=rht)


class _CheckedSquaredReLUFunction(torch.autograd.Function):
    """y = relu(x)^2 checking x for fc1; dx checking dy for fc2 (one kernel launch each where Triton runs). With
    ``y_rht`` / ``dx_rht`` not None, the launch also returns y's (dx's) raw amax for fc2's (fc1's) quantizer;
    forward returns (y, amax or an empty tensor), backward records dx's on dx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fc1: LayerTelemetry, fc2: LayerTelemetry, y_rht: bool | None,
                dx_rht: bool | None):
        y, amax = fc1.check_by(_OUTPUT, x, lambda check: _forward(x, check, y_rht))
        ctx.save_for_backward(x)
        ctx.fc2 = fc2
        ctx.dx_rht = dx_rht
        # as fc2's probe: the gradient is checked when the check was on at forward (the probe was inserted) and
        # still is at backward (check_by looks again)
        ctx.check_dy = fc2.check_nonfinite
        if amax is None:
            amax = x.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(amax)
        return y, amax

    @staticmethod
    def backward(ctx, dy: torch.Tensor, _damax):
        (x,) = ctx.saved_tensors
        if ctx.check_dy:
            dx, amax = ctx.fc2.check_by(_INPUT_GRAD, dy, lambda check: _backward(x, dy, check, ctx.dx_rht))
        else:
            dx, amax = _backward(x, dy, None, ctx.dx_rht)
        if amax is not None:
            attach_amax(dx, amax, ctx.dx_rht)
        return dx, None, None, None, None


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def _consumer_amax_rht(lctx, rows: int, tensor: str) -> bool | None:
    """``pair_amax_rht`` of the casts ``lctx``'s layer makes of its input x (``tensor="x"``) or of its output
    gradient dy (``"dy"``) under its current recipe; None without a quantizing layer."""
    recipe = getattr(lctx, "recipe", None)
    if recipe is None or recipe.is_bf16:
        return None
    if tensor == "x":
        return pair_amax_rht(rows, recipe.fprop.a, recipe.wgrad.b)
    return pair_amax_rht(rows, recipe.dgrad.a, recipe.wgrad.a)


class CheckedSquaredReLU:
    """megatron's ``squared_relu`` for one MLP (its ``activation_func``), running fc1's output check forward and
    fc2's input-gradient check backward in its own kernels (the module docstring)."""

    def __init__(self, fc1_telemetry: LayerTelemetry, fc2_telemetry: LayerTelemetry, fc1_context=None,
                 fc2_context=None) -> None:
        if not isinstance(fc1_telemetry, LayerTelemetry) or not isinstance(fc2_telemetry, LayerTelemetry):
            raise TypeError(f"CheckedSquaredReLU takes the LayerTelemetry of fc1 and fc2, got "
                            f"{type(fc1_telemetry).__name__} and {type(fc2_telemetry).__name__}")
        self.fc1_telemetry = fc1_telemetry
        self.fc2_telemetry = fc2_telemetry
        # the layers' LinearContexts (their current recipes say which amax their quantizers read), or None
        self.fc1_context = fc1_context
        self.fc2_context = fc2_context

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        y_rht = _consumer_amax_rht(self.fc2_context, rows, "x")
        dx_rht = _consumer_amax_rht(self.fc1_context, rows, "dy")
        if x.dtype not in (torch.bfloat16, torch.float32):  # the amax kernels take bf16 and fp32
            y_rht = dx_rht = None
        y, amax = _CheckedSquaredReLUFunction.apply(x, self.fc1_telemetry, self.fc2_telemetry, y_rht, dx_rht)
        if y_rht is not None:
            attach_amax(y, amax, y_rht)
        return y

    def __repr__(self) -> str:
        return "CheckedSquaredReLU()"


def checked_squared_relu_fits(config: TransformerConfig) -> bool:
    """Whether megatron's MLP of ``config`` (its activation being squared ReLU) calls ``activation_func`` on fc1's
    output itself: no bias added in between, no gated linear unit, none of megatron's fused activation paths."""
    return not (config.add_bias_linear or config.gated_linear_unit or config.bias_activation_fusion
                or config.use_te_activation_func)


def install_checked_squared_relu(mlp: torch.nn.Module) -> None:
    """Make ``mlp`` (megatron's ``MLP`` with squared ReLU, of a config :func:`checked_squared_relu_fits`) run
    :class:`CheckedSquaredReLU` of its own fc1 and fc2, and hand those two checks to it."""
    if not checked_squared_relu_fits(mlp.config):
        raise ValueError("the checked squared ReLU replaces megatron's plain activation call: it needs "
                         "add_bias_linear, gated_linear_unit, bias_activation_fusion and use_te_activation_func off")
    fc1, fc2 = mlp.linear_fc1.quant_telemetry, mlp.linear_fc2.quant_telemetry
    mlp.activation_func = CheckedSquaredReLU(fc1, fc2, getattr(mlp.linear_fc1, "lctx", None),
                                             getattr(mlp.linear_fc2, "lctx", None))
    fc1.output_check_by_consumer = True
    fc2.input_grad_check_by_producer = True
