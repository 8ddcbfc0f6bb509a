"""Loss against tokens for several runs, and each run's relative difference to a baseline run, as a PNG.

    python scripts/plot_runs.py runs/bf16 runs/fp8 runs/nvfp4 --baseline runs/bf16 --out loss.png
    python scripts/plot_runs.py runs/a/metrics.jsonl runs/b --metric val_loss --smooth 1

Each argument is a run directory (its ``metrics.jsonl``) or a JSONL file. A run is labelled by the
``config.yaml`` beside its metrics: ``<experiment.name> (<precision.recipe>, seed <experiment.seed>)``, with the
folder added where two labels would be the same (the jobs of a sweep share a name); without a ``config.yaml``, by
its folder. A series of one record (one evaluation) is drawn as a marker. The baseline defaults to the first
run. The relative difference (run - baseline) / baseline is taken at the run's token counts, the baseline
linearly interpolated there (only where the baseline covers them). ``--smooth N``: a trailing mean over N
records before comparing (training losses are noisy; evaluation losses need none).

``--seeds-dir DIR`` plots the runs of ``scripts/convergence.py --seeds`` (``<recipe>_s<seed>`` under DIR) instead:
each recipe's mean over its seeds, and below, each recipe's difference to the baseline recipe's run of the same
seed, averaged over the seeds, with a band of one standard error (sd / sqrt(pairs)); only the steps every seed of
both recipes logged are used:

    python scripts/plot_runs.py --seeds-dir runs/seeds --metric val_loss --out seeds_val_loss.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def _series(path: Path, metric: str, smooth: int):
    import numpy as np

    from nvfp4_train.metrics import load_metrics

    kind = "eval" if metric == "val_loss" else "train"
    recs = [r for r in load_metrics(path, kind) if r.get(metric) is not None]
    if not recs:
        raise SystemExit(f"{path}: no {kind} records with {metric!r}")
    x = np.array([r["tokens"] for r in recs], dtype=np.float64)
    y = np.array([r[metric] for r in recs], dtype=np.float64)
    if smooth > 1:
        c = np.cumsum(np.insert(y, 0, 0.0))
        n = np.minimum(np.arange(1, len(y) + 1), smooth)
        y = (c[1:] - c[np.arange(len(y)) + 1 - n]) / n
    return x, y


def _folder(path: Path) -> Path:
    return path.parent if path.suffix == ".jsonl" else path


def run_label(path: Path) -> str:
    """``<experiment.name> (<precision.recipe>, seed <experiment.seed>)`` from the run's ``config.yaml``, else the
    run's folder name."""
    import yaml

    try:
        cfg = yaml.safe_load((_folder(path) / "config.yaml").read_text()) or {}
        exp, prec = cfg["experiment"], cfg["precision"]
        return f"{exp['name']} ({prec['recipe']}, seed {exp['seed']})"
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return _folder(path).name


def run_labels(paths: list[Path]) -> dict[Path, str]:
    """:func:`run_label` of each path; where two are the same, each with its folder added."""
    labels = {p: run_label(p) for p in paths}
    same = {lab for lab in labels.values() if list(labels.values()).count(lab) > 1}
    return {p: f"{lab} [{_folder(p)}]" if lab in same else lab for p, lab in labels.items()}


def _marker(x) -> str | None:
    """A marker where a series has one point (one evaluation): a line through one point draws nothing."""
    return "o" if len(x) == 1 else None


def plot_runs(paths: list[Path], out: Path, *, baseline: Path | None = None, metric: str = "loss",
              smooth: int = 1) -> Path:
    """:func:`runs_figure` saved as ``out`` (its folder made)."""
    return _save(runs_figure(paths, baseline=baseline, metric=metric, smooth=smooth), out)


def runs_figure(paths: list[Path], *, baseline: Path | None = None, metric: str = "loss", smooth: int = 1):
    """The figure of :func:`plot_runs`: ``metric`` against tokens for each run, and below (two runs or more)
    each run's relative difference to ``baseline`` (default the first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    baseline = baseline or paths[0]
    runs = {p: _series(p, metric, smooth) for p in dict.fromkeys([baseline, *paths])}
    bx, by = runs[baseline]
    if len(runs) > 1:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:  # one run: nothing to compare
        fig, ax1 = plt.subplots(1, 1, figsize=(9, 5))
        ax2 = None
    labels = run_labels(list(runs))
    for p, (x, y) in runs.items():
        (line,) = ax1.plot(x, y, label=labels[p] + (" (baseline)" if p == baseline and len(runs) > 1 else ""),
                           lw=1.2, marker=_marker(x))
        inside = (x >= bx[0]) & (x <= bx[-1])
        if ax2 is not None and p != baseline and inside.any():
            rel = (y[inside] - np.interp(x[inside], bx, by)) / np.interp(x[inside], bx, by)
            ax2.plot(x[inside], 100.0 * rel, label=labels[p], lw=1.2, color=line.get_color(),
                     marker=_marker(x[inside]))
    ax1.set_ylabel(metric + (f" (mean of {smooth})" if smooth > 1 else ""))
    _finish(fig, ax1, ax2, "relative difference to the baseline (%)")
    return fig


def _finish(fig, ax1, ax2, ylabel2: str) -> None:
    """Grid, legends and the tokens axis; ``ax2`` (None: one panel) gets the zero line and ``ylabel2``."""
    ax1.legend()
    ax1.grid(alpha=0.3)
    if ax2 is None:
        ax1.set_xlabel("tokens")
    else:
        ax2.axhline(0.0, color="k", lw=0.8)
        ax2.set_ylabel(ylabel2)
        ax2.set_xlabel("tokens")
        ax2.grid(alpha=0.3)
        if ax2.get_legend_handles_labels()[0]:  # no run overlaps the baseline's tokens: nothing to label
            ax2.legend()
    fig.tight_layout()


def _save(fig, out: Path) -> Path:
    """Save ``fig`` as ``out`` (its folder made) and close it."""
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _common(series: list[tuple]) -> tuple:
    """The x values every series has, and each series' y there (series: (x, y) pairs of numpy arrays)."""
    import numpy as np

    xs = series[0][0]
    for x, _ in series[1:]:
        xs = np.intersect1d(xs, x)
    return xs, [y[np.isin(x, xs)] for x, y in series]


