"""``python -m nvfp4_train.export {hf, import-hf, nvfp4} ...`` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["import", "hf"]:  # `import hf` is the same command as `import-hf`
        argv = ["import-hf", *argv[2:]]
    p = argparse.ArgumentParser(prog="python -m nvfp4_train.export", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hf", help="a checkpoint as a Hugging Face Nemotron-H folder (bf16)")
    h.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    h.add_argument("out", help="the folder to write (new or empty)")
    i = sub.add_parser("import-hf", help="a Hugging Face Nemotron-H folder as a checkpoint train.py resumes from")
    i.add_argument("hf_dir")
    i.add_argument("out", help="the checkpoint root to write (new or empty); the checkpoint is OUT/step_0000000")
    i.add_argument("--model", default=None,
                   help="one of our model sizes (e.g. 12b) the folder must match field by field; the checkpoint "
                        "records it, so `train.py model=<it>` resumes")
    i.add_argument("overrides", nargs="*", help="Hydra overrides recorded in the checkpoint's config.yaml")
    n = sub.add_parser("nvfp4", help="the NVFP4-trained layers in ModelOpt's NVFP4 layout (vLLM, TensorRT-LLM)")
    n.add_argument("checkpoint")
    n.add_argument("out")
    n.add_argument("--calib-data", required=True,
                   help="prefix of a prepared token dataset (e.g. the validation set) for the activation amax")
    n.add_argument("--calib-batches", type=int, default=8, help="calibration batches (default 8)")
    n.add_argument("--calib-seq", type=int, default=512, help="tokens per calibration sequence (multiple of 16)")
    n.add_argument("--calib-batch-size", type=int, default=1)
    n.add_argument("--padded", choices=("error", "bf16"), default="error",
                   help="an NVFP4 layer whose width is not a multiple of 16: an error (default) or written in BF16")
    args = p.parse_args(argv)
    if args.command == "hf":
        from nvfp4_train.export.hf import export_hf

        print(export_hf(args.checkpoint, args.out))
    elif args.command == "import-hf":
        from nvfp4_train.export.hf import import_hf

        print(import_hf(args.hf_dir, args.out, model=args.model, overrides=tuple(args.overrides)))
    else:
        from nvfp4_train.export.nvfp4 import export_nvfp4

        if args.calib_batches < 1:
            raise SystemExit("--calib-batches must be >= 1 (input_scale needs the activation amax)")
        print(export_nvfp4(args.checkpoint, args.out, calib_data=args.calib_data, calib_batches=args.calib_batches,
                           calib_seq=args.calib_seq, calib_batch_size=args.calib_batch_size, padded=args.padded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
