"""The GEMM engine choice (kernels/gemm_engine.py): "auto" resolves by the device, "native" dispatches to the
native modules' ``nvfp4_gemm_native`` / ``mxfp4_gemm_native`` (stood in for here: no sm_100 device on CPU), and
on CPU every engine gives the reference's result."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import nvfp4_train.kernels.gemm_engine as ge
from nvfp4_train.kernels._dispatch import interpret_mode
import nvfp4_train.kernels.mxfp4 as mx
import nvfp4_train.kernels.nvfp4 as nv
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, GEMM_ENGINES, check_gemm_engine, resolve_gemm_engine


@pytest.fixture
def fake_native(monkeypatch):
    """nvfp4_train.kernels.nvfp4.native / nvfp4_train.kernels.mxfp4.native stand-ins that record their calls."""
    calls = []
    nvm = types.ModuleType("nvfp4_train.kernels.nvfp4.native")
    nvm.native_fp4_supported = lambda device: True
    nvm.nvfp4_gemm_native = lambda a, b, out_dtype=torch.bfloat16: calls.append(("nvfp4", out_dtype)) or "nv"
    mxm = types.ModuleType("nvfp4_train.kernels.mxfp4.native")
    mxm.mxfp4_gemm_native = lambda a, b, out_dtype=torch.bfloat16: calls.append(("mxfp4", out_dtype)) or "mx"
    monkeypatch.setitem(sys.modules, "nvfp4_train.kernels.nvfp4.native", nvm)
    monkeypatch.setitem(sys.modules, "nvfp4_train.kernels.mxfp4.native", mxm)
    monkeypatch.setattr(ge, "_NATIVE_BY_DEVICE", {})
    return nvm, calls


@pytest.mark.parametrize("major, supported, want", [(9, True, "cublas"), (10, True, "native"), (12, False, "cublas")])
def test_auto_follows_the_device(monkeypatch, fake_native, major, supported, want):
    nvm, _ = fake_native
    nvm.native_fp4_supported = lambda device: supported
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: (major, 0))
    cuda0 = torch.device("cuda", 0)
    assert resolve_gemm_engine("auto", cuda0) == want
    assert resolve_gemm_engine("native", cuda0) == "native"  # asked for explicitly: no fallback on a GPU
    for e in ("cublas", "triton"):
        assert resolve_gemm_engine(e, cuda0) == e


def test_cpu_resolves_to_the_hopper_default():
    cpu = torch.device("cpu")
    assert DEFAULT_GEMM_ENGINE == "cublas"
    assert {e: resolve_gemm_engine(e, cpu) for e in GEMM_ENGINES} == {
        "cublas": "cublas", "triton": "triton", "native": "cublas", "auto": "cublas"}


def test_native_dispatch(monkeypatch, fake_native):
    """Where the engine resolves to "native", nvfp4_gemm / mxfp4_gemm call the native modules' functions."""
    _, calls = fake_native
    for mod in (nv, mx):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
        monkeypatch.setattr(mod, "resolve_gemm_engine", lambda e, d: "native")
    q = nv.quantize_nvfp4_ref(torch.ones(4, 32))
    assert nv.nvfp4_gemm(q, q, torch.float32, engine="auto") == "nv"
    m = mx.quantize_mxfp4_ref(torch.ones(4, 32))
    assert mx.mxfp4_gemm(m, m, torch.float32, engine="native") == "mx"
    assert calls == [("nvfp4", torch.float32), ("mxfp4", torch.float32)]


def test_reference_path_ignores_the_engine(gen):
    if interpret_mode():
        pytest.skip("under TRITON_INTERPRET=1 CPU tensors take the Triton path (engines differ in summation order)")
    a = nv.quantize_nvfp4_ref(torch.randn(8, 64, generator=gen))
    b = nv.quantize_nvfp4_ref(torch.randn(5, 64, generator=gen), block_2d=False)
    ref = nv.nvfp4_gemm_ref(a, b)
    for e in GEMM_ENGINES:
        assert torch.equal(nv.nvfp4_gemm(a, b, engine=e), ref)
        ma = mx.quantize_mxfp4_ref(torch.randn(8, 64, generator=gen))
        assert torch.equal(mx.mxfp4_gemm(ma, ma, engine=e), mx.mxfp4_gemm_ref(ma, ma))


def test_bad_engine_names_the_choices():
    with pytest.raises(ValueError, match=r"GEMM engine 'cuda' is not one of \('cublas', 'triton', 'native', 'auto'\)"):
        check_gemm_engine("cuda")
    q = nv.quantize_nvfp4_ref(torch.ones(4, 32))
    with pytest.raises(ValueError, match="precision.gemm_engine"):
        nv.nvfp4_gemm(q, q, engine="cuda")
    m = mx.quantize_mxfp4_ref(torch.ones(4, 32))
    with pytest.raises(ValueError, match="is not one of"):
        mx.mxfp4_gemm(m, m, engine="cuda")
