#!/usr/bin/env python3
"""Launch the small-scale reproduction of the paper's convergence claims (RECIPE §8) on ONE GPU: several
``train.py`` runs at once, same model, data order, seed and schedule, differing only in precision.

Runs (``--runs``; default all):
  bf16          the baseline
  fp8           the paper's FP8 baseline (E4M3, 1x128 / 128x128 blocks)
  nvfp4         the paper's NVFP4 recipe (2-D weights, RHT on wgrad, SR on gradients, bf16 blocks)
  nvfp4_no_rht  ... without the Random Hadamard Transform
  nvfp4_no_sr   ... with round-to-nearest gradients
  nvfp4_1d      ... with 1x16 weight blocks (two quantizations of W)
  nvfp4_all     ... with every block in NVFP4 (no bf16 blocks)
  mxfp4         MXFP4 (32-element blocks, power-of-two scales)

Each run writes ``<out>/<name>/`` (resolved config, ``metrics.jsonl``, its command line in ``command.txt``),
then ``scripts/plot_runs.py`` plots loss vs tokens and the relative difference to bf16.

    python3 scripts/convergence.py --out runs/convergence --steps 300 -- model=small data.seq_length=1024
    python3 scripts/convergence.py --dry-run          # print the commands

Anything after ``--`` is passed to every run (Hydra overrides).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUNS: dict[str, list[str]] = {
    "bf16": ["precision=bf16"],
    "fp8": ["precision=fp8"],
    "nvfp4": ["precision=nvfp4"],
    "nvfp4_no_rht": ["precision=nvfp4", "precision.ablations.rht=false"],
    "nvfp4_no_sr": ["precision=nvfp4", "precision.ablations.stochastic_rounding=false"],
    "nvfp4_1d": ["precision=nvfp4", "precision.ablations.weight_2d=false"],
    "nvfp4_all": ["precision=nvfp4", "precision.ablations.all_blocks_quantized=true"],
    "mxfp4": ["precision=mxfp4"],
}


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "convergence")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=None, help="seconds; SIGTERM the runs after this")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    procs = []
    for name in a.runs:
        run_dir = a.out / name
        cmd = [sys.executable, str(ROOT / "train.py"), *RUNS[name], f"schedule.train_steps={a.steps}",
               f"experiment.name={name}", f"experiment.run_dir={run_dir}", f"experiment.seed={a.seed}",
               f"data.seed={a.seed}", *extra]
        line = " ".join(shlex.quote(c) for c in cmd)
        print(line, flush=True)
        if a.dry_run:
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command.txt").write_text(line + "\n")
        log = open(run_dir / "stdout.log", "w")
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                             env=dict(os.environ, PYTHONUNBUFFERED="1"))))
    start = time.time()
    codes = {}
    while procs and len(codes) < len(procs):
        for name, p in procs:
            if name not in codes and p.poll() is not None:
                codes[name] = p.returncode
                print(f"[convergence] {name} exited {p.returncode} after {time.time() - start:.0f}s", flush=True)
        if a.timeout and time.time() - start > a.timeout:
            for name, p in procs:
                if name not in codes:
                    p.terminate()  # the trainer saves and exits on SIGTERM
            for name, p in procs:
                if name not in codes:
                    codes[name] = p.wait()
                    print(f"[convergence] {name} stopped (timeout), exit {codes[name]}", flush=True)
        time.sleep(2)
    if procs:
        metrics = [str(a.out / n / "metrics.jsonl") for n in a.runs if (a.out / n / "metrics.jsonl").exists()]
        if metrics:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_runs.py"), *metrics,
                            "--out", str(a.out / "loss.png")], cwd=ROOT)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
