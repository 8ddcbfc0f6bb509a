"""``fusion.activation``: the MLPs' squared ReLU runs fc1's output check and fc2's input-gradient check in its own
kernels (``nvfp4_train.models.activation``). One model with it off and one with it on (the same weights and batch):
the same per-token loss and every parameter's gradient bit for bit, and the same non-finite answers (every event
with its time: ``nonfinite_events``; ``first_nonfinite_layer``) when a NaN, +Inf or -Inf appears in an MLP's fc1
output or fc2 input gradient, on the host clock and the device clock, with the check switched off and on again. On
CPU the activation runs its reference; under the interpreter (and natively on a GPU) the Triton kernels.

The non-finite value is put where the unfused check sees it too: into fc1's GEMM output before the layer's own
check, and into the gradient leaving fc2's GEMM before fc2's probe (megatron's ``_forward_impl`` of the layer is
wrapped for the one layer; a forward hook would act after the layer's check)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch

from nvfp4_train.kernels.fused.nonfinite_reference import track_nonfinite_check_ref
from nvfp4_train.models.activation import CheckedSquaredReLU
from nvfp4_train.models.config import model_config
from nvfp4_train.models.fusion import FusionConfig
from nvfp4_train.precision import telemetry as tel_mod
from nvfp4_train.precision.layer_map import LayerPrecisionMap
from nvfp4_train.precision.telemetry import (
    LayerTelemetry,
    first_nonfinite_layer,
    nonfinite_events,
    reset_nonfinite,
    set_device_clock,
    set_nonfinite_check,
)
from tests.cuda_graphs import capture
from tests.kernels.test_squared_relu import assert_same_bits
from tests.precision.mcore_util import megatron_single_rank

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")
SEQ, BATCH = 32, 2
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _build(mc, activation: bool, device: str = "cpu", precision: str = "bf16"):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    # every other fusion off: the two models differ in this switch only
    fusion = dataclasses.replace(FusionConfig.all_off(), activation=activation)
    pmap = LayerPrecisionMap(mc.pattern, precision, keep_first=0, keep_last=0)
    model = build_model(mc, pmap, config=transformer_config(mc), seq_length=SEQ, fusion=fusion)
    return model.to(device)


def _mlps(model) -> list:
    return [layer.mlp for layer in model.decoder.layers if hasattr(layer, "mlp") and hasattr(layer.mlp, "linear_fc1")]


class _SetGrad(torch.autograd.Function):
    """Identity forward; backward writes ``value`` into the gradient at flat ``index``."""

    @staticmethod
    def forward(ctx, x, index: int, value: float):
        ctx.index, ctx.value = index, value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[ctx.index] = ctx.value
        return g, None, None


@contextlib.contextmanager
def _inject(layer, where: str, value: float, index: int):
    """``value`` at flat ``index`` of ``layer``'s GEMM output (fc1) or of the gradient its GEMM gives its input
    (fc2), inside the layer (before its own check and probe): megatron's ``_forward_impl``, for this layer only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cls = ColumnParallelLinear if where == "fc1_output" else RowParallelLinear
    inner = cls._forward_impl

    def wrapped(self, input, weight, *args, **kwargs):
        if self is not layer:
            return inner(self, input, weight, *args, **kwargs)
        if where == "fc1_output":
            y = inner(self, input, weight, *args, **kwargs).clone()
            with torch.no_grad():
                y.view(-1)[index] = value
            return y
        return inner(self, _SetGrad.apply(input, index, value), weight, *args, **kwargs)

    cls._forward_impl = wrapped
    try:
        yield
    finally:
        cls._forward_impl = inner


