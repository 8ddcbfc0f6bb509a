"""A run's output is for people: third-party warnings go to ``<run dir>/warnings.log`` once each, ours stay on
stderr (``nvfp4_train.warnings_log``), and a short train.py run prints no line twice."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from nvfp4_train.warnings_log import LOG_NAME, ThirdPartyWarnings
from tests.trainer.runs import TINY, run, tail

ROOT = Path(__file__).resolve().parents[2]
THIRD = "/opt/somewhere/site-packages/megatron/core/optimizer/__init__.py"  # any file outside our packages


def _warn(message, filename, category=UserWarning):
    warnings.warn_explicit(message, category, filename, 24)


def test_third_party_warnings_go_to_the_log_once_and_ours_stay(tmp_path):
    err = io.StringIO()
    with warnings.catch_warnings(record=True) as shown:  # what reaches the usual display
        warnings.simplefilter("always")
        routed = ThirdPartyWarnings(stderr=err).install()
        try:
            _warn("Apex is not installed", THIRD)  # before the run directory is known: held
            routed.attach(tmp_path, rank=0)
            _warn("Apex is not installed", THIRD)  # the same again: dropped
            _warn("`all_gather_into_tensor` is deprecated", THIRD, FutureWarning)
            import logging

            logging.getLogger("megatron.core.utils").warning("CUDA_DEVICE_MAX_CONNECTIONS is not 1")
            _warn("ours", str(ROOT / "nvfp4_train" / "trainer.py"))
        finally:
            routed.close()
    log = (tmp_path / LOG_NAME).read_text()
    assert log.count("Apex is not installed") == 1
    assert "FutureWarning: `all_gather_into_tensor` is deprecated" in log
    assert "megatron.core.utils: WARNING: CUDA_DEVICE_MAX_CONNECTIONS is not 1" in log
    assert "ours" not in log
    assert err.getvalue().splitlines() == [f"third-party warnings (megatron-core, torch, ...; each once): "
                                           f"{tmp_path / LOG_NAME}"]
    assert [str(w.message) for w in shown] == ["ours"]  # our warning: shown as always


def test_a_short_run_prints_no_line_twice_and_no_third_party_warning(tmp_path):
    """Three steps through train.py (the GPTModel stand-in: megatron-core's optimizer, DDP and their imports'
    warnings, one rank on CPU), stdout and stderr together."""
    log, run_dir = tmp_path / "out.log", tmp_path / "run"
    assert run([*TINY, "schedule.train_steps=3", f"experiment.run_dir={run_dir}"], log=log) == 0, tail(log)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    repeated = sorted({ln for ln in lines if lines.count(ln) > 1})
    assert not repeated, repeated
    noise = [ln for ln in lines if "site-packages" in ln or "warnings.warn(" in ln or "Warning:" in ln]
    assert not noise, noise
    if (run_dir / LOG_NAME).exists():  # this environment's megatron-core warned (Apex / TE missing, ...)
        assert sum(ln.startswith("third-party warnings") for ln in lines) == 1
