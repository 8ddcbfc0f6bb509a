"""The ``precision`` config section (Hydra schema) and its conversion to a :class:`LayerPrecisionMap`."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from nvfp4_train.precision.layer_map import LayerPrecisionMap, PrecisionRule, PrecisionSwitch
from nvfp4_train.precision.recipe import DEFAULT_GEMM_ENGINE, Ablations

__all__ = ["PrecisionConfig"]


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
    direct_dequant: bool = False
    """NVFP4 on the Hopper engines (cublas, triton): the quantize kernel writes the operands that one GEMM reads
    once (x rowwise for fprop, dy rowwise for dgrad, dy columnwise with RHT for wgrad) as their block-scaled
    values (bf16 / fp16), which the GEMM's dequantize launch would otherwise write from the packed codes. The same
    bits; about 1.1 bytes of memory traffic less per element of those operands. x columnwise (saved for
    backward) and the cached weight stay packed; off on telemetry steps and for the native engine (both read
    packed codes). Off by default until its step is measured: the kernels passed their bitwise GPU tests on an
    H100 (2026-12-05, f261a02), after the columnwise value copy's store was changed (``docs/benchmarks.md``,
    "Correctness on the GPU")."""

    def __post_init__(self) -> None:
        if not isinstance(self.direct_dequant, bool):
            raise ValueError(f"precision.direct_dequant={self.direct_dequant!r} must be a bool (true or false)")
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
            direct_dequant=self.direct_dequant,
        )
