"""The hybrid layout as a short validated string (megatron-core's ``hybrid_override_pattern``, plus stages).

Every character but ``|`` is one block, in order: ``M`` a Mamba-2 block, ``*`` an attention block, ``-`` an
MLP block. ``|`` marks a pipeline-stage boundary; it is not a block. Blocks are numbered 0..n-1 over the
whole pattern (the GLOBAL block index), which is what the layer precision map and checkpoints use, whatever
the pipeline layout::

    "M-M*|-M-"   stages ("M-M*", "-M-"), stage 1 local block 0 is global block 4

megatron-core's ``MambaStack`` numbers its layers ``layer_number = offset + local + 1`` (1-based, global);
its module names (``decoder.layers.<local>``) are stage-local. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAMBA", "ATTENTION", "MLP", "STAGE_BOUNDARY", "BLOCK_KINDS", "KIND_NAMES", "HybridPattern"]

MAMBA = "M"
ATTENTION = "*"
MLP = "-"
STAGE_BOUNDARY = "|"
BLOCK_KINDS = (MAMBA, ATTENTION, MLP)
KIND_NAMES = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp"}
_ALLOWED = "M (Mamba-2), * (attention), - (MLP), | (pipeline-stage boundary)"


@dataclass(frozen=True)
class HybridPattern:
    """A validated hybrid pattern. Build it with :meth:`parse`."""

    text: str
    """The pattern as given, ``|`` included."""
    stages: tuple[str, ...]
    """The blocks of each pipeline stage (one stage when the pattern has no ``|``)."""

    @classmethod
    def parse(cls, text: str, *, num_layers: int | None = None, pp_size: int | None = None) -> HybridPattern:
        """Validate ``text``; ``num_layers`` (blocks) and ``pp_size`` (pipeline stages) are checked when given.

        A pattern without ``|`` is one stage; with ``pp_size > 1`` it must carry ``pp_size - 1`` boundaries
        (stages are chosen by the user, not split evenly: block kinds cost very different amounts).
        """
        if not isinstance(text, str) or not text:
            raise ValueError(f"hybrid pattern must be a non-empty string of {_ALLOWED}, got {text!r}")
        for pos, ch in enumerate(text):
            if ch not in BLOCK_KINDS and ch != STAGE_BOUNDARY:
                raise ValueError(
                    f"hybrid pattern {text!r} has {ch!r} at position {pos}: allowed characters are {_ALLOWED}"
                )
        stages = tuple(text.split(STAGE_BOUNDARY))
        for i, stage in enumerate(stages):
            if not stage:
                raise ValueError(
                    f"hybrid pattern {text!r}: pipeline stage {i} (of {len(stages)}) is empty: "
                    f"remove the extra '|' (a '|' goes between two non-empty stages)"
                )
        pattern = cls(text=text, stages=stages)
        n = pattern.num_blocks
        if num_layers is not None and num_layers != n:
            raise ValueError(
                f"hybrid pattern {text!r} has {n} blocks but num_layers={num_layers}: "
                f"make them agree (every character but '|' is one block)"
            )
        if pp_size is not None:
            if pp_size < 1:
                raise ValueError(f"pp_size={pp_size} must be >= 1")
            if pattern.num_stages != pp_size:
                raise ValueError(
                    f"hybrid pattern {text!r} has {pattern.num_stages} pipeline stage(s) but pp_size={pp_size}: "
                    f"put {pp_size - 1} '|' stage boundaries into the pattern"
                    + (f", e.g. {pattern.even_split(pp_size)!r}" if pattern.num_stages == 1 else "")
                )
        return pattern

    # --- blocks -----------------------------------------------------------------------------------------
    @property
    def blocks(self) -> str:
        """The pattern without stage boundaries: ``blocks[i]`` is the kind of global block ``i``."""
        return "".join(self.stages)

    @property
    def num_blocks(self) -> int:
        return sum(len(s) for s in self.stages)

    def __len__(self) -> int:
        return self.num_blocks

    def kind(self, index: int) -> str:
        """The kind (``M``, ``*``, ``-``) of global block ``index``."""
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for a {self.num_blocks}-block pattern")
        return self.blocks[index]

    def count(self, kind: str) -> int:
        if kind not in BLOCK_KINDS:
            raise ValueError(f"block kind {kind!r} is not one of {BLOCK_KINDS}")
        return self.blocks.count(kind)

    def counts(self) -> dict[str, int]:
        """``{"M": ..., "-": ..., "*": ...}``."""
        return {k: self.count(k) for k in (MAMBA, MLP, ATTENTION)}

    @property
    def num_mamba(self) -> int:
        return self.count(MAMBA)

    @property
    def num_attention(self) -> int:
        return self.count(ATTENTION)

    @property
    def num_mlp(self) -> int:
        return self.count(MLP)

    def counts_str(self) -> str:
        """``28 M, 28 -, 6 *``."""
        return ", ".join(f"{v} {k}" for k, v in self.counts().items())

    # --- pipeline stages --------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_offsets(self) -> tuple[int, ...]:
        """Global index of the first block of each stage."""
        offsets, total = [], 0
        for s in self.stages:
            offsets.append(total)
            total += len(s)
        return tuple(offsets)

    def stage_sizes(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self.stages)

    def global_index(self, stage: int, local_index: int) -> int:
        """The global block index of block ``local_index`` (0-based) of pipeline stage ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"pipeline stage {stage} out of range: pattern {self.text!r} has {self.num_stages}")
        size = len(self.stages[stage])
        if not 0 <= local_index < size:
            raise ValueError(f"local block {local_index} out of range: stage {stage} has {size} blocks")
        return self.stage_offsets[stage] + local_index

    def stage_local(self, index: int) -> tuple[int, int]:
        """Inverse of :meth:`global_index`: ``(stage, local_index)`` of global block ``index``."""
        if not 0 <= index < self.num_blocks:
            raise ValueError(f"block {index} out of range for a {self.num_blocks}-block pattern")
        for stage, off in reversed(list(enumerate(self.stage_offsets))):
            if index >= off:
                return stage, index - off
        raise AssertionError("unreachable")

    def even_split(self, pp_size: int) -> str:
        """The blocks split into ``pp_size`` stages of near-equal block count (a suggestion, not a balance of
        compute)."""
        n = self.num_blocks
        if not 1 <= pp_size <= n:
            raise ValueError(f"cannot split {n} blocks into {pp_size} non-empty stages")
        bounds = [round(i * n / pp_size) for i in range(pp_size + 1)]
        return STAGE_BOUNDARY.join(self.blocks[bounds[i] : bounds[i + 1]] for i in range(pp_size))

    def __str__(self) -> str:
        return self.text
