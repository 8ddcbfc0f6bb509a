"""Model sizes: the analytic parameter count (RECIPE.md §6), validation, and the YAML files."""

from __future__ import annotations

import dataclasses

import pytest

from nvfp4_train.models.config import (
    PATTERN_12B,
    SIZES,
    ModelConfig,
    block_parameters,
    count_parameters,
    model_config,
    parameter_breakdown,
    size_names,
)
from nvfp4_train.config import compose_config


def test_12b_matches_recipe():
    cfg = SIZES["12b"]
    p = cfg.hybrid_pattern()
    assert cfg.pattern == "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-" == PATTERN_12B
    assert p.num_blocks == 62 and (p.num_mamba, p.num_mlp, p.num_attention) == (28, 28, 6)
    assert cfg.mamba_d_inner == 10240
    assert cfg.mamba_in_proj_width == 2 * 10240 + 2 * 8 * 128 + 128 == 22656
    assert cfg.attention_qkv_width == (40 + 2 * 8) * 128
    n = count_parameters(cfg)
    assert abs(n - 12.31e9) <= 0.005 * 12.31e9, n
    assert n == 12_310_001_152


def test_12b_blocks_written_out():
    cfg = SIZES["12b"]
    h = 5120
    assert block_parameters(cfg, "M") == {
        "norm": h,
        "in_proj": h * 22656,
        "conv1d": (10240 + 2 * 8 * 128) * 4 + (10240 + 2 * 8 * 128),
        "dt_bias": 128,
        "A_log": 128,
        "D": 128,
        "gated_norm": 10240,
        "out_proj": 10240 * h,
    }
    assert block_parameters(cfg, "-") == {"norm": h, "fc1": h * 20480, "fc2": 20480 * h}
    assert block_parameters(cfg, "*") == {"norm": h, "qkv": h * 7168, "proj": 5120 * h}
    b = parameter_breakdown(cfg)
    assert b["embedding"] == b["output_layer"] == 131072 * h and b["final_norm"] == h


def test_8b():
    cfg = SIZES["8b"]
    p = cfg.hybrid_pattern()
    assert p.num_blocks == 52 and (p.num_mamba, p.num_mlp, p.num_attention) == (24, 24, 4)
    assert [i for i, c in enumerate(p.blocks) if c == "*"] == [7, 18, 29, 40]
    assert cfg.mamba_in_proj_width == 18560
    # Nemotron-H-8B-Base's published parameter count, to the parameter.
    assert count_parameters(cfg) == 8_100_852_736


@pytest.mark.parametrize("name, lo, hi", [("tiny", 1e6, 2e7), ("small", 50e6, 100e6), ("10m", 9e6, 12e6), ("125m", 110e6, 140e6), ("1.2b", 1.1e9, 1.35e9)])
def test_other_sizes(name, lo, hi):
    assert lo <= count_parameters(SIZES[name]) <= hi


def test_tiny_has_all_kinds_and_our_vocab():
    cfg = SIZES["tiny"]
    p = cfg.hybrid_pattern()
    assert p.num_mamba and p.num_mlp and p.num_attention and p.num_blocks <= 8
    assert 64 <= cfg.hidden_size <= 128 and cfg.vocab_size == 32768


def test_1_2b_is_a_plain_transformer():
    cfg = SIZES["1.2b"]
    assert set(cfg.pattern) == {"*", "-"} and cfg.pattern.count("*") == 20
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (2048, 6144, 16, 8)
    assert cfg.position_embedding == "rope"


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(pattern="M-*", num_layers=4), "has 3 blocks but num_layers=4"),
        (dict(ffn_hidden_size=None), r"ffn_hidden_size=None must be a positive int \(the pattern has MLP blocks"),
        (dict(num_query_groups=3), "num_query_groups=3 must divide num_attention_heads=4"),
        (dict(mamba_num_groups=3), "mamba_num_groups=3 must divide mamba_num_heads=8"),
        (dict(mamba_head_dim=0), "mamba_head_dim=0 must be a positive int"),
        (dict(activation="relu6"), "activation='relu6' is not one of"),
        (dict(position_embedding="alibi"), "position_embedding='alibi'"),
        (dict(hidden_size=True), "hidden_size=True must be a positive int"),
    ],
)
def test_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        model_config("tiny", **changes)


def test_unused_kinds_need_no_sizes():
    cfg = ModelConfig(pattern="M-M-", hidden_size=64, vocab_size=100, ffn_hidden_size=128, mamba_num_heads=4, mamba_head_dim=32, mamba_num_groups=2)
    assert cfg.num_layers == 4 and cfg.num_attention_heads is None
    assert count_parameters(cfg) > 0
    with pytest.raises(ValueError, match="unknown model size"):
        model_config("7b")


@pytest.mark.parametrize("name", list(SIZES))
def test_yaml_equals_python_size(name):
    cfg = compose_config("table", [f"model={name}"])
    assert isinstance(cfg.model, ModelConfig)
    assert cfg.model == SIZES[name], [
        f.name for f in dataclasses.fields(ModelConfig) if getattr(cfg.model, f.name) != getattr(SIZES[name], f.name)
    ]


def test_size_names():
    assert size_names() == ("tiny", "small", "10m", "125m", "1.2b", "8b", "12b")
