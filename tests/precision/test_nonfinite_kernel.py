"""The one-launch non-finite check (kernels/fused/nonfinite.py) against its reference, bitwise: the kept times and
the device clock are float64 bit patterns, equal to the last bit; every NaN/±Inf is found wherever it sits (the last
element of an odd-sized tensor, tensors of many tiles and programs), an empty tensor launches nothing, one check is
one launch, and the layers' telemetry names the first non-finite layer through it, with either clock."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from nvfp4_train.bench.aten_ops import AtenOps
from nvfp4_train.bench.sass import have_nvidia_tools
from nvfp4_train.kernels.fused import nonfinite as nf
from nvfp4_train.kernels.fused.nonfinite_reference import (
    NEVER,
    track_nonfinite_clocked_ref,
    track_nonfinite_ref,
)
from nvfp4_train.precision import telemetry as tel_mod
from nvfp4_train.precision.telemetry import (
    LayerTelemetry,
    first_nonfinite_layer,
    nonfinite_events,
    reset_nonfinite,
    set_device_clock,
)
from tests.cuda_graphs import capture

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero"}


def _bits(x: torch.Tensor) -> int:
    """The float64 0-d tensor's bit pattern (bitwise comparison: NaN-safe, no tolerance)."""
    assert x.dtype == torch.float64 and x.dim() == 0
    return int(x.cpu().view(torch.int64))


def _draw(shape, dtype, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A random tensor of ``shape`` with edge values (±0, subnormals, the largest finite, ±1) at random places;
    ``kind``: "finite", or a NaN/±Inf ("nan", "inf", "-inf") at a random position, "last" (at the last element),
    "first", or "many" (several of all three kinds)."""
    n = 1
    for s in shape:
        n *= s
    t = (torch.randn(n, generator=gen) * 3).to(dtype)
    if n:
        fi = torch.finfo(dtype)
        edges = torch.tensor([0.0, -0.0, fi.tiny / 4, -fi.tiny, fi.max, -fi.max, 1.0, -1.0], dtype=torch.float64)
        where = torch.randint(n, (min(n, 8),), generator=gen)
        t[where] = edges[: len(where)].to(dtype)
        pick = lambda: list(BAD.values())[int(torch.randint(3, (), generator=gen))]  # noqa: E731
        if kind in BAD:
            t[int(torch.randint(n, (), generator=gen))] = BAD[kind]
        elif kind == "last":
            t[-1] = pick()
        elif kind == "first":
            t[0] = pick()
        elif kind == "many":
            for i in torch.randint(n, (5,), generator=gen).tolist():
                t[i] = pick()
    return t.reshape(shape)


class _KernelLaunches:
    """Counts the launches of the check's Triton kernel (on CUDA and under the interpreter alike)."""

    def __init__(self, monkeypatch):
        self.n = 0
        kernel = nf._track_nonfinite_kernel
        outer = self

        class Counting:
            def __getitem__(self, grid):
                outer.n += 1
                return kernel[grid]

        monkeypatch.setattr(nf, "_track_nonfinite_kernel", Counting())


def _recorder() -> AtenOps:
    """The torch ops that launch a kernel, less the interpreter's copies of the kernel's arguments (a CUDA launch
    has none)."""
    return AtenOps(ignore=frozenset({"copy_"}) if INTERPRET else frozenset())


def _cases(device: str, gen: torch.Generator) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, kind, tile size): odd sizes, each finite and twice with NaN/±Inf (once a NaN, +Inf, -Inf or one at
    the first element, drawn; once at the last element or several), at the default tile and at a small one (4
    programs under the interpreter, several tiles each). (129, 67) = 8643 elements is three default tiles."""
    shapes = [(1,), (7,), (3, 5, 7), (2048 + 16,), (129, 67)]
    if device == "cuda":  # a thousand programs, one or two tiles each (5.6M elements)
        shapes += [(2731, 2053)]
    bad = ["nan", "inf", "-inf", "first"]
    cases = []
    for shape in shapes:
        n = torch.Size(shape).numel()
        kinds = ["finite", bad[int(torch.randint(len(bad), (), generator=gen))],
                 ("last", "many")[int(torch.randint(2, (), generator=gen))]]
        for block in (nf.BLOCK, 16 if n <= 256 else 1024):
            cases += [(shape, kind, block) for kind in kinds]
    return cases


# -- the kernel against the reference, bitwise


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference_bitwise(triton_device, gen, dtype):
    """Host clock: a fresh ``kept`` (None) and an earlier one (a time before or after ``now``, or NEVER), the
    times bitwise the reference's, on finite tensors and on NaN/±Inf anywhere; the kernel's counter is zero after
    each launch and ``kept`` is updated in place."""
    dev = triton_device
    arrivals = nf.new_arrivals(dev)
    for shape, kind, block in _cases(dev, gen):
        t = _draw(shape, dtype, kind, gen).to(dev)
        now = int(torch.randint(2**40, (), generator=gen))
        k = nf.track_nonfinite_triton(None, t, now, arrivals, block=block)
        r = track_nonfinite_ref(None, t, now)
        assert k.dtype == torch.float64 and k.dim() == 0 and k.device == t.device
        assert _bits(k) == _bits(r), (shape, kind, block)
        assert _bits(k) == _bits(torch.tensor(float(now if kind != "finite" else NEVER), dtype=torch.float64))
        prev = (now - 3, now + 3, NEVER)[int(torch.randint(3, (), generator=gen))]
        kept = torch.tensor(float(prev), dtype=torch.float64, device=dev)
        out = nf.track_nonfinite_triton(kept, t, now, arrivals, block=block)
        want = track_nonfinite_ref(torch.tensor(float(prev), dtype=torch.float64, device=dev), t, now)
        assert out is kept and _bits(kept) == _bits(want), (shape, kind, block, prev)
        assert int(arrivals.cpu()) == 0


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clocked_kernel_matches_reference_bitwise(triton_device, gen, dtype):
    """Device clock: ``clock`` advanced by exactly one per check however many programs ran, and ``kept`` bitwise
    the reference's, from clock values up to 2**53 - 3 (float64 stays exact) and kept values before and after."""
    dev = triton_device
    arrivals = nf.new_arrivals(dev)
    for shape, kind, block in _cases(dev, gen):
        t = _draw(shape, dtype, kind, gen).to(dev)
        start = float(int(torch.randint(2**20, (), generator=gen)) if kind != "many" else 2**53 - 3)
        prev = (start - 1, start + 5, float(NEVER))[int(torch.randint(3, (), generator=gen))]
        clock = torch.tensor(start, dtype=torch.float64, device=dev)
        kept = torch.tensor(prev, dtype=torch.float64, device=dev)
        nf.track_nonfinite_clocked_triton(kept, t, clock, arrivals, block=block)
        rc = torch.tensor(start, dtype=torch.float64, device=dev)
        rk = torch.tensor(prev, dtype=torch.float64, device=dev)
        track_nonfinite_clocked_ref(rk, t, rc)
        assert _bits(clock) == _bits(rc) == _bits(torch.tensor(start + 1, dtype=torch.float64))
        assert _bits(kept) == _bits(rk), (shape, kind, block, prev)
        assert int(arrivals.cpu()) == 0


