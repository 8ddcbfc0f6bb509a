"""The end-to-end tests of this folder whose train.py runs mostly come one at a time (the kills during saves,
the spike rollback, the NaN gradient) run side by side: a package fixture runs each test's runs and checks
in a thread, two at a time, and each test waits for its own (its failure is raised in the test)."""

from __future__ import annotations

import pytest

from tests.side_by_side import for_selected_tests


@pytest.fixture(scope="package")
def reliability_runs(request, tmp_path_factory) -> dict:
    from tests.reliability.test_kill_during_save import kill_during_saves, kill_schedule_seed
    from tests.reliability.test_nonfinite import nan_gradient_runs
    from tests.reliability.test_spike_rollback import spike_runs

    kill = "test_sigkill_during_saves_always_resumes_from_the_newest_complete_checkpoint"
    seed = kill_schedule_seed()
    kills, spike, nan = (tmp_path_factory.mktemp(name) for name in ("kills", "spike", "nan_gradient"))
    runs = for_selected_tests(request, {
        kill: lambda: kill_during_saves(kills, seed),
        "test_spike_is_logged_or_rolled_back_past_its_data_window": lambda: spike_runs(spike),
        "test_nan_gradient_in_one_layer_is_skipped_named_and_resumed": lambda: nan_gradient_runs(nan),
    })
    if kill in runs:
        runs[kill] = (seed, runs[kill])
    return runs
