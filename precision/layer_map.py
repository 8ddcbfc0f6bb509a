"""Which recipe each linear layer runs: the layer precision map (RECIPE.md §4), and the late precision switch.

A linear layer is named by the GLOBAL index of its block in the hybrid pattern (every pattern character but
``|`` is one block; under pipeline parallelism convert a stage-local index with
``nvfp4_train.models.pattern.HybridPattern.global_index``) and its role inside the block:

    M  mamba.in_proj   mamba.out_proj
    *  attention.qkv   attention.proj
    -  mlp.fc1         mlp.fc2

Resolution, in order (the last match wins):
1. every layer runs the run's recipe (a named recipe with its ablations applied);
2. the first ``keep_first`` and last ``keep_last`` blocks run ``bf16``. Unless given, the counts are the
   recipe's paper setting for a 62-block model scaled to the depth n and ROUNDED UP:
   ``ceil(count * n / 62)`` (nvfp4/mxfp4: 2 and 8; fp8/fp8_tensorwise: 1 and 2). Rounding up errs on the
   stable side (the paper: fewer BF16 blocks trains worse, none diverged at 1.2B) and keeps at least one
   block at each end for any depth; at n = 62 it gives the paper's counts exactly;
3. the user's rules, in order: blocks (``"0-3,60,61"``, inclusive ranges) and/or role globs
   (``"mamba.*,mlp.fc2"``) -> a recipe name. A rule that matches no layer is an error. A rule naming the
   run's base recipe (e.g. ``nvfp4``) gets the run's recipe, ablations included.

Embeddings and the output layer are always bf16; they are listed in the table but are not among the counted
linear layers. The map is pure data (no torch): the layers ask it for their recipe at build time, and the
trainer asks :meth:`LayerPrecisionMap.recipe_at` when a :class:`PrecisionSwitch` is configured.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from nvfp4_train.precision.recipe import (
    BF16,
    Ablations,
    GemmCasts,
    OperandCast,
    QuantRecipe,
    apply_ablations,
    named_recipe,
    recipe_names,
)

__all__ = [
    "ROLES_BY_KIND",
    "REFERENCE_DEPTH",
    "DEFAULT_KEEP",
    "scaled_keep",
    "PrecisionRule",
    "PrecisionSwitch",
    "recipe_in_effect",
    "LayerPrecision",
    "LayerPrecisionMap",
]

ROLES_BY_KIND: dict[str, tuple[str, ...]] = {
    "M": ("mamba.in_proj", "mamba.out_proj"),
    "*": ("attention.qkv", "attention.proj"),
    "-": ("mlp.fc1", "mlp.fc2"),
}
ALL_ROLES = tuple(r for roles in ROLES_BY_KIND.values() for r in roles)

REFERENCE_DEPTH = 62  # the paper's 12B, for which the default keep counts were chosen
DEFAULT_KEEP: dict[str, tuple[int, int]] = {  # (first, last) blocks in bf16 at REFERENCE_DEPTH
    "bf16": (0, 0),
    "fp8": (1, 2),
    "fp8_tensorwise": (1, 2),
    "nvfp4": (2, 8),
    "mxfp4": (2, 8),
}


def scaled_keep(count: int, num_blocks: int, reference_depth: int = REFERENCE_DEPTH) -> int:
    """``ceil(count * num_blocks / reference_depth)`` in exact integer arithmetic, at most ``num_blocks``."""
    return min(num_blocks, -(-count * num_blocks // reference_depth))


@dataclass(kw_only=True)
class PrecisionRule:
    """One user rule: the layers selected by ``blocks`` and ``roles`` run ``recipe``.

    Also the Hydra schema of an item of ``precision.rules``.
    """

    recipe: str
    """A named recipe (``bf16``, ``fp8``, ``fp8_tensorwise``, ``nvfp4``, ``mxfp4``)."""
    blocks: str | None = None
    """Global block indices: comma-separated ints and inclusive ranges, ``"0-3,60,61"``. None: every block."""
    roles: str | None = None
    """Comma-separated role globs, ``"mamba.*,mlp.fc2"``. None: every role."""

    def __post_init__(self) -> None:
        if self.blocks is None and self.roles is None:
            raise ValueError(
                f"precision rule {self.describe()} selects nothing in particular: give blocks and/or roles "
                f"(to change every layer, change precision.recipe)"
            )

    def describe(self) -> str:
        sel = []
        if self.blocks is not None:
            sel.append(f"blocks={self.blocks!r}")
        if self.roles is not None:
            sel.append(f"roles={self.roles!r}")
        return f"{{{', '.join(sel)} -> {self.recipe!r}}}"

    def block_set(self, num_blocks: int) -> set[int] | None:
        """The selected block indices (None: all); ValueError for bad syntax or indices out of range."""
        if self.blocks is None:
            return None
        spec = self.blocks
        items: Iterable = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
        out: set[int] = set()
        for item in items:
            text = str(item).strip()
            lo_s, sep, hi_s = text.partition("-")
            try:
                lo = int(lo_s)
                hi = int(hi_s) if sep else lo
            except ValueError:
                raise ValueError(
                    f"precision rule {self.describe()}: cannot read block item {text!r}: use ints and "
                    f"inclusive ranges like '0-3,60,61'"
                ) from None
            if lo > hi or lo < 0 or hi >= num_blocks:
                raise ValueError(
                    f"precision rule {self.describe()}: block item {text!r} is outside 0..{num_blocks - 1} "
                    f"(or an empty range) for this {num_blocks}-block pattern"
                )
            out.update(range(lo, hi + 1))
        return out

    def role_globs(self) -> tuple[str, ...] | None:
        if self.roles is None:
            return None
        spec = self.roles
        items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
        globs = tuple(s.strip() for s in items if str(s).strip())
        if not globs:
            raise ValueError(f"precision rule {self.describe()}: roles is empty")
        return globs


@dataclass(kw_only=True)
class PrecisionSwitch:
    """Switch precision for the rest of the run (paper App. D). Also the Hydra schema of ``precision.switch``.

    Inactive when both ``at_fraction`` and ``at_step`` are None. Active from optimizer step
    :meth:`start_step` (0-based) on. ``at_fraction`` is a fraction of the run's steps, which equals the
    fraction of tokens at a constant global batch (the paper switched for the last ~18% of tokens:
    ``at_fraction=0.82``).
    """

    mode: str = "fprop_bf16"
    """``fprop_bf16``: only the forward GEMM in bf16 (the paper's better choice); ``all_bf16``: every GEMM."""
    at_fraction: float | None = None
    """Switch after this fraction of the run, in [0, 1]."""
    at_step: int | None = None
    """Switch at this optimizer step (0-based)."""

    MODES = ("fprop_bf16", "all_bf16")

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"PrecisionSwitch.mode={self.mode!r} is not one of {self.MODES}")
        if self.at_fraction is not None and self.at_step is not None:
            raise ValueError(
                f"PrecisionSwitch: give at_fraction or at_step, not both "
                f"(got at_fraction={self.at_fraction}, at_step={self.at_step})"
            )
        if self.at_fraction is not None and not 0.0 <= self.at_fraction <= 1.0:
            raise ValueError(f"PrecisionSwitch.at_fraction={self.at_fraction} must be in [0, 1]")
        if self.at_step is not None and self.at_step < 0:
            raise ValueError(f"PrecisionSwitch.at_step={self.at_step} must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.at_fraction is not None or self.at_step is not None

    def start_step(self, total_steps: int) -> int | None:
        """First step (0-based) that runs switched; None when disabled. ``ceil(at_fraction * total_steps)``,
        computed on the decimal value of ``at_fraction`` (0.82 of 100 steps is step 82, not 83)."""
        if self.at_step is not None:
            return self.at_step
        if self.at_fraction is None:
            return None
        if total_steps < 0:
            raise ValueError(f"total_steps={total_steps} must be >= 0")
        return math.ceil(Fraction(repr(float(self.at_fraction))) * total_steps)

    def active(self, step: int, total_steps: int) -> bool:
        start = self.start_step(total_steps)
        return start is not None and step >= start

    def describe(self) -> str:
        if not self.enabled:
            return "none"
        when = f"step {self.at_step}" if self.at_step is not None else f"{self.at_fraction:g} of the run"
        return f"{self.mode} from {when}"


def switched_recipe(recipe: QuantRecipe, mode: str) -> QuantRecipe:
    """``recipe`` after a switch of ``mode`` (``fprop_bf16`` / ``all_bf16``)."""
    if mode == "all_bf16" or recipe.is_bf16:
        return BF16
    if mode == "fprop_bf16":
        if not recipe.fprop.quantized:
            return recipe
        bf = OperandCast()
        return recipe.replace(name=f"{recipe.name}+fprop_bf16", fprop=GemmCasts("fprop", bf, bf))
    raise ValueError(f"switch mode {mode!r} is not one of {PrecisionSwitch.MODES}")


def recipe_in_effect(
    recipe: QuantRecipe, switch: PrecisionSwitch | None, *, step: int, total_steps: int
) -> QuantRecipe:
    """The recipe a layer configured with ``recipe`` runs at optimizer ``step`` of ``total_steps``."""
    if switch is None or not switch.active(step, total_steps):
        return recipe
    return switched_recipe(recipe, switch.mode)


@dataclass(frozen=True)
class LayerPrecision:
    """One row of the resolved map."""

    block: int
    kind: str
    role: str
    recipe: str
    reason: str  # "default", "first 2", "last 8", "rule 0"


class LayerPrecisionMap:
    """The resolved precision of every linear layer of a hybrid pattern (see the module docstring)."""

    def __init__(
        self,
        pattern: str,
        recipe: str | QuantRecipe = "nvfp4",
        *,
        ablations: Ablations | None = None,
        keep_first: int | None = None,
        keep_last: int | None = None,
        rules: Sequence[PrecisionRule] = (),
        switch: PrecisionSwitch | None = None,
        gemm_engine: str | None = None,
    ) -> None:
        """``pattern``: the hybrid pattern (``|`` allowed, ignored: indices are global); ``recipe``: a named
        recipe, or a custom :class:`QuantRecipe` (then ``keep_first``/``keep_last`` must be given);
        ``gemm_engine``: the fp4 GEMM engine of every quantized recipe of the map (None: the recipes' own)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern must be a non-empty string, got {pattern!r}")
        blocks = pattern.replace("|", "")
        for pos, ch in enumerate(blocks):
            if ch not in ROLES_BY_KIND:
                raise ValueError(f"pattern {pattern!r}: block {pos} has unknown kind {ch!r} (use M, *, -)")
        self.pattern = pattern
        self.blocks = blocks
        n = len(blocks)
        ablations = ablations if ablations is not None else Ablations()
        self.ablations = ablations
        self.switch = switch if switch is not None and switch.enabled else None

        if isinstance(recipe, QuantRecipe):
            base_name, base = recipe.name, recipe
        else:
            base_name, base = recipe, named_recipe(recipe)
        run_recipe = apply_ablations(base, ablations)
        self.base_name = base_name
        self.run_recipe = run_recipe
        # Recipes a rule may name; the run's base name resolves to the run's (ablated) recipe.
        self._registry: dict[str, QuantRecipe] = {name: named_recipe(name) for name in recipe_names()}
        self._registry[base_name] = run_recipe
        if gemm_engine is not None:  # QuantRecipe checks the name
            self._registry = {k: r if r.is_bf16 else r.replace(gemm_engine=gemm_engine)
                              for k, r in self._registry.items()}
            run_recipe = self.run_recipe = self._registry[base_name]

        # keep counts
        if ablations.all_blocks_quantized:
            if keep_first or keep_last:
                raise ValueError(
                    f"ablations.all_blocks_quantized=true conflicts with keep_first={keep_first}, "
                    f"keep_last={keep_last}: drop one of them"
                )
            keep_first = keep_last = 0
        self.keep_default = (keep_first is None, keep_last is None)
        if run_recipe.is_bf16 and (keep_first or keep_last or self.switch is not None):
            warnings.warn(
                f"recipe {base_name!r} runs every layer in bf16: keep_first={keep_first}, keep_last={keep_last} "
                f"and the precision switch ({self.switch.describe() if self.switch else 'none'}) have no effect",
                stacklevel=2,
            )
        if keep_first is None or keep_last is None:
            if base_name not in DEFAULT_KEEP or not isinstance(recipe, str):
                raise ValueError(
                    f"recipe {base_name!r} has no default keep_first/keep_last: give both explicitly"
                )
            ref_first, ref_last = DEFAULT_KEEP[base_name]
            if keep_first is None:
                keep_first = scaled_keep(ref_first, n)
            if keep_last is None:
                keep_last = scaled_keep(ref_last, n)
        for label, v in (("keep_first", keep_first), ("keep_last", keep_last)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= n:
                raise ValueError(f"{label}={v!r} must be an int in 0..{n} (the pattern has {n} blocks)")
        self.keep_first, self.keep_last = keep_first, keep_last

        # resolve
        names: dict[tuple[int, str], tuple[str, str]] = {}
        for b, kind in enumerate(blocks):
            for role in ROLES_BY_KIND[kind]:
                if b < keep_first:
                    names[(b, role)] = ("bf16", f"first {keep_first}")
                elif b >= n - keep_last:
                    names[(b, role)] = ("bf16", f"last {keep_last}")
                else:
                    names[(b, role)] = (base_name, "default")
        self.rules = tuple(rules)
        for i, rule in enumerate(self.rules):
            if rule.recipe not in self._registry:
                raise ValueError(
                    f"precision rule {i} {rule.describe()}: unknown recipe {rule.recipe!r}: "
                    f"use one of {tuple(self._registry)}"
                )
            sel_blocks = rule.block_set(n)
            globs = rule.role_globs()
            hits = [
                key
                for key in names
                if (sel_blocks is None or key[0] in sel_blocks)
                and (globs is None or any(fnmatch.fnmatchcase(key[1], g) for g in globs))
            ]
            if not hits:
                raise ValueError(
                    f"precision rule {i} {rule.describe()} matches no linear layer of pattern {pattern!r} "
                    f"(roles are {', '.join(ALL_ROLES)}; blocks 0..{n - 1}): fix or remove it"
                )
            for key in hits:
                names[key] = (rule.recipe, f"rule {i}")

        self._recipes: dict[str, QuantRecipe] = {}
        rows = []
        for (b, role), (rname, reason) in names.items():
            r = self._registry[rname]
            self._recipes[r.name] = r
            rows.append(LayerPrecision(block=b, kind=blocks[b], role=role, recipe=r.name, reason=reason))
        self.entries: tuple[LayerPrecision, ...] = tuple(rows)
        self._by_key = {(e.block, e.role): e for e in rows}

    # --- lookups ----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def _entry(self, block: int, role: str) -> LayerPrecision:
        try:
            return self._by_key[(block, role)]
        except KeyError:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} out of range 0..{self.num_blocks - 1}") from None
            kind = self.blocks[block]
            raise ValueError(
                f"block {block} is {kind!r}: its roles are {ROLES_BY_KIND[kind]}, not {role!r}"
            ) from None

    def recipe_name(self, block: int, role: str) -> str:
        """Name of the recipe of layer ``role`` of global block ``block``."""
        return self._entry(block, role).recipe

    def recipe(self, block: int, role: str) -> QuantRecipe:
        """The recipe of layer ``role`` of global block ``block`` (no precision switch applied)."""
        return self._recipes[self._entry(block, role).recipe]

    def recipe_at(self, block: int, role: str, *, step: int, total_steps: int) -> QuantRecipe:
        """The recipe in effect at optimizer ``step``, the precision switch applied."""
        return recipe_in_effect(self.recipe(block, role), self.switch, step=step, total_steps=total_steps)

    @property
    def recipes(self) -> dict[str, QuantRecipe]:
        """The recipes used by at least one layer, by name."""
        return dict(self._recipes)

    # --- counts and table -------------------------------------------------------------------------------
    @property
    def num_linear(self) -> int:
        return len(self.entries)

    @property
    def num_bf16(self) -> int:
        return sum(self._recipes[e.recipe].is_bf16 for e in self.entries)

    def summary_line(self) -> str:
        """``bf16 linear layers: 20/124 (16.1%)``."""
        return f"bf16 linear layers: {self.num_bf16}/{self.num_linear} ({100 * self.num_bf16 / self.num_linear:.1f}%)"

    def table(self, *, describe_recipes: bool = True) -> str:
        """The resolved table: a header (with each quantized recipe's casts when ``describe_recipes``), the
        embedding, every linear layer, the output layer; its last line is :meth:`summary_line`."""
        def keep_word(v: int, default: bool, which: int) -> str:
            if not default:
                return f"{v} (given)"
            ref = DEFAULT_KEEP.get(self.base_name, (0, 0))[which]
            return f"{v} (default: ceil({ref}*{self.num_blocks}/{REFERENCE_DEPTH}))"

        head = [
            f"recipe: {self.run_recipe.name}"
            + (f"  ablations: {', '.join(self.ablations.recipe_tags())}" if self.ablations.recipe_tags() else ""),
            f"bf16 blocks: first {keep_word(self.keep_first, self.keep_default[0], 0)}, "
            f"last {keep_word(self.keep_last, self.keep_default[1], 1)}"
            + ("  [all_blocks_quantized]" if self.ablations.all_blocks_quantized else ""),
            f"rules: {len(self.rules)}" + "".join(f"\n  rule {i}: {r.describe()}" for i, r in enumerate(self.rules)),
            f"precision switch: {self.switch.describe() if self.switch else 'none'}",
        ]
        if describe_recipes:
            head += [r.describe() for r in self._recipes.values() if not r.is_bf16]
        rows = [("block", "kind", "role", "recipe", "why"), ("-", "", "embedding", "bf16", "always")]
        rows += [(str(e.block), e.kind, e.role, e.recipe, e.reason) for e in self.entries]
        rows.append(("-", "", "output_layer", "bf16", "always"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(head + [""] + body + [self.summary_line()])

