"""``fusion.rms_norm``: a block's RMSNorm runs the input-gradient check of the one linear layer that reads its
output (attention's ``linear_qkv``, the MLP's ``linear_fc1``, the Mamba mixer's ``in_proj``) in its backward kernel
(``models/layers.py: hand_input_grad_check_to_norm``), instead of that layer's probe reading the gradient again.

One model with the switch off and one with it on (the same weights and batch): the same non-finite events, times
included, when a NaN, +Inf or -Inf enters the gradient leaving one of those layers' GEMMs, on the host clock and
the device clock; on a CPU (where the norm takes torch's autograd and checks by a probe on its output) the same
loss and gradients bit for bit; under the interpreter the kernel's check (the gradients then differ within the
norm's bound, ``tests/models/test_norm.py``)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from nvfp4_train.models.fusion import FusionConfig
from tests.models.test_activation_fusion import _SetGrad, _same_step, nonfinite_runner

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")
SEQ, BATCH = 32, 2
PATTERN = "M*-"
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.fixture
def single_rank():
    from tests.precision.mcore_util import megatron_single_rank

    with megatron_single_rank():
        yield


def _build(rms_norm: bool, device: str = "cpu"):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config("tiny").replace(pattern=PATTERN, num_layers=len(PATTERN), vocab_size=1024)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    fusion = FusionConfig(**{**{f.name: False for f in dataclasses.fields(FusionConfig)}, "rms_norm": rms_norm})
    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=transformer_config(mc), seq_length=SEQ,
                        fusion=fusion)
    return mc, model.to(device)


def _pairs(model) -> list:
    """(norm, consumer) of every block, in block order."""
    out = []
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            out.append((layer.norm, layer.mixer.in_proj))
        elif hasattr(layer.mlp, "linear_fc1"):
            out.append((layer.pre_mlp_layernorm, layer.mlp.linear_fc1))
        else:
            out.append((layer.input_layernorm, layer.self_attention.linear_qkv))
    return out


def test_build_hands_each_blocks_consumer_check_to_its_norm(single_rank):
    for on in (False, True):
        _, model = _build(on)
        pairs = _pairs(model)
        assert len(pairs) == 3
        for norm, consumer in pairs:
            assert (norm.consumer is consumer.quant_telemetry) == on
            assert consumer.quant_telemetry.input_grad_check_by_producer == on
        assert model.decoder.final_norm.consumer is None  # the output layer has no check


@contextlib.contextmanager
def _inject(layer, value: float, index: int):
    """``value`` at flat ``index`` of the gradient ``layer``'s GEMM gives its input (inside the layer, before its
    probe): megatron's ``ColumnParallelLinear._forward_impl``, for this layer only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    inner = ColumnParallelLinear._forward_impl

    def wrapped(self, input, weight, *args, **kwargs):
        if self is layer:
            input = _SetGrad.apply(input, index, value)
        return inner(self, input, weight, *args, **kwargs)

    ColumnParallelLinear._forward_impl = wrapped
    try:
        yield
    finally:
        ColumnParallelLinear._forward_impl = inner


def _same_events(device: str, gen: torch.Generator, monkeypatch, bitwise: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (mc, off), (_, on) = _build(False, device), _build(True, device)
    ids = torch.randint(0, mc.vocab_size, (BATCH, SEQ), generator=gen).to(device)
    pos = torch.arange(SEQ, device=device)[None].expand(BATCH, SEQ)
    runner = nonfinite_runner(device, ids, pos, monkeypatch)

    def run(model, clock: str, inject=None):
        out, events, _, count = runner(model, clock, inject)
        return out, events, count

    with sdpa_kernel(SDPBackend.MATH):
        base_off, base_on = run(off, "host"), run(on, "host")
        assert base_off[1] == base_on[1] == []
        if bitwise:
            _same_step(base_off[0], base_on[0])
        for block, (value, clock) in enumerate(zip(("nan", "inf", "-inf"), ("host", "device", "host"))):
            for extra in ((), (("device",) if clock == "host" else ("host",))):
                clk = extra[0] if extra else clock
                index = int(torch.randint(SEQ * BATCH * mc.hidden_size, (), generator=gen))
                got = []
                for model in (off, on):
                    consumer = _pairs(model)[block][1]
                    got.append(run(model, clk, _inject(consumer, BAD[value], index)))
                (step_off, events_off, count_off), (step_on, events_on, count_on) = got
                case = (block, value, clk, index)
                assert events_on == events_off != [], case
                assert count_on == count_off, case
                name = _pairs(on)[block][1].layer_name
                assert (name, "backward") in [(n, w) for _, n, w in events_on], case
                if bitwise:
                    _same_step(step_off, step_on)


def test_norm_check_equals_the_consumers_probe_on_cpu(single_rank, gen, monkeypatch):
    """CPU without the interpreter: the norm takes torch's autograd and checks by a probe on its output."""
    _same_events("cpu", gen, monkeypatch, bitwise=True)


@pytest.mark.triton
def test_norm_check_in_the_backward_kernel_equals_the_consumers_probe(single_rank, triton_device, gen,
                                                                       monkeypatch):
    """Under the interpreter (natively on a GPU): the check runs in the norm's backward kernel."""
    from nvfp4_train.kernels.fused import rms_norm as kernel

    checked, launch = [], kernel.rms_norm_backward_triton

    def counting(*args, **kwargs):
        checked.append(kwargs.get("check") is not None)
        return launch(*args, **kwargs)

    monkeypatch.setattr(kernel, "rms_norm_backward_triton", counting)
    _same_events(triton_device, gen, monkeypatch, bitwise=False)
    assert any(checked) and not all(checked)  # the blocks' norms check, the final norm does not
