"""Precision: recipes (which cast each GEMM operand gets) and the layer precision map (which layer runs which
recipe). These two modules are pure data and import neither torch nor the kernels, so importing
``nvfp4_train.precision`` stays light; the quantized layers live in their own modules.
"""

from nvfp4_train.precision.layer_map import (
    ROLES_BY_KIND,
    LayerPrecision,
    LayerPrecisionMap,
    PrecisionRule,
    PrecisionSwitch,
    recipe_in_effect,
    scaled_keep,
)
from nvfp4_train.precision.recipe import (
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

__all__ = [
    "Ablations",
    "BF16",
    "GemmCasts",
    "LayerPrecision",
    "LayerPrecisionMap",
    "NAMED_RECIPES",
    "OperandCast",
    "PrecisionRule",
    "PrecisionSwitch",
    "QuantRecipe",
    "ROLES_BY_KIND",
    "apply_ablations",
    "named_recipe",
    "recipe_in_effect",
    "recipe_names",
    "scaled_keep",
]
