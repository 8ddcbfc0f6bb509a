"""Unit tests of bench_train.py's --profile arithmetic: the kernel-interval union, the categories, the summary
and the kernel extraction (from synthetic events: the real ones need a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.bench_train import (
    KERNEL_CATEGORIES,
    cuda_kernels,
    kernel_category,
    kernel_summary,
    union_length,
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
    ("_chunk_scan_fwd_kernel", "mamba"),
    ("_bmm_chunk_fwd_kernel", "mamba"),
    ("_layer_norm_fwd_1pass_kernel", "mamba"),
    ("flash_fwd_kernel", "attention"),
    ("CUDNN_something", "attention"),                # case-insensitive
    ("multi_tensor_apply_kernel<AdamFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "nccl"),
    ("elementwise_kernel<128, 4>", "norm/elementwise/other"),
    # PyTorch's own kernel names are full of "lambda": not the LAMB optimizer (seen on the H200, session 6)
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
