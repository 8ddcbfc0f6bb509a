"""``python -m models.summary model=<size>``: the pattern, block counts and parameter count of a model
config, without building it (the count is analytic: ``models.config.count_parameters``; a test checks it
against built models). Last line: ``parameters: N``."""

from __future__ import annotations

import sys

from models.config import count_parameters, parameter_breakdown


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
    argv = sys.argv[1:] if argv is None else argv
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        print(summary(argv))
    except (ValueError, HydraException, OmegaConfBaseException) as e:  # bad override/value: the message names it
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
