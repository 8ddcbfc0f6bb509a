"""Per-layer quantization telemetry on inputs whose codes and errors are known by hand; non-finite tracking
names the first bad layer; telemetry off does no work."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_train.precision import telemetry as tel_mod
from nvfp4_train.precision.megatron_linear import QuantColumnParallelLinear, QuantRowParallelLinear
from nvfp4_train.precision.recipe import named_recipe
from nvfp4_train.precision.telemetry import (
    OPERAND_NAMES,
    collect_telemetry,
    first_nonfinite_layer,
    nonfinite_events,
    reset_nonfinite,
    set_nonfinite_check,
    set_telemetry,
)
from tests.precision.mcore_util import column, config, megatron_single_rank, row


@pytest.fixture(scope="module", autouse=True)
def mcore():
    with megatron_single_rank():
        yield


# x: every row is these two 16-blocks. amax = 5.25 = 2688·2^-9, so the tensor scale is 2^-9 and every
# dequantized value q·sdec·2^-9 is exact.
#   block 0 (amax 5.25 -> sdec 448, d = 0.875): 5.25, 0.875, -1.75, 2.625 are 6, 1, -2, 3 times d (exact,
#     5.25 saturated), 12 zeros.
#   block 1 (amax 3 -> sdec 256, d = 0.5, v = 2x exactly): 3 -> 6 (saturated); bf16(1.1) = 1.1015625 ->
#     v 2.203 -> 2 (error 0.1015625); bf16(0.3) = 0.30078125 -> v 0.602 -> 0.5 (error 0.05078125);
#     0.5 and -1.5 exact; bf16(0.1) = 0.10009765625 -> v 0.2002 -> 0 (a zero code, error 0.10009765625);
#     10 zeros.
X_ROW = [5.25, 0.875, -1.75, 2.625] + [0.0] * 12 + [3.0, 1.1, 0.3, 0.5, -1.5, 0.1] + [0.0] * 10
X_ZERO = (12 + 11) / 32
X_SAT = 2 / 32
_SIGNAL = sum(v * v for v in (5.25, 0.875, 1.75, 2.625, 3.0, 1.1015625, 0.30078125, 0.5, 1.5, 0.10009765625))
_NOISE = 0.1015625**2 + 0.05078125**2 + 0.10009765625**2
X_SQNR = 10 * math.log10(_SIGNAL / _NOISE)  # all rows alike: the ratio of one row's sums


def _weight() -> torch.Tensor:
    """W [16, 32], two 16x16 tiles. Tile 0: the diagonal 0.328125 = 2688·2^-13 (the amax: tensor scale
    2^-13, sdec 448, the diagonal is 6·448·2^-13), zeros elsewhere. Tile 1: all 0.1640625 (tile amax times c
    = 1344·fp32(1/6) -> sdec 224; 0.1640625 = 6·224·2^-13). Every value is on the grid: 16 + 256 saturated
    codes, 240 zeros, no error (SQNR +inf)."""
    w = torch.zeros(16, 32)
    w[:, :16] = torch.eye(16) * 0.328125
    w[:, 16:] = 0.1640625
    return w.bfloat16()


def _dy() -> torch.Tensor:
    """dy [16, 16] (stochastically rounded): amax 6 makes enc = 1 exactly, so v = dy sits exactly on the
    grid and every draw gives the same codes: 1 saturated (6) and 12 zeros per row. The dequantized values
    q·448·fp32(6/2688) carry one fp32 rounding (relative error <= 2^-24), so SQNR >= 20·log10(2^23) > 138 dB."""
    return torch.tensor([[6.0, 1.0, -2.0, 3.0] + [0.0] * 12] * 16).bfloat16()


def test_nvfp4_telemetry_known_values():
    layer = column(QuantColumnParallelLinear, 32, 16, config(), recipe=named_recipe("nvfp4"), layer_name="L0")
    with torch.no_grad():
        layer.weight.copy_(_weight())
    layer.set_telemetry(True)
    x = torch.tensor([X_ROW] * 16).bfloat16().view(8, 2, 32).requires_grad_()
    y, _ = layer(x)
    y.backward(_dy().view(8, 2, 16))
    t = collect_telemetry(layer)["L0"]
    assert set(t) == set(OPERAND_NAMES)
    assert t["fprop.x"]["zero"] == X_ZERO and t["fprop.x"]["saturated"] == X_SAT
    assert t["fprop.x"]["sqnr_db"] == pytest.approx(X_SQNR, rel=1e-12)  # exact sums; log10 to the last bits
    assert t["fprop.W"] == {"zero": 240 / 512, "saturated": 272 / 512, "sqnr_db": math.inf}
    assert t["dgrad.dy"]["zero"] == 12 / 16 and t["dgrad.dy"]["saturated"] == 1 / 16
    assert t["dgrad.dy"]["sqnr_db"] > 138
    for op in ("wgrad.x_col", "wgrad.dy_col"):  # Hadamard-mixed: no hand values, but sane ones
        s = t[op]
        assert 0 <= s["zero"] <= 1 and 0 < s["saturated"] <= 1 and s["sqnr_db"] > 10


def test_fp8_telemetry_known_values():
    """Per-tensor FP8 with amax 448: the scale is 1 and E4M3-representable values are exact; 448 saturates."""
    layer = column(QuantColumnParallelLinear, 32, 16, config(), recipe=named_recipe("fp8_tensorwise"),
                   layer_name="F")
    layer.set_telemetry(True)
    x = torch.tensor([[448.0, 1.0, -2.0, 0.5, 3.0] + [0.0] * 27] * 16).bfloat16()
    layer(x.view(8, 2, 32))
    assert collect_telemetry(layer)["F"]["fprop.x"] == {"zero": 27 / 32, "saturated": 1 / 32, "sqnr_db": math.inf}


def test_telemetry_off_does_no_work(monkeypatch, gen):
    layer = column(QuantColumnParallelLinear, 32, 16, config(), recipe=named_recipe("nvfp4"), layer_name="L")
    layer.set_telemetry(True)
    layer(torch.randn(8, 2, 32, generator=gen).bfloat16())
    assert collect_telemetry(layer)["L"]
    set_telemetry(layer, False)
    assert layer.lctx.telemetry is None and collect_telemetry(layer) == {}

    def boom(*a, **k):
        raise AssertionError("telemetry computed while off")

    monkeypatch.setattr(tel_mod, "operand_stats", boom)
    x = torch.randn(8, 2, 32, generator=gen).bfloat16().requires_grad_()
    layer(x)[0].sum().backward()


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_first_nonfinite_layer(gen, recipe):
    r = named_recipe(recipe)
    cfg = config()
    model = torch.nn.ModuleDict({
        "fc1": column(QuantColumnParallelLinear, 32, 64, cfg, recipe=r, layer_name="0.mlp.fc1"),
        "fc2": row(QuantRowParallelLinear, 64, 32, cfg, recipe=r, layer_name="0.mlp.fc2"),
    })

    def step(dy_fill=None):
        x = torch.randn(8, 2, 32, generator=gen).bfloat16().requires_grad_()
        h, _ = model["fc1"](x)
        y, _ = model["fc2"](torch.relu(h))
        dy = torch.randn_like(y)
        if dy_fill is not None:
            dy[3, 1, 5] = dy_fill
        y.backward(dy)

    step()
    assert first_nonfinite_layer(model) is None
    # an Inf in the output gradient: fc2's backward runs first, then fc1's
    step(float("inf"))
    assert [(n, w) for _, n, w in nonfinite_events(model)] == [("0.mlp.fc2", "backward"), ("0.mlp.fc1", "backward")]
    assert first_nonfinite_layer(model) == "0.mlp.fc2"
    reset_nonfinite(model)
    assert first_nonfinite_layer(model) is None
    # a NaN weight in fc1: its forward output is the first non-finite value of the step
    with torch.no_grad():
        model["fc1"].weight[0, 0] = float("nan")
    model["fc1"].lctx.weight_cache.clear()
    step()
    assert first_nonfinite_layer(model) == "0.mlp.fc1"
    assert ("0.mlp.fc2", "forward") in [(n, w) for _, n, w in nonfinite_events(model)]
    # switched off: nothing recorded
    reset_nonfinite(model)
    set_nonfinite_check(model, False)
    step()
    assert first_nonfinite_layer(model) is None
