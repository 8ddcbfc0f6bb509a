"""The layer precision map (RECIPE.md §4): defaults, scaling, rules, the late precision switch."""

from __future__ import annotations

import pytest

from nvfp4_train.models.config import PATTERN_8B, PATTERN_12B, SIZES
from nvfp4_train.models.pattern import HybridPattern
from nvfp4_train.precision.layer_map import (
    ROLES_BY_KIND,
    LayerPrecisionMap,
    PrecisionRule,
    PrecisionSwitch,
    recipe_in_effect,
    scaled_keep,
)
from nvfp4_train.precision.recipe import BF16, Ablations, OperandCast, apply_ablations, named_recipe


def bf16_blocks(m: LayerPrecisionMap) -> list[int]:
    return sorted({e.block for e in m.entries if m.recipe(e.block, e.role).is_bf16})


def test_12b_nvfp4_is_the_papers_16_percent():
    m = LayerPrecisionMap(PATTERN_12B, "nvfp4")
    assert (m.keep_first, m.keep_last) == (2, 8)
    assert m.num_linear == 124 and m.num_bf16 == 20
    assert m.summary_line() == "bf16 linear layers: 20/124 (16.1%)"
    assert bf16_blocks(m) == [0, 1] + list(range(54, 62))
    assert m.recipe_name(2, "mamba.in_proj") == "nvfp4"
    assert m.recipe(7, "attention.qkv") is named_recipe("nvfp4")
    assert m.recipe(61, "mlp.fc2") is BF16
    assert m.table().splitlines()[-1] == "bf16 linear layers: 20/124 (16.1%)"


def test_12b_fp8_keeps_first_1_last_2():
    m = LayerPrecisionMap(PATTERN_12B, "fp8")
    assert (m.keep_first, m.keep_last) == (1, 2)
    assert bf16_blocks(m) == [0, 60, 61]
    assert m.num_bf16 == 6
    assert m.recipe_name(1, "mlp.fc1") == "fp8"


def test_bf16_run_is_all_bf16():
    m = LayerPrecisionMap(PATTERN_12B, "bf16")
    assert m.num_bf16 == m.num_linear == 124
    with pytest.warns(UserWarning, match="have no effect"):
        LayerPrecisionMap(PATTERN_12B, "bf16", keep_last=3)


@pytest.mark.parametrize(
    "n, nvfp4_keep, fp8_keep",
    [
        (62, (2, 8), (1, 2)),  # exact at the paper's depth
        (52, (2, 7), (1, 2)),  # 2*52/62 = 1.68, 8*52/62 = 6.71
        (40, (2, 6), (1, 2)),  # 1.29, 5.16; 0.65, 1.29
        (26, (1, 4), (1, 1)),  # 0.84, 3.35; 0.42, 0.84
        (6, (1, 1), (1, 1)),
        (1, (1, 1), (1, 1)),  # overlapping keeps: the single block is bf16
        (124, (4, 16), (2, 4)),
    ],
)
def test_scaled_keep_rounds_up(n, nvfp4_keep, fp8_keep):
    assert (scaled_keep(2, n), scaled_keep(8, n)) == nvfp4_keep
    assert (scaled_keep(1, n), scaled_keep(2, n)) == fp8_keep
    m = LayerPrecisionMap("M" * n, "nvfp4")
    assert (m.keep_first, m.keep_last) == nvfp4_keep


def test_8b_default_and_paper_setting():
    m = LayerPrecisionMap(PATTERN_8B, "nvfp4")
    assert (m.keep_first, m.keep_last) == (2, 7)
    m = LayerPrecisionMap(PATTERN_8B, "nvfp4", keep_first=0, keep_last=8)  # the paper's 8B run
    assert bf16_blocks(m) == list(range(44, 52)) and m.keep_default == (False, False)


def test_explicit_keep_and_errors():
    m = LayerPrecisionMap(PATTERN_12B, "nvfp4", keep_first=0, keep_last=4)  # "last 4 also converged"
    assert bf16_blocks(m) == [58, 59, 60, 61]
    with pytest.raises(ValueError, match="keep_last=63 must be an int in 0..62"):
        LayerPrecisionMap(PATTERN_12B, "nvfp4", keep_last=63)
    with pytest.raises(ValueError, match="keep_first=-1"):
        LayerPrecisionMap(PATTERN_12B, "nvfp4", keep_first=-1)


