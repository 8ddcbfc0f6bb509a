"""The host-side shortcuts of the NVFP4 launchers (scripts/bench_host.py measures them): each gives the same bits
as the reference and as the general path it skips."""

from __future__ import annotations

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from nvfp4_train.kernels.nvfp4 import nvfp4_amax, quantize_nvfp4_rowcol, quantize_nvfp4_rowcol_ref
from tests.kernels.test_nvfp4_quantize_triton import assert_same

pytestmark = pytest.mark.triton


class _Ops(TorchDispatchMode):
    """The aten ops the launchers issue; under the interpreter, not those of the interpreter's own launches (it
    copies the kernels' tensors in and out)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops = []
        self.inside = False
        if triton_interpret():
            import triton.runtime.interpreter as interpreter

            run = interpreter.InterpretedFunction.run

            def counted(fn, *args, **kwargs):
                self.inside = True
                try:
                    return run(fn, *args, **kwargs)
                finally:
                    self.inside = False

            monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def triton_interpret() -> bool:
    from nvfp4_train.kernels._dispatch import interpret_mode

    return interpret_mode()


def test_cdiv_is_tritons():
    from nvfp4_train.kernels.fp4_triton import cdiv

    for a in (0, 1, 15, 16, 17, 127, 128, 129, 20480 + 16):
        for b in (1, 16, 64, 128, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.parametrize("col_rht", [False, True])
def test_given_amax_pair_is_read_in_place(triton_device, gen, col_rht, monkeypatch):
    """row_amax, col_amax = the two elements of one fp32 buffer (as cast_pair passes the all-reduced amax): the
    quantizer reads that buffer (no fill, no copy); any other pair is copied as before; the same bits either way."""
    x = (torch.randn(48, 64, generator=gen) * 3).bfloat16()
    xd = x.to(triton_device)
    am = nvfp4_amax(xd, col_rht) * 1.5  # a larger amax than x's own (as another TP rank's would be)
    rec = _Ops(monkeypatch)
    for row_amax, col_amax, in_place in [
        (*am.unbind(), True),
        (am[0], am[1], True),
        (am[1], am[0], False),  # reversed: not the buffer's order
        (am[0].clone(), am[1].clone(), False),  # two buffers
        (am[0:1], am[1:2], False),  # 1-element views, not 0-d
    ]:
        rec.ops.clear()
        with rec:
            row, col = quantize_nvfp4_rowcol(xd, col_rht=col_rht, row_amax=row_amax, col_amax=col_amax)
        rrow, rcol = quantize_nvfp4_rowcol_ref(x, col_rht=col_rht, row_amax=row_amax.cpu(), col_amax=col_amax.cpu())
        assert_same(row, rrow)
        assert_same(col, rcol)
        assert ("zeros" not in rec.ops and "copy_" not in rec.ops) == in_place, rec.ops
        assert torch.equal(am.cpu(), (nvfp4_amax(xd, col_rht) * 1.5).cpu())  # the given buffer is not written


def test_device_scalar_passes_fp32_scalars_through(triton_device):
    from nvfp4_train.kernels.fp4_gemm import _device_scalar

    t = torch.tensor(0.375, device=triton_device)
    assert _device_scalar(t, t.device, "alpha") is t
    one = torch.tensor([0.5], device=triton_device)
    assert _device_scalar(one, one.device, "alpha") is one
    b = torch.tensor(0.375, dtype=torch.bfloat16, device=triton_device)
    got = _device_scalar(b, b.device, "alpha")
    assert got.dtype == torch.float32 and got.shape == (1,) and float(got) == 0.375
    with pytest.raises(ValueError, match="alpha must be on meta"):
        _device_scalar(t, torch.device("meta"), "alpha")


@pytest.mark.parametrize("col_rht", [False, True])
def test_one_given_amax_or_none(triton_device, gen, col_rht):
    """One of the two amaxes given (the amax pass computes the other: into a scratch buffer when it would
    overwrite the given one, else in place), none given, and 2-D tiles (no column amax): the reference's bits."""
    x = (torch.randn(32, 48, generator=gen) * 5).bfloat16()
    xd = x.to(triton_device)
    given = torch.tensor(40.0)
    # row_amax alone without the RHT: the column copy (x's own values) takes the given amax too, in both
    for kw in (dict(row_amax=given), dict(col_amax=given), {}):
        row, col = quantize_nvfp4_rowcol(xd, col_rht=col_rht, **{k: v.to(triton_device) for k, v in kw.items()})
        rrow, rcol = quantize_nvfp4_rowcol_ref(x, col_rht=col_rht, **kw)
        assert_same(row, rrow)
        assert_same(col, rcol)
    for kw in (dict(row_amax=given), {}):
        row, col = quantize_nvfp4_rowcol(xd, block_2d=True, **{k: v.to(triton_device) for k, v in kw.items()})
        rrow, rcol = quantize_nvfp4_rowcol_ref(x, block_2d=True, **kw)
        assert_same(row, rrow)
        assert_same(col, rcol)
