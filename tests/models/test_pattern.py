"""The validated hybrid pattern and its pipeline-stage mapping."""

from __future__ import annotations

import pytest

from nvfp4_train.models.pattern import HybridPattern


def test_counts():
    p = HybridPattern.parse("M-M*-|M-")
    assert p.blocks == "M-M*-M-" and p.num_blocks == len(p) == 7
    assert p.counts() == {"M": 3, "-": 3, "*": 1}
    assert (p.num_mamba, p.num_mlp, p.num_attention) == (3, 3, 1)
    assert p.counts_str() == "3 M, 3 -, 1 *"
    assert p.kind(3) == "*" and p.kind(6) == "-"
    assert str(p) == "M-M*-|M-"


@pytest.mark.parametrize(
    "text, kwargs, match",
    [
        ("M-X-", {}, r"has 'X' at position 2: allowed characters are M \(Mamba-2\)"),
        ("M-E", {}, "has 'E' at position 2"),
        ("M -", {}, "has ' ' at position 1"),
        ("", {}, "non-empty string"),
        ("|M-", {}, r"pipeline stage 0 \(of 2\) is empty"),
        ("M-|", {}, r"pipeline stage 1 \(of 2\) is empty"),
        ("M-||M-", {}, r"pipeline stage 1 \(of 3\) is empty"),
        ("M-M-", dict(num_layers=5), "has 4 blocks but num_layers=5"),
        ("M-|M-", dict(num_layers=5), "has 4 blocks but num_layers=5"),
        ("M-|M-", dict(pp_size=3), r"has 2 pipeline stage\(s\) but pp_size=3: put 2 '\|'"),
        ("M-M-", dict(pp_size=2), r"has 1 pipeline stage\(s\) but pp_size=2: put 1 '\|' .* e.g. 'M-\|M-'"),
        ("M-", dict(pp_size=0), "pp_size=0 must be >= 1"),
    ],
)
def test_validation_errors(text, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridPattern.parse(text, **kwargs)


def test_pp_size_and_num_layers_agreeing():
    p = HybridPattern.parse("M-M*|-M-|M", num_layers=8, pp_size=3)
    assert p.stages == ("M-M*", "-M-", "M") and p.stage_sizes() == (4, 3, 1)
    assert p.stage_offsets == (0, 4, 7)
    assert HybridPattern.parse("M-", pp_size=1).num_stages == 1


def test_global_index_round_trip():
    p = HybridPattern.parse("M-M*|-M-|M")
    expect = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert [p.stage_local(g) for g in range(8)] == expect
    assert [p.global_index(s, i) for s, i in expect] == list(range(8))
    with pytest.raises(ValueError, match="local block 3 out of range: stage 1 has 3 blocks"):
        p.global_index(1, 3)
    with pytest.raises(ValueError, match="pipeline stage 3 out of range"):
        p.global_index(3, 0)
    with pytest.raises(ValueError, match="block 8 out of range"):
        p.stage_local(8)


def test_even_split():
    p = HybridPattern.parse("M-M-M-M*-")
    assert p.even_split(1) == "M-M-M-M*-"
    assert p.even_split(3) == "M-M|-M-|M*-"
    assert HybridPattern.parse(p.even_split(4), pp_size=4).blocks == p.blocks
    with pytest.raises(ValueError, match="cannot split 9 blocks into 10"):
        p.even_split(10)
