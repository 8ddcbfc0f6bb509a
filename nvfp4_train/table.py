"""Print the resolved layer precision table of a config, without building the model.

    python -m nvfp4_train.table model=12b precision=nvfp4 [more Hydra overrides]
    nvfp4-precision-table --help | --cfg job [overrides] | -m precision=nvfp4,fp8 model=12b

Composes ``configs/table.yaml`` with the overrides (Hydra's compose API), resolves the layer precision map
of the model's pattern and prints it; the last line is ``bf16 linear layers: A/B (P%)``. Imports neither
torch nor megatron-core.
"""

from __future__ import annotations

from collections.abc import Sequence

from nvfp4_train.models.config import count_parameters


def render(overrides: Sequence[str] = ()) -> str:
    """The text the command prints for ``overrides``."""
    from nvfp4_train.config import compose_config

    cfg = compose_config("table", overrides)
    model = cfg.model
    pattern = model.hybrid_pattern()
    pmap = cfg.precision.layer_map(model.pattern)
    head = (
        f"model: {model.name}  {pattern.num_blocks} blocks ({pattern.counts_str()}), "
        f"{pattern.num_stages} pipeline stage(s), {count_parameters(model):,} parameters\n"
        f"pattern: {model.pattern}"
    )
    return head + "\n" + pmap.table()


def main(argv: Sequence[str] | None = None) -> int:
    """The command (``nvfp4-precision-table``): ``--help``, ``--cfg job`` and ``-m`` as every tool's."""
    from nvfp4_train.cli import table_main

    return table_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
