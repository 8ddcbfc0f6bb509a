"""``bench_train.py --fusion``: each mode's overrides name every switch of the ``fusion`` section."""

from __future__ import annotations

import dataclasses

import pytest

from nvfp4_train.bench.train import FUSION_MODES, fusion_overrides
from nvfp4_train.config import compose_config
from nvfp4_train.models.fusion import FusionConfig


@pytest.mark.parametrize("mode", FUSION_MODES)
def test_fusion_modes_set_every_switch(mode):
    cfg = compose_config("train", ["model=tiny", *fusion_overrides(mode)])
    got = dataclasses.asdict(cfg.fusion)
    want = {"on": dataclasses.asdict(FusionConfig()),
            "off": {f.name: False for f in dataclasses.fields(FusionConfig)}}[mode]
    assert got == want


def test_unknown_fusion_mode_is_refused():
    with pytest.raises(ValueError, match="--fusion 'half': one of on, off"):
        fusion_overrides("half")
