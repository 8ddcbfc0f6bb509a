"""Smoke tests of the GPU scripts' CPU modes, so they do not rot between GPU runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.side_by_side import captured, completed, side_by_side

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> tuple[Path, dict]:
    """The runs of bench_train.py and bench_checkpoint.py that the tests below check, run side by side."""
    out = tmp_path_factory.mktemp("scripts")
    args = {
        "quick": ["scripts/bench_train.py", "--quick", "--recipes", "bf16", "nvfp4", "--json", str(out / "quick.json"),
                  "--cuda-graph", "off", "--work-dir", str(out / "work"), "data.seed=7"],
        "grad_accum": ["scripts/bench_train.py", "--quick", "--recipes", "nvfp4", "--grad-accum", "2", "--json",
                       str(out / "grad_accum.json"), "--nonfinite-check", "after_skip"],
        "ckpt": ["scripts/bench_checkpoint.py", "--model", "tiny", "--out", str(out / "ckpts"), "--json",
                 str(out / "ckpt.json")],
    }
    codes = side_by_side({name: captured(a, out / name, cwd=ROOT, env=_env()) for name, a in args.items()})
    return out, {name: completed(out / name, rc) for name, rc in codes.items()}


def test_bench_train_quick(script_runs):
    """The benchmark builds the trainer of each case (random tokens as an indexed dataset) and times its own
    ``train_step``; overrides after the options reach every case's config (here: the data order's seed), and so
    does the ``--cuda-graph`` mode (each row and the table name it)."""
    tmp_path, runs = script_runs
    p = runs["quick"]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((tmp_path / "quick.json").read_text())
    assert [(r["recipe"], r["cuda_graph"]) for r in rows] == [("bf16", "off"), ("nvfp4", "off")]
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["logged_tokens_per_s"] > 0 for r in rows)
    assert "| tiny | off | on | nvfp4 |" in p.stdout and all(r["fusion"] == "on" for r in rows)
    assert all(r["nonfinite_check"] == "every_step" and r["nonfinite_checked_layers"] > 0 for r in rows)
    cfg = (tmp_path / "work" / "tiny_nvfp4" / "config.yaml").read_text()  # the trainer's own run directory
    assert "seed: 7" in cfg and "nvfp4" in cfg and "cuda_graph: 'off'" in cfg
    assert ("fusion:\n  rope: true\n  qkv_rope: true\n  cross_entropy: true\n  wgrad_accumulation: true\n"
            "  mamba: true") in cfg


def test_bench_train_grad_accum_counts_every_micro_batch(script_runs):
    """--grad-accum 2: a step is two micro-batches (the second with the weight cache filled) and an optimizer
    step; tokens/s counts both micro-batches; --nonfinite-check reaches the trainer's config."""
    tmp_path, runs = script_runs
    p = runs["grad_accum"]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    (r,) = json.loads((tmp_path / "grad_accum.json").read_text())
    assert r["grad_accum"] == 2
    assert r["nonfinite_check"] == "after_skip" and r["nonfinite_checked_layers"] == 0  # the check is off
    assert r["tokens_per_s"] == pytest.approx(2 * r["micro_batch"] * r["seq"] / r["step_s"], rel=1e-9)


def test_bench_checkpoint_tiny(script_runs):
    tmp_path, runs = script_runs
    out, root, p = tmp_path / "ckpt.json", tmp_path / "ckpts", runs["ckpt"]
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
    assert len(lines) == 9
    assert all("schedule.train_steps=7" in line and "model=tiny" in line for line in lines)
    assert any("precision=nvfp4_no_rht" in line for line in lines)  # the named precision configs
    assert any("precision=nvfp4 precision.switch.at_fraction=0.8" in line for line in lines)  # the late switch


def test_convergence_seeds_name_runs_and_share_one_data_order():
    p = _run(["scripts/convergence.py", "--dry-run", "--runs", "bf16", "nvfp4_no_sr", "--seeds", "7", "8",
              "--data-seed", "5", "--", "model=tiny"])
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if "train.py" in line]
    assert len(lines) == 4
    for name, seed in [("bf16", 7), ("nvfp4_no_sr", 7), ("bf16", 8), ("nvfp4_no_sr", 8)]:
        assert any(f"experiment.name={name}_s{seed} " in line and f"experiment.seed={seed} " in line
                   for line in lines), (name, seed)
    assert all("data.seed=5 " in line for line in lines)
    bad = _run(["scripts/convergence.py", "--dry-run", "--seeds", "3", "3"])
    assert bad.returncode != 0 and "repeats a seed" in bad.stderr


