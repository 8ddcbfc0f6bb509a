"""``python -m nvfp4_train.summary model=<size>`` (installed: ``nvfp4-summary``): the pattern, block counts and
parameter count of a model config, without building it (the count is analytic:
``nvfp4_train.models.config.count_parameters``; a test checks it against built models). Last line: ``parameters: N``.

    nvfp4-summary model=12b
    nvfp4-summary --help | --cfg job model=12b | -m model=tiny,small,12b"""

from __future__ import annotations

from nvfp4_train.models.config import count_parameters, parameter_breakdown


def summary(overrides: list[str]) -> str:
    from nvfp4_train.config.compose import compose_config

    cfg = compose_config("table", overrides).model
    pattern = cfg.hybrid_pattern()
    lines = [
        f"model: {cfg.name}",
        f"pattern: {pattern.text}",
        f"blocks: {pattern.num_blocks} ({pattern.counts_str()})",
        f"hidden: {cfg.hidden_size}  vocab: {cfg.vocab_size}",
    ]
    for name, n in parameter_breakdown(cfg).items():
        lines.append(f"  {name:<24} {n:>16,}")
    lines.append(f"parameters: {count_parameters(cfg)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command: ``--help``, ``--cfg job`` and ``-m`` as every tool's (``nvfp4_train.cli``)."""
    from nvfp4_train.cli import summary_main

    return summary_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
