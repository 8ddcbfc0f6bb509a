"""Per-layer quantization telemetry on inputs whose codes and errors are known by hand; non-finite tracking
names the first bad layer; telemetry off does no work."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from nvfp4_train.precision import telemetry as tel_mod
from nvfp4_train.precision.megatron_linear import QuantColumnParallelLinear, QuantRowParallelLinear
from nvfp4_train.precision.recipe import named_recipe
from nvfp4_train.precision.telemetry import (
    OPERAND_NAMES,
    LayerTelemetry,
    collect_telemetry,
    first_nonfinite_layer,
    nonfinite_events,
    reset_nonfinite,
    set_device_clock,
    set_nonfinite_check,
    set_telemetry,
)
from nvfp4_train.bench.aten_ops import AtenOps
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


@pytest.mark.parametrize("mode", ["every_step", "after_skip"])
def test_nonfinite_checks_after_skip_checks_only_after_a_skipped_step(gen, mode):
    """The trainer's ``logging.nonfinite_check``: ``after_skip`` leaves a bad step unnamed, names the next one,
    and switches the check off again after a good step; ``every_step`` names every bad step."""
    from nvfp4_train.trainer import NonfiniteChecks

    cfg = config()
    model = torch.nn.ModuleDict({
        "fc1": column(QuantColumnParallelLinear, 32, 64, cfg, recipe=named_recipe("nvfp4"), layer_name="0.mlp.fc1"),
        "fc2": row(QuantRowParallelLinear, 64, 32, cfg, recipe=named_recipe("nvfp4"), layer_name="0.mlp.fc2"),
    })

    def step(bad: bool) -> str | None:
        """One step (an Inf in the output gradient when ``bad``), then what the trainer reports for it."""
        x = torch.randn(8, 2, 32, generator=gen).bfloat16().requires_grad_()
        h, _ = model["fc1"](x)
        y, _ = model["fc2"](torch.relu(h))
        dy = torch.randn_like(y)
        if bad:
            dy[0, 0, 0] = float("inf")
        y.backward(dy)
        first = first_nonfinite_layer(model)
        reset_nonfinite(model)
        checks.after_step(not bad)
        return first

    checks = NonfiniteChecks(mode, tel_mod, model)
    checked = mode == "every_step"
    assert all(m.quant_telemetry.check_nonfinite is checked for m in model.values())
    assert step(bad=True) == ("0.mlp.fc2" if checked else None)  # after_skip: the first bad step is unnamed
    assert all(m.quant_telemetry.check_nonfinite for m in model.values())  # on after a skipped step
    assert step(bad=True) == "0.mlp.fc2"  # ... so the next bad step is named
    assert step(bad=False) is None
    assert all(m.quant_telemetry.check_nonfinite is checked for m in model.values())  # after_skip: off again
    assert step(bad=True) == ("0.mlp.fc2" if checked else None)
    NonfiniteChecks(mode, None, model).after_step(False)  # no telemetry module: nothing to switch, no error


# -- the non-finite check's kernel launches and its equivalence with the isfinite/where formulation



def _old_first_bad(prev, t, clock):
    """The previous formulation (10 kernel launches per check), with an empty tensor taken as finite."""
    now = next(clock)
    if t.numel() == 0:
        bad = torch.tensor(False)
    else:
        bad = ~torch.isfinite(torch.linalg.vector_norm(t.detach(), float("inf")))
    now = torch.where(bad, now, tel_mod._NEVER)
    return now if prev is None else torch.minimum(prev, now)


class _Layer(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.layer_name = name
        self.quant_telemetry = LayerTelemetry()


def _tensor(kind, dtype, shape, gen):
    if kind == "empty":
        return torch.empty(0, *shape[1:], dtype=dtype)
    t = torch.randn(*shape, generator=gen).to(dtype)
    if kind == "large":  # finite, near the dtype's largest value
        t.view(-1)[-1] = torch.finfo(dtype).max
    elif kind != "finite":
        t.view(-1)[int(torch.randint(t.numel(), (), generator=gen))] = {"inf": float("inf"), "-inf": float("-inf"),
                                                                        "nan": float("nan")}[kind]
    return t


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="counts the torch formulation; under TRITON_INTERPRET=1 the check is the Triton kernel, "
                           "whose single launch tests/precision/test_nonfinite_kernel.py counts")
def test_nonfinite_check_launches_four_kernels_and_never_syncs():
    tel = LayerTelemetry()
    x = torch.randn(16, 8).bfloat16()
    x32 = x.float()
    with AtenOps() as first:
        tel.check_output(x)
    tel.check_input_grad(x)
    with AtenOps() as later:
        tel.check_output(x)
        tel.check_input_grad(x)
        tel.check_input_grad(x32)
    assert first.kernels == ["linalg_vector_norm", "full", "add", "nan_to_num"]
    assert later.kernels == ["linalg_vector_norm", "add", "nan_to_num", "minimum"] * 3
    with AtenOps() as empty:
        tel.check_output(torch.empty(0, 8, dtype=torch.bfloat16))
    assert empty.kernels == []
    for rec in (first, later):
        assert not {"_local_scalar_dense", "item", "is_nonzero", "nonzero"} & set(rec.ops)
    assert tel.forward_bad.dtype == torch.float64 and tel.forward_bad.dim() == 0


def test_nonfinite_check_matches_the_isfinite_formulation(monkeypatch):
    """Random sequences of checks over 3 layers, both directions, bf16/fp16/fp32, finite, ±inf, NaN, empty,
    1-element and near-max tensors, with resets: the same times and events as the old formulation."""
    gen = torch.Generator().manual_seed(0)
    layers = [_Layer(f"L{i}") for i in range(3)]
    model = torch.nn.ModuleList(layers)
    kinds = ["finite"] * 6 + ["large", "inf", "-inf", "nan", "empty"]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    shapes = [(4, 8), (1,), (1, 1), (3, 5, 7)]
    for trial in range(20):
        monkeypatch.setattr(tel_mod, "_clock", itertools.count())
        ref_clock = itertools.count()
        ref = {(i, d): None for i in range(3) for d in ("forward", "backward")}
        reset_nonfinite(model)
        for n in range(40):
            i = int(torch.randint(3, (), generator=gen))
            d = ("forward", "backward")[int(torch.randint(2, (), generator=gen))]
            kind = kinds[int(torch.randint(len(kinds), (), generator=gen))] if trial % 4 else "finite"
            if trial % 4 == 1 and kind not in ("empty", "large"):
                kind = "finite" if n % 7 else kind  # sparse bad values
            t = _tensor(kind, dtypes[int(torch.randint(3, (), generator=gen))],
                        shapes[int(torch.randint(len(shapes), (), generator=gen))], gen)
            tel = layers[i].quant_telemetry
            (tel.check_output if d == "forward" else tel.check_input_grad)(t)
            ref[i, d] = _old_first_bad(ref[i, d], t, ref_clock)
            if n % 13 == 12:
                want = sorted((int(v), f"L{i}", d) for (i, d), v in ref.items()
                              if v is not None and int(v) != tel_mod._NEVER)
                assert nonfinite_events(model) == want, (trial, n)
                assert first_nonfinite_layer(model) == (want[0][1] if want else None)
                for (j, dd), v in ref.items():
                    got = getattr(layers[j].quant_telemetry, f"{dd}_bad")
                    assert (tel_mod._NEVER if got is None else int(got)) == (
                        tel_mod._NEVER if v is None else int(v)), (trial, n, j, dd)
            if n == 25 and trial % 3 == 2:
                reset_nonfinite(model)
                ref = dict.fromkeys(ref)


def test_device_clock_gives_the_host_clock_answers(gen, monkeypatch):
    """The graph-safe check (set_device_clock: a device counter and persistent tensors updated in place, no host
    int in any launch) names the same layers in the same order as the host clock, over random sequences of
    checks with resets; its own times count the checks of the model, from 1."""
    host = [_Layer(f"L{i}") for i in range(3)]
    dev = [_Layer(f"L{i}") for i in range(3)]
    hm, dm = torch.nn.ModuleList(host), torch.nn.ModuleList(dev)
    clock = torch.zeros((), dtype=torch.float64)
    set_device_clock(dm, clock)
    kept = [(layer.quant_telemetry.forward_bad, layer.quant_telemetry.backward_bad) for layer in dev]
    monkeypatch.setattr(tel_mod, "_clock", itertools.count(1))
    kinds = ["finite"] * 8 + ["inf", "-inf", "nan", "empty"]
    for n in range(120):
        i = int(torch.randint(3, (), generator=gen))
        fwd = bool(torch.randint(2, (), generator=gen))
        t = _tensor(kinds[int(torch.randint(len(kinds), (), generator=gen))], torch.bfloat16, (4, 8), gen)
        for layers in (host, dev):
            tel = layers[i].quant_telemetry
            (tel.check_output if fwd else tel.check_input_grad)(t)
        if n % 10 == 9:
            assert nonfinite_events(dm) == nonfinite_events(hm), n
            assert int(clock) == n + 1
        if n % 40 == 39:
            reset_nonfinite(hm)
            reset_nonfinite(dm)
    # the tensors a captured graph writes are the ones the layers keep, also after resets
    assert all(a is layer.quant_telemetry.forward_bad and b is layer.quant_telemetry.backward_bad
               for (a, b), layer in zip(kept, dev))
    with AtenOps() as rec:
        dev[0].quant_telemetry.check_output(torch.ones(4, 8))
    assert not {"_local_scalar_dense", "item", "is_nonzero", "nonzero"} & set(rec.ops)
    set_device_clock(dm, None)  # back to the host clock: nothing kept
    assert all(layer.quant_telemetry.forward_bad is None for layer in dev)


def test_nonfinite_times_stay_exact_past_float32(monkeypatch):
    """Times are kept in float64: a time beyond 2**24 (and near 2**53) comes back exactly."""
    for start in (2**24 + 1, 2**53 - 3):
        tel = LayerTelemetry()
        model = torch.nn.ModuleList([_Layer("A")])
        model[0].quant_telemetry = tel
        monkeypatch.setattr(tel_mod, "_clock", itertools.count(start))
        tel.check_output(torch.ones(3))
        tel.check_output(torch.tensor([1.0, float("nan")]).bfloat16())
        tel.check_output(torch.tensor([float("inf")]))
        assert nonfinite_events(model) == [(start + 1, "A", "forward")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_check_on_cuda(dtype):
    # the check relies on add(prev, max|t|, alpha=0) giving NaN for an inf/NaN max on the GPU's kernels too
    # (IEEE 0 * inf = NaN, no alpha == 0 shortcut): checked on CPU by the tests above, here on CUDA
    tel = LayerTelemetry()
    dev = "cuda"
    tel.check_output(torch.ones(64, 32, dtype=dtype, device=dev))
    assert tel.forward_bad is not None and float(tel.forward_bad) == float(tel_mod._NEVER)
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = LayerTelemetry()
        x = torch.ones(64, 32, dtype=dtype, device=dev)
        t.check_output(x)                      # fine: no time recorded
        x[3, 7] = bad
        t.check_output(x)                      # the first bad one: its time is kept
        first = float(t.forward_bad)
        assert first != float(tel_mod._NEVER) and first == first, (dtype, bad)  # a time, not NEVER or NaN
        t.check_output(x)                      # a later bad one does not replace it
        assert float(t.forward_bad) == first
