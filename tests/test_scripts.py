"""Smoke tests of the GPU scripts' CPU modes, so they do not rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_bench_train_quick(tmp_path):
    out = tmp_path / "bench.json"
    p = _run(["scripts/bench_train.py", "--quick", "--recipes", "bf16", "nvfp4", "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["recipe"] for r in rows] == ["bf16", "nvfp4"]
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in rows)
    assert "| tiny | nvfp4 |" in p.stdout


def test_bench_checkpoint_tiny(tmp_path):
    out, root = tmp_path / "ckpt.json", tmp_path / "ckpts"
    p = _run(["scripts/bench_checkpoint.py", "--model", "tiny", "--out", str(root), "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["bytes"] > 0
    assert {"sharded_state", "dist_save", "manifest", "commit", "total"} <= set(res["save"])
    assert {"verify", "dist_load", "optim_load", "total"} <= set(res["load"])
    assert "| manifest |" in p.stdout and "| dist_load |" in p.stdout
    assert not root.exists()  # removed at the end without --keep


def test_convergence_dry_run_lists_every_run():
    p = _run(["scripts/convergence.py", "--dry-run", "--steps", "7", "--", "model=tiny"])
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if "train.py" in line]
    assert len(lines) == 8
    assert all("schedule.train_steps=7" in line and "model=tiny" in line for line in lines)
    assert any("precision.ablations.rht=false" in line for line in lines)
