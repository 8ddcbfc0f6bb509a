"""Per-layer quantization telemetry and non-finite tracking for the quantized linear layers.

Telemetry (switched on by the trainer every N steps with :func:`set_telemetry`): for each quantized operand
of the three GEMMs of a layer (RECIPE §3) it records

    operand        tensor quantized                                   (reduction along its last dim)
    fprop.x        x   [M,K]
    fprop.W        W   [N,K]
    dgrad.dy       dy  [M,N]
    wgrad.x_col    xᵀ  [K,M]   (Hadamard-mixed along M when the recipe says so)
    wgrad.dy_col   dyᵀ [N,M]   (likewise)

three numbers: ``zero`` the share of zero codes (±0), ``saturated`` the share of values at the format's
largest magnitude (E2M1 ±6 for nvfp4/mxfp4, E4M3 ±448 for fp8), and ``sqnr_db`` = 10·log10(Σx² / Σ(x−x̂)²),
x̂ the dequantized operand and x the high-precision tensor the quantizer received (for an RHT operand, the
Hadamard-mixed tensor, rounded to the input dtype as the quantizer does; +inf when x̂ = x). When telemetry
is off the layer's ``LinearContext.telemetry`` is ``None`` and nothing is computed. The numbers stay device
tensors until :func:`collect_telemetry` reads them (one host sync, at the trainer's reporting step). With
several micro-batches per step the last call's numbers are kept.

Non-finite tracking (on by default, :func:`set_nonfinite_check`): every layer checks its forward output and
the gradient of its input and keeps, on the device, the time (a global call counter) of its first non-finite
value: ``kept = min(kept, now if t holds a NaN/±Inf else never)``, a float64 0-d tensor, no host sync. On a CUDA
tensor (and on CPU under ``TRITON_INTERPRET=1``) a check is ONE launch of the kernel
``nvfp4_train.kernels.fused.nonfinite``: it reads t once and the last of its programs updates the kept time in
place (each layer keeps a small int32 counter for it). Elsewhere (CPU) it is the kernel's reference
(``nonfinite_reference.py``): 4 torch launches, max|t| then three on the 0-d result (before: 10, the
``isfinite``/``where`` formulation). An empty tensor counts as finite and launches nothing.
Under CUDA graphs (``nvfp4_train.cuda_graph``) the time cannot be a host int (a captured graph would replay the
same value): :func:`set_device_clock` gives the layers of a model one shared 0-d float64 device counter, which
every check advances by one in place (the kernel: its last program; the reference: ``clock += 1``, then
``minimum(kept, where(finite, never, clock))``, 5 launches), and each layer keeps its first times in two
persistent 0-d tensors updated in place; reset fills them with "never". The times are then the model's own
count instead of the global one: the same order, so the same answers. No host sync happens until
:func:`first_nonfinite_layer` is asked: it names the layer that went non-finite first, in forward or
backward. :func:`reset_nonfinite` clears it.

A layer can hand a check to the op next to it that reads the same tensor anyway: with
``output_check_by_consumer`` its output is checked by the op that consumes it, with
``input_grad_check_by_producer`` its input gradient by the op that produces it (the MLP's squared ReLU reads fc1's
output forward and fc2's input gradient backward: ``nvfp4_train.models.activation``). That op runs the check in a
kernel launch of its own through :meth:`LayerTelemetry.check_by`, at the point of the clock order where the layer's
own check would have run (nothing else is checked in between), so every time and answer is the same.

The layers (``nvfp4_train.precision.megatron_linear``) carry a :class:`LayerTelemetry` as
``quant_telemetry``; the functions here walk any module tree for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeVar

import torch

from nvfp4_train.kernels.fused.nonfinite import (
    NEVER,
    kernel_takes,
    track_nonfinite_clocked_ref,
    track_nonfinite_clocked_triton,
    track_nonfinite_ref,
    track_nonfinite_triton,
)
from nvfp4_train.kernels.fused.nonfinite_reference import NonfiniteCheck
from nvfp4_train.precision.operand import Operand
from nvfp4_train.precision.recipe import OperandCast

__all__ = [
    "OPERAND_NAMES",
    "STAT_NAMES",
    "LayerTelemetry",
    "operand_stats",
    "set_telemetry",
    "collect_telemetry",
    "set_nonfinite_check",
    "set_device_clock",
    "first_nonfinite_layer",
    "nonfinite_events",
    "reset_nonfinite",
    "probe_input_grad",
    "probe_grad",
]

OPERAND_NAMES = ("fprop.x", "fprop.W", "dgrad.dy", "wgrad.x_col", "wgrad.dy_col")
STAT_NAMES = ("zero", "saturated", "sqnr_db")

_NEVER = NEVER  # the "no non-finite value seen" time
_NEVER_F = float(_NEVER)
_clock = itertools.count()  # one global order of forward and backward calls, across layers
_R = TypeVar("_R")


def _codes_fp4(codes_packed: torch.Tensor) -> torch.Tensor:
    from nvfp4_train.kernels.fp4_reference import unpack_nibbles

    return unpack_nibbles(codes_packed) & 7  # magnitude code: 0 is ±0, 7 is ±6


def _dequantize(op: Operand) -> torch.Tensor:
    if op.format == "nvfp4":
        from nvfp4_train.kernels.nvfp4 import dequantize_nvfp4

        return dequantize_nvfp4(op.data)
    if op.format == "mxfp4":
        from nvfp4_train.kernels.mxfp4 import dequantize_mxfp4

        return dequantize_mxfp4(op.data)
    if op.format == "fp8_e4m3":
        from nvfp4_train.kernels.fp8 import dequantize_fp8

        return dequantize_fp8(op.data)
    raise ValueError(f"no telemetry for operand format {op.format!r}")


def _high_precision_input(source: torch.Tensor, cast: OperandCast) -> torch.Tensor:
    """What the quantizer received, as float64: the source, Hadamard-mixed (and rounded to the source dtype,
    as operand.cast_one / the kernels do) when the cast has RHT."""
    if cast.hadamard:
        from nvfp4_train.kernels.nvfp4.reference import hadamard16_ref

        return hadamard16_ref(source).to(torch.float64)
    return source.to(torch.float64)


def operand_stats(source: torch.Tensor, cast: OperandCast, op: Operand) -> torch.Tensor:
    """float64 [3] on the source's device: (zero share, saturated share, SQNR in dB) of ``op``, the cast of
    the 2-D tensor ``source`` (reduction along its last dim) under ``cast``."""
    if op.format in ("nvfp4", "mxfp4"):
        mag = _codes_fp4(op.data.codes)
        zero, sat = mag == 0, mag == 7
    elif op.format == "fp8_e4m3":
        mag = op.data.data.view(torch.uint8) & 0x7F
        zero, sat = mag == 0, mag == 0x7E  # 0x7E = 448, the E4M3 max (0x7F is NaN)
    else:
        raise ValueError(f"no telemetry for operand format {op.format!r}")
    n = mag.numel()
    x = _high_precision_input(source, cast)
    deq = _dequantize(op).to(torch.float64)
    signal = (x * x).sum()
    noise = ((x - deq) ** 2).sum()
    # noise 0 -> +inf (exact), including an all-zero tensor; NaN operands give NaN
    sqnr = torch.where(noise == 0, torch.full_like(noise, float("inf")), 10 * torch.log10(signal / noise))
    return torch.stack((zero.sum().to(torch.float64) / n, sat.sum().to(torch.float64) / n, sqnr))


class LayerTelemetry:
    """One layer's telemetry recorder and non-finite tracker (see the module docstring)."""

    def __init__(self) -> None:
        self.stats: dict[str, torch.Tensor] = {}
        self.check_nonfinite = True
        self.forward_bad: torch.Tensor | None = None  # float64 0-d: clock time of the first non-finite output
        self.backward_bad: torch.Tensor | None = None  # ... of the first non-finite input gradient
        self.clock: torch.Tensor | None = None  # the device clock (set_device_clock); None: the host clock
        # the check kernel's counters of finished programs (forward, backward), int32 [1] each, zero between checks
        self._arrivals: tuple[torch.Tensor, torch.Tensor] | None = None
        # the output's check is made by the op that consumes the output, the input gradient's by the op that
        # produces it (through check_by): check_output and probe_input_grad then do nothing
        self.output_check_by_consumer: bool = False
        self.input_grad_check_by_producer: bool = False

    def set_device_clock(self, clock: torch.Tensor | None) -> None:
        """Time the non-finite checks by ``clock`` (a 0-d float64 device tensor shared by a model's layers,
        advanced in place by every check), keeping the first times in persistent tensors; None: the host
        clock again. Either way the times kept so far are dropped (they are of the other clock)."""
        self.clock = clock
        self.forward_bad = self.backward_bad = None
        if clock is not None:
            self.forward_bad = torch.full((), _NEVER_F, dtype=torch.float64, device=clock.device)
            self.backward_bad = torch.full((), _NEVER_F, dtype=torch.float64, device=clock.device)
            self._counters(clock.device)  # now, not inside a graph capture

    def _counters(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self._arrivals
        if a is None or a[0].device != device:
            buf = torch.zeros(2, dtype=torch.int32, device=device)
            a = self._arrivals = (buf[0:1], buf[1:2])
        return a

    # -- telemetry: called by QuantLinearFunction through LinearContext.telemetry
    def record(self, name: str, source: torch.Tensor, cast: OperandCast, op: Operand | None) -> None:
        if op is None or not cast.quantized:
            return
        self.stats[name] = operand_stats(source.detach(), cast, op)

    def clear_stats(self) -> None:
        self.stats.clear()

    # -- non-finite tracking
    def _check(self, kept: torch.Tensor | None, t: torch.Tensor, direction: int) -> torch.Tensor | None:
        """``kept`` after checking ``t`` (updated in place, or a new tensor for None with the host clock): the
        kernel where it takes t, else the reference; ``now`` (host clock) is taken by every call. ``direction``:
        0 forward (the output), 1 backward (the input gradient), each with its own kernel counter."""
        clock = self.clock
        if clock is None:
            now = next(_clock)
            if t.numel() == 0:  # nothing to check: finite
                return kept
            if kernel_takes(t):
                return track_nonfinite_triton(kept, t, now, self._counters(t.device)[direction])
            return track_nonfinite_ref(kept, t, now)
        if t.numel() and kernel_takes(t):
            track_nonfinite_clocked_triton(kept, t, clock, self._counters(t.device)[direction])
        else:
            track_nonfinite_clocked_ref(kept, t, clock)
        return kept

    def check_output(self, y: torch.Tensor) -> None:
        if self.check_nonfinite and not self.output_check_by_consumer:
            self.forward_bad = self._check(self.forward_bad, y, 0)

    def check_input_grad(self, g: torch.Tensor) -> None:
        if self.check_nonfinite:
            self.backward_bad = self._check(self.backward_bad, g, 1)

    def check_by(self, direction: int, t: torch.Tensor, launch: Callable[[NonfiniteCheck | None], _R]) -> _R:
        """``launch(check)``: a kernel launch that reads ``t``, this layer's output (``direction`` 0) or input
        gradient (1), for its own purpose and checks it on this layer's behalf, with ``check`` this layer's check
        of that slot (None while the check is off). The same check as :meth:`check_output` /
        :meth:`check_input_grad` at this point: the host clock's time is taken here, the device clock is advanced
        by the launch; the kept time is stored in the slot afterwards. Returns what ``launch`` returns."""
        assert direction in (0, 1)
        if not self.check_nonfinite:
            return launch(None)
        kept = self.forward_bad if direction == 0 else self.backward_bad
        check = NonfiniteCheck(kept, self._counters(t.device)[direction], clock=self.clock)
        if self.clock is None:
            check.now = next(_clock)
        out = launch(check)
        if direction == 0:
            self.forward_bad = check.kept
        else:
            self.backward_bad = check.kept
        return out

    def reset_nonfinite(self) -> None:
        if self.clock is not None:  # the persistent tensors a captured graph writes
            self.forward_bad.fill_(_NEVER_F)
            self.backward_bad.fill_(_NEVER_F)
        else:
            self.forward_bad = self.backward_bad = None


class _InputGradProbe(torch.autograd.Function):
    """Identity in forward; in backward, reports the incoming gradient (the layer's input gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tel: LayerTelemetry) -> torch.Tensor:
        ctx.tel = tel
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.tel.check_input_grad(g)
        return g, None


def probe_grad(x: torch.Tensor, tel: LayerTelemetry) -> torch.Tensor:
    """``x`` itself, with the gradient flowing back through it checked as ``tel``'s layer input gradient whatever
    ``tel.input_grad_check_by_producer`` says: for the producer that took the check over and runs it here (on a
    path without its fused kernel)."""
    if not tel.check_nonfinite or not x.requires_grad:
        return x
    return _InputGradProbe.apply(x, tel)


def probe_input_grad(x: torch.Tensor, tel: LayerTelemetry) -> torch.Tensor:
    """``x`` itself, with the gradient flowing back through it checked for non-finite values (unless the op that
    produces that gradient checks it: ``tel.input_grad_check_by_producer``)."""
    if not tel.check_nonfinite or tel.input_grad_check_by_producer or not x.requires_grad:
        return x
    return _InputGradProbe.apply(x, tel)


def _layers(model: torch.nn.Module):
    """(name, layer) for every quantized layer in ``model``: its ``layer_name``, else its module path."""
    for path, m in model.named_modules():
        tel = getattr(m, "quant_telemetry", None)
        if isinstance(tel, LayerTelemetry):
            yield (getattr(m, "layer_name", "") or path), m


def set_telemetry(model: torch.nn.Module, enabled: bool) -> None:
    """Switch operand telemetry on or off for every quantized layer in ``model``."""
    for _, m in _layers(model):
        m.set_telemetry(enabled)


def collect_telemetry(model: torch.nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """``{layer_name: {operand: {"zero", "saturated", "sqnr_db"}}}`` for the layers that recorded anything
    since their telemetry was switched on (one host sync)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, m in _layers(model):
        stats = m.quant_telemetry.stats
        if stats:
            out[name] = {
                op: dict(zip(STAT_NAMES, (float(v) for v in t.tolist()))) for op, t in stats.items()
            }
    return out


def set_nonfinite_check(model: torch.nn.Module, enabled: bool) -> None:
    """Switch the per-layer non-finite check on (the default) or off."""
    for _, m in _layers(model):
        m.quant_telemetry.check_nonfinite = enabled


def set_device_clock(model: torch.nn.Module, clock: torch.Tensor | None) -> None:
    """Time every quantized layer's non-finite checks by the device counter ``clock`` (a 0-d float64 tensor
    the layers share; see the module docstring), or by the host clock again (None)."""
    for _, m in _layers(model):
        m.quant_telemetry.set_device_clock(clock)


def nonfinite_events(model: torch.nn.Module) -> list[tuple[int, str, str]]:
    """Every layer that saw a non-finite value since the last reset, as (time, layer_name, "forward" |
    "backward"), earliest first (one host sync)."""
    events = []
    for name, m in _layers(model):
        tel = m.quant_telemetry
        for where, t in (("forward", tel.forward_bad), ("backward", tel.backward_bad)):
            if t is not None:
                when = int(t)
                if when != _NEVER:
                    events.append((when, name, where))
    return sorted(events)


def first_nonfinite_layer(model: torch.nn.Module) -> str | None:
    """The name of the layer whose output (forward) or input gradient (backward) went non-finite first since
    the last :func:`reset_nonfinite`, or None."""
    events = nonfinite_events(model)
    return events[0][1] if events else None


def reset_nonfinite(model: torch.nn.Module) -> None:
    for _, m in _layers(model):
        m.quant_telemetry.reset_nonfinite()