def test_all_blocks_quantized():
    m = LayerPrecisionMap(PATTERN_12B, "nvfp4", ablations=Ablations(all_blocks_quantized=True))
    assert m.num_bf16 == 0 and (m.keep_first, m.keep_last) == (0, 0)
    with pytest.raises(ValueError, match="all_blocks_quantized=true conflicts with keep_first=2"):
        LayerPrecisionMap(PATTERN_12B, "nvfp4", ablations=Ablations(all_blocks_quantized=True), keep_first=2)


def test_ablated_run_recipe_and_rules_naming_the_base():
    ab = Ablations(rht=False)
    m = LayerPrecisionMap(
        PATTERN_12B, "nvfp4", ablations=ab, rules=[PrecisionRule(recipe="nvfp4", blocks="0-1")]
    )
    ablated = apply_ablations(named_recipe("nvfp4"), ab)
    assert m.recipe(0, "mamba.in_proj") == ablated  # the base name resolves to the run's recipe
    assert m.recipe_name(5, "mlp.fc1") == "nvfp4+no_rht"
    assert m.num_bf16 == 16


def test_rules_in_order_last_match_wins():
    rules = [
        PrecisionRule(recipe="bf16", roles="mamba.*"),
        PrecisionRule(recipe="fp8", blocks="2-4,7", roles="mamba.out_proj,attention.q*"),
        PrecisionRule(recipe="nvfp4", blocks="0"),
    ]
    m = LayerPrecisionMap(PATTERN_12B, "nvfp4", rules=rules)
    assert m.recipe_name(0, "mamba.in_proj") == "nvfp4"  # rule 2 beats the keep and rule 0
    assert m.recipe_name(1, "mlp.fc1") == "bf16"  # keep_first
    assert m.recipe_name(2, "mamba.in_proj") == "bf16"  # rule 0
    assert m.recipe_name(2, "mamba.out_proj") == "fp8"  # rule 1
    assert m.recipe_name(7, "attention.qkv") == "fp8"
    assert m.recipe_name(7, "attention.proj") == "nvfp4"
    assert m.recipe_name(3, "mlp.fc1") == "nvfp4"
    reasons = {(e.block, e.role): e.reason for e in m.entries}
    assert reasons[(0, "mamba.in_proj")] == "rule 2" and reasons[(1, "mlp.fc1")] == "first 2"


@pytest.mark.parametrize(
    "rule, match",
    [
        (PrecisionRule(recipe="bf16", roles="attention.*"), r"rule 0 \{roles='attention.\*' -> 'bf16'\} matches no linear"),
        (PrecisionRule(recipe="bf16", roles="mamba.inproj"), "matches no linear layer"),
        (PrecisionRule(recipe="bf16", blocks="1", roles="mamba.*"), "matches no linear layer"),  # block 1 is '-'
        (PrecisionRule(recipe="bf16", blocks="9"), r"block item '9' is outside 0..5"),
        (PrecisionRule(recipe="bf16", blocks="3-1"), "empty range"),
        (PrecisionRule(recipe="bf16", blocks="a-b"), "cannot read block item 'a-b'"),
        (PrecisionRule(recipe="bf16", blocks="-1"), "cannot read block item '-1'"),
        (PrecisionRule(recipe="fp6", blocks="0"), "unknown recipe 'fp6'"),
        (PrecisionRule(recipe="bf16", roles=" , "), "roles is empty"),
    ],
)
def test_bad_rules_raise(rule, match):
    with pytest.raises(ValueError, match=match):
        LayerPrecisionMap("M-M-M-", "nvfp4", rules=[rule])


def test_rule_without_selector_raises():
    with pytest.raises(ValueError, match="give blocks and/or roles"):
        PrecisionRule(recipe="bf16")


def test_lookup_errors_and_roles():
    m = LayerPrecisionMap("M*-", "nvfp4")
    assert [e.role for e in m.entries] == [*ROLES_BY_KIND["M"], *ROLES_BY_KIND["*"], *ROLES_BY_KIND["-"]]
    with pytest.raises(ValueError, match=r"block 0 is 'M': its roles are \('mamba.in_proj', 'mamba.out_proj'\)"):
        m.recipe(0, "mlp.fc1")
    with pytest.raises(ValueError, match="block 3 out of range"):
        m.recipe(3, "mlp.fc1")
    with pytest.raises(ValueError, match="unknown kind 'E'"):
        LayerPrecisionMap("ME", "nvfp4")


