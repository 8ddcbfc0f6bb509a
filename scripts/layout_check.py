#!/usr/bin/env python3
"""Multi-GPU check: the same training continues identically under another parallel layout, and throughput
per layout. For each layout in ``--layouts`` (e.g. ``1 tp2 pp2 dp2``):

1. The reference: ``train.py`` on one process for ``--steps`` steps, saving a checkpoint at ``--save-at``.
2. Every other layout resumes that checkpoint (``checkpoint.resume=<step dir>``) under torchrun with its
   TP/PP/DP and trains to ``--steps``: its per-step losses after the checkpoint are compared with the
   reference's (megatron reshards the model; the data order comes from the consumed samples).
3. Tokens/s of each layout over its steps after the checkpoint (from ``metrics.jsonl``).

A layout is ``1`` (one process), ``tpN``, ``ppN``, ``dpN`` or a combination such as ``tp2pp2``; the world
size is the product. Extra Hydra overrides after ``--`` go to every run.

    python3 scripts/layout_check.py --out runs/layout --layouts 1 tp2 pp2 dp2 -- model=small precision=nvfp4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_layout(text: str) -> dict[str, int]:
    if text == "1":
        return {"tp": 1, "pp": 1, "dp": 1}
    parts = dict(re.findall(r"(tp|pp|dp)(\d+)", text))
    if not parts or "".join(f"{k}{v}" for k, v in re.findall(r"(tp|pp|dp)(\d+)", text)) != text:
        raise ValueError(f"layout {text!r}: use '1' or tpN/ppN/dpN parts, e.g. tp2pp2")
    return {k: int(parts.get(k, 1)) for k in ("tp", "pp", "dp")}


def run(cmd: list[str], log: Path, env: dict) -> int:
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", nargs="+", default=["1", "tp2", "pp2", "dp2"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-at", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-2,
                    help="relative loss difference allowed per step (TP/DP change bf16 summation orders)")
    a = ap.parse_args(argv)
    from nvfp4_train.metrics import load_metrics

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    common = [f"schedule.train_steps={a.steps}", "logging.wandb=disabled", "logging.tensorboard=false",
              "logging.progress=lines", *extra]
    ref_dir = a.out / "ref_1"
    ref_dir.mkdir(parents=True, exist_ok=True)
    rc = run([sys.executable, "train.py", *common, f"checkpoint.interval={a.save_at}",
              f"experiment.run_dir={ref_dir}", "experiment.name=ref_1"], ref_dir / "stdout.log", env)
    if rc != 0:
        print(f"reference run failed ({rc}); see {ref_dir / 'stdout.log'}")
        return 1
    ckpt = ref_dir / "checkpoints" / f"step_{a.save_at:07d}"
    ref = {r["step"]: r for r in load_metrics(ref_dir)}
    results = []
    ok = True
    for text in a.layouts:
        lay = parse_layout(text)
        world = lay["tp"] * lay["pp"] * lay["dp"]
        if world == 1:
            recs = [ref[s] for s in sorted(ref) if s > a.save_at]
            results.append(dict(layout=text, world=1, max_rel=0.0, tokens_per_s=_tps(recs)))
            continue
        d = a.out / text
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "train.py", *common, f"parallel.tp={lay['tp']}", f"parallel.pp={lay['pp']}",
               f"checkpoint.resume={ckpt}", "checkpoint.interval=0", f"experiment.run_dir={d}",
               f"experiment.name={text}"]
        rc = run(cmd, d / "stdout.log", env)
        if rc != 0:
            results.append(dict(layout=text, world=world, error=f"exit {rc}, see {d / 'stdout.log'}"))
            ok = False
            continue
        recs = [r for r in load_metrics(d) if r["step"] > a.save_at]
        rel = max(abs(r["loss"] - ref[r["step"]]["loss"]) / abs(ref[r["step"]]["loss"]) for r in recs)
        ok &= rel <= a.rtol
        results.append(dict(layout=text, world=world, max_rel=rel, tokens_per_s=_tps(recs),
                            losses=[(r["step"], r["loss"], ref[r["step"]]["loss"]) for r in recs]))
    (a.out / "layout_check.json").write_text(json.dumps(results, indent=1))
    print("| layout | GPUs | max rel. loss diff vs 1 GPU (steps after resume) | tokens/s |")
    print("|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['layout']} | {r['world']} | {r['error']} | |")
        else:
            print(f"| {r['layout']} | {r['world']} | {r['max_rel']:.2e} | {r['tokens_per_s']:,.0f} |")
    return 0 if ok else 1


def _tps(recs: list[dict]) -> float:
    vals = [r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s")]  # the first step after start warms up
    return sum(vals) / len(vals) if vals else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
