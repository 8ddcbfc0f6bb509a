"""The benchmark scripts measure both NVFP4 GEMM engines in one run (CPU smoke tests of their logic: no timing
value). bench_kernels.py --dry-run runs its GEMM checks under the interpreter in a subprocess; bench_linear.py
--quick runs the layers on CPU (the reference GEMM whatever the engine), so it checks the labelling only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # the scripts import this checkout


def test_bench_kernels_dry_run_measures_the_cublas_engine(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_kernels.py"), "--dry-run", "--gemm-only",
                           "--shapes", "qkv", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**ENV, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cuBLAS-engine total" in proc.stdout and "cublasLt alpha epilogue" in proc.stdout
    res = json.loads(out.read_text())
    assert not res["failures"] and not res["quantize"]  # every check passed; --gemm-only: no quantize table
    (row,) = res["gemm"]
    for key in ("cublas-engine total_ms", "cublasLt alpha epilogue_ms", "mm fp32 + alpha pass_ms", "alpha pass_ms", "predequant fp16_ms",
                "gemm16 fp16_ms"):
        assert row[key] is not None and row[key] > 0, key


def test_bench_linear_two_engines(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_linear.py"), "--quick", "--recipes", "nvfp4",
                           "--shapes", "mlp.fc1", "--gemm-engine", "triton", "cublas", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| nvfp4 | triton |" in proc.stdout and "| nvfp4 | cublas |" in proc.stdout
    assert "| nvfp4 [cublas] | cublas |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["gemm_engines"] == ["triton", "cublas"]
    rows = res["shapes"][0]["rows"]
    assert [(r["recipe"], r["gemm_engine"]) for r in rows] == [("bf16", None), ("nvfp4", "triton"), ("nvfp4", "cublas")]
    assert set(res["totals"]) == {"bf16", "nvfp4 [triton]", "nvfp4 [cublas]"}


def test_bench_linear_bad_engine():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_linear.py"), "--quick", "--recipes", "nvfp4",
                           "--shapes", "mlp.fc1", "--gemm-engine", "cuBLAS"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode != 0 and "invalid choice: 'cuBLAS'" in proc.stderr
