"""What the export tests train: the real hybrid ``tiny`` model (NVFP4, three steps of ``train.py`` on the
committed sample text). The trained checkpoint itself is the session fixture ``trained_tiny`` (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.runs import TINY, _TOKENS, run, tail

# TINY without the GPT stand-in and its model sizes: the hybrid `tiny`, 64 tokens per micro-batch
HYBRID_TINY = [a for a in TINY if not a.startswith(("experiment.model_provider", "model."))] + [
    "model=tiny", "precision=nvfp4", "schedule.train_steps=3", "experiment.name=export_tiny"]
VALIDATION = str(_TOKENS / "text_validation")


def train_tiny(out: Path, *extra: str, nproc: int = 1) -> Path:
    """Train the hybrid `tiny` for three steps into ``out/run``; returns the run directory."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"
    rc = run([*HYBRID_TINY, f"experiment.run_dir={out / 'run'}", *extra], log=log, nproc=nproc)
    assert rc == 0, tail(log)
    return out / "run"
