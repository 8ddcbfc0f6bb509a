"""Named recipes and every ablation give exactly the casts of RECIPE.md §3/§5; bad casts raise ValueError."""

from __future__ import annotations

import pytest

from nvfp4_train.precision.recipe import (
    ABLATIONS,
    BF16,
    NAMED_RECIPES,
    Ablations,
    GemmCasts,
    OperandCast,
    QuantRecipe,
    apply_ablations,
    named_recipe,
    recipe_names,
)


def C(fmt, block=None, rounding="nearest", hadamard=False):
    return OperandCast(fmt, block, rounding, hadamard)


def casts(r: QuantRecipe):
    """(x, W) fprop, (dy, Wᵀ) dgrad, (dyᵀ, xᵀ) wgrad."""
    return (r.fprop.a, r.fprop.b, r.dgrad.a, r.dgrad.b, r.wgrad.a, r.wgrad.b)


NV_ROW, NV_TILE = (1, 16), (16, 16)
# The paper's nvfp4 (RECIPE §3), in the order of casts().
NVFP4 = (
    C("nvfp4", NV_ROW),                            # fprop x: 1x16 along K, RNE
    C("nvfp4", NV_TILE),                           # fprop W: 16x16 tiles, RNE
    C("nvfp4", NV_ROW, "stochastic"),              # dgrad dy: 1x16 along N, stochastic
    C("nvfp4", NV_TILE),                           # dgrad Wᵀ: the same tiles
    C("nvfp4", NV_ROW, "stochastic", True),        # wgrad dy columnwise, RHT, stochastic
    C("nvfp4", NV_ROW, "nearest", True),           # wgrad x columnwise, RHT, RNE
)  # fmt: skip


def test_names():
    assert recipe_names() == ("bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4")
    for name, r in NAMED_RECIPES.items():
        assert r.name == name and named_recipe(name) is r
    with pytest.raises(ValueError, match="unknown recipe 'nvfp8'"):
        named_recipe("nvfp8")


def test_bf16():
    assert casts(BF16) == (C("bf16"),) * 6
    assert BF16.is_bf16 and not BF16.weight_shared_fprop_dgrad


def test_fp8_baseline():
    r = named_recipe("fp8")
    act, w = C("fp8_e4m3", (1, 128)), C("fp8_e4m3", (128, 128))
    assert casts(r) == (act, w, act, w, act, act)
    assert r.weight_shared_fprop_dgrad and not r.is_bf16


def test_fp8_tensorwise():
    r = named_recipe("fp8_tensorwise")
    assert casts(r) == (C("fp8_e4m3"),) * 6
    assert r.weight_shared_fprop_dgrad


def test_nvfp4_is_the_paper():
    r = named_recipe("nvfp4")
    assert casts(r) == NVFP4
    assert r.weight_shared_fprop_dgrad
    assert r.formats == {"nvfp4"}


def test_mxfp4_same_placement_as_nvfp4():
    r = named_recipe("mxfp4")
    expect = tuple(
        C("mxfp4", (1, 32) if c.block == NV_ROW else (32, 32), c.rounding, c.hadamard) for c in NVFP4
    )
    assert casts(r) == expect


def _nv(**changes):
    """NVFP4 with per-position changes: {index: OperandCast}."""
    out = list(NVFP4)
    for i, c in changes.items():
        out[int(i[1:])] = c
    return tuple(out)


