"""``python -m nvfp4_train.export {hf, import-hf, nvfp4} ...`` (see the package docstring).

Third-party warnings (megatron-core's, torch's) are routed as ``train.py`` routes them, and a user error is one
line on stderr, as for ``evaluate`` and ``generate`` (``nvfp4_train.evaluate.routed_run`` and ``failed``): none
is printed; after a success one line says how many were held back and how to see them.
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m nvfp4_train.export"
EXIT_STATUS = """exit status: 0 done; 2 bad arguments or input (one line names the file, tensor or layer and the fix;
checked before anything is written, and nothing already there is changed); 4 a file could not be read or
written (permissions, no space: one line names it)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EXIT_STATUS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hf", help="a checkpoint as a Hugging Face Nemotron-H folder (bf16)", epilog=EXIT_STATUS)
    h.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    h.add_argument("out", help="the folder to write (new or empty)")
    i = sub.add_parser("import-hf", help="a Hugging Face Nemotron-H folder as a checkpoint train.py resumes from",
                       epilog=EXIT_STATUS)
    i.add_argument("hf_dir")
    i.add_argument("out", help="the checkpoint root to write (new or empty); the checkpoint is OUT/step_0000000")
    i.add_argument("--model", default=None,
                   help="one of our model sizes (e.g. 12b) the folder must match field by field; the checkpoint "
                        "records it, so `train.py model=<it>` resumes")
    i.add_argument("overrides", nargs="*", help="Hydra overrides recorded in the checkpoint's config.yaml")
    n = sub.add_parser("nvfp4", help="the NVFP4-trained layers in ModelOpt's NVFP4 layout (vLLM, TensorRT-LLM)",
                       epilog=EXIT_STATUS)
    n.add_argument("checkpoint")
    n.add_argument("out")
    n.add_argument("--calib-data", required=True,
                   help="prefix of a prepared token dataset (e.g. the validation set) for the activation amax")
    n.add_argument("--calib-batches", type=int, default=8, help="calibration batches (default 8)")
    n.add_argument("--calib-seq", type=int, default=512, help="tokens per calibration sequence (multiple of 16)")
    n.add_argument("--calib-batch-size", type=int, default=1)
    n.add_argument("--padded", choices=("error", "bf16"), default="error",
                   help="an NVFP4 layer whose input width K is not a multiple of 16 (no NVFP4 form): an error "
                        "(default) or written in BF16")
    return p


def _run(args: argparse.Namespace) -> int:
    from nvfp4_train.evaluate import failed

    try:
        if args.command == "hf":
            from nvfp4_train.export.hf import export_hf

            print(export_hf(args.checkpoint, args.out))
        elif args.command == "import-hf":
            from nvfp4_train.export.hf import import_hf

            print(import_hf(args.hf_dir, args.out, model=args.model, overrides=tuple(args.overrides)))
        else:
            from nvfp4_train.export.nvfp4 import export_nvfp4

            print(export_nvfp4(args.checkpoint, args.out, calib_data=args.calib_data,
                               calib_batches=args.calib_batches, calib_seq=args.calib_seq,
                               calib_batch_size=args.calib_batch_size, padded=args.padded))
    except (ValueError, OSError) as e:
        return failed(f"{PROG} {args.command}", e)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (``EXIT_STATUS``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["import", "hf"]:  # `import hf` is the same command as `import-hf`
        argv = ["import-hf", *argv[2:]]
    args = _parser().parse_args(argv)  # a usage error exits 2 here, before anything is imported
    from nvfp4_train.evaluate import routed_run

    return routed_run(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