def _step(model, ids, pos):
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids)
    loss.float().sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_step(a, b) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert_same_bits(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert_same_bits(grads_a[name], grads_b[name])


def nonfinite_runner(device: str, ids: torch.Tensor, pos: torch.Tensor, monkeypatch):
    """``run(model, clock, inject=None)``: one step of ``model`` on ``clock`` ("host" or "device") from time 1,
    inside ``inject``; returns (the step's loss and gradients, its non-finite events, the first non-finite layer,
    the device clock's count or None). Each model keeps its own device clock across runs."""
    clocks = {}

    def run(model, clock: str, inject=None):
        reset_nonfinite(model)
        monkeypatch.setattr(tel_mod, "_clock", itertools.count(1))
        if clock == "device":
            c = clocks.setdefault(id(model), torch.zeros((), dtype=torch.float64, device=device))
            set_device_clock(model, c)
            c.zero_()
        else:
            set_device_clock(model, None)
        with inject or contextlib.nullcontext():
            out = _step(model, ids, pos)
        count = int(clocks[id(model)]) if clock == "device" else None
        return out, nonfinite_events(model), first_nonfinite_layer(model), count

    return run


def _fused_equals_unfused(device: str, gen: torch.Generator, cases: list[tuple[str, str, str]],
                          monkeypatch) -> None:
    """Build both models; a clean step (bitwise, nothing non-finite); then each (where, value, clock) case: the
    same step bits and the same events, times included; finally the check off (nothing seen, no time taken) and
    on again."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mc = model_config("tiny").replace(pattern="-*-", num_layers=3, vocab_size=1024)
    unfused, fused = _build(mc, False, device), _build(mc, True, device)
    mlps_u, mlps_f = _mlps(unfused), _mlps(fused)
    assert len(mlps_f) == 2
    assert all(isinstance(m.activation_func, CheckedSquaredReLU) for m in mlps_f)
    assert all(m.linear_fc1.quant_telemetry.output_check_by_consumer for m in mlps_f)
    assert all(m.linear_fc2.quant_telemetry.input_grad_check_by_producer for m in mlps_f)
    assert not any(isinstance(m.activation_func, CheckedSquaredReLU) for m in mlps_u)
    ids = torch.randint(0, mc.vocab_size, (BATCH, SEQ), generator=gen).to(device)
    pos = torch.arange(SEQ, device=device)[None].expand(BATCH, SEQ)
    run = nonfinite_runner(device, ids, pos, monkeypatch)

    with sdpa_kernel(SDPBackend.MATH):
        base_u, base_f = run(unfused, "host"), run(fused, "host")
        assert run(unfused, "host")[0][0].equal(base_u[0][0])  # the unfused step repeats its own bits here
        _same_step(base_u[0], base_f[0])
        assert base_u[1] == base_f[1] == []
        for where, value, clock in cases:
            block = int(torch.randint(2, (), generator=gen))
            n = SEQ * BATCH * (mc.ffn_hidden_size or 4 * mc.hidden_size)
            index = int(torch.randint(n, (), generator=gen))
            got = []
            for model, mlps in ((unfused, mlps_u), (fused, mlps_f)):
                layer = mlps[block].linear_fc1 if where == "fc1_output" else mlps[block].linear_fc2
                got.append(run(model, clock, _inject(layer, where, BAD[value], index)))
            (step_u, events_u, first_u, count_u), (step_f, events_f, first_f, count_f) = got
            case = (where, value, clock, block, index)
            assert events_f == events_u and first_f == first_u and count_f == count_u, case
            _same_step(step_u, step_f)
            name = (mlps_f[block].linear_fc1 if where == "fc1_output" else mlps_f[block].linear_fc2).layer_name
            assert (name, "forward" if where == "fc1_output" else "backward") in [(n_, w) for _, n_, w in events_f]
            if where == "fc1_output" and value == "-inf":  # relu makes it 0: the check alone sees it
                assert [(n_, w) for _, n_, w in events_f] == [(name, "forward")], case
        # switched off (logging.nonfinite_check=after_skip between bad steps), then on again
        for model in (unfused, fused):
            set_nonfinite_check(model, False)
        layer_u, layer_f = mlps_u[0].linear_fc1, mlps_f[0].linear_fc1
        off = [run(unfused, "device", _inject(layer_u, "fc1_output", BAD["nan"], 5)),
               run(fused, "device", _inject(layer_f, "fc1_output", BAD["nan"], 5))]
        assert off[0][1] == off[1][1] == [] and off[0][3] == off[1][3] == 0
        for model in (unfused, fused):
            set_nonfinite_check(model, True)
        on = [run(unfused, "device", _inject(layer_u, "fc1_output", BAD["nan"], 5)),
              run(fused, "device", _inject(layer_f, "fc1_output", BAD["nan"], 5))]
        assert on[0][1] == on[1][1] != [] and on[0][3] == on[1][3] > 0


_ALL_CASES = [(w, v, c) for w in ("fc1_output", "fc2_input_grad") for v in BAD for c in ("host", "device")]


def test_fused_activation_equals_unfused_on_cpu(single_rank, gen, monkeypatch):
    """CPU without the interpreter: the activation's reference (torch's squared ReLU, the check's reference)."""
    _fused_equals_unfused("cpu", gen, _ALL_CASES, monkeypatch)


@pytest.mark.triton
def test_fused_activation_kernel_equals_unfused(single_rank, triton_device, gen, monkeypatch):
    """The Triton kernels inside megatron's MLP (the interpreter on CPU, natively on a GPU): every injection case,
    and the checks moved into the activation's launches (two fewer non-finite launches per MLP and step)."""
    from nvfp4_train.kernels.fused import nonfinite as nf
    from nvfp4_train.kernels.fused import squared_relu as sr

    launches = {"check": 0, "activation": 0}

    def counting(name, kernel):
        class Counting:
            def __getitem__(self, grid):
                launches[name] += 1
                return kernel[grid]
        return Counting()

    monkeypatch.setattr(nf, "_track_nonfinite_kernel", counting("check", nf._track_nonfinite_kernel))
    monkeypatch.setattr(sr, "_squared_relu_kernel", counting("activation", sr._squared_relu_kernel))
    mc = model_config("tiny").replace(pattern="-*-", num_layers=3, vocab_size=1024)
    per_step = {}
    for activation in (False, True):
        model = _build(mc, activation, triton_device)
        ids = torch.randint(0, mc.vocab_size, (BATCH, SEQ), generator=gen).to(triton_device)
        launches.update(check=0, activation=0)
        _step(model, ids, torch.arange(SEQ, device=triton_device)[None].expand(BATCH, SEQ))
        per_step[activation] = dict(launches)
    # 6 linear layers, 2 checks each; fused: fc1's output and fc2's input gradient of both MLPs move
    assert per_step[False] == {"check": 12, "activation": 0}
    assert per_step[True] == {"check": 8, "activation": 4}
    _fused_equals_unfused(triton_device, gen, _ALL_CASES, monkeypatch)


@pytest.mark.parametrize("variant", [{"activation": "swiglu"}, {"add_bias_linear": True}, {"activation": "gelu"}])
def test_other_mlps_keep_megatrons_activation(single_rank, variant):
    """A gated, biased or non-squared-ReLU MLP keeps megatron's activation and its layers their own checks."""
    mc = model_config("tiny").replace(pattern="-*-", num_layers=3, vocab_size=1024, **variant)
    model = _build(mc, True)
    for mlp in _mlps(model):
        assert not isinstance(mlp.activation_func, CheckedSquaredReLU)
        assert not mlp.linear_fc1.quant_telemetry.output_check_by_consumer
        assert not mlp.linear_fc2.quant_telemetry.input_grad_check_by_producer


def test_handed_over_checks_take_no_time_of_their_own():
    """``output_check_by_consumer`` / ``input_grad_check_by_producer``: the layer's own check and probe do nothing
    (no clock time taken, no probe inserted); ``check_by`` takes the one time the layer's check would have."""
    from nvfp4_train.precision.telemetry import probe_input_grad

    clock = itertools.count(1)
    tel = LayerTelemetry()
    tel.output_check_by_consumer = tel.input_grad_check_by_producer = True
    x = torch.tensor([1.0, float("-inf")]).requires_grad_(True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tel_mod, "_clock", clock)
        tel.check_output(x)
        assert probe_input_grad(x, tel) is x
        assert tel.forward_bad is None and next(clock) == 1
        seen = []
        assert tel.check_by(0, x, lambda check: (seen.append(check), track_nonfinite_check_ref(check, x), "out")[2]) \
            == "out"
        assert float(tel.forward_bad) == 2.0 and seen[0].now == 2  # x has a -Inf: kept at its time
        tel.check_nonfinite = False
        assert tel.check_by(1, x, lambda check: check) is None and next(clock) == 3


@pytest.mark.gpu
def test_device_clock_checks_of_the_activation_replay_from_a_cuda_graph():
    """The checked activation's forward and backward captured in one CUDA graph on the device clock: every replay
    advances the clock by the two checks and keeps the times of that replay's values (no allocation per call)."""

    class _Layer(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.layer_name = name
            self.quant_telemetry = LayerTelemetry()

    fc1, fc2 = _Layer("fc1"), _Layer("fc2")
    model = torch.nn.ModuleList([fc1, fc2])
    clock = torch.zeros((), dtype=torch.float64, device="cuda")
    set_device_clock(model, clock)
    act = CheckedSquaredReLU(fc1.quant_telemetry, fc2.quant_telemetry)
    x = torch.randn(4099, 33, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(4099, 33, device="cuda").bfloat16()

    def step():
        (g,) = torch.autograd.grad(act(x), x, dy)
        return g

    graph = capture(step)
    reset_nonfinite(model)
    clock.zero_()
    graph.replay()
    assert float(clock) == 2 and first_nonfinite_layer(model) is None
    with torch.no_grad():
        x[4098, 32] = float("-inf")  # relu makes it 0; the check finds it
    dy[0, 0] = float("nan")
    graph.replay()
    assert nonfinite_events(model) == [(3, "fc1", "forward"), (4, "fc2", "backward")]


def _amax_handover(device: str, gen: torch.Generator, monkeypatch, precision: str, pattern: str = "-*-") -> None:
    """Both models' step; each nvfp4 / fp8 per-tensor pair cast records its tensor's shape and whether it was given
    an amax. The same step bits; the fused model's fc2 x and fc1 dy of both MLPs given theirs, nothing else."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nvfp4_train.precision import operand

    mc = model_config("tiny").replace(pattern=pattern, num_layers=len(pattern), vocab_size=1024)
    unfused, fused = _build(mc, False, device, precision), _build(mc, True, device, precision)
    given = []
    if precision == "nvfp4":
        inner = operand.quantize_nvfp4_rowcol

        def spy(t, *args, **kwargs):
            given.append((tuple(t.shape), kwargs.get("row_amax") is not None))
            return inner(t, *args, **kwargs)

        monkeypatch.setattr(operand, "quantize_nvfp4_rowcol", spy)
    else:
        from nvfp4_train.kernels import fp8 as fp8_mod

        inner = fp8_mod.quantize_fp8_rowcol

        def spy(t, *args, **kwargs):
            given.append((tuple(t.shape), kwargs.get("amax") is not None))
            return inner(t, *args, **kwargs)

        monkeypatch.setattr(fp8_mod, "quantize_fp8_rowcol", spy)
    ids = torch.randint(0, mc.vocab_size, (BATCH, SEQ), generator=gen).to(device)
    pos = torch.arange(SEQ, device=device)[None].expand(BATCH, SEQ)
    ffn = mc.ffn_hidden_size or 4 * mc.hidden_size
    with sdpa_kernel(SDPBackend.MATH):
        step_u = _step(unfused, ids, pos)
        calls_u, given[:] = list(given), []
        step_f = _step(fused, ids, pos)
        calls_f = list(given)
    _same_step(step_u, step_f)
    assert [shape for shape, _ in calls_u] == [shape for shape, _ in calls_f] and calls_f
    assert not any(g for _, g in calls_u)
    assert [shape for shape, g in calls_f if g] == [(SEQ * BATCH, ffn)] * 4  # fc2's x, fc1's dy, two MLPs


@pytest.mark.parametrize("precision", ["nvfp4", "fp8_tensorwise"])
def test_activation_hands_its_amax_to_the_quantizers(single_rank, gen, monkeypatch, precision):
    """With quantized MLP layers the activation also gives fc2 its input's amax (forward) and fc1 its output
    gradient's (backward): those casts read it instead of measuring the tensor, and the step is the unfused one bit
    for bit (the same scales). CPU: the activation's reference and the quantizers' references."""
    _amax_handover("cpu", gen, monkeypatch, precision)


@pytest.mark.triton
@pytest.mark.parametrize("precision", ["nvfp4", "fp8_tensorwise"])
def test_activation_kernel_hands_its_amax_to_the_quantizers(single_rank, triton_device, gen, monkeypatch,
                                                            precision):
    """The same through the Triton kernels (the activation's amax kernels and the quantizers'; two MLP blocks: the
    interpreter's quantize kernels are slow)."""
    _amax_handover(triton_device, gen, monkeypatch, precision, pattern="--")
