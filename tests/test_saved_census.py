"""The saved-tensor census (scripts/saved_census.py, nvfp4_train.bench.saved_census) on the tiny model: its table's total must equal the saved bytes measured another way.

The independent measurement: a bare ``saved_tensors_hooks`` pack hook that keeps every saved tensor, the
distinct storages among them (parameters and the inputs left out) summed, plus what the quantized layers
report they keep as ctx attributes (``LinearContext.saved_bytes``, the bytes of the quantized x copy; no hook
sees those). No module stack, no graph walk, no dispatch mode, no categories: a census that drops, double-counts
or misattributes a storage out of the total fails here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.side_by_side import captured, completed, side_by_side

ROOT = Path(__file__).resolve().parents[1]

_INDEPENDENT = r"""
import json, sys
import torch
from nvfp4_train.bench import saved_census as sc
path, recipe = sys.argv[1], sys.argv[2]
if path == "gpu":
    sc.install_gpu_stand_ins("kernel")
model, forward, inputs, _ = sc.build("tiny", recipe, 128, 2)
def key(t):  # the storage, not the view: its own definition, not the script's
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
kept = []
with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
    loss = forward()
skip = {key(p) for p in model.parameters()} | {k[1:] for k in inputs}
storages = {key(t) for t in kept} - skip
from nvfp4_train.precision.megatron_linear import quant_layers
ctx_bytes = sum(m.lctx.saved_bytes for m in quant_layers(model) if not m.lctx.recipe.is_bf16)
print(json.dumps(dict(hooked=sum(k[1] for k in storages), ctx=ctx_bytes)))
"""


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


CASES = [("cpu", "nvfp4"), ("gpu", "nvfp4"), ("gpu", "bf16")]


@pytest.fixture(scope="module")
def census_runs(tmp_path_factory) -> tuple[Path, dict]:
    """The script and the independent count of every case, run side by side."""
    out = tmp_path_factory.mktemp("census")
    jobs = {}
    for path, recipe in CASES:
        args = ["--case", "tiny", "--recipe", recipe, "--seq", "128", "--micro-batch", "2", "--path", path, "--top",
                "500", "--json", str(out / f"{path}_{recipe}.json")]
        jobs[f"{path}_{recipe}_script"] = captured(["scripts/saved_census.py", *args], out / f"{path}_{recipe}_script",
                                                   cwd=ROOT, env=_env())
        jobs[f"{path}_{recipe}_independent"] = captured(["-c", _INDEPENDENT, path, recipe],
                                                        out / f"{path}_{recipe}_independent", cwd=ROOT, env=_env())
    codes = side_by_side(jobs)
    return out, {name: completed(out / name, rc) for name, rc in codes.items()}


@pytest.mark.parametrize("path,recipe", CASES)
def test_saved_census_total_matches_independent_count(census_runs, path, recipe):
    tmp_path, runs = census_runs
    out = tmp_path / f"{path}_{recipe}.json"
    p = runs[f"{path}_{recipe}_script"]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    q = runs[f"{path}_{recipe}_independent"]
    assert q.returncode == 0, q.stderr[-4000:]
    ind = json.loads(q.stdout.strip().splitlines()[-1])
    assert (ind["ctx"] > 0) == (recipe != "bf16")
    assert res["total_bytes"] == ind["hooked"] + ind["ctx"], (res["total_bytes"], ind)
    assert sum(r["bytes"] for r in res["rows"]) == res["total_bytes"]
    assert "| **total** |" in p.stdout
    # the stand-ins save what mamba-ssm saves: dA_cumsum, fp32 [b, heads, chunks, chunk] per Mamba block
    scan = [r for r in res["detail"] if r["category"] == "Mamba: SSD scan" and r["dtype"] == "float32"]
    if path == "gpu":
        assert scan and scan[0]["shape"] == [2, 8, 128 // 32, 32], scan