def test_convergence_runs_seeds_then_plots_and_summarizes(tmp_path):
    """The launch path end to end: two seeds of the tiny model train, then the paired plot and the table."""
    from tests.trainer.runs import TINY  # the trainer tests' GPT stand-in and token files (a clean clone has no data/)

    out = tmp_path / "cv"
    overrides = [o for o in TINY if not o.startswith("schedule.eval_interval=")] + [
        "schedule.eval_interval=3", "checkpoint.save_at_end=false"]
    p = _run(["scripts/convergence.py", "--out", str(out), "--runs", "bf16", "--steps", "3", "--seeds", "1", "2",
              "--", *overrides])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + "".join(
        (out / f"bf16_s{s}" / "stdout.log").read_text()[-1500:] for s in (1, 2) if (out / f"bf16_s{s}").exists())
    assert (out / "seeds_val_loss.png").stat().st_size > 0
    assert "final validation loss at step 3" in p.stdout and "| bf16 | 2 |" in p.stdout


def test_convergence_summarize_groups_seeds_and_leaves_out_short_runs(tmp_path):
    from nvfp4_train.experiments.convergence import summarize

    def run(name: str, evals: list[tuple[int, float]]) -> None:
        d = tmp_path / name
        d.mkdir()
        recs = [{"type": "train", "step": 1, "loss": 9.0}] + [{"type": "eval", "step": s, "val_loss": v}
                                                              for s, v in evals]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")

    run("bf16_s1", [(10, 5.0), (20, 4.0)])
    run("bf16_s2", [(10, 5.0), (20, 4.2)])
    run("nvfp4_no_sr_s1", [(10, 5.1), (20, 4.4)])
    run("nvfp4_no_sr_s2", [(10, 5.1), (20, 4.2)])
    run("mxfp4_s1", [(10, 5.3)])  # stopped early: its last evaluation is at step 10
    table = summarize(tmp_path)
    assert "final validation loss at step 20" in table
    assert "| bf16 | 2 | 4.1000 | 0.1414 | – | – |" in table
    # paired by seed: 4.4 / 4.0 - 1 = +10%, 4.2 / 4.2 - 1 = 0%: mean +5%, s.e. = sd(10, 0) / sqrt(2) = 5%
    assert "| nvfp4_no_sr | 2 | 4.3000 | 0.1414 | +4.88% | +5.00% ± 5.00%, 2 |" in table
    assert "mxfp4_s1 (last evaluation at step 10)" in table and "| mxfp4 |" not in table
    assert summarize(tmp_path / "bf16_s1").startswith("no evaluation records")  # nothing below a run dir
    from nvfp4_train.experiments.convergence import paired_curves

    curves = paired_curves(tmp_path).splitlines()
    assert curves[0] == "| run | 10 | 20 |"
    # step 10: +2% in both seeds (s.e. 0); step 20 as the final table; mxfp4 has one seed and no step 20
    assert "| nvfp4_no_sr | +2.00 ± 0.00 | +5.00 ± 5.00 |" in curves
    assert "| mxfp4 | +6.00 | – |" in curves
    assert paired_curves(tmp_path, every=2).splitlines()[0] == "| run | 20 |"


def test_layout_check_parses_layouts():
    from nvfp4_train.experiments.layout_check import Layout, parse_layout

    assert parse_layout("1") == Layout("1")
    assert parse_layout("tp2sp") == Layout("tp2sp", tp=2, sp=True)
    assert parse_layout("tp2pp2dp2:tp2") == Layout("tp2pp2dp2", tp=2, pp=2, dp=2, resume_from="tp2")
    assert parse_layout("pp4").world == 4
    for bad, msg in [("tp", "tpN/ppN/dpN"), ("dp2sp", "needs tp >= 2"), ("1:tp2", "resumes nothing"),
                     ("tp1", "one process"), ("tp2x", "tpN/ppN/dpN")]:
        try:
            parse_layout(bad)
        except ValueError as e:
            assert msg in str(e), (bad, str(e))
        else:
            raise AssertionError(f"{bad!r} was accepted")
    # a layout resuming one that does not come before it: refused before anything runs
    p = _run(["scripts/layout_check.py", "--out", "unused", "--layouts", "1", "dp2:tp2", "tp2"], timeout=60)
    assert p.returncode == 2 and "tp2 must be an earlier multi-process layout" in p.stderr, p.stderr[-2000:]
    p = _run(["scripts/layout_check.py", "--out", "unused", "--layouts", "1", "tp2", "pp2", "tp2:pp2"], timeout=60)
    assert p.returncode == 2 and "layout tp2 given twice" in p.stderr, p.stderr[-2000:]


