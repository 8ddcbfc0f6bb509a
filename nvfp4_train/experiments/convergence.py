"""Launch the small-scale reproduction of the paper's convergence claims (RECIPE §8) on ONE GPU: several
``train.py`` runs at once, same model, data order, seed and schedule, differing only in precision.

Runs (``--runs``; default all; each is the precision config of its name, ``configs/precision/``):
  bf16          the baseline
  fp8           the paper's FP8 baseline (E4M3, 1x128 / 128x128 blocks)
  nvfp4         the paper's NVFP4 recipe (2-D weights, RHT on wgrad, SR on gradients, bf16 blocks)
  nvfp4_no_rht  ... without the Random Hadamard Transform
  nvfp4_no_sr   ... with round-to-nearest gradients
  nvfp4_1d      ... with 1x16 weight blocks (two quantizations of W)
  nvfp4_all_blocks  ... with every block in NVFP4 (no bf16 blocks)
  mxfp4         MXFP4 (32-element blocks, power-of-two scales)
  nvfp4_to_bf16 the paper's NVFP4 recipe, forward GEMMs in bf16 for the last 20% of steps (App. D)

Each run writes ``<out>/<name>/`` (resolved config, ``metrics.jsonl``, its command line in ``command.txt``),
then ``scripts/plot_runs.py`` plots loss vs tokens and the relative difference to bf16 (``loss.png``; with several
seeds ``seeds_val_loss.png``, paired by seed: ``plot_runs.py --seeds-dir``), and a table of the final validation
losses is printed (``--summarize`` prints it for runs already made).

``--seeds S1 S2 ...`` repeats every run with each seed (``experiment.seed``: the initial weights and the
stochastic-rounding keys), all with the same data order (``data.seed`` = ``--data-seed``); the runs are then
named ``<name>_s<seed>``, and the table gives each recipe's mean and sample standard deviation over its seeds
(the run-to-run spread that one seed per recipe cannot show) and its difference to bf16 paired by seed, with a
standard error.

    python3 scripts/convergence.py --out runs/convergence --steps 300 -- model=small data.seq_length=1024
    python3 scripts/convergence.py --out runs/seeds --runs bf16 nvfp4 --seeds 1 2 3 -- model=small
    python3 scripts/convergence.py --summarize runs/seeds   # the table again, from the runs' metrics.jsonl
    python3 scripts/convergence.py --dry-run          # print the commands

Anything after ``--`` is passed to every run (Hydra overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

RUNS: dict[str, list[str]] = {
    "bf16": ["precision=bf16"],
    "fp8": ["precision=fp8"],
    "nvfp4": ["precision=nvfp4"],
    "nvfp4_no_rht": ["precision=nvfp4_no_rht"],
    "nvfp4_no_sr": ["precision=nvfp4_no_sr"],
    "nvfp4_1d": ["precision=nvfp4_1d"],
    "nvfp4_all_blocks": ["precision=nvfp4_all_blocks"],
    "mxfp4": ["precision=mxfp4"],
    "nvfp4_to_bf16": ["precision=nvfp4", "precision.switch.at_fraction=0.8"],
}


def run_name(name: str, seed: int, seeds: list[int]) -> str:
    """The run directory's name: the recipe's alone with one seed, ``<name>_s<seed>`` with several."""
    return name if len(seeds) == 1 else f"{name}_s{seed}"


def _eval_records(metrics: Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every evaluation record in a run's ``metrics.jsonl``, in file order."""
    out = []
    for line in metrics.read_text().splitlines():
        if '"eval"' in line:
            r = json.loads(line)
            if r.get("type") == "eval" and "val_loss" in r:
                out.append((int(r["step"]), float(r["val_loss"])))
    return out


def final_val_loss(metrics: Path) -> tuple[int, float] | None:
    """(step, val_loss) of the last evaluation record in a run's ``metrics.jsonl``; None if it has none."""
    records = _eval_records(metrics)
    return records[-1] if records else None


_SEEDED = re.compile(r"^(?P<name>.+)_s(?P<seed>-?\d+)$")


def recipe_order(names) -> list[str]:
    """``names`` in table and plot order: the recipes of ``RUNS`` in their order, then any others sorted."""
    names = set(names)
    return [n for n in RUNS if n in names] + sorted(names - set(RUNS))


def group_runs(out: Path) -> dict[str, dict[str | None, Path]]:
    """The run directories under ``out`` that hold a ``metrics.jsonl``, by recipe and seed: ``<name>_s<seed>``
    is ``{name: {seed: dir}}``, any other ``<run>`` is ``{run: {None: dir}}``."""
    groups: dict[str, dict[str | None, Path]] = {}
    for m in sorted(out.glob("*/metrics.jsonl")):
        g = _SEEDED.match(m.parent.name)
        name, seed = (g["name"], g["seed"]) if g else (m.parent.name, None)
        groups.setdefault(name, {})[seed] = m.parent
    return groups


