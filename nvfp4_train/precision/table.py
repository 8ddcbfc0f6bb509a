"""Print the resolved layer precision table of a config, without building the model.

    python -m nvfp4_train.precision.table model=12b precision=nvfp4 [more Hydra overrides]

Composes ``configs/table.yaml`` with the overrides (Hydra's compose API), resolves the layer precision map
of the model's pattern and prints it; the last line is ``bf16 linear layers: A/B (P%)``. Imports neither
torch nor megatron-core.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from models.config import count_parameters


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        text = render(argv)
    except Exception as e:  # user input errors: print the chain of messages, not a traceback
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(e, (ValueError, TypeError, HydraException, OmegaConfBaseException)):
            raise
        print(f"error: {_messages(e)}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _messages(e: BaseException) -> str:
    """``e``'s message followed by those of its causes (Hydra puts the key and the reason in the cause)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = str(e).strip()
        if msg and msg not in parts and "$VALUE" not in msg:
            parts.append(msg)
        e = e.__cause__ or e.__context__
    return "\n  caused by: ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
