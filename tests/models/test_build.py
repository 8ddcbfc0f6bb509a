"""Pipeline stage layout of the hybrid pattern agrees with megatron-core's layer offsets (its
TransformerLayer adds that offset to the local layer number)."""

from __future__ import annotations

import pytest

from nvfp4_train.models.config import model_config


@pytest.mark.parametrize("size,pp", [("12b", 4), ("12b", 2), ("8b", 4), ("tiny", 2), ("small", 3)])
def test_stage_offsets_match_megatron(size, pp):
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from nvfp4_train.models.build import stage_pattern, transformer_config

    mc = model_config(size)
    pattern = stage_pattern(mc, pp)
    assert sum(pattern.stage_sizes()) == mc.num_layers
    cfg = transformer_config(mc, pp=pp, use_cpu_initialization=True)
    assert [get_transformer_layer_offset(cfg, pp_rank=r) for r in range(pp)] == list(pattern.stage_offsets)


def test_uneven_middle_stages_are_refused():
    from nvfp4_train.models.build import transformer_config

    mc = model_config("tiny").replace(pattern="M|-*|-M-|M", num_layers=7)
    with pytest.raises(ValueError, match="middle stages"):
        transformer_config(mc, pp=4)


def test_sequence_parallel_needs_tp():
    from nvfp4_train.models.build import transformer_config

    with pytest.raises(ValueError, match="sequence_parallel"):
        transformer_config(model_config("tiny"), sequence_parallel=True)
