"""scripts/bench_linear.py --quick runs on CPU and reports what it claims (every shape x recipe, exact saved
bytes per format)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.side_by_side import captured, completed, side_by_side

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory) -> tuple[Path, dict]:
    """The two runs of bench_linear.py that the tests below check, side by side."""
    out = tmp_path_factory.mktemp("bench_linear")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # tiny GEMMs: threads only contend
    script = str(REPO / "scripts" / "bench_linear.py")
    args = {"quick": [script, "--quick", "--json", str(out / "quick.json")],
            "profile": [script, "--quick", "--recipes", "nvfp4", "--shapes", "mlp.fc1", "--profile", "nvfp4", "--json",
                        str(out / "profile.json")]}
    codes = side_by_side({name: captured(a, out / name, cwd=REPO, env=env) for name, a in args.items()})
    return out, {name: completed(out / name, rc) for name, rc in codes.items()}


def test_bench_linear_quick(bench_runs):
    tmp_path, runs = bench_runs
    out, proc = tmp_path / "quick.json", runs["quick"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "## targets" in proc.stdout and "| nvfp4 |" in proc.stdout
    res = json.loads(out.read_text())
    assert len(res["shapes"]) == 6
    for s in res["shapes"]:
        m, k = s["M"], s["K"]
        rows = {r["recipe"]: r for r in s["rows"]}
        assert list(rows) == ["bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4"]
        # bytes saved for backward: bf16 keeps x; the others only the columnwise (wgrad) copy of x
        assert rows["bf16"]["saved_bytes"] == 2 * m * k
        assert rows["nvfp4"]["saved_bytes"] == m * k // 2 + m * k // 16 + 4  # codes, E4M3 scales, amax
        assert rows["mxfp4"]["saved_bytes"] == m * k // 2 + m * k // 32  # codes, E8M0 scales
        assert rows["fp8"]["saved_bytes"] == m * k + 4 * m * k // 128  # E4M3, fp32 scale per 1x128
        assert rows["fp8_tensorwise"]["saved_bytes"] == m * k + 4
        assert rows["nvfp4"]["saved_ratio"] <= 0.3
        assert rows["bf16"]["time_ratio"] == 1.0 and rows["bf16"]["y_rel_err"] == 0.0
        # the quantized layers ran their formats. Fixed inputs: x, dy and the weights come from seeded CPU
        # generators in nvfp4_train.bench.linear, and the quantization is elementwise (bitwise the same on every
        # machine). Measured 2026-12-02 at cb98560 (2-core CPU machine), the same under 1 and 2 threads:
        # relative L2 error of the output fp8 0.0367-0.0369, fp8_tensorwise 0.0373-0.0375, nvfp4 0.1455-0.1462,
        # mxfp4 0.1640-0.1648. A machine can change only the CPU GEMMs' fp32 accumulation order: each output
        # moves by at most one bf16 rounding (2^-8 relative) where the order flips it, plus gamma_K sum|x||w|
        # (K <= 512: gamma_K <= 3.1e-5), in the quantized output and in the bf16 reference alike, so a relative
        # error moves by at most about 2 * 2^-8 = 0.008: the margins (0.1 - 0.0375 = 0.06, 0.3 - 0.165 = 0.13)
        # are 8x and 17x that.
        for r, hi in (("fp8", 0.1), ("fp8_tensorwise", 0.1), ("nvfp4", 0.3), ("mxfp4", 0.3)):
            assert 0 < rows[r]["y_rel_err"] < hi and rows[r]["ms"] > 0
    assert set(res["totals"]) == {"bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4"}


def test_bench_linear_profile_lists_the_ops(bench_runs):
    tmp_path, runs = bench_runs
    out, proc = tmp_path / "profile.json", runs["profile"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "### mlp.fc1, nvfp4: GPU kernels per fwd+bwd" in proc.stdout
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["shapes"][0]["rows"]}
    assert "kernels" not in rows["bf16"]  # only the recipes asked for
    kernels = rows["nvfp4"]["kernels"]
    assert kernels and all(k["us"] > 0 and k["calls"] > 0 for k in kernels)
    assert [k["us"] for k in kernels] == sorted((k["us"] for k in kernels), reverse=True)