def paired_difference(runs: list[tuple], bases: list[tuple]) -> tuple:
    """``runs[i]`` against ``bases[i]`` (same seed), both (x, y) series: at the x values all of them have, the mean
    over i of ``100 * (run / base - 1)`` and its standard error (sd / sqrt(n); None for one pair)."""
    import numpy as np

    x, ys = _common(list(runs) + list(bases))
    rel = 100.0 * (np.array(ys[:len(runs)]) / np.array(ys[len(runs):]) - 1.0)
    se = rel.std(axis=0, ddof=1) / np.sqrt(len(runs)) if len(runs) > 1 else None
    return x, rel.mean(axis=0), se


def plot_seeds(seeds_dir: Path, out: Path, *, baseline: str = "bf16", metric: str = "val_loss",
               smooth: int = 1) -> Path:
    """Mean over seeds per recipe and the seed-paired difference to ``baseline`` (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from nvfp4_train.experiments.convergence import group_runs, recipe_order

    groups = {n: {s: d for s, d in runs.items() if s is not None} for n, runs in group_runs(seeds_dir).items()}
    groups = {n: runs for n, runs in groups.items() if runs}
    if baseline not in groups:
        raise SystemExit(f"{seeds_dir}: no seeded runs of the baseline {baseline!r} "
                         f"(<{baseline}_s<seed>/metrics.jsonl)")
    order = recipe_order(groups)
    series = {n: {s: _series(d, metric, smooth) for s, d in runs.items()} for n, runs in groups.items()}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for n in order:
        x, ys = _common(list(series[n].values()))
        (line,) = ax1.plot(x, np.mean(ys, axis=0), lw=1.2, label=f"{n} (mean of {len(ys)} seeds)", marker=_marker(x))
        pairs = sorted(set(series[n]) & set(series[baseline]))
        if n == baseline or not pairs:
            continue
        x, mean, se = paired_difference([series[n][s] for s in pairs], [series[baseline][s] for s in pairs])
        ax2.plot(x, mean, lw=1.2, color=line.get_color(), label=f"{n} ({len(pairs)} pairs)", marker=_marker(x))
        if se is not None:
            ax2.fill_between(x, mean - se, mean + se, color=line.get_color(), alpha=0.2, lw=0)
    ax1.set_ylabel(metric + (f" (mean of {smooth})" if smooth > 1 else "") + ", mean over seeds")
    _finish(fig, ax1, ax2, f"vs {baseline}, same seed (%): mean ± s.e.")
    return _save(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="run directories or metrics.jsonl files")
    ap.add_argument("--baseline", default=None,
                    help="run to compare against (default: the first); with --seeds-dir a recipe name (default bf16)")
    ap.add_argument("--seeds-dir", type=Path, default=None,
                    help="plot convergence.py --seeds runs (<recipe>_s<seed>) under this folder, paired by seed")
    ap.add_argument("--metric", default="loss", choices=["loss", "val_loss"])
    ap.add_argument("--smooth", type=int, default=1, help="trailing mean over this many records")
    ap.add_argument("--out", type=Path, default=Path("loss.png"))
    a = ap.parse_args(argv)
    if a.seeds_dir is not None:
        if a.runs:
            ap.error("give either run directories or --seeds-dir, not both")
        if not a.seeds_dir.is_dir():
            ap.error(f"--seeds-dir: {a.seeds_dir} is not a directory")
        print(plot_seeds(a.seeds_dir, a.out, baseline=a.baseline or "bf16", metric=a.metric, smooth=a.smooth))
        return 0
    if not a.runs:
        ap.error("give at least one run directory or metrics.jsonl file (or --seeds-dir)")
    baseline = None if a.baseline is None else Path(a.baseline)
    print(plot_runs(a.runs, a.out, baseline=baseline, metric=a.metric, smooth=a.smooth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
