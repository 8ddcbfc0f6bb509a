"""``scripts/bench_sdpa_repeat.py``: the count of repeats whose bits differ from the first, and the CPU run."""

from __future__ import annotations

import itertools

import pytest
import torch

from nvfp4_train.bench.sdpa_repeat import count_differing, main, sdpa_run


def test_count_differing_counts_each_key_that_changes():
    calls = itertools.count()

    def run():  # "a" never changes; "b" changes from the third call on; "c" on every other call; "d" is -0.0 in
        # the second call (equal as a number, other bits); "e" the same NaN every call
        i = next(calls)
        return {"a": torch.zeros(3), "b": torch.tensor([float(i >= 2)]), "c": torch.tensor([i % 2 * 1e-30]),
                "d": torch.tensor([-0.0 if i == 1 else 0.0]), "e": torch.full((2,), float("nan"))}

    assert count_differing(run, 5) == {"a": 0, "b": 3, "c": 2, "d": 1, "e": 0}


def test_cpu_math_backward_is_repeatable_and_shapes_match():
    run = sdpa_run((1, 2, 1, 16, 8), "cpu")
    out = run()
    assert out["out"].shape == out["dq"].shape == (1, 2, 16, 8) and out["dk"].shape == (1, 1, 16, 8)
    assert count_differing(run, 3) == {"out": 0, "dq": 0, "dk": 0, "dv": 0}


def test_main_on_the_cpu(capsys):
    assert main(["--reps", "2", "--shapes", "tiny", "--backends", "MATH", "CUDNN_ATTENTION"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny MATH: 2 runs, differing from the first: {'out': 0, 'dq': 0, 'dk': 0, 'dv': 0}")
    want = "2 runs" if torch.cuda.is_available() else "not available"  # the CPU has no cuDNN attention
    assert lines[1].startswith(f"tiny CUDNN_ATTENTION: {want}")


def test_fewer_than_two_repeats_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--reps", "1"])
    assert "needs at least 2" in capsys.readouterr().err