@pytest.mark.triton
def test_permuted_views_are_read_in_place_and_gapped_views_go_to_the_reference(triton_device, gen, monkeypatch):
    """A transpose (dense, not contiguous) is read by the kernel as one span; a slice with gaps (whose gaps hold
    NaNs that are not its elements) is not the kernel's: the dispatching call gives it to the reference."""
    dev = triton_device
    arrivals = nf.new_arrivals(dev)
    launches = _KernelLaunches(monkeypatch)
    base = _draw((33, 65), torch.bfloat16, "finite", gen).to(dev)
    tr = base.t()
    assert not tr.is_contiguous() and nf.kernel_takes(tr)
    assert _bits(nf.track_nonfinite(None, tr, 5, arrivals)) == _bits(track_nonfinite_ref(None, tr, 5))
    tr[int(torch.randint(65, (), generator=gen)), int(torch.randint(33, (), generator=gen))] = float("inf")
    assert float(nf.track_nonfinite(None, tr, 6, arrivals)) == 6.0
    assert launches.n == 2
    gapped = torch.full((9, 10), float("nan"), device=dev)
    gapped[:, ::2] = 1.0
    view = gapped[:, ::2]
    assert not nf.kernel_takes(view)
    assert float(nf.track_nonfinite(None, view, 7, arrivals)) == float(NEVER) and launches.n == 2
    with pytest.raises(ValueError, match="has gaps"):
        nf.track_nonfinite_triton(None, view, 7, arrivals)


@pytest.mark.triton
def test_empty_tensor_launches_nothing_and_counts_as_finite(triton_device, monkeypatch):
    dev = triton_device
    arrivals = nf.new_arrivals(dev)
    launches = _KernelLaunches(monkeypatch)
    empty = torch.empty(0, 7, dtype=torch.bfloat16, device=dev)
    kept = torch.tensor(3.0, dtype=torch.float64, device=dev)
    clock = torch.tensor(10.0, dtype=torch.float64, device=dev)
    with _recorder() as rec:
        assert nf.track_nonfinite_triton(None, empty, 4, arrivals) is None
        assert nf.track_nonfinite_triton(kept, empty, 4, arrivals) is kept
    assert rec.kernels == []
    nf.track_nonfinite_clocked_triton(kept, empty, clock, arrivals)  # the clock counts checks: it advances
    assert launches.n == 0 and float(clock) == 11.0 and float(kept) == 3.0