FP32_U = 2.0 ** -24  # unit roundoff of fp32

# What the layout tests compare, and why with these bounds. Only the first step after a resume is compared,
# against the run whose state at that point is the checkpoint it resumed (the reference for a layout resuming
# the reference; the source layout for NAME:FROM, whose in-memory state after the save is what it saved):
# both compute that step's loss from the same weights on the same batch, before any update, so the
# comparison is lockstep, not exposed to rounding differences that Adam amplifies over later steps (the
# multi-step comparison is the script's own --rtol check, a GPU-scale heuristic: here --rtol inf, it still
# fails on a NaN). The step's loss is the mean of the two micro-batch losses. Under PP (activations move
# between stages exactly) and under DP (each rank runs one of the same micro-batches) with the same TP, every
# micro-batch loss is bitwise the one of the run compared with: same weights, same ops, same shapes. The
# mean is fl32((a + b) / 2) on one DP replica (the division by 2 is exact) and (a / 2 + b / 2) summed in
# float64 over DP ranks (exact for fp32 a, b), so two such losses differ by at most one fp32 rounding of the
# exact mean: relative 2^-24, bound 2 u. Layouts that change TP change the GEMMs' bf16 reductions: they must
# run and give a finite loss here; that the optimizer state survives a TP/PP reshard bit for bit is
# tests/trainer/test_train_dist.py's test.
LAYOUT_STEPS = ["--steps", "4", "--save-at", "2", "--save-at2", "3", "--rtol", "inf"]


def _loss_at(row: dict, step: int) -> float:
    (loss,) = [x for s, x, _ in row["losses"] if s == step]
    return loss


def _lockstep(got: float, want: float) -> None:
    assert abs(got - want) <= 2 * FP32_U * abs(want), (got, want)


