"""Quantization recipes as data: one cast per operand of each GEMM of a linear layer (RECIPE.md §3, §5).

A linear layer ``y = x Wᵀ`` (x [M,K], W [N,K], dy [M,N]) runs three GEMMs. Each is written here in ONE
orientation, ``C = A · Bᵀ`` with both operands stored with the GEMM's reduction dimension last:

    role    A            B            reduction dim   output
    fprop   x   [M,K]    W   [N,K]    K               y  [M,N]
    dgrad   dy  [M,N]    Wᵀ  [K,N]    N               dx [M,K]
    wgrad   dyᵀ [N,M]    xᵀ  [K,M]    M               dW [N,K]

so a block shape ``(r, c)`` always means ``c`` elements along the reduction dim by ``r`` along the other.
``(1, 16)`` on ``xᵀ`` in wgrad is "x columnwise, 16 along M"; ``(1, 16)`` on ``Wᵀ`` in dgrad is "W
columnwise, 16 along N"; a square ``(16, 16)`` tile is the same tile in W and Wᵀ, which is why 2-D weight
scaling lets dgrad reuse fprop's quantized weight bit for bit. The Hadamard transform, when on, is applied
along the reduction dim to BOTH operands of a GEMM (``(A H)(B H)ᵀ = A Bᵀ`` needs H on both sides).

Named recipes: ``bf16``, ``fp8`` (the paper's baseline), ``fp8_tensorwise``, ``nvfp4`` (the paper's),
``mxfp4``. Every paper ablation is an :class:`Ablations` value applied to a named fp4 recipe by
:func:`apply_ablations`; ``Ablations.all_blocks_quantized`` is read by the layer precision map instead.

Pure Python: no torch, no kernels, no megatron (a recipe naming another GEMM engine than the default checks
the name against ``kernels/gemm_engine.py`` when it is made).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "GEMM_ROLES",
    "OPERANDS",
    "OperandCast",
    "GemmCasts",
    "QuantRecipe",
    "Ablations",
    "ABLATIONS",
    "NAMED_RECIPES",
    "recipe_names",
    "named_recipe",
    "apply_ablations",
    "BF16",
    "DEFAULT_GEMM_ENGINE",
]

FORMATS = ("bf16", "fp8_e4m3", "nvfp4", "mxfp4")
# nvfp4_train.kernels.gemm_engine.DEFAULT_GEMM_ENGINE (tests/precision/test_recipe.py checks they agree), named here so that
# the recipes, the config schema and the layer table import without the kernels
DEFAULT_GEMM_ENGINE = "cublas"
FP4_FORMATS = ("nvfp4", "mxfp4")
ROUNDINGS = ("nearest", "stochastic")
GEMM_ROLES = ("fprop", "dgrad", "wgrad")

# Block shapes each format supports, in the (other dim, reduction dim) convention of the module docstring.
# None means one scale for the whole tensor.
_BLOCKS: dict[str, tuple[tuple[int, int] | None, ...]] = {
    "bf16": (None,),
    "fp8_e4m3": (None, (1, 128), (128, 128)),
    "nvfp4": ((1, 16), (16, 16)),
    "mxfp4": ((1, 32), (32, 32)),
}
HADAMARD_SIZE = 16  # RECIPE §3: H16, applied to every 16 consecutive elements along the reduction dim

# Per role: (name, shape, layout words) of operand A and operand B.
OPERANDS: dict[str, tuple[tuple[str, str, str], tuple[str, str, str]]] = {
    "fprop": (("x", "[M,K]", "rowwise, along K"), ("W", "[N,K]", "rowwise, along K")),
    "dgrad": (("dy", "[M,N]", "rowwise, along N"), ("Wᵀ", "[K,N]", "W columnwise, along N")),
    "wgrad": (("dyᵀ", "[N,M]", "dy columnwise, along M"), ("xᵀ", "[K,M]", "x columnwise, along M")),
}

_SCALE_WORDS = {
    "fp8_e4m3": "FP32 scale",
    "nvfp4": "E4M3 scales + FP32 tensor scale",
    "mxfp4": "UE8M0 scales",
}


@dataclass(frozen=True)
class OperandCast:
    """How one operand of one GEMM is cast before the GEMM.

    ``format``: ``bf16`` (no quantization), ``fp8_e4m3``, ``nvfp4`` or ``mxfp4``.
    ``block``: ``(rows, cols)`` of one scale block, ``cols`` along the GEMM's reduction dim; ``None`` for one
    scale per tensor (bf16 and fp8 per-tensor scaling only).
    ``rounding``: ``nearest`` (round to nearest even) or ``stochastic`` (fp4 formats only).
    ``hadamard``: the 16-point random Hadamard transform along the reduction dim before quantizing.
    """

    format: str = "bf16"
    block: tuple[int, int] | None = None
    rounding: str = "nearest"
    hadamard: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"OperandCast.format={self.format!r} is not one of {FORMATS}")
        block = self.block
        if block is not None:
            if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block
            ):
                raise ValueError(
                    f"OperandCast.block={block!r} must be a pair of positive ints (rows, cols) or None"
                )
            block = (int(block[0]), int(block[1]))
            object.__setattr__(self, "block", block)  # accept lists (from YAML), store a tuple
        allowed = _BLOCKS[self.format]
        if block not in allowed:
            raise ValueError(
                f"OperandCast.block={_block_str(block)} is not valid for format {self.format!r}: "
                f"use one of {', '.join(_block_str(b) for b in allowed)}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"OperandCast.rounding={self.rounding!r} is not one of {ROUNDINGS}")
        if self.rounding == "stochastic" and self.format not in FP4_FORMATS:
            raise ValueError(
                f"stochastic rounding is only for fp4 formats {FP4_FORMATS}, got format={self.format!r}: "
                f"use rounding='nearest'"
            )
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"OperandCast.hadamard={self.hadamard!r} must be a bool")
        if self.hadamard:
            if self.format not in FP4_FORMATS:
                raise ValueError(
                    f"hadamard=True is only for fp4 formats {FP4_FORMATS} (the transform exists to tame "
                    f"outliers inside 16/32-element fp4 blocks), got format={self.format!r}: set hadamard=False"
                )
            assert block is not None and block[1] % HADAMARD_SIZE == 0, "every fp4 block is 16k wide"

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"

    def short(self) -> str:
        """One line: ``nvfp4 1x16 stochastic RHT``."""
        if self.format == "bf16":
            return "bf16"
        parts = [self.format, _block_str(self.block), self.rounding]
        if self.hadamard:
            parts.append("RHT")
        return " ".join(parts)


@dataclass(frozen=True)
class GemmCasts:
    """The casts of the two operands of one GEMM ``C = A · Bᵀ`` (see the module docstring for A and B)."""

    role: str
    a: OperandCast
    b: OperandCast

    def __post_init__(self) -> None:
        if self.role not in GEMM_ROLES:
            raise ValueError(f"GemmCasts.role={self.role!r} is not one of {GEMM_ROLES}")
        (na, _, _), (nb, _, _) = OPERANDS[self.role]
        a, b = self.a, self.b
        if a.format != b.format:
            raise ValueError(
                f"{self.role}: both operands of a GEMM must share one format, got {na}={a.format} and "
                f"{nb}={b.format}: set both to the same format"
            )
        ka = None if a.block is None else a.block[1]
        kb = None if b.block is None else b.block[1]
        if ka != kb:
            raise ValueError(
                f"{self.role}: the scale blocks of {na} ({_block_str(a.block)}) and {nb} "
                f"({_block_str(b.block)}) must have the same extent along the reduction dim: "
                f"use the same block width for both"
            )
        if a.hadamard != b.hadamard:
            raise ValueError(
                f"{self.role}: the Hadamard transform must be on both operands or neither "
                f"(it cancels only as (A H)(B H)ᵀ = A Bᵀ), got {na} hadamard={a.hadamard}, "
                f"{nb} hadamard={b.hadamard}"
            )

    @property
    def quantized(self) -> bool:
        return self.a.quantized


def _bf16_gemm(role: str) -> GemmCasts:
    return GemmCasts(role, OperandCast(), OperandCast())


@dataclass(frozen=True)
class QuantRecipe:
    """A linear layer's precision: the casts of fprop, dgrad and wgrad (RECIPE.md §3)."""

    name: str
    fprop: GemmCasts
    dgrad: GemmCasts
    wgrad: GemmCasts
    # which implementation runs the fp4 GEMMs (``kernels/gemm_engine.py``; ``precision.gemm_engine``): not the
    # numerics (every engine is exact up to the fp32 summation order), so not part of the name
    gemm_engine: str = DEFAULT_GEMM_ENGINE

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"QuantRecipe.name={self.name!r} must be a non-empty string")
        if self.gemm_engine != DEFAULT_GEMM_ENGINE:
            from nvfp4_train.kernels.gemm_engine import check_gemm_engine

            check_gemm_engine(self.gemm_engine)
        for role in GEMM_ROLES:
            g = getattr(self, role)
            if not isinstance(g, GemmCasts) or g.role != role:
                raise ValueError(f"QuantRecipe.{role} must be GemmCasts(role={role!r}, ...), got {g!r}")

    def gemms(self) -> tuple[GemmCasts, GemmCasts, GemmCasts]:
        return (self.fprop, self.dgrad, self.wgrad)

    @property
    def is_bf16(self) -> bool:
        """True when no operand of any GEMM is quantized (the layer is a plain bf16 linear)."""
        return not any(g.quantized for g in self.gemms())

    @property
    def formats(self) -> frozenset[str]:
        return frozenset(c.format for g in self.gemms() for c in (g.a, g.b))

    @property
    def weight_shared_fprop_dgrad(self) -> bool:
        """True when dgrad's Wᵀ is exactly fprop's quantized W, transposed (quantize W once per step).

        Holds when both casts are equal, quantized, Hadamard-free and the block is square or per-tensor: a
        square tile is the same tile read transposed. 1-D weight blocks (or RHT on fprop/dgrad) need a
        second, columnwise quantization of W for dgrad.
        """
        w_f, w_d = self.fprop.b, self.dgrad.b
        return (
            w_f == w_d
            and w_f.quantized
            and not w_f.hadamard
            and (w_f.block is None or w_f.block[0] == w_f.block[1])
        )

    def replace(self, **changes) -> QuantRecipe:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A readable multi-line description: one line per operand of each GEMM."""
        lines = [f"recipe {self.name}" + ("  (all bf16)" if self.is_bf16 else "")]
        for g in self.gemms():
            for i, cast in enumerate((g.a, g.b)):
                name, shape, layout = OPERANDS[g.role][i]
                role = g.role if i == 0 else ""
                if cast.format == "bf16":
                    what = "bf16"
                else:
                    scale = "per-tensor" if cast.block is None else f"{_block_str(cast.block)} blocks"
                    what = f"{cast.format:<8} {scale:<14} {_SCALE_WORDS[cast.format]:<31} {cast.rounding}"
                    if cast.hadamard:
                        what += " + RHT"
                    if g.role == "dgrad" and i == 1 and self.weight_shared_fprop_dgrad:
                        what += "  (fprop's quantized W, transposed)"
                lines.append(f"  {role:<6} {name:<4}{shape:<6} {layout:<23} {what}")
        return "\n".join(lines)


def _recipe(name: str, x, w, dy_d, w_d, dy_w, x_w) -> QuantRecipe:
    return QuantRecipe(
        name=name,
        fprop=GemmCasts("fprop", x, w),
        dgrad=GemmCasts("dgrad", dy_d, w_d),
        wgrad=GemmCasts("wgrad", dy_w, x_w),
    )


def _fp4_recipe(name: str, fmt: str, width: int) -> QuantRecipe:
    """RECIPE §3: W 2-D tiles RNE (the same values in dgrad); x 1-D RNE; dy 1-D stochastic in dgrad;
    wgrad operands columnwise with RHT and their own amax, dy stochastic, x RNE."""
    row = (1, width)
    tile = (width, width)
    return _recipe(
        name,
        x=OperandCast(fmt, row, "nearest"),
        w=OperandCast(fmt, tile, "nearest"),
        dy_d=OperandCast(fmt, row, "stochastic"),
        w_d=OperandCast(fmt, tile, "nearest"),
        dy_w=OperandCast(fmt, row, "stochastic", hadamard=True),
        x_w=OperandCast(fmt, row, "nearest", hadamard=True),
    )


def _fp8_recipe(name: str, act, weight) -> QuantRecipe:
    a = OperandCast("fp8_e4m3", act)
    w = OperandCast("fp8_e4m3", weight)
    return _recipe(name, x=a, w=w, dy_d=a, w_d=w, dy_w=a, x_w=a)


BF16 = QuantRecipe("bf16", _bf16_gemm("fprop"), _bf16_gemm("dgrad"), _bf16_gemm("wgrad"))

NAMED_RECIPES: dict[str, QuantRecipe] = {
    "bf16": BF16,
    # RECIPE §5: E4M3 everywhere, FP32 scales computed online, 1x128 activations/gradients, 128x128 weights.
    "fp8": _fp8_recipe("fp8", (1, 128), (128, 128)),
    # One FP32 scale per tensor from its current amax (no amax history).
    "fp8_tensorwise": _fp8_recipe("fp8_tensorwise", None, None),
    "nvfp4": _fp4_recipe("nvfp4", "nvfp4", 16),
    # The paper's NVFP4 recipe with only the format changed (1x32 blocks, UE8M0 scales; weights in 32x32
    # tiles so that dgrad still reuses fprop's values), so an NVFP4-vs-MXFP4 comparison isolates the format.
    "mxfp4": _fp4_recipe("mxfp4", "mxfp4", 32),
}


def recipe_names() -> tuple[str, ...]:
    return tuple(NAMED_RECIPES)


def named_recipe(name: str) -> QuantRecipe:
    """The named recipe ``name`` (``bf16``, ``fp8``, ``fp8_tensorwise``, ``nvfp4``, ``mxfp4``)."""
    try:
        return NAMED_RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}: use one of {recipe_names()}") from None


# The one vocabulary of the ablations: name -> (the ``Ablations`` switch, its value). ``precision=<base>_<name>``
# is the named config (configs/precision/nvfp4_no_rht.yaml, ...), ``<base>_<name>`` the convergence run,
# ``<base>+<name>`` the recipe it resolves to (all but all_blocks, which picks blocks, not casts).
ABLATIONS: dict[str, tuple[str, bool]] = {
    "no_rht": ("rht", False),
    "no_sr": ("stochastic_rounding", False),
    "1d": ("weight_2d", False),
    "rht_all": ("rht_all_gemms", True),
    "sr_all": ("stochastic_rounding_all", True),
    "all_blocks": ("all_blocks_quantized", True),
}


@dataclass(kw_only=True)
class Ablations:
    """The paper's ablations as switches on a named fp4 recipe (defaults = the paper's recipe).

    Also the Hydra schema of ``precision.ablations`` (so not frozen: OmegaConf must merge into it).
    """

    rht: bool = True
    """Random Hadamard transform on the wgrad operands. False: the paper's "no RHT" ablation."""
    stochastic_rounding: bool = True
    """Stochastic rounding of the gradient dy (dgrad and wgrad). False: "no SR", every cast rounds to nearest."""
    weight_2d: bool = True
    """2-D weight tiles (16x16 for nvfp4), shared by fprop and dgrad. False: "1-D weights", 1x16 blocks along
    K in fprop and a second quantization along N for dgrad."""
    rht_all_gemms: bool = False
    """RHT also on fprop (x, W along K) and dgrad (dy, Wᵀ along N). Needs ``rht``."""
    stochastic_rounding_all: bool = False
    """Stochastic rounding on every fp4 operand (x and W too). Needs ``stochastic_rounding``."""
    all_blocks_quantized: bool = False
    """No blocks kept in bf16 (the "all NVFP4" ablation). A layer-map switch: it sets keep_first = keep_last
    = 0 and conflicts with explicit nonzero keep counts; it does not change the recipe."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, bool):
                raise ValueError(f"Ablations.{f.name}={v!r} must be a bool")
        if self.rht_all_gemms and not self.rht:
            raise ValueError("Ablations: rht_all_gemms=true contradicts rht=false: set rht=true")
        if self.stochastic_rounding_all and not self.stochastic_rounding:
            raise ValueError(
                "Ablations: stochastic_rounding_all=true contradicts stochastic_rounding=false: "
                "set stochastic_rounding=true"
            )

    def recipe_tags(self) -> tuple[str, ...]:
        """The ``ABLATIONS`` names of the switches set here that change the recipe, in that table's order
        (used in recipe names: ``nvfp4+no_rht``)."""
        return tuple(tag for tag, (fld, value) in ABLATIONS.items()
                     if fld != "all_blocks_quantized" and getattr(self, fld) == value)

    @property
    def is_default(self) -> bool:
        return self == Ablations()


def apply_ablations(recipe: QuantRecipe, ablations: Ablations) -> QuantRecipe:
    """``recipe`` with the recipe-changing switches of ``ablations`` applied; its name gets ``+tag``s.

    Only fp4 recipes have ablations; ``all_blocks_quantized`` is ignored here (the layer map reads it).
    """
    tags = ablations.recipe_tags()
    if not tags:
        return recipe
    if not (recipe.formats & set(FP4_FORMATS)):
        raise ValueError(
            f"ablations {list(tags)} apply to fp4 recipes (nvfp4, mxfp4), not to recipe {recipe.name!r}: "
            f"reset precision.ablations or choose precision=nvfp4"
        )

    def cast(c: OperandCast, *, weight: bool, grad: bool, rht: bool | None) -> OperandCast:
        if c.format not in FP4_FORMATS:
            return c
        block, rounding, hadamard = c.block, c.rounding, c.hadamard
        if weight and not ablations.weight_2d:
            block = (1, block[1])
        if rht is not None:
            hadamard = rht
        if grad and not ablations.stochastic_rounding:
            rounding = "nearest"
        if ablations.stochastic_rounding_all:
            rounding = "stochastic"
        return OperandCast(c.format, block, rounding, hadamard)

    # rht: None keeps the named recipe's placement; True/False forces it on that GEMM.
    fprop_rht = True if ablations.rht_all_gemms else None
    wgrad_rht = None if ablations.rht else False
    f, d, w = recipe.fprop, recipe.dgrad, recipe.wgrad
    return QuantRecipe(
        name=recipe.name + "".join(f"+{t}" for t in tags),
        gemm_engine=recipe.gemm_engine,
        fprop=GemmCasts(
            "fprop",
            cast(f.a, weight=False, grad=False, rht=fprop_rht),
            cast(f.b, weight=True, grad=False, rht=fprop_rht),
        ),
        dgrad=GemmCasts(
            "dgrad",
            cast(d.a, weight=False, grad=True, rht=fprop_rht),
            cast(d.b, weight=True, grad=False, rht=fprop_rht),
        ),
        wgrad=GemmCasts(
            "wgrad",
            cast(w.a, weight=False, grad=True, rht=wgrad_rht),
            cast(w.b, weight=False, grad=False, rht=wgrad_rht),
        ),
    )


def _block_str(block: tuple[int, int] | None) -> str:
    return "per-tensor" if block is None else f"{block[0]}x{block[1]}"
