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

The values are megatron's ``squared_relu`` and torch autograd's gradient of it, bit for bit
(``squared_relu_reference.py``, ``docs/numerics.md``, "Fused step"); backward reads the saved x (fc1's output, the
one tensor the unfused path saves too: relu's output).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from nvfp4_train.kernels.fused.squared_relu import squared_relu_backward, squared_relu_forward
from nvfp4_train.precision.telemetry import LayerTelemetry

__all__ = ["CheckedSquaredReLU", "checked_squared_relu_fits", "install_checked_squared_relu"]

_OUTPUT, _INPUT_GRAD = 0, 1  # LayerTelemetry's check slots (directions)


class _CheckedSquaredReLUFunction(torch.autograd.Function):
    """y = relu(x)^2 checking x for fc1; dx checking dy for fc2 (one kernel launch each where Triton runs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fc1: LayerTelemetry, fc2: LayerTelemetry) -> torch.Tensor:
        y = fc1.check_by(_OUTPUT, x, lambda check: squared_relu_forward(x, check))
        ctx.save_for_backward(x)
        ctx.fc2 = fc2
        # as fc2's probe: the gradient is checked when the check was on at forward (the probe was inserted) and
        # still is at backward (check_by looks again)
        ctx.check_dy = fc2.check_nonfinite
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.check_dy:
            dx = ctx.fc2.check_by(_INPUT_GRAD, dy, lambda check: squared_relu_backward(x, dy, check))
        else:
            dx = squared_relu_backward(x, dy)
        return dx, None, None


class CheckedSquaredReLU:
    """megatron's ``squared_relu`` for one MLP (its ``activation_func``), running fc1's output check forward and
    fc2's input-gradient check backward in its own kernels (the module docstring)."""

    def __init__(self, fc1_telemetry: LayerTelemetry, fc2_telemetry: LayerTelemetry) -> None:
        if not isinstance(fc1_telemetry, LayerTelemetry) or not isinstance(fc2_telemetry, LayerTelemetry):
            raise TypeError(f"CheckedSquaredReLU takes the LayerTelemetry of fc1 and fc2, got "
                            f"{type(fc1_telemetry).__name__} and {type(fc2_telemetry).__name__}")
        self.fc1_telemetry = fc1_telemetry
        self.fc2_telemetry = fc2_telemetry

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _CheckedSquaredReLUFunction.apply(x, self.fc1_telemetry, self.fc2_telemetry)

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
    mlp.activation_func = CheckedSquaredReLU(fc1, fc2)
    fc1.output_check_by_consumer = True
    fc2.input_grad_check_by_producer = True