# -- through the layers' telemetry


class _Layer(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.layer_name = name
        self.quant_telemetry = LayerTelemetry()


@pytest.mark.triton
def test_one_check_is_one_launch_and_never_syncs(triton_device, monkeypatch):
    """Through ``LayerTelemetry``: every check of a non-empty tensor is one kernel launch and no torch kernel (the
    counters' one-time allocation aside), with either clock; no host sync."""
    dev = triton_device
    launches = _KernelLaunches(monkeypatch)
    tel = LayerTelemetry()
    x = torch.randn(16, 9, device=dev).bfloat16()
    x32, empty = x.float(), torch.empty(0, 9, dtype=torch.bfloat16, device=dev)
    tel.check_output(x)  # allocates the counters
    with _recorder() as rec:
        tel.check_output(x)
        tel.check_input_grad(x)  # the first backward check: a new kept tensor, written by the kernel
        tel.check_input_grad(x32)
        tel.check_output(empty)
    assert launches.n == 4 and rec.kernels == []
    assert not _SYNC_OPS & set(rec.ops)
    clock = torch.zeros((), dtype=torch.float64, device=dev)
    tel.set_device_clock(clock)
    with _recorder() as rec:
        tel.check_output(x)
        tel.check_input_grad(x)
    assert launches.n == 6 and rec.kernels == [] and not _SYNC_OPS & set(rec.ops)
    assert float(clock) == 2.0 and _bits(tel.forward_bad) == _bits(tel.backward_bad) == _bits(
        torch.tensor(float(NEVER), dtype=torch.float64))


@pytest.mark.triton
@pytest.mark.parametrize("clocked", [False, True], ids=["host_clock", "device_clock"])
def test_first_nonfinite_layer_is_named(triton_device, gen, monkeypatch, clocked):
    """Random sequences of checks over 4 layers (both directions, bf16/fp16/fp32, NaN/±Inf at random places or
    last, empty tensors, resets): the events and the first non-finite layer are those worked out here from the
    kinds drawn (time of a check = its place in the sequence, from 1), and every check ran the kernel."""
    dev = triton_device
    launches = _KernelLaunches(monkeypatch)
    layers = [_Layer(f"blocks.{i}.mlp.fc{1 + i % 2}") for i in range(4)]
    model = torch.nn.ModuleList(layers)
    clock = torch.zeros((), dtype=torch.float64, device=dev)
    if clocked:
        set_device_clock(model, clock)
    monkeypatch.setattr(tel_mod, "_clock", itertools.count(1))
    kinds = ["finite"] * 7 + ["nan", "inf", "-inf", "last", "empty"]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    want: dict[tuple[str, str], int] = {}
    non_empty = 0
    for n in range(1, 61):
        i = int(torch.randint(4, (), generator=gen))
        where = ("forward", "backward")[int(torch.randint(2, (), generator=gen))]
        kind = kinds[int(torch.randint(len(kinds), (), generator=gen))]
        shape = [(5, 9), (3, 1, 7), (4099,)][int(torch.randint(3, (), generator=gen))]
        if kind == "empty":
            t = torch.empty(0, 9, dtype=torch.bfloat16, device=dev)
        else:
            t = _draw(shape, dtypes[int(torch.randint(3, (), generator=gen))], kind, gen).to(dev)
            non_empty += 1
        tel = layers[i].quant_telemetry
        (tel.check_output if where == "forward" else tel.check_input_grad)(t)
        if kind not in ("finite", "empty"):
            want.setdefault((layers[i].layer_name, where), n)
        if n % 20 == 0:
            expected = sorted((when, name, w) for (name, w), when in want.items())
            assert nonfinite_events(model) == expected, n
            assert first_nonfinite_layer(model) == (expected[0][1] if expected else None)
            if clocked:
                assert float(clock) == n
            reset_nonfinite(model)
            want = {}
    assert launches.n == non_empty
    assert all(int(a.cpu()) == 0 for layer in layers if layer.quant_telemetry._arrivals is not None
               for a in layer.quant_telemetry._arrivals)


# -- errors; which layouts the kernel reads; the kernel compiles for the H200


def test_one_span_takes_dense_permutations_only():
    x = torch.zeros(4, 6, 5)
    assert nf._one_span(x) and nf._one_span(x.permute(2, 0, 1)) and nf._one_span(x.transpose(0, 1))
    assert nf._one_span(x[1:3].transpose(0, 2)) and nf._one_span(torch.zeros(5, 1, 4).transpose(0, 2))
    assert not nf._one_span(x[:, :1]) and not nf._one_span(x[..., ::2]) and not nf._one_span(x.permute(2, 0, 1)[1:])
    assert not nf._one_span(torch.zeros(4, 1).expand(4, 3))  # stride 0: the same slot twice
    assert not nf._one_span(torch.zeros(10).as_strided((3, 3), (2, 1)))  # overlapping rows


def test_errors_name_the_value_and_the_fix():
    t = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"arrivals=None.*new_arrivals"):
        nf.track_nonfinite_triton(None, t, 1, None)
    with pytest.raises(ValueError, match=r"arrivals=torch.int64"):
        nf.track_nonfinite_triton(None, t, 1, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"kept is a torch.float32"):
        nf.track_nonfinite_triton(torch.zeros(()), t, 1, nf.new_arrivals("cpu"))
    with pytest.raises(ValueError, match=r"clock is a torch.float32"):
        nf.track_nonfinite_clocked_triton(torch.zeros((), dtype=torch.float64), t, torch.zeros(()),
                                          nf.new_arrivals("cpu"))
    with pytest.raises(TypeError, match=r"torch.int32"):
        nf.track_nonfinite_triton(None, torch.ones(4, dtype=torch.int32), 1, nf.new_arrivals("cpu"))


