"""Unit tests of the step profile's arithmetic (nvfp4_train.bench.profile, bench_train --profile): the kernel-interval
union, the categories, the summary and the kernel extraction, the host-blocking runtime calls (from synthetic
events: the real ones need a GPU); and of --sync-debug's warning capture and stack grouping (fake warnings and a
faked torch.cuda)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nvfp4_train.bench import profile
from nvfp4_train.bench.profile import (
    KERNEL_CATEGORIES,
    ROOT,
    cuda_kernels,
    group_sync_warnings,
    kernel_category,
    kernel_summary,
    runtime_calls,
    runtime_summary,
    sync_debug_step,
    sync_frames,
    union_length,
    warning_stacks,
)

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@pytest.mark.parametrize("intervals, length", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (20, 25)], 15.0),                    # disjoint
    ([(0, 10), (5, 15)], 15.0),                     # overlapping
    ([(0, 20), (5, 10), (12, 13)], 20.0),           # nested
    ([(0, 10), (10, 12)], 12.0),                    # touching
    ([(30, 40), (0, 10), (5, 12), (35, 50)], 32.0),  # unsorted: [0, 12] and [30, 50]
])
def test_union_length(intervals, length):
    assert union_length(intervals) == pytest.approx(length)


@pytest.mark.parametrize("name, cat", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("_quantize_nvfp4_kernel", "nvfp4/fp8 cast"),
    ("_amax_kernel", "nvfp4/fp8 cast"),
    ("_amax_grouped_kernel", "nvfp4/fp8 cast"),
    ("_squared_relu_amax_kernel", "norm/elementwise/other"),  # the activation, which also computes an amax
    ("_squared_relu_kernel", "norm/elementwise/other"),
    ("_chunk_scan_fwd_kernel", "mamba"),
    ("_bmm_chunk_fwd_kernel", "mamba"),
    ("_layer_norm_fwd_1pass_kernel", "mamba"),
    ("flash_fwd_kernel", "attention"),
    ("CUDNN_something", "attention"),                # case-insensitive
    ("multi_tensor_apply_kernel<AdamFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "nccl"),
    ("elementwise_kernel<128, 4>", "norm/elementwise/other"),
    # PyTorch's own kernel names are full of "lambda": not the LAMB optimizer (seen on the H200, 2026-11-29)
    ("elementwise_kernel<128, 2, gpu_kernel_impl_nocast<BinaryFunctor<float, MulFunctor<float> > >"
     "::{lambda(int)#1}>", "norm/elementwise/other"),
    ("multi_tensor_apply_kernel<lamb_stage1>", "optimizer"),
])
def test_kernel_category(name, cat):
    assert kernel_category(name) == cat


def test_kernel_category_first_match_wins():
    # a name matching several regexes takes the earliest category: the order of the dict is the priority
    assert kernel_category("cutlass_fp8_scaled_mm") == "gemm"           # also "_fp8" (cast)
    assert kernel_category("_scale_chunk_states") == "nvfp4/fp8 cast"   # also "chunk" (mamba)
    assert kernel_category("adam_nccl") == "optimizer"                  # also "nccl"
    cats = {"a": "foo", "b": "foo|bar", "rest": ""}
    assert kernel_category("foobar", cats) == "a"
    assert kernel_category("bar", cats) == "b"
    assert kernel_category("baz", cats) == "rest"
    assert list(KERNEL_CATEGORIES)[-1] == "norm/elementwise/other"


def test_kernel_summary():
    kernels = [("gemm_a", 0.0, 400.0), ("_quantize_x", 100.0, 300.0),    # overlapping streams
               ("gemm_a", 500.0, 700.0), ("elementwise", 800.0, 900.0)]  # gaps 400-500, 700-800, 900-1000
    rec, rows = kernel_summary(kernels, wall_s=1e-3)
    assert rec["wall_ms"] == pytest.approx(1.0)
    assert rec["busy_ms"] == pytest.approx(0.7)
    assert rec["idle_frac"] == pytest.approx(0.3)
    assert rec["launches"] == 4
    assert rec["categories"]["gemm"] == pytest.approx(dict(ms=0.6, pct=600 / 7))
    assert rec["categories"]["nvfp4/fp8 cast"]["ms"] == pytest.approx(0.2)
    assert rec["categories"]["mamba"] == dict(ms=0.0, pct=0.0)
    assert [t["name"] for t in rec["top"]] == ["gemm_a", "_quantize_x", "elementwise"]
    assert rec["top"][0]["count"] == 2 and rec["top"][0]["total_ms"] == pytest.approx(0.6)
    assert rows[0] == dict(name="gemm_a", category="gemm", count=2, total_us=600.0)
    assert "note" not in rec


def test_kernel_summary_no_cuda_events():
    rec, rows = kernel_summary([], wall_s=0.5)
    assert rows == [] and rec["top"] == [] and rec["launches"] == 0
    assert rec["busy_ms"] == 0.0 and rec["idle_frac"] == 1.0
    assert all(v == dict(ms=0.0, pct=0.0) for v in rec["categories"].values())
    assert rec["note"] == "no CUDA events"


def test_kernel_summary_truncates_names():
    rec, _ = kernel_summary([("k" * 200, 0.0, 1.0)], wall_s=1e-6)
    assert rec["top"][0]["name"] == "k" * 80


class _KinetoEvent:
    def __init__(self, name, dev, start_ns, dur_ns, activity="kernel", annotation=False):
        self._v = (name, dev, start_ns, dur_ns, activity, annotation)

    def name(self): return self._v[0]
    def device_type(self): return self._v[1]
    def start_ns(self): return self._v[2]
    def duration_ns(self): return self._v[3]
    def activity_type(self): return self._v[4]
    def is_user_annotation(self): return self._v[5]


def test_cuda_kernels_from_kineto_events():
    events = [_KinetoEvent("aten::mm", CPU, 0, 5000, "cpu_op"),
              _KinetoEvent("gemm_a", CUDA, 1000, 2000),
              _KinetoEvent("ProfilerStep#1", CUDA, 0, 9000, "gpu_user_annotation", True),
              _KinetoEvent("Memcpy HtoD (Pageable -> Device)", CUDA, 4000, 500, "gpu_memcpy"),
              _KinetoEvent("Memset (Device)", CUDA, 4500, 100, "gpu_memset")]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert cuda_kernels(prof) == [("gemm_a", 1.0, 3.0)]


def test_cuda_kernels_from_function_events():
    # a torch without kineto_results: the FunctionEvents' time_range (us), no activity_type attribute
    def fe(name, dev, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=dev, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(profiler=SimpleNamespace(), events=lambda: [
        fe("aten::mm", CPU, 0.0, 5.0), fe("gemm_a", CUDA, 1.0, 3.0), fe("range", CUDA, 0.0, 9.0, True),
        fe("Memcpy DtoD (Device -> Device)", CUDA, 4.0, 4.5)])
    assert cuda_kernels(prof) == [("gemm_a", 1.0, 3.0)]


def test_runtime_calls_from_kineto_events():
    events = [_KinetoEvent("aten::mm", CPU, 0, 5000, "cpu_op"),
              _KinetoEvent("cudaLaunchKernel", CPU, 100, 4000, "cuda_runtime"),
              _KinetoEvent("cuLaunchKernelEx", CPU, 200, 6000, "cuda_driver"),
              _KinetoEvent("cudaStreamSynchronize", CPU, 300, 2_500_000, "cuda_runtime"),
              _KinetoEvent("gemm_a", CUDA, 1000, 2000),
              _KinetoEvent("ProfilerStep#1", CPU, 0, 9000, "user_annotation", True)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert runtime_calls(prof) == [("cudaLaunchKernel", 4.0), ("cuLaunchKernelEx", 6.0),
                                   ("cudaStreamSynchronize", 2500.0)]


def test_runtime_calls_from_function_events():
    def fe(name, dev, start, end):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(profiler=SimpleNamespace(), events=lambda: [
        fe("aten::mm", CPU, 0.0, 5.0), fe("cudaMemcpyAsync", CPU, 1.0, 3.0), fe("gemm_a", CUDA, 1.0, 3.0),
        fe("cuStreamSynchronize", CPU, 4.0, 14.0), fe("custom_range", CPU, 0.0, 1.0)])
    assert runtime_calls(prof) == [("cudaMemcpyAsync", 2.0), ("cuStreamSynchronize", 10.0)]


def test_runtime_summary():
    calls = [("cudaLaunchKernel", 4.0), ("cudaLaunchKernel", 6.0), ("cuLaunchKernelEx", 5.0),
             ("cudaLaunchKernelExC", 5.0),
             ("cudaStreamSynchronize", 1000.0), ("cudaStreamSynchronize", 3000.0),
             ("cudaMemcpyAsync", 20.0), ("cudaMemcpy", 500.0), ("cuMemcpyDtoHAsync_v2", 7.0),
             ("cudaStreamWaitEvent", 1.0), ("cudaDeviceSynchronize", 50.0), ("cudaEventSynchronize", 2.0),
             ("cuCtxSynchronize", 3.0),
             ("cudaGetDevice", 1.0), ("cudaEventRecord", 2.0), ("cudaStreamIsCapturing", 1.0)]  # not counted
    rec = runtime_summary(calls)
    assert rec["launch_calls"] == dict(count=4, total_ms=pytest.approx(0.020))
    rows = {r["name"]: r for r in rec["runtime_calls"]}
    assert set(rows) == {"cudaStreamSynchronize", "cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyDtoHAsync_v2",
                         "cudaStreamWaitEvent", "cudaDeviceSynchronize", "cudaEventSynchronize",
                         "cuCtxSynchronize"}
    assert rows["cudaStreamSynchronize"] == dict(name="cudaStreamSynchronize", count=2, total_ms=4.0, max_ms=3.0)
    assert rows["cudaMemcpy"]["count"] == 1 and rows["cudaMemcpyAsync"]["count"] == 1  # apart
    assert [r["name"] for r in rec["runtime_calls"]][:3] == ["cudaStreamSynchronize", "cudaMemcpy",
                                                             "cudaDeviceSynchronize"]  # most time first
    assert runtime_summary([]) == dict(runtime_calls=[], launch_calls=dict(count=0, total_ms=0.0))


def _frame(filename, lineno, name):
    return SimpleNamespace(filename=filename, lineno=lineno, name=name)


SITE = "/x/.venv/lib/python3.11/site-packages"


def test_sync_frames_filters_and_orders():
    stack = [_frame("/usr/lib/python3.11/runpy.py", 1, "_run_module"),     # outermost: not shown
             _frame(str(ROOT / "scripts/bench_train.py"), 10, "step"),
             _frame(f"{SITE}/megatron/core/distributed/ddp.py", 20, "forward"),
             _frame(f"{SITE}/numpy/core/x.py", 5, "np_thing"),              # not a listed library
             _frame(str(ROOT / "precision/ops.py"), 30, "quantize"),
             _frame(f"{SITE}/torch/_tensor.py", 40, "item")]                # innermost
    assert sync_frames(stack) == ("torch/_tensor.py:40 item", "precision/ops.py:30 quantize",
                                  "megatron/core/distributed/ddp.py:20 forward",
                                  "scripts/bench_train.py:10 step")
    assert sync_frames(stack, n=2) == ("torch/_tensor.py:40 item", "precision/ops.py:30 quantize")
    # a library checked out outside site-packages counts by its directory name
    assert sync_frames([_frame("/opt/src/mamba_ssm/ops/ssd.py", 7, "fwd")]) == ("mamba_ssm/ops/ssd.py:7 fwd",)
    assert sync_frames([_frame("<stdin>", 1, "<module>")]) == ()


def test_group_sync_warnings():
    a = [_frame(str(ROOT / "scripts/bench_train.py"), 10, "step"), _frame(f"{SITE}/torch/_tensor.py", 40, "item")]
    b = [_frame(str(ROOT / "scripts/bench_train.py"), 12, "step")]
    deep = [_frame(str(ROOT / f"m{i}.py"), i, f"f{i}") for i in range(10)]
    msg = "called a synchronizing CUDA operation"
    records = [(msg, a), (msg, b), (msg, a), ("other", a), (msg, a), (msg, deep),
               (msg, [_frame("/elsewhere/x.py", 1, "g")] + deep)]  # same innermost 6 frames: one group
    groups = group_sync_warnings(records)
    assert groups[0] == dict(count=3, message=msg, frames=["torch/_tensor.py:40 item",
                                                           "scripts/bench_train.py:10 step"])
    assert groups[1] == dict(count=2, message=msg, frames=[f"m{i}.py:{i} f{i}" for i in range(9, 3, -1)])
    assert sorted((g["count"], g["message"], len(g["frames"])) for g in groups[2:]) == [(1, msg, 1),
                                                                                       (1, "other", 2)]
    assert sum(g["count"] for g in groups) == len(records)
    assert group_sync_warnings([]) == []


def _emit(msg):
    warnings.warn(msg)


def test_warning_stacks_records_the_python_stack():
    before = warnings.showwarning
    with warning_stacks() as records:
        _emit("one")
        _emit("one")              # "always": repeated warnings are all recorded
        warnings.warn("two", DeprecationWarning)
    assert warnings.showwarning is before
    assert [m for m, _ in records] == ["one", "one", "two"]
    here = Path(__file__).name
    # innermost frame: the emitting function, no frame of the hook or of the warnings module
    assert records[0][1][-1].name == "_emit" and Path(records[0][1][-1].filename).name == here
    assert records[0][1][-2].name == "test_warning_stacks_records_the_python_stack"
    assert records[2][1][-1].name == "test_warning_stacks_records_the_python_stack"
    assert group_sync_warnings(records)[0]["frames"][0].endswith("_emit")


def test_warning_stacks_sees_torch_cpp_warnings():
    # a TORCH_WARN from C++ reaches Python as a warning when the op returns: the stack is the Python caller's
    torch._C._set_warnAlways(True)  # TORCH_WARN_ONCE (x.T on a 3-D tensor) warns every time
    try:
        with warning_stacks() as records:
            torch.zeros(2, 3, 4).T
            torch.zeros(2, 3, 4).T
    finally:
        torch._C._set_warnAlways(False)
    assert len(records) == 2
    # the caller's frame is on the stack; innermost unless another test left a __torch_function__ override active
    # (seen in the full suite), whose Python frame then comes after it
    names = [f.name for f in records[0][1]]
    assert "test_warning_stacks_sees_torch_cpp_warnings" in names[-3:], names[-5:]


class _FakeCuda:
    def __init__(self):
        self.mode, self.modes, self.syncs = 0, [], 0

    def is_available(self): return True
    def synchronize(self): self.syncs += 1
    def get_sync_debug_mode(self): return self.mode

    def set_sync_debug_mode(self, mode):
        self.mode = mode
        self.modes.append(mode)


def test_sync_debug_step(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(profile.torch, "cuda", fake)

    def step():
        assert fake.mode == "warn"
        for _ in range(3):
            _emit("called a synchronizing CUDA operation")

    sd = sync_debug_step(step)
    assert fake.modes == ["warn", 0] and fake.mode == 0  # restored
    assert sd["warnings"] == 3 and len(sd["groups"]) == 1 and sd["groups"][0]["count"] == 3
    assert sd["groups"][0]["frames"][0].endswith("_emit")


def test_sync_debug_step_restores_the_mode_on_error(monkeypatch):
    fake = _FakeCuda()
    fake.mode = 1
    monkeypatch.setattr(profile.torch, "cuda", fake)

    def step():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        sync_debug_step(step)
    assert fake.modes == ["warn", 1] and fake.mode == 1


def test_sync_debug_step_without_cuda(monkeypatch):
    monkeypatch.setattr(profile.torch.cuda, "is_available", lambda: False)
    assert sync_debug_step(lambda: pytest.fail("must not run")) is None


@pytest.mark.parametrize("window, busy, gaps", [
    ((0, 10), [], [(0, 10)]),
    ((0, 10), [(0, 10)], []),
    ((0, 10), [(2, 4), (3, 5), (7, 8)], [(0, 2), (5, 7), (8, 10)]),   # overlapping busy intervals count once
    ((0, 10), [(-5, 1), (9, 20)], [(1, 9)]),                          # intervals beyond the window are clipped
    ((0, 10), [(7, 8), (2, 4)], [(0, 2), (4, 7), (8, 10)]),           # unsorted
    ((0, 10), [(20, 30)], [(0, 10)]),
])
def test_idle_gaps(window, busy, gaps):
    assert profile.idle_gaps(window, busy) == gaps


def test_idle_by_phase():
    # window 0-100; the GPU busy 10-40 and 60-70; host phases a: 0-30, b: 30-50, c: 50-80; 80-100 outside
    phases = [("train_step/a", 0, 30), ("train_step/b", 30, 50), ("train_step/c", 50, 80)]
    got = profile.idle_by_phase((0, 100), [(10, 40), (60, 70)], phases)
    assert list(got) == ["a", "b", "c", profile.OUTSIDE]
    assert got == {"a": 10.0, "b": 10.0, "c": 20.0, profile.OUTSIDE: 20.0}
    assert sum(got.values()) == 100 - union_length([(10, 40), (60, 70)])
    # a phase seen twice (a name repeats) adds up; no phases: all idle is outside
    got = profile.idle_by_phase((0, 10), [], [("train_step/a", 0, 2), ("train_step/a", 5, 6)])
    assert got == {"a": 3.0, profile.OUTSIDE: 7.0}
    assert profile.idle_by_phase((0, 10), [(0, 4)], []) == {profile.OUTSIDE: 6.0}


def test_host_ranges_and_device_intervals_from_kineto_events():
    events = [_KinetoEvent("train_step/b", CPU, 5000, 1000, "user_annotation", True),
              _KinetoEvent("train_step/a", CPU, 1000, 2000, "user_annotation", True),
              _KinetoEvent("train_step/a", CUDA, 1500, 2000, "gpu_user_annotation", True),
              _KinetoEvent("aten::mm", CPU, 0, 5000, "cpu_op"),
              _KinetoEvent("gemm_a", CUDA, 1000, 2000),
              _KinetoEvent("Memcpy HtoD (Pageable -> Device)", CUDA, 4000, 500, "gpu_memcpy"),
              _KinetoEvent("Memset (Device)", CUDA, 4500, 100, "gpu_memset")]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert profile.host_ranges(prof, "train_step/") == [("train_step/a", 1.0, 3.0), ("train_step/b", 5.0, 6.0)]
    assert profile.device_intervals(prof) == [(1.0, 3.0), (4.0, 4.5), (4.5, 4.6)]


def test_profile_step_on_cpu_has_no_idle_attribution(tmp_path):
    rec = profile.profile_step(lambda: torch.ones(3).sum(), tmp_path / "k.csv")
    assert "idle_by_phase" not in rec and rec["note"] == "no CUDA events"


def test_bench_train_refuses_mamba_cases_on_a_gpu_without_causal_conv1d(monkeypatch, capsys):
    """On a GPU without causal-conv1d the cases with Mamba layers would time the conv's PyTorch fallback (about
    twice the ``small`` step): refused in one line naming the fix, unless --conv-fallback asks for it; no GPU, or
    causal-conv1d there: nothing to refuse."""
    from nvfp4_train.bench import train as bench_train
    from nvfp4_train.models.mamba import _import

    monkeypatch.setattr(_import, "load_causal_conv1d", lambda: (None, "causal-conv1d is not installed"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_train.conv_fallback_cases(["small", "1.2b"]) == ([], "causal-conv1d is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_train.conv_fallback_cases(["small", "1.2b", "slice12b", "tiny"]) == (
        ["small", "slice12b", "tiny"], "causal-conv1d is not installed")
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--cases", "1.2b", "small"])
    with pytest.raises(SystemExit) as e:
        bench_train.main()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--cases small: causal-conv1d is not installed" in err
    assert "install causal-conv1d's wheel" in err and "--conv-fallback" in err
    monkeypatch.setattr(_import, "load_causal_conv1d", lambda: (object(), "causal-conv1d 1.7.0 CUDA kernel"))
    assert bench_train.conv_fallback_cases(["small"]) == ([], "causal-conv1d 1.7.0 CUDA kernel")