def test_custom_recipe_needs_keep_counts():
    custom = named_recipe("nvfp4").replace(name="mine")
    with pytest.raises(ValueError, match="no default keep_first/keep_last"):
        LayerPrecisionMap(PATTERN_12B, custom)
    m = LayerPrecisionMap(PATTERN_12B, custom, keep_first=1, keep_last=1)
    assert m.recipe_name(5, "mlp.fc1") == "mine" and m.num_bf16 == 4


def test_pipeline_patterns_use_global_indices():
    staged = PATTERN_12B[:31] + "|" + PATTERN_12B[31:]
    p = HybridPattern.parse(staged, num_layers=62, pp_size=2)
    flat = LayerPrecisionMap(PATTERN_12B, "nvfp4")
    m = LayerPrecisionMap(staged, "nvfp4")
    assert [(e.block, e.role, e.recipe) for e in m.entries] == [(e.block, e.role, e.recipe) for e in flat.entries]
    # stage 1, local block 0 is global block 31; stage 1 local 23 is global 54, the first of the last 8.
    assert p.global_index(1, 0) == 31
    assert m.recipe_name(p.global_index(1, 22), "mlp.fc1") == "nvfp4"
    assert m.recipe_name(p.global_index(1, 23), "mamba.in_proj") == "bf16"


# --- the late precision switch (App. D) ---------------------------------------------------------------------
def test_switch_start_step():
    assert PrecisionSwitch(at_fraction=0.82).start_step(100) == 82  # exact decimal, not 83
    assert PrecisionSwitch(at_fraction=0.82).start_step(1001) == 821  # ceil(820.82)
    assert PrecisionSwitch(at_step=500).start_step(10) == 500
    assert PrecisionSwitch().start_step(100) is None and not PrecisionSwitch().enabled
    s = PrecisionSwitch(at_fraction=0.5)
    assert [s.active(k, 10) for k in (4, 5, 9)] == [False, True, True]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(at_fraction=0.5, at_step=3), "not both"),
        (dict(at_fraction=1.5), r"must be in \[0, 1\]"),
        (dict(at_step=-1), ">= 0"),
        (dict(mode="fp8"), "mode='fp8' is not one of"),
    ],
)
def test_switch_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionSwitch(**kwargs)


def test_recipe_in_effect():
    nv = named_recipe("nvfp4")
    fwd = PrecisionSwitch(mode="fprop_bf16", at_step=10)
    assert recipe_in_effect(nv, fwd, step=9, total_steps=100) is nv
    r = recipe_in_effect(nv, fwd, step=10, total_steps=100)
    assert r.name == "nvfp4+fprop_bf16"
    assert r.fprop.a == r.fprop.b == OperandCast()
    assert (r.dgrad, r.wgrad) == (nv.dgrad, nv.wgrad)
    assert not r.weight_shared_fprop_dgrad and not r.is_bf16  # dgrad now quantizes W itself
    assert recipe_in_effect(nv, PrecisionSwitch(mode="all_bf16", at_step=0), step=0, total_steps=1) is BF16
    assert recipe_in_effect(BF16, fwd, step=50, total_steps=100) is BF16
    assert recipe_in_effect(nv, None, step=50, total_steps=100) is nv


def test_map_recipe_at():
    m = LayerPrecisionMap(PATTERN_12B, "nvfp4", switch=PrecisionSwitch(at_fraction=0.82))
    assert m.recipe_at(5, "mlp.fc1", step=81, total_steps=100).name == "nvfp4"
    assert m.recipe_at(5, "mlp.fc1", step=82, total_steps=100).name == "nvfp4+fprop_bf16"
    assert m.recipe_at(0, "mamba.in_proj", step=99, total_steps=100) is BF16
    assert "fprop_bf16 from 0.82 of the run" in m.table()
    # a disabled switch (the config default) is dropped
    assert LayerPrecisionMap(PATTERN_12B, "nvfp4", switch=PrecisionSwitch()).switch is None


def test_table_lists_embedding_and_output():
    m = LayerPrecisionMap(SIZES["tiny"].pattern, "nvfp4")
    lines = m.table().splitlines()
    rows = [line.split() for line in lines if line.startswith(("-", *"0123456789"))]
    assert rows[0][:3] == ["-", "embedding", "bf16"] and rows[-1][:3] == ["-", "output_layer", "bf16"]
    assert len(rows) == m.num_linear + 2
    assert lines[-1] == "bf16 linear layers: 4/12 (33.3%)"
