"""Perplexity of a checkpoint on a prepared token dataset: ``python -m nvfp4_train.evaluate CKPT --data PREFIX``.

The dataset is any ``prepare_data.py`` output (``PREFIX.bin``/``.idx``, checked against the run's tokenizer).
Its documents (each ending with the end-of-document id, as prepared) are read in order as one token stream
and cut into non-overlapping windows of ``seq_length + 1`` tokens: each window predicts its last
``seq_length`` tokens from the ones before, as training does. The loss is the mean next-token cross entropy
over every predicted token; perplexity is ``exp(loss)``.

The model runs as trained (``--precision trained``: the run's layer precision map, so NVFP4 layers quantize
their inputs as in the training's validation pass; sequence length x batch must then be a multiple of 16) or
with every linear layer in high precision (``--precision bf16``: the function the Hugging Face export
computes). Parameters are bf16 as trained; ``--device cuda`` runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator

import torch

__all__ = ["token_batches", "load_model", "perplexity", "main", "PRECISIONS"]

PRECISIONS = ("trained", "bf16")


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


def load_model(checkpoint: str, *, precision: str = "trained", device: str = "cpu"):
    """(run info, our model with the checkpoint's weights) at TP = PP = 1 on ``device``, bf16 parameters."""
    from omegaconf import OmegaConf

    from nvfp4_train.config.precision import PrecisionConfig
    from nvfp4_train.export.checkpoint_io import build_model_single, load_checkpoint_model

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    info, state = load_checkpoint_model(checkpoint)
    layer_map = None
    if precision == "trained":
        prec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), info.config["precision"]))
        layer_map = prec.layer_map(info.model.pattern)
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


def perplexity(model, batches, *, device: str = "cpu") -> dict:
    """``{"loss", "perplexity", "tokens", "batches"}`` of ``model`` over ``batches`` of (tokens, labels)."""
    total, count, n = 0.0, 0, 0
    with torch.no_grad():
        for tokens, labels in batches:
            tokens, labels = tokens.to(device), labels.to(device)
            pos = torch.arange(tokens.shape[1], device=device)[None].expand_as(tokens)
            losses = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels)
            total += float(losses.double().sum())
            count += labels.numel()
            n += 1
    if count == 0:
        raise ValueError("the dataset has fewer tokens than one batch: lower --seq-length or --batch-size")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "batches": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvfp4_train.evaluate",
                                description="Perplexity of a checkpoint on a prepared token dataset.")
    p.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    p.add_argument("--data", required=True, help="prefix of a prepared dataset (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per window (default: the run's)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--batches", type=int, default=None, help="at most this many batches (default: all)")
    p.add_argument("--precision", choices=PRECISIONS, default="trained")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer.json, if it moved")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    info, model = load_model(args.checkpoint, precision=args.precision, device=args.device)
    if args.tokenizer:
        from nvfp4_train.data.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer, eod_token=info.config.get("data", {}).get("eod_token"))
    else:
        tok = run_tokenizer(info)
    seq = args.seq_length or int(info.config.get("data", {}).get("seq_length", 1024))
    batches = token_batches(args.data, seq_length=seq, batch_size=args.batch_size, max_batches=args.batches,
                            tokenizer=tok)
    result = perplexity(model, batches, device=args.device)
    print(json.dumps({"checkpoint": str(info.path), "step": info.step, "data": args.data, "seq_length": seq,
                      "precision": args.precision, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
