import math

import pytest

from nvfp4_train.spikes import SpikeConfig, SpikeDetector


def test_spike_is_factor_times_running_median():
    d = SpikeDetector(SpikeConfig(factor=1.5, window=5, min_history=3))
    for loss in (4.0, 4.0, 4.0):
        assert not d.observe(loss)
    assert not d.observe(5.99)  # 5.99 <= 1.5 * 4.0
    assert d.observe(6.01)  # > 6.0 = 1.5 * median(4, 4, 4, 5.99)
    assert d.median() == 4.0  # the spike did not enter the history
    assert not d.observe(float("nan")) and not d.observe(math.inf)  # the non-finite guard's business


def test_no_spike_before_min_history_and_when_off():
    d = SpikeDetector(SpikeConfig(factor=1.5, window=5, min_history=3))
    assert not d.observe(10.0) and not d.observe(1.0) and not d.observe(100.0)
    off = SpikeDetector(SpikeConfig())
    assert not any(off.observe(x) for x in (1.0, 1.0, 1e9))


def test_state_round_trip():
    d = SpikeDetector(SpikeConfig(factor=2.0, window=3, min_history=1))
    for x in (1.0, 2.0, 3.0, 4.0):
        d.observe(x)
    e = SpikeDetector(SpikeConfig(factor=2.0, window=3, min_history=1))
    e.load_state_dict(d.state_dict())
    assert e.median() == d.median() == 3.0 and e.observe(6.5) and not e.observe(5.9)


@pytest.mark.parametrize("kw", [{"factor": 0.5}, {"factor": 1.0}, {"window": 0}, {"max_rollbacks": -1}])
def test_bad_config(kw):
    with pytest.raises(ValueError):
        SpikeConfig(**kw)


@pytest.mark.parametrize("override,needle", [("spike.factor=0.5", "spike.factor=0.5 must be 0 (off) or > 1"),
                                             ("spike.window=0", "spike.window"),
                                             ("spike.max_rollbacks=-1", "spike.max_rollbacks >= 0")])
def test_bad_spike_values_are_config_errors(override, needle):
    from nvfp4_train.config import compose_config

    assert compose_config("train", []).spike == SpikeConfig()  # off unless asked for
    with pytest.raises(ValueError) as e:
        compose_config("train", [override])
    assert needle in str(e.value)
