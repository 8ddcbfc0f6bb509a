"""scripts/plot_runs.py (``nvfp4_train.experiments.plots``): runs labelled by their config, one evaluation drawn."""

from __future__ import annotations

import json
from pathlib import Path


def _run(d: Path, name: str | None, recipe: str, seed: int, evals: list[tuple[int, float]]) -> Path:
    d.mkdir(parents=True)
    if name is not None:  # the trainer's config.yaml (the keys the label reads, as the trainer writes them)
        (d / "config.yaml").write_text(f"precision:\n  recipe: {recipe}\nexperiment:\n  name: {name}\n"
                                       f"  run_dir: {d}\n  seed: {seed}\n")
    recs = [{"type": "eval", "step": s, "tokens": 64 * s, "val_loss": v} for s, v in evals]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_runs_are_labelled_by_config_and_one_evaluation_is_a_marker(tmp_path):
    """The jobs of a sweep are folders 0, 1, ...: labelled by folder, their legend said "0" and "1". A run with
    one evaluation (a short run's only one) was a line through one point: nothing drawn."""
    import matplotlib.pyplot as plt

    from nvfp4_train.experiments.plots import runs_figure

    a = _run(tmp_path / "sweep" / "0", "tiny_nvfp4", "nvfp4", 1234, [(10, 7.5), (20, 7.1)])
    b = _run(tmp_path / "sweep" / "1", "tiny_bf16", "bf16", 7, [(20, 7.0)])
    c = _run(tmp_path / "old", None, "", 0, [(10, 7.6), (20, 7.2)])  # no config.yaml: its folder
    fig = runs_figure([a, b, c], metric="val_loss")
    try:
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
        assert sorted(lines) == ["old", "tiny_bf16 (bf16, seed 7)", "tiny_nvfp4 (nvfp4, seed 1234) (baseline)"]
        assert lines["tiny_bf16 (bf16, seed 7)"].get_marker() == "o"  # one point
        assert lines["old"].get_marker() in ("None", "", None)  # a line
        diffs = {ln.get_label(): ln for ln in fig.axes[1].get_lines() if not ln.get_label().startswith("_")}
        assert diffs["tiny_bf16 (bf16, seed 7)"].get_marker() == "o"
    finally:
        plt.close(fig)


def test_two_runs_of_one_label_get_their_folders(tmp_path):
    """The jobs of a sweep share a name, precision and seed (here they differ in a key the label does not show)."""
    from nvfp4_train.experiments.plots import run_labels

    a = _run(tmp_path / "s" / "0", "tiny_nvfp4", "nvfp4", 1234, [(1, 1.0)])
    b = _run(tmp_path / "s" / "1", "tiny_nvfp4", "nvfp4", 1234, [(1, 1.0)])
    assert list(run_labels([a, b / "metrics.jsonl"]).values()) == [f"tiny_nvfp4 (nvfp4, seed 1234) [{a}]",
                                                                   f"tiny_nvfp4 (nvfp4, seed 1234) [{b}]"]
