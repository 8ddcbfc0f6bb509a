"""nvfp4_train.bench.torchao_fp8 (scripts/bench_torchao.py) --quick runs in-process on CPU: every shape x variant
reported, torchao's variants unavailable with a reason (CPU, or torchao missing) instead of a crash, and our FP8
variants within the derived E4M3 error range of bf16."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from nvfp4_train.bench.torchao_fp8 import PAIRS, VARIANTS, main, pairs, targets

OURS = ("ours_fp8", "ours_fp8_tensorwise")
TORCHAO = tuple(v for v in VARIANTS if v.startswith("torchao_"))

# The relative L2 error of y, x.grad and W.grad of our FP8 variants against bf16's, on the fixed inputs of the
# benchmark (x, W, dy from one seeded CPU generator, --seed 1; the quantizers are elementwise, bitwise the same
# on every machine).
# Upper bound: E4M3 keeps 3 mantissa bits, so round to nearest moves each element by a relative u <= 2^-4 (the
# blocks' scales map each block's amax to 448; Gaussian inputs leave a negligible fraction subnormal). With
# x' = x(1 + d), w' = w(1 + e) the error of one output sum_i x_i w_i (d_i + e_i + d_i e_i) has, for independent
# zero-mean inputs and rounding errors uncorrelated with each other, a mean square <= (2u^2 + u^4) * E[y^2]: the
# relative error is <= sqrt(2) u (1 + u^2 / 2)^(1/2) ~= 0.0885; both outputs' bf16 roundings add at most 2 * 2^-9.
# The same holds for dx = dy W (reduction along N) and dW = dy^T x (along M).
HI = math.sqrt(2 * 2.0**-8 + 2.0**-16) + 2 * 2.0**-9  # 0.0924
# Lower bound (the format ran, not bf16): under a uniform-mantissa model an element's absolute error has RMS
# ulp / sqrt(12) and its value is < 16 ulp, so its relative RMS error is >= 1 / (16 sqrt(12)) = 0.018, and the two
# operands' errors add in quadrature: >= 0.025. 0.01 leaves 2.5x.
LO = 0.01
# Measured 2026-12-02 at 160bcb1 (2-core CPU machine): 0.0360-0.0380 for every shape, tensor and recipe at
# --seed 1; 0.0360-0.0382 over --seed 1..20.


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny CPU GEMMs: more threads only contend (on a shared 2-core machine they made a run 3x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(argv: list[str], tmp_path, capsys) -> tuple[dict, str]:
    out = tmp_path / "ao.json"
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_quick_reports_every_shape_and_variant(tmp_path, capsys):
    res, text = _run(["--quick"], tmp_path, capsys)
    for key in ("device", "torch", "torchao", "torchao_error", "triton", "commit", "shapes", "totals", "targets"):
        assert key in res
    assert (res["torchao"] is None) != (res["torchao_error"] is None)
    assert len(res["shapes"]) == 6
    for s in res["shapes"]:
        rows = {r["variant"]: r for r in s["rows"]}
        assert list(rows) == list(VARIANTS)
        assert rows["bf16"]["available"] and rows["bf16"]["time_ratio"] == 1.0
        assert rows["bf16"]["y_rel_err"] == rows["bf16"]["dx_rel_err"] == rows["bf16"]["dw_rel_err"] == 0.0
        for v in OURS:
            r = rows[v]
            assert r["available"] and r["ms"] > 0 and r["burst_ms"] > 0 and r["time_ratio"] > 0
            for err in ("y_rel_err", "dx_rel_err", "dw_rel_err"):
                assert LO < r[err] < HI, (s["shape"], v, err, r[err])
        for v in TORCHAO:  # CUDA-only kernels: unavailable on CPU, whether torchao is installed or not
            assert not rows[v]["available"] and rows[v]["reason"], rows[v]
            assert f"| {v} | unavailable: " in text
        assert [(p["ours"], p["torchao"]) for p in s["pairs"]] == list(PAIRS)
        assert all(p["ratio"] is None for p in s["pairs"])
    assert res["totals"]["ours_fp8"]["available"] and not res["totals"]["torchao_fp8_blockwise"]["available"]
    assert [t["evaluated"] for t in res["targets"]] == [False, False]
    assert "## all 6 shapes (summed)" in text and "not evaluated (a variant unavailable)" in text


def test_torchao_missing_is_reported_not_raised(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    res, text = _run(["--quick", "--shapes", "mlp.fc1", "--variants", "ours_fp8", "torchao_fp8_blockwise",
                      "torchao_fp8_tensorwise_compiled"], tmp_path, capsys)
    assert res["torchao"] is None and "torchao not importable" in res["torchao_error"]
    (s,) = res["shapes"]
    rows = {r["variant"]: r for r in s["rows"]}
    assert list(rows) == ["bf16", "ours_fp8", "torchao_fp8_blockwise", "torchao_fp8_tensorwise_compiled"]
    assert rows["ours_fp8"]["available"]
    for v in ("torchao_fp8_blockwise", "torchao_fp8_tensorwise_compiled"):
        assert not rows[v]["available"] and rows[v]["reason"].startswith("torchao not importable")
    assert "torchao not importable" in text


def _row(variant: str, ms: float | None, burst: float | None = None) -> dict:
    if ms is None:
        return {"variant": variant, "available": False, "reason": "x"}
    return {"variant": variant, "available": True, "ms": ms, "burst_ms": ms if burst is None else burst}


def test_targets_need_ours_at_most_torchao_on_every_shape():
    faster = [_row("ours_fp8", 1.0), _row("torchao_fp8_blockwise", 2.0)]
    (p,) = pairs(faster)
    assert (p["ours"], p["torchao"], p["ratio"], p["burst_ratio"]) == ("ours_fp8", "torchao_fp8_blockwise", 0.5, 0.5)
    tie = [_row("ours_fp8", 2.0), _row("torchao_fp8_blockwise", 2.0)]
    slower_b2b = [_row("ours_fp8", 1.0, burst=3.0), _row("torchao_fp8_blockwise", 2.0)]
    missing = [_row("ours_fp8", 1.0), _row("torchao_fp8_blockwise", None)]

    def verdict(*shape_rows):
        (t,) = targets([{"shape": f"s{i}", "pairs": pairs(rows)} for i, rows in enumerate(shape_rows)])
        return t["evaluated"], t["met"]

    assert verdict(faster, tie) == (True, True)  # "at least as fast": a tie meets it
    assert verdict(faster, slower_b2b) == (True, False)  # one shape, back to back, misses it
    assert verdict(faster, missing) == (False, False)
