"""The ``precision`` config section (Hydra schema) and its conversion to a :class:`LayerPrecisionMap`."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING, OmegaConf

from nvfp4_train.precision.layer_map import LayerPrecisionMap, PrecisionRule, PrecisionSwitch
from nvfp4_train.precision.recipe import DEFAULT_GEMM_ENGINE, Ablations

__all__ = ["PrecisionConfig", "RETIRED_FIELDS", "without_retired_fields", "saved_precision_config"]


# Fields that a saved ``precision`` section (a checkpoint's ``config.yaml``) may name and this schema no longer has,
# none of which changed the numerics: ``direct_dequant`` wrote some NVFP4 operands as their block-scaled values
# instead of packed codes, the same bits as the packed path that every run now takes.
RETIRED_FIELDS = ("direct_dequant",)


def without_retired_fields(saved: dict) -> dict:
    """A saved ``precision`` section without its ``RETIRED_FIELDS``: what this schema reads of it (a resume, an
    evaluation or an export of a checkpoint written while one of them existed)."""
    return {k: v for k, v in saved.items() if k not in RETIRED_FIELDS}


@dataclass(kw_only=True)
class PrecisionConfig:
    """Which recipe the linear layers run (``configs/precision/*.yaml``)."""

    recipe: str = MISSING
    """Named recipe of the run: ``bf16``, ``fp8``, ``fp8_tensorwise``, ``nvfp4``, ``mxfp4``."""
    keep_first: int | None = None
    """Blocks at the start kept in bf16. None: the recipe's 62-block setting scaled to the depth, rounded up."""
    keep_last: int | None = None
    """Blocks at the end kept in bf16. None: as keep_first (nvfp4: 8 of 62; fp8: 2 of 62)."""
    rules: list[PrecisionRule] = field(default_factory=list)
    """Explicit rules (blocks and/or role globs -> recipe), applied in order after the keep counts."""
    ablations: Ablations = field(default_factory=Ablations)
    """The paper's ablations, switches on an fp4 recipe (all off = the paper's recipe)."""
    switch: PrecisionSwitch = field(default_factory=PrecisionSwitch)
    """Switch to bf16 (forward only, or everything) for the rest of the run (off unless a step is given)."""
    gemm_engine: str = DEFAULT_GEMM_ENGINE
    """Which implementation runs the fp4 (nvfp4, mxfp4) GEMMs (``kernels/gemm_engine.py``): ``cublas`` (Hopper,
    the default: bf16 operands, cuBLAS with fp32 output, a Triton alpha pass), ``triton`` (Hopper: one Triton
    16-bit GEMM), ``native`` (the FP4 tensor cores of sm_100+) or ``auto`` (native where the GPU has it, else
    cublas). Exact up to the fp32 summation order; on CPU (the reference path) the results do not depend on it.
    MXFP4 runs its one Triton GEMM under both Hopper engines."""

    def __post_init__(self) -> None:
        if self.gemm_engine == DEFAULT_GEMM_ENGINE:
            return
        from nvfp4_train.kernels.gemm_engine import GEMM_ENGINES  # only for another engine: the table imports no kernels

        if self.gemm_engine not in GEMM_ENGINES:
            raise ValueError(f"precision.gemm_engine={self.gemm_engine!r} is not one of {GEMM_ENGINES} "
                             f"(default {DEFAULT_GEMM_ENGINE!r})")

    def layer_map(self, pattern: str) -> LayerPrecisionMap:
        """The resolved layer precision map for the hybrid ``pattern`` (raises on rules that match nothing)."""
        return LayerPrecisionMap(
            pattern,
            self.recipe,
            ablations=self.ablations,
            keep_first=self.keep_first,
            keep_last=self.keep_last,
            rules=self.rules,
            switch=self.switch,
            gemm_engine=self.gemm_engine,
        )


def saved_precision_config(saved: dict) -> PrecisionConfig:
    """The :class:`PrecisionConfig` of a checkpoint's saved ``precision`` section (its ``RETIRED_FIELDS`` dropped,
    today's defaults for fields added since): what an evaluation or an export of that checkpoint runs."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), without_retired_fields(saved)))