def summarize(out: Path) -> str:
    """A markdown table of the final validation loss per recipe under ``out`` (every ``<run>/metrics.jsonl``):
    runs named ``<name>_s<seed>`` are grouped by ``<name>``; mean, sample standard deviation (n > 1) and the
    mean's difference to bf16's in %. Runs whose last evaluation is at another step than the most common one
    (stopped early) are listed apart and left out of the means.

    With seeds, the last column pairs each run with bf16's run of the same seed (same initial weights and data
    order): the mean over seeds of ``run / bf16 - 1`` in %, with its standard error (sample sd / sqrt(n)) and
    the number of pairs. The seed moves every recipe's loss alike to some degree, so the paired difference is
    the comparison the seeds are for; the unpaired means carry the seed-to-seed spread of both."""
    finals: dict[str, list[tuple[str, str | None, int, float]]] = {}
    for name, runs in group_runs(out).items():
        for seed, d in runs.items():
            f = final_val_loss(d / "metrics.jsonl")
            if f is not None:
                finals.setdefault(name, []).append((d.name, seed, *f))
    if not finals:
        return f"no evaluation records under {out}"
    steps = [step for rs in finals.values() for _, _, step, _ in rs]
    step = statistics.mode(steps)
    rows: dict[str, dict[str | None, float]] = {}
    short = []
    for name, rs in finals.items():
        short += [f"{run} (last evaluation at step {st})" for run, _, st, _ in rs if st != step]
        vals = {seed: v for _, seed, st, v in rs if st == step}
        if vals:
            rows[name] = vals
    bf16 = rows.get("bf16", {})
    base = statistics.fmean(bf16.values()) if bf16 else None
    order = recipe_order(rows)
    lines = [f"final validation loss at step {step}", "",
             "| run | seeds | mean | sd | vs bf16 | paired vs bf16 (mean ± s.e., pairs) |",
             "|---|---|---|---|---|---|"]
    for n in order:
        v = list(rows[n].values())
        mean = statistics.fmean(v)
        sd = f"{statistics.stdev(v):.4f}" if len(v) > 1 else "–"
        rel = "–" if base is None or n == "bf16" else f"{100 * (mean / base - 1):+.2f}%"
        d = [100 * (x / bf16[s] - 1) for s, x in rows[n].items() if s is not None and s in bf16]
        paired = "–"
        if n != "bf16" and len(d) > 1:
            paired = f"{statistics.fmean(d):+.2f}% ± {statistics.stdev(d) / len(d) ** 0.5:.2f}%, {len(d)}"
        lines.append(f"| {n} | {len(v)} | {mean:.4f} | {sd} | {rel} | {paired} |")
    if short:
        lines += ["", "left out (stopped early): " + "; ".join(short)]
    return "\n".join(lines)


def eval_losses(metrics: Path) -> dict[int, float]:
    """{step: val_loss} of every evaluation record in a run's ``metrics.jsonl`` (a step evaluated again: the later)."""
    return dict(_eval_records(metrics))


def paired_curves(out: Path, every: int = 1) -> str:
    """A markdown table of each recipe's validation loss relative to bf16's run of the same seed at every
    ``every``-th evaluation step: ``run / bf16 - 1`` in %, the mean over the seeds that have both, with its
    standard error (sample sd / sqrt(n)) when there are several (the paper's Fig. 2/4, as numbers)."""
    groups = group_runs(out)
    if "bf16" not in groups:
        return f"no bf16 runs under {out}: the curves are relative to bf16"
    curves = {name: {seed: eval_losses(d / "metrics.jsonl") for seed, d in runs.items()}
              for name, runs in groups.items()}
    base = curves["bf16"]
    steps = sorted({st for c in base.values() for st in c})[every - 1::every]
    lines = ["| run | " + " | ".join(str(st) for st in steps) + " |", "|---|" + "---|" * len(steps)]
    for name in recipe_order(curves):
        if name == "bf16":
            continue
        cells = []
        for st in steps:
            d = [100 * (c[st] / base[seed][st] - 1) for seed, c in curves[name].items()
                 if seed in base and st in c and st in base[seed]]
            if not d:
                cells.append("–")
            elif len(d) == 1:
                cells.append(f"{d[0]:+.2f}")
            else:
                cells.append(f"{statistics.fmean(d):+.2f} ± {statistics.stdev(d) / len(d) ** 0.5:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234],
                    help="experiment.seed of each repeat (initial weights, stochastic-rounding keys); default 1234")
    ap.add_argument("--data-seed", type=int, default=1234, help="data.seed of every run (one data order)")
    ap.add_argument("--summarize", type=Path, metavar="DIR",
                    help="print the final-loss table of the runs under DIR and exit (launches nothing)")
    ap.add_argument("--curves", type=int, default=0, metavar="K",
                    help="with --summarize: also the loss relative to bf16 (paired by seed) at every K-th evaluation")
    ap.add_argument("--timeout", type=float, default=None, help="seconds; SIGTERM the runs after this")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.summarize is not None:
        if not a.summarize.is_dir():
            ap.error(f"--summarize: {a.summarize} is not a directory")
        print(summarize(a.summarize))
        if a.curves > 0:
            print()
            print(paired_curves(a.summarize, every=a.curves))
        return 0
    if len(set(a.seeds)) != len(a.seeds):
        ap.error(f"--seeds repeats a seed: {a.seeds}")
    procs = []
    names = [(run_name(n, seed, a.seeds), n, seed) for seed in a.seeds for n in a.runs]
    for name, recipe, seed in names:
        run_dir = a.out / name
        cmd = [sys.executable, str(ROOT / "train.py"), *RUNS[recipe], f"schedule.train_steps={a.steps}",
               f"experiment.name={name}", f"experiment.run_dir={run_dir}", f"experiment.seed={seed}",
               f"data.seed={a.data_seed}", *extra]
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
        metrics = [str(a.out / n / "metrics.jsonl") for n, _, _ in names if (a.out / n / "metrics.jsonl").exists()]
        if metrics:
            plot = [sys.executable, "-m", "nvfp4_train.experiments.plots"]
            if len(a.seeds) > 1 and "bf16" in a.runs:  # each recipe against bf16's run of its seed
                plot += ["--seeds-dir", str(a.out), "--metric", "val_loss", "--out", str(a.out / "seeds_val_loss.png")]
            else:
                plot += [*metrics, "--out", str(a.out / "loss.png")]
            subprocess.run(plot, cwd=ROOT)
            print(summarize(a.out), flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