ABLATION_CASES = {
    "no_rht": (
        Ablations(rht=False),
        _nv(i4=C("nvfp4", NV_ROW, "stochastic"), i5=C("nvfp4", NV_ROW)),
        True,
    ),
    "no_sr": (
        Ablations(stochastic_rounding=False),
        _nv(i2=C("nvfp4", NV_ROW), i4=C("nvfp4", NV_ROW, "nearest", True)),
        True,
    ),
    "1d": (
        Ablations(weight_2d=False),
        _nv(i1=C("nvfp4", NV_ROW), i3=C("nvfp4", NV_ROW)),  # W along K in fprop, along N in dgrad
        False,
    ),
    "rht_all": (
        Ablations(rht_all_gemms=True),
        (
            C("nvfp4", NV_ROW, "nearest", True),
            C("nvfp4", NV_TILE, "nearest", True),
            C("nvfp4", NV_ROW, "stochastic", True),
            C("nvfp4", NV_TILE, "nearest", True),
            NVFP4[4],
            NVFP4[5],
        ),
        False,  # H along K in fprop and along N in dgrad: different values
    ),
    "sr_all": (
        Ablations(stochastic_rounding_all=True),
        tuple(C(c.format, c.block, "stochastic", c.hadamard) for c in NVFP4),
        True,
    ),
}


@pytest.mark.parametrize("tag", list(ABLATION_CASES))
def test_each_ablation(tag):
    ab, expect, shared = ABLATION_CASES[tag]
    r = apply_ablations(named_recipe("nvfp4"), ab)
    assert casts(r) == expect
    assert r.name == f"nvfp4+{tag}"
    assert r.weight_shared_fprop_dgrad is shared


def test_gemm_engine_default_and_check():
    from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE as KERNELS_DEFAULT

    assert named_recipe("nvfp4").gemm_engine == KERNELS_DEFAULT
    assert named_recipe("nvfp4").replace(gemm_engine="triton").gemm_engine == "triton"
    with pytest.raises(ValueError, match="GEMM engine 'cuBLAS' is not one of"):
        named_recipe("nvfp4").replace(gemm_engine="cuBLAS")


def test_ablation_cases_are_the_vocabulary():
    """Every recipe-changing name of ABLATIONS is a case above, with that one switch set."""
    assert set(ABLATION_CASES) == set(ABLATIONS) - {"all_blocks"}
    for tag, (fld, value) in ABLATIONS.items():
        ab = Ablations(**{fld: value})
        assert ab != Ablations()
        assert ab.recipe_tags() == (() if tag == "all_blocks" else (tag,))
        if tag in ABLATION_CASES:
            assert ABLATION_CASES[tag][0] == ab


def test_all_blocks_quantized_leaves_recipe_alone():
    r = named_recipe("nvfp4")
    assert apply_ablations(r, Ablations(all_blocks_quantized=True)) is r
    assert apply_ablations(r, Ablations()) is r


def test_combined_ablations():
    r = apply_ablations(named_recipe("nvfp4"), Ablations(rht=False, stochastic_rounding=False, weight_2d=False))
    assert r.name == "nvfp4+no_rht+no_sr+1d"
    assert casts(r) == (C("nvfp4", NV_ROW),) * 6


def test_ablations_on_mxfp4():
    r = apply_ablations(named_recipe("mxfp4"), Ablations(weight_2d=False, rht=False))
    assert casts(r) == (C("mxfp4", (1, 32)),) * 2 + (C("mxfp4", (1, 32), "stochastic"), C("mxfp4", (1, 32))) + (
        C("mxfp4", (1, 32), "stochastic"),
        C("mxfp4", (1, 32)),
    )


@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8_tensorwise"])
def test_ablations_need_an_fp4_recipe(name):
    with pytest.raises(ValueError, match="apply to fp4 recipes"):
        apply_ablations(named_recipe(name), Ablations(rht=False))