@pytest.mark.dist
def test_layout_check_concurrent_waves_after_a_prewarm(tmp_path):
    """The whole script on two gloo ranks (GPTModel stand-in, bf16), --prewarm --concurrent: first one step of
    each distinct layout from scratch, all at once; then TP=2 and PP=2 resume the reference at once (four gloo
    processes), and DP=2 resumes PP=2's checkpoint in the second wave; every layout runs, the lockstep steps
    agree (see above), and the rows say the GPUs were shared. (The sequential mode: the four-rank test.)"""
    from tests.trainer.runs import TINY

    out = tmp_path / "layout"
    p = _run(["scripts/layout_check.py", "--out", str(out), "--layouts", "1", "tp2", "pp2", "dp2:pp2",
              *LAYOUT_STEPS, "--concurrent", "--prewarm", "--",
              *[a for a in TINY if not a.startswith(("schedule.train_steps", "checkpoint.interval"))]], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads((out / "layout_check.json").read_text())}
    assert list(rows) == ["1", "tp2", "pp2", "dp2"]
    assert rows["tp2"]["resumed"] == rows["pp2"]["resumed"] == "1 @ 2" and rows["dp2"]["resumed"] == "pp2 @ 3"
    assert [s for s, _, _ in rows["tp2"]["losses"]] == [3, 4] and [s for s, _, _ in rows["dp2"]["losses"]] == [4]
    assert all(math.isfinite(r["max_rel"]) for r in rows.values())
    # tokens/s: the median over the steps after the first (dp2 trains one step: none)
    assert all(rows[k]["tokens_per_s"] > 0 for k in ("1", "tp2", "pp2")) and math.isnan(rows["dp2"]["tokens_per_s"])
    _lockstep(_loss_at(rows["pp2"], 3), rows["pp2"]["losses"][0][2])  # vs the reference's step 3
    _lockstep(_loss_at(rows["dp2"], 4), _loss_at(rows["pp2"], 4))
    assert all(rows[k]["shared_gpus"] for k in ("tp2", "pp2", "dp2"))
    assert "not a throughput" in p.stdout
    assert not (out / "1" / "checkpoints").exists()  # removed without --keep-checkpoints
    # --prewarm: one step of each distinct layout from scratch first (the run-length overrides replaced), no checkpoint
    for name in ("1", "tp2", "pp2", "dp2"):
        assert f"prewarm {name}: done" in p.stdout, p.stdout[-3000:]
        recs = [json.loads(x) for x in (out / "prewarm" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs if r["type"] == "train"] == [1]
        assert not list((out / "prewarm" / name).glob("checkpoints/step_*"))


@pytest.mark.dist
def test_layout_check_four_rank_combinations_nvfp4(tmp_path):
    """The combinations of the multi-GPU issue on four gloo ranks, hybrid tiny model, nvfp4 recipe (RHT and
    stochastic rounding): TP2xPP2 resumes the one-process checkpoint of step 2, TP2xDP2 resumes the checkpoint
    TP2xPP2 wrote at step 3 (a checkpoint written under a 4-rank layout continues under another).

    Lockstep (see above): TP2xDP2's step 4 is computed from the checkpoint TP2xPP2 saved after its step 3, so it
    must be TP2xPP2's step 4 within 2 u: the same TP, no fprop operand stochastically rounded, PP moving
    activations exactly, and only the mean of the two micro-batch losses evaluated differently: the weights
    survive the PP2 -> PP1 reshard intact. The later steps differ by more than rounding: a layout changes the
    stochastic-rounding draws (the per-layer SR counters are carried only when the layout is unchanged, and TP
    draws by position in the local shard), so they are only checked to be finite."""
    from tests.trainer.runs import TINY

    out = tmp_path / "layout"
    tiny = [a for a in TINY if a.split("=")[0].split(".")[0] not in ("model", "experiment")
            and not a.startswith(("schedule.train_steps", "checkpoint.interval"))]
    p = _run(["scripts/layout_check.py", "--out", str(out), "--layouts", "1", "tp2pp2", "tp2dp2:tp2pp2",
              *LAYOUT_STEPS, "--", "model=tiny", "precision=nvfp4", *tiny], timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads((out / "layout_check.json").read_text())}
    assert list(rows) == ["1", "tp2pp2", "tp2dp2"]
    assert rows["tp2pp2"]["gpus"] == rows["tp2dp2"]["gpus"] == 4
    assert rows["tp2pp2"]["resumed"] == "1 @ 2" and rows["tp2dp2"]["resumed"] == "tp2pp2 @ 3"
    assert [s for s, _, _ in rows["tp2pp2"]["losses"]] == [3, 4]
    assert [s for s, _, _ in rows["tp2dp2"]["losses"]] == [4]
    assert all(math.isfinite(r["max_rel"]) for r in rows.values()), {k: r["max_rel"] for k, r in rows.items()}
    _lockstep(_loss_at(rows["tp2dp2"], 4), _loss_at(rows["tp2pp2"], 4))


def test_layout_check_compare_rows():
    """The script's per-row comparison with the reference's records (the --rtol decision uses max_rel)."""
    from nvfp4_train.experiments.layout_check import compare

    ref = {3: {"step": 3, "loss": 10.0, "grad_norm": 2.0}, 4: {"step": 4, "loss": 8.0, "grad_norm": 1.0}}
    row = compare([{"step": 3, "loss": 10.5, "grad_norm": 2.0}, {"step": 4, "loss": 8.0, "grad_norm": 1.5}], ref)
    assert row["max_rel"] == 0.05 and row["max_rel_grad_norm"] == 0.5
    assert row["losses"] == [(3, 10.5, 10.0), (4, 8.0, 8.0)]
    assert "no reference" in compare([{"step": 5, "loss": 1.0}], ref)["error"]
    assert "no reference" in compare([], ref)["error"]
    assert math.isnan(compare([{"step": 3, "loss": float("nan")}], ref)["max_rel"])  # then max_rel <= rtol fails


def test_launch_inventory_nvfp4_layer_budget(tmp_path):
    """The NVFP4 layer's launches per fwd+bwd with the weight cached (the GPU code path, counted under the
    interpreter): x and dy each one amax pass and one fused row+column quantize, one dequantize launch for both
    operands per GEMM (which also forms alpha: no torch division or product), the three GEMMs (cuBLASLt, alpha in
    the epilogue; under the interpreter ``mm`` and an interpreter-only alpha pass) and the two amax buffer fills:
    12. A new launch in the hot path shows up here."""
    import os

    out = tmp_path / "inv.json"
    p = subprocess.run([sys.executable, "scripts/launch_inventory.py", "--recipe", "nvfp4", "bf16", "--gemm-engine",
                        "cublas", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    nv, bf = json.loads(out.read_text())
    assert nv["triton"] == {"_amax_grouped_kernel": 2, "_quantize_grouped_kernel": 2, "_dequant_pair_kernel": 3}
    assert nv["interpreter_only"]["triton _alpha_scale_kernel"] == 3
    assert nv["torch_kernels"] == {"zeros": 2, "mm": 3}
    assert nv["total_launches"] == 12
    assert bf["torch_kernels"] == {"mm": 3} and not bf["triton"]
    p = subprocess.run([sys.executable, "scripts/launch_inventory.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(ROOT)})
    assert p.returncode != 0 and "TRITON_INTERPRET=1" in p.stderr


def test_bench_host_prints_its_fields(tmp_path):
    """scripts/bench_host.py (host time of a layer's fwd+bwd, launches stubbed) runs and reports every field."""
    out = tmp_path / "host.json"
    p = subprocess.run([sys.executable, "scripts/bench_host.py", "--recipe", "nvfp4", "bf16", "--layer", "function",
                        "checked", "--iters", "3", "--warmup", "2", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "| recipe | layer | host us |" in p.stdout and "| nvfp4 | checked |" in p.stdout
    rows = json.loads(out.read_text())
    assert [(r["recipe"], r["layer"]) for r in rows] == [("nvfp4", "function"), ("bf16", "function"),
                                                         ("nvfp4", "checked"), ("bf16", "checked")]
    nv = rows[0]
    assert nv["host_us"] > 0 and nv["aten_ops"] > 0 and nv["triton"]["_quantize_grouped_kernel"] == 2
    assert nv["launches"] == 12 and rows[2]["launches"] == 12 + 2  # the non-finite check: one launch, twice
    assert "mm" in nv["torch_kernels"] and "_to_copy" in nv["interpreter_only"]


def test_plot_seeds_pairs_runs_by_seed(tmp_path):
    import numpy as np

    from nvfp4_train.experiments.plots import main, paired_difference

    # two seeds; the run is 10% and 20% above its own seed's baseline where both logged (x = 1, 2); the
    # baseline of seed 2 also logged x = 3, which the run of seed 2 did not: left out
    x12, x123 = np.array([1.0, 2.0]), np.array([1.0, 2.0, 3.0])
    x, mean, se = paired_difference([(x12, np.array([1.1, 2.2])), (x12, np.array([1.2, 2.4]))],
                                    [(x12, np.array([1.0, 2.0])), (x123, np.array([1.0, 2.0, 7.0]))])
    assert x.tolist() == [1.0, 2.0]
    np.testing.assert_allclose(mean, [15.0, 15.0])
    np.testing.assert_allclose(se, [5.0, 5.0])  # sd(10, 20) / sqrt(2)
    assert paired_difference([(x12, np.array([1.1, 2.2]))], [(x12, np.array([1.0, 2.0]))])[2] is None

    def run(name: str, losses: list[float]) -> None:
        d = tmp_path / "seeds" / name
        d.mkdir(parents=True)
        recs = [{"type": "eval", "step": i + 1, "tokens": 100 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")

    for seed, k in ((1, 1.1), (2, 1.2)):
        run(f"bf16_s{seed}", [5.0, 4.0])
        run(f"nvfp4_s{seed}", [5.0 * k, 4.0 * k])
    out = tmp_path / "seeds.png"
    assert main(["--seeds-dir", str(tmp_path / "seeds"), "--metric", "val_loss", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    with pytest.raises(SystemExit, match="no seeded runs of the baseline 'fp8'"):
        main(["--seeds-dir", str(tmp_path / "seeds"), "--metric", "val_loss", "--baseline", "fp8", "--out", str(out)])


def test_no_script_or_test_imports_a_script():
    """Scripts are command lines over the library: neither a script nor a test imports ``scripts.*`` (what both
    need lives in an importable module, e.g. ``nvfp4_train.bench``)."""
    import ast

    offenders = []
    for path in sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("tests/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n == "scripts" or n.startswith("scripts.")]
    assert not offenders, offenders


def test_bench_data_loader(tmp_path):
    """The loader benchmark reads steps of micro-batches with and without the worker and reports each."""
    p = _run(["scripts/bench_data_loader.py", "--cases", "small", "--micro-batches", "2", "--steps", "2",
              "--gap-ms", "0", "--json", str(tmp_path / "loader.json")])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((tmp_path / "loader.json").read_text())
    got = [(r["case"], r["seq"], r["micro_batch"], r["num_workers"]) for r in rows]
    assert got == [("small", 2048, 8, 1), ("small", 2048, 8, 0)]
    assert all(0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in rows)
    assert "| small | 8 x 2048 | 2 | 1 |" in p.stdout
