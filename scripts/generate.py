"""Generate text from a checkpoint (greedy or top-p sampling), with the tokenizer the run used.

    python scripts/generate.py runs/tiny_nvfp4_cpu --prompt "The kernel" --max-new-tokens 40
    python scripts/generate.py CKPT --prompt "..." --temperature 0.8 --top-p 0.9 --seed 1 --device cuda

The command line of ``nvfp4_train.generate.generate_text`` (see it for the decoding rules).
"""

from __future__ import annotations

import argparse
import sys

from nvfp4_train.generate import generate_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate text from a checkpoint.")
    p.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("bf16", "trained"), default="bf16",
                   help="bf16: linear layers in high precision; trained: the run's layer precision map")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer.json, if it moved")
    args = p.parse_args(argv)
    text = generate_text(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed, precision=args.precision,
                         device=args.device, tokenizer=args.tokenizer)
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