@pytest.mark.skipif(not have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_kernel_compiles_for_sm90_with_wide_loads_and_one_atomic():
    """Compiled for sm_90 on any machine (no GPU needed): 16-byte loads (8 bf16 or 4 fp32 a load; the tile is
    read in wide vectors) and one atomic per program, for both clocks."""
    from nvfp4_train.bench import sass

    for ptr, dtype, clocked, fresh in (("*bf16", torch.bfloat16, False, True), ("*fp32", torch.float32, True, False)):
        bits, exp = nf._FORMATS[dtype]
        listing = sass.compile_sass(
            nf._track_nonfinite_kernel,
            dict(t_ptr=ptr, n="i32", kept_ptr="*fp64", clock_ptr="*fp64", arrivals_ptr="*i32", now="i64"),
            dict(BITS=bits, EXP=exp, NEVER_F=float(NEVER), CLOCKED=clocked, FRESH=fresh, BLOCK=nf.BLOCK),
            divisible=["t_ptr", "n", "kept_ptr", "clock_ptr", "arrivals_ptr"], num_warps=nf.NUM_WARPS)
        assert "LDG.E.128" in listing, (ptr, clocked)
        assert sass.count_opcodes(listing)["ATOMG"] == 1, (ptr, clocked)


@pytest.mark.gpu
def test_device_clock_checks_replay_from_a_cuda_graph():
    """The device-clock checks of three layers captured in one CUDA graph: every replay advances the clock by
    the six checks and names the first non-finite layer of that replay's inputs (static buffers changed between
    replays); the kernel's counters stay zero."""
    dev = "cuda"
    layers = [_Layer(f"L{i}") for i in range(3)]
    model = torch.nn.ModuleList(layers)
    clock = torch.zeros((), dtype=torch.float64, device=dev)
    set_device_clock(model, clock)
    xs = [torch.ones(4099, 33, dtype=torch.bfloat16, device=dev) for _ in range(3)]

    def checks():  # times 1..6 after the clock's value: L0 fwd xs[0], L0 bwd xs[2], L1 fwd, bwd xs[1], L2 ...
        for i, layer in enumerate(layers):
            layer.quant_telemetry.check_output(xs[i])
            layer.quant_telemetry.check_input_grad(xs[2 - i])

    graph = capture(checks)
    assert float(clock) == 6  # capture runs nothing
    reset_nonfinite(model)
    graph.replay()
    assert float(clock) == 12 and first_nonfinite_layer(model) is None
    xs[1][4098, 32] = float("nan")  # the last element of L1's output and input gradient
    graph.replay()
    assert nonfinite_events(model) == [(15, "L1", "forward"), (16, "L1", "backward")]
    reset_nonfinite(model)
    xs[1].fill_(1.0)
    xs[2][17, 3] = float("-inf")  # L2's output (time 5) and L0's input gradient (time 2)
    graph.replay()
    graph.replay()  # the kept times are the first replay's
    assert nonfinite_events(model) == [(20, "L0", "backward"), (23, "L2", "forward")]
    assert first_nonfinite_layer(model) == "L0" and float(clock) == 30
    assert all(int(a) == 0 for layer in layers for a in layer.quant_telemetry._arrivals)
