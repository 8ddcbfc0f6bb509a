"""What the export tests train: the real hybrid ``tiny`` model (NVFP4, three steps of ``train.py`` on the
committed sample text). The trained checkpoint itself is the session fixture ``trained_tiny`` (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.runs import ROOT, TINY, _TOKENS, run, tail

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


def import_off_root(name: str, *attributes: str) -> tuple:
    """``importlib.import_module(name)`` and its ``attributes`` (a lazy module imports a submodule on attribute
    access), with the repository root off ``sys.path``, as a user's process outside the checkout imports them.

    transformers 5.25 imports the ``kernels`` distribution (Hugging Face's hub kernels, a requirement of it since
    that release) when a model module loads, and nvidia-modelopt imports transformers. Under pytest the repository
    root is on ``sys.path`` ahead of site-packages, and the root holds our own ``kernels/`` folder (installed as
    ``nvfp4_train.kernels``; nothing imports it by its top-level name), which would shadow it."""
    import importlib
    import os
    import sys

    root = ROOT.resolve()
    shadow = sys.modules.get("kernels")
    if shadow is not None and Path(getattr(shadow, "__file__", None) or "/").resolve().parent == root / "kernels":
        del sys.modules["kernels"]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root]
    try:
        module = importlib.import_module(name)
        return tuple(getattr(module, a) for a in attributes)
    finally:
        sys.path[:] = saved


def nemotron_h():
    """transformers' ``(NemotronHConfig, NemotronHForCausalLM)`` (imported off the root: :func:`import_off_root`)."""
    return import_off_root("transformers", "NemotronHConfig", "NemotronHForCausalLM")
