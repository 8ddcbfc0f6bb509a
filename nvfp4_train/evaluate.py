"""Perplexity of a checkpoint on a prepared token dataset: ``python -m nvfp4_train.evaluate CKPT --data PREFIX``.

The dataset is any ``prepare_data.py`` output (``PREFIX.bin``/``.idx``, checked against the run's tokenizer).
Its documents (each ending with the end-of-document id, as prepared) are read in order as one token stream
and cut into non-overlapping windows of ``seq_length + 1`` tokens: each window predicts its last
``seq_length`` tokens from the ones before, as training does. The loss is the mean next-token cross entropy
over every predicted token; perplexity is ``exp(loss)``.

The model runs as trained (``--precision trained``: the run's layer precision map, so NVFP4 layers quantize
their inputs as in the training's validation pass; sequence length x batch must then be a multiple of 16) or
with every linear layer in high precision (``--precision bf16``: the function the Hugging Face export
computes). Parameters are bf16 as trained; the device is CUDA when available, else the CPU (``--device``).

By default the first ``--max-tokens 65536`` predicted tokens are evaluated (the first ``max(1, 65536 //
(batch_size * seq_length))`` batches; ``--max-tokens all`` or ``0``: the whole split); the result says how much of
the split that was (``split_fraction``, and one line on stderr). A progress bar runs on stderr when it is a
terminal, else a line every 10%. Third-party warnings (megatron-core, torch) are routed as ``train.py`` routes
them (``nvfp4_train.warnings_log``): none is printed. Exit status: ``EXIT_STATUS`` (0 done, 2 a bad argument,
checkpoint, dataset or tokenizer, 4 a file that could not be read; one line on stderr names it).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

import torch

__all__ = ["token_batches", "split_tokens", "load_model", "perplexity", "Progress", "default_device", "failed",
           "routed_run", "main", "PRECISIONS", "DEFAULT_MAX_TOKENS", "EXIT_STATUS"]

PRECISIONS = ("trained", "bf16")
DEFAULT_MAX_TOKENS = 65536
"""Predicted tokens ``python -m nvfp4_train.evaluate`` evaluates unless ``--max-tokens`` says otherwise (a third of
the default corpus's validation split: a quick look; compare runs over the whole split, ``--max-tokens all``)."""


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def token_batches(prefix: str, *, seq_length: int, batch_size: int = 1, max_batches: int | None = None,
                  vocab_size: int | None = None, tokenizer=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens, labels)`` pairs, each ``[batch_size, seq_length]`` int64, from the token stream of ``prefix``
    (labels are tokens shifted by one). Stops after ``max_batches`` or when the stream ends (a partial last
    batch is dropped). The dataset is validated first (``nvfp4_train.data.datasets.check_indexed_dataset``)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from nvfp4_train.data.datasets import check_indexed_dataset, validate_indexed_dataset

    if seq_length < 1 or batch_size < 1:
        raise ValueError(f"seq_length={seq_length} and batch_size={batch_size} must be >= 1")
    if tokenizer is not None:
        check_indexed_dataset(prefix, tokenizer)
    else:
        validate_indexed_dataset(prefix, vocab_size)
    ds = IndexedDataset(str(prefix), mmap=True)
    window = seq_length + 1
    buf = np.empty(0, dtype=np.int64)
    rows: list[np.ndarray] = []
    made = 0
    for i in range(len(ds)):
        buf = np.concatenate([buf, np.asarray(ds[i], dtype=np.int64)])
        while buf.size >= window:
            rows.append(buf[:window])
            buf = buf[window:]
            if len(rows) == batch_size:
                t = torch.from_numpy(np.stack(rows))
                yield t[:, :-1].contiguous(), t[:, 1:].contiguous()
                rows, made = [], made + 1
                if max_batches is not None and made >= max_batches:
                    return


def split_tokens(prefix: str) -> int:
    """The number of tokens in the prepared dataset ``prefix`` (all its documents)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix), mmap=True)  # held while its memory-mapped lengths are read
    return int(ds.sequence_lengths.sum())


def load_model(checkpoint: str, *, precision: str = "trained", device: str = "cpu"):
    """(run info, our model with the checkpoint's weights) at TP = PP = 1 on ``device``, bf16 parameters."""
    from nvfp4_train.config.precision import saved_precision_config
    from nvfp4_train.export.checkpoint_io import build_model_single, load_checkpoint_model

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    info, state = load_checkpoint_model(checkpoint)
    layer_map = None
    if precision == "trained":
        layer_map = saved_precision_config(info.config["precision"]).layer_map(info.model.pattern)
    model = build_model_single(info.model, dtype=torch.bfloat16, layer_map=layer_map)
    model.load_state_dict(state, strict=False)
    return info, model.to(device)


def run_tokenizer(info):
    """The tokenizer the run used (its config's ``data.tokenizer``; None: the committed one)."""
    from nvfp4_train.data.tokenizer import load_tokenizer

    data = info.config.get("data", {})
    try:
        return load_tokenizer(data.get("tokenizer"), eod_token=data.get("eod_token"))
    except FileNotFoundError as e:
        raise ValueError(f"checkpoint {info.path}: the run's tokenizer is missing ({e}); pass --tokenizer PATH with "
                         f"the tokenizer.json the run was trained with") from None


class Progress:
    """Progress over ``total`` steps on ``out`` (stderr by default): a tqdm bar when ``out`` is a terminal and tqdm
    imports, else a line each time the steps done pass another ``1 / lines`` of the total (every 10%)."""

    def __init__(self, total: int, *, unit: str = "batches", out: TextIO | None = None, lines: int = 10) -> None:
        if total < 0 or lines < 1:
            raise ValueError(f"total={total} must be >= 0 and lines={lines} >= 1")
        self.total, self.unit, self.lines = total, unit, lines
        self.out = out if out is not None else sys.stderr
        self.done = 0
        self._printed = 0  # lines printed so far
        self._start = time.perf_counter()
        self._bar = None
        if self.out.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, unit=unit, file=self.out, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        reached = min(self.lines, self.done * self.lines // self.total) if self.total else 0
        if reached > self._printed:  # one line, however many tenths this update crossed
            self._printed = reached
            print(f"{100 * min(self.done, self.total) // self.total}% ({self.done}/{self.total} {self.unit}, "
                  f"{time.perf_counter() - self._start:.1f} s)", file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def perplexity(model, batches, *, device: str = "cpu", progress: Progress | None = None) -> dict:
    """``{"loss", "perplexity", "tokens", "batches"}`` of ``model`` over ``batches`` of (tokens, labels);
    ``progress`` is advanced by one per batch."""
    total, count, n = 0.0, 0, 0
    with torch.no_grad():
        for tokens, labels in batches:
            tokens, labels = tokens.to(device), labels.to(device)
            pos = torch.arange(tokens.shape[1], device=device)[None].expand_as(tokens)
            losses = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels)
            total += float(losses.double().sum())
            count += labels.numel()
            n += 1
            if progress is not None:
                progress.update()
    if count == 0:
        raise ValueError("the dataset has fewer tokens than one batch: lower --seq-length or --batch-size")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "batches": n}


def _max_tokens(text: str) -> int:
    """``--max-tokens``: a count >= 0, or ``all`` (0: no bound)."""
    if text.strip().lower() == "all":
        return 0
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count >= 0 or 'all'")
    return value


EXIT_STATUS = """exit status: 0 done; 2 bad arguments or input (one line names the checkpoint, dataset or tokenizer
and the fix); 4 a file could not be read (permissions, I/O: one line names it)."""


def failed(prog: str, e: BaseException) -> int:
    """Report the error ``e`` of a command line as one line on stderr; returns its exit status (``EXIT_STATUS``:
    2 for bad input, including a missing file, 4 for another OS error)."""
    line = re.sub(r"\s*\n\s*", " ", str(e).strip()) or type(e).__name__
    print(f"{prog}: {line}", file=sys.stderr)
    bad_input = isinstance(e, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError))
    return 2 if bad_input else 4


def routed_run(run: Callable[[], int]) -> int:
    """``run()`` with third-party warnings routed as ``train.py`` routes them (``nvfp4_train.warnings_log``): none
    is printed; after a success one line says how many were held back and how to see them, after a failure
    nothing is added to its one error line. The process group that loading a model creates is destroyed after
    ``run()``."""
    from nvfp4_train.warnings_log import ThirdPartyWarnings

    import torch.distributed as dist

    held = io.StringIO()
    routed = ThirdPartyWarnings(stderr=held).install()  # before megatron-core is imported
    had_group = dist.is_initialized()
    try:
        status = run()
    finally:
        if not had_group and dist.is_initialized():  # the group loading the model made (NCCL warns at exit)
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        routed.close()
    if status == 0:
        print(held.getvalue(), end="", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    prog = "python -m nvfp4_train.evaluate"
    p = argparse.ArgumentParser(prog=prog, description="Perplexity of a checkpoint on a prepared token dataset.",
                                epilog=EXIT_STATUS)
    p.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    p.add_argument("--data", required=True, help="prefix of a prepared dataset (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per window (default: the run's)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=_max_tokens, default=DEFAULT_MAX_TOKENS, metavar="N|all",
                   help=f"evaluate at most N predicted tokens, at least one batch (default {DEFAULT_MAX_TOKENS}; "
                        f"all or 0: the whole split)")
    p.add_argument("--batches", type=int, default=None, help="at most this many batches (default: no bound but "
                   "--max-tokens)")
    p.add_argument("--precision", choices=PRECISIONS, default="trained")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer.json, if it moved")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda when available, else cpu)")
    args = p.parse_args(argv)
    return routed_run(lambda: _run(args, prog))


def _run(args: argparse.Namespace, prog: str) -> int:
    device = args.device or default_device()
    try:
        if (args.seq_length is not None and args.seq_length < 1) or args.batch_size < 1:
            raise ValueError(f"--seq-length {args.seq_length} and --batch-size {args.batch_size} must be >= 1")
        info, model = load_model(args.checkpoint, precision=args.precision, device=device)
        if args.tokenizer:
            from nvfp4_train.data.tokenizer import load_tokenizer

            tok = load_tokenizer(args.tokenizer, eod_token=info.config.get("data", {}).get("eod_token"))
        else:
            tok = run_tokenizer(info)
        seq = args.seq_length or int(info.config.get("data", {}).get("seq_length", 1024))
        max_batches = args.batches
        if args.max_tokens:  # at most max_tokens predicted tokens, at least one batch
            by_tokens = max(1, args.max_tokens // (args.batch_size * seq))
            max_batches = by_tokens if max_batches is None else min(max_batches, by_tokens)
        batches = token_batches(args.data, seq_length=seq, batch_size=args.batch_size, max_batches=max_batches,
                                tokenizer=tok)
        first = next(batches, None)  # the dataset is checked here, before anything is printed
        in_split = split_tokens(args.data)
        available = in_split // (seq + 1) // args.batch_size  # whole batches of windows in the split
        progress = Progress(available if max_batches is None else min(max_batches, available))
        try:
            result = perplexity(model, itertools.chain([] if first is None else [first], batches), device=device,
                                progress=progress)
        finally:
            progress.close()
    except (ValueError, OSError) as e:
        return failed(prog, e)
    read = result["batches"] * args.batch_size * (seq + 1)  # stream tokens the windows took
    fraction = read / in_split if in_split else 0.0
    whole = result["batches"] == available
    print(f"evaluated {result['tokens']} predicted tokens in {result['batches']} batches of {args.batch_size} x "
          f"{seq}: {100 * fraction:.1f}% of the split's {in_split} tokens"
          + ("" if whole else "; --max-tokens all evaluates the whole split"), file=sys.stderr, flush=True)
    print(json.dumps({"checkpoint": str(info.path), "step": info.step, "data": args.data, "seq_length": seq,
                      "precision": args.precision, **result, "split_tokens": in_split, "split_fraction": fraction}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
