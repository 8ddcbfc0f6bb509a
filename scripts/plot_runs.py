"""Loss against tokens for several runs, and each run's relative difference to a baseline run, as a PNG.

    python scripts/plot_runs.py runs/bf16 runs/fp8 runs/nvfp4 --baseline runs/bf16 --out loss.png
    python scripts/plot_runs.py runs/a/metrics.jsonl runs/b --metric val_loss --smooth 1

Each argument is a run directory (its ``metrics.jsonl``) or a JSONL file. The baseline defaults to the first
run. The relative difference (run - baseline) / baseline is taken at the run's token counts, the baseline
linearly interpolated there (only where the baseline covers them). ``--smooth N``: a trailing mean over N
records before comparing (training losses are noisy; evaluation losses need none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def _label(path: Path) -> str:
    return path.parent.name if path.name == "metrics.jsonl" else path.name


def plot_runs(paths: list[Path], out: Path, *, baseline: Path | None = None, metric: str = "loss",
              smooth: int = 1) -> Path:
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
    for p, (x, y) in runs.items():
        (line,) = ax1.plot(x, y, label=_label(p) + (" (baseline)" if p == baseline and len(runs) > 1 else ""), lw=1.2)
        inside = (x >= bx[0]) & (x <= bx[-1])
        if ax2 is not None and p != baseline and inside.any():
            rel = (y[inside] - np.interp(x[inside], bx, by)) / np.interp(x[inside], bx, by)
            ax2.plot(x[inside], 100.0 * rel, label=_label(p), lw=1.2, color=line.get_color())
    ax1.set_ylabel(metric + (f" (mean of {smooth})" if smooth > 1 else ""))
    ax1.legend()
    ax1.grid(alpha=0.3)
    if ax2 is None:
        ax1.set_xlabel("tokens")
    else:
        ax2.axhline(0.0, color="k", lw=0.8)
        ax2.set_ylabel(f"relative difference to {_label(baseline)} (%)")
        ax2.set_xlabel("tokens")
        ax2.grid(alpha=0.3)
        ax2.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories or metrics.jsonl files")
    ap.add_argument("--baseline", type=Path, default=None, help="run to compare against (default: the first)")
    ap.add_argument("--metric", default="loss", choices=["loss", "val_loss"])
    ap.add_argument("--smooth", type=int, default=1, help="trailing mean over this many records")
    ap.add_argument("--out", type=Path, default=Path("loss.png"))
    a = ap.parse_args(argv)
    print(plot_runs(a.runs, a.out, baseline=a.baseline, metric=a.metric, smooth=a.smooth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