def test_contradictory_ablations():
    with pytest.raises(ValueError, match="rht_all_gemms=true contradicts rht=false"):
        Ablations(rht=False, rht_all_gemms=True)
    with pytest.raises(ValueError, match="stochastic_rounding_all=true contradicts"):
        Ablations(stochastic_rounding=False, stochastic_rounding_all=True)
    with pytest.raises(ValueError, match="must be a bool"):
        Ablations(rht="yes")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="int4"), "is not one of"),
        (dict(format="fp8_e4m3", block=(1, 128), rounding="stochastic"), "stochastic rounding is only for fp4"),
        (dict(format="bf16", rounding="stochastic"), "stochastic rounding is only for fp4"),
        (dict(format="nvfp4", block=(1, 16), rounding="up"), "rounding='up' is not one of"),
        (dict(format="bf16", block=(1, 16)), "not valid for format 'bf16'"),
        (dict(format="nvfp4", block=(1, 32)), r"not valid for format 'nvfp4': use one of 1x16, 16x16"),
        (dict(format="nvfp4", block=None), "per-tensor is not valid for format 'nvfp4'"),
        (dict(format="mxfp4", block=(1, 16)), "not valid for format 'mxfp4'"),
        (dict(format="fp8_e4m3", block=(1, 64)), "not valid for format 'fp8_e4m3'"),
        (dict(format="fp8_e4m3", block=(1, 128), hadamard=True), "hadamard=True is only for fp4"),
        (dict(format="bf16", hadamard=True), "hadamard=True is only for fp4"),
        (dict(format="nvfp4", block=(1, 0)), "pair of positive ints"),
        (dict(format="nvfp4", block=(16,)), "pair of positive ints"),
    ],
)
def test_operand_cast_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OperandCast(**kwargs)


def test_operand_cast_accepts_list_block():
    c = OperandCast("nvfp4", [16, 16])
    assert c.block == (16, 16) and c == OperandCast("nvfp4", (16, 16))
    assert OperandCast("nvfp4", (1, 16), "stochastic", True).short() == "nvfp4 1x16 stochastic RHT"


def test_gemm_validation():
    nv = C("nvfp4", NV_ROW)
    with pytest.raises(ValueError, match="fprop: both operands of a GEMM must share one format, got x=nvfp4 and W=bf16"):
        GemmCasts("fprop", nv, C("bf16"))
    with pytest.raises(ValueError, match="same extent along the reduction dim"):
        GemmCasts("dgrad", C("fp8_e4m3", (1, 128)), C("fp8_e4m3"))
    with pytest.raises(ValueError, match="Hadamard transform must be on both operands"):
        GemmCasts("wgrad", C("nvfp4", NV_ROW, hadamard=True), nv)
    with pytest.raises(ValueError, match="role='bprop'"):
        GemmCasts("bprop", nv, nv)
    GemmCasts("fprop", C("nvfp4", NV_ROW), C("nvfp4", NV_TILE))  # 1x16 against 16x16: both 16 along K


def test_recipe_validation():
    f = GemmCasts("fprop", C("bf16"), C("bf16"))
    with pytest.raises(ValueError, match="QuantRecipe.dgrad must be GemmCasts"):
        QuantRecipe("x", f, f, GemmCasts("wgrad", C("bf16"), C("bf16")))
    with pytest.raises(ValueError, match="non-empty"):
        QuantRecipe("", f, GemmCasts("dgrad", C("bf16"), C("bf16")), GemmCasts("wgrad", C("bf16"), C("bf16")))


def test_recipes_are_frozen():
    with pytest.raises(AttributeError):
        named_recipe("nvfp4").name = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        named_recipe("nvfp4").fprop.a.rounding = "stochastic"  # type: ignore[misc]


def test_describe():
    text = named_recipe("nvfp4").describe()
    lines = text.splitlines()
    assert lines[0] == "recipe nvfp4" and len(lines) == 7
    assert sum("RHT" in line for line in lines) == 2
    assert sum("stochastic" in line for line in lines) == 2
    assert "fprop's quantized W, transposed" in lines[4]
    assert "dy columnwise, along M" in lines[5] and "x columnwise, along M" in lines[6]
    assert "(all bf16)" in BF16.describe()
    assert "128x128 blocks" in named_recipe("fp8").describe()
    assert "per-tensor" in named_recipe("fp8_tensorwise").describe()
