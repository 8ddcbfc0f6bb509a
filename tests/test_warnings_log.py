"""Our own warnings under ``train.py``'s router (``nvfp4_train.warnings_log``): one line each, and a warning the
trainer also prints as a note of the run (``RunEventWarning``) is not shown a second time; third-party warnings
held where there is no run directory are counted in one line."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

from nvfp4_train.warnings_log import ThirdPartyWarnings

OURS = Path(__file__).resolve().parents[1] / "nvfp4_train" / "warnings_log.py"  # its line 1 is text

SCRIPT = f"""
import sys, warnings
from pathlib import Path
from nvfp4_train.warnings_log import RunEventWarning, ThirdPartyWarnings

routed = ThirdPartyWarnings().install()
routed.attach(Path(sys.argv[1]), rank=0)
warnings.warn_explicit("schedule.cuda_graph=on: the steps run eager", UserWarning, {str(OURS)!r}, 1)
warnings.warn_explicit("the precision differs from checkpoint x", RunEventWarning, {str(OURS)!r}, 1)
routed.close()
"""


def test_our_warnings_are_one_line_and_run_events_are_left_to_the_note(tmp_path):
    """In a process of its own, as under train.py: the usual display (stderr) with Python's default filters.
    Python's display quoted the source line as a second line; the run-event warning printed a second copy of
    the trainer's note."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [f"{OURS}:1: UserWarning: schedule.cuda_graph=on: the steps run eager"]


def test_warnings_held_without_a_run_directory_are_counted_on_one_line():
    """``export``, ``evaluate``, ``generate`` and a run refused its run directory never attach a log: the held
    warnings are counted, each distinct one once. Before, the line said "the run made no run directory", which
    is not what happened to a refused run, and those commands have no run at all."""
    third = "/opt/somewhere/site-packages/megatron/core/optimizer/__init__.py"  # outside our packages
    err = io.StringIO()
    with warnings.catch_warnings(record=True) as shown:  # what reaches the usual display
        warnings.simplefilter("always")
        routed = ThirdPartyWarnings(stderr=err).install()
        try:
            warnings.warn_explicit("Apex is not installed", UserWarning, third, 24)
            warnings.warn_explicit("`all_gather_into_tensor` is deprecated", FutureWarning, third, 24)
            warnings.warn_explicit("Apex is not installed", UserWarning, third, 24)  # the same again: once
        finally:
            routed.close()
    assert not shown
    assert err.getvalue().splitlines() == ["(2 third-party warning(s) not shown: no run directory to log them to; "
                                           "`python -W default ...` shows them)"]
