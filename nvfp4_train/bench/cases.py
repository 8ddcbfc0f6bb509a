"""The benchmark cases: a model of a named case under a recipe, and the trainer that runs it.

``build_trainer`` is how every tool that times or inspects a training step gets one (``nvfp4_train.bench.train``,
``op_census``): a :class:`nvfp4_train.trainer.Trainer` of the case, on random tokens written as an indexed
dataset, stepped by its own ``train_step()`` (the step ``train.py`` loops over; no copy of it lives here).
``build_case`` builds the case's bare model and input for the tools that look inside one forward
(``saved_census``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

CASES = {
    # name: (size, overrides, seq, micro_batch, keep_all_quantized)
    "slice12b": ("12b", {"pattern": "M-*-", "num_layers": 4}, 8192, 1, True),
    "small": ("small", {}, 2048, 8, False),
    "1.2b": ("1.2b", {}, 4096, 2, False),
    "tiny": ("tiny", {}, 256, 2, False),
}


def init_dist() -> None:
    """One process as a group of one (gloo on CPU, NCCL on CUDA), as the benchmarks run."""
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()


def build_case(case: str, recipe: str, seq: int | None = None, mb: int | None = None, device: str = "cpu"):
    """The model of ``CASES[case]`` under ``recipe`` (its config, its layer precision map: every block quantized
    where the case says so), built from seed 0, and its input: token ids from seed 1, [mb, seq] (the case's own
    sequence and micro-batch unless given), and positions. Returns ``(model, mc, lm, ids, pos)``. The one builder
    of the step benchmark, the op census and the saved-tensor census."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    size, overrides, case_seq, case_mb, all_q = CASES[case]
    seq, mb = seq or case_seq, mb or case_mb
    mc = model_config(size).replace(**overrides)
    keep = {"keep_first": 0, "keep_last": 0} if all_q and recipe != "bf16" else {}
    lm = LayerPrecisionMap(mc.pattern, recipe, **keep)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_model(mc, lm, config=transformer_config(mc), seq_length=seq)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, mc.vocab_size, (mb, seq), generator=g).to(device)
    pos = torch.arange(seq, device=device)[None].expand(mb, seq)
    return model, mc, lm, ids, pos


def cuda_step_times(step: Callable[[], object], iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step``, timed with CUDA events around it (synchronized after each)."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def cuda_pipelined_step_times(step: Callable[[], object], iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step`` run back to back as a training loop runs them (no host
    synchronization between them): a CUDA event before each call and one after the last, one synchronize at the
    end. A step's time is the device time from its event to the next: from the end of the previous step's
    kernels to the end of its own (``Trainer.train_step`` orders the caller's stream after its kernels), idle
    gaps included; the host work of a step overlaps the previous step's kernels where the loop allows it."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    for i in range(iters):
        events[i].record()
        step()
    events[-1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]


def random_token_prefix(out_dir: Path, vocab: int, tokens: int, doc_len: int, seed: int = 1) -> str:
    """An indexed dataset (``.bin``/``.idx``, megatron-core's builder, as ``scripts/prepare_data.py`` writes one)
    of ``tokens`` token ids drawn uniformly from ``[0, vocab)`` with a seeded generator, in documents of
    ``doc_len`` tokens; returns its prefix. Written once per (vocab, tokens, doc_len, seed) under ``out_dir``."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = out_dir / f"random_v{vocab}_n{tokens}_d{doc_len}_s{seed}"
    if Path(f"{prefix}.idx").exists():
        return str(prefix)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab <= 65536 else np.int32
    g = torch.Generator().manual_seed(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin.tmp", dtype=dtype)
    for start in range(0, tokens, doc_len):
        n = min(doc_len, tokens - start)
        builder.add_document(torch.randint(0, vocab, (n,), generator=g).numpy().astype(dtype), [n])
    builder.finalize(f"{prefix}.idx.tmp")
    Path(f"{prefix}.bin.tmp").rename(f"{prefix}.bin")
    Path(f"{prefix}.idx.tmp").rename(f"{prefix}.idx")
    return str(prefix)


def case_overrides(case: str, recipe: str, *, grad_accum: int, steps: int, run_dir: Path, prefix: str,
                   nonfinite_check: str = "every_step", extra: tuple[str, ...] = (), seq: int | None = None,
                   mb: int | None = None) -> list[str]:
    """The ``train.py`` overrides of ``CASES[case]`` under ``recipe`` (a named precision config), a step of
    ``grad_accum`` micro-batches of the case's shape, ``steps`` steps of data from ``prefix`` (validation from the
    same tokens), nothing written but ``config.yaml`` and the metrics files in ``run_dir`` (no checkpoints, no
    wandb, no TensorBoard). ``seq``/``mb``: another sequence length / micro-batch than the case's. ``extra``
    comes last (it wins)."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    size, overrides, case_seq, case_mb, all_q = CASES[case]
    seq, mb = seq or case_seq, mb or case_mb
    args = [f"model={size}", *(f"model.{k}={v}" for k, v in overrides.items()), f"precision={recipe}"]
    if all_q and recipe != "bf16":
        args += ["precision.keep_first=0", "precision.keep_last=0"]
    args += [f"data.train_prefixes=[{prefix}]", f"data.valid_prefixes=[{prefix}]", f"data.seq_length={seq}",
             f"data.cache_dir={run_dir / 'idx'}", f"schedule.micro_batch_size={mb}",
             f"schedule.global_batch_size={mb * grad_accum}", f"schedule.train_steps={steps}",
             "schedule.warmup_steps=1", "schedule.lr=1e-4", "schedule.min_lr=1e-5", "schedule.eval_interval=0",
             "schedule.eval_batches=1", "checkpoint.interval=0", "checkpoint.save_at_end=false",
             "checkpoint.save_on_signal=false", "checkpoint.resume=none", "logging.wandb=disabled",
             "logging.tensorboard=false", "logging.progress=none", f"logging.nonfinite_check={nonfinite_check}",
             f"experiment.run_dir={run_dir}", f"experiment.name=bench_{case}_{recipe}", *extra]
    return args


def case_token_prefix(case: str, work_dir: Path, tokens: int, seq: int) -> str:
    """``random_token_prefix`` under ``work_dir/tokens`` for ``CASES[case]``: ``tokens`` ids below both the model's
    and the data tokenizer's vocabularies, in documents of ``seq + 1`` tokens."""
    from nvfp4_train.config import compose_config
    from nvfp4_train.data.datasets import load_tokenizer_for

    size, overrides, _, _, _ = CASES[case]
    cfg0 = compose_config("train", [f"model={size}", *(f"model.{k}={v}" for k, v in overrides.items())])
    # the trainer checks every token id against the data's tokenizer, whose vocabulary may be smaller than the
    # model's (1.2b: 131,072 embedding rows, the shipped tokenizer's 32,768 ids)
    vocab = min(cfg0.model.vocab_size, load_tokenizer_for(cfg0.data).vocab_size)
    return random_token_prefix(work_dir / "tokens", vocab, tokens, seq + 1)


def build_trainer(case: str, recipe: str, *, grad_accum: int, steps: int, work_dir: Path,
                  nonfinite_check: str = "every_step", extra: tuple[str, ...] = (), seq: int | None = None,
                  mb: int | None = None):
    """A :class:`~nvfp4_train.trainer.Trainer` of ``CASES[case]`` under ``recipe`` (``case_overrides``), on
    random tokens below the model's and the tokenizer's vocabularies written under ``work_dir`` (enough for ``steps`` steps), its run
    directory ``work_dir/<case>_<recipe>``. The caller steps it with ``train_step()`` and closes it."""
    from nvfp4_train.config import compose_config
    from nvfp4_train.trainer import Trainer

    _, _, case_seq, case_mb, _ = CASES[case]
    seq, mb = seq or case_seq, mb or case_mb
    prefix = case_token_prefix(case, work_dir, (steps + 2) * grad_accum * mb * (seq + 1), seq)
    run_dir = work_dir / f"{case}_{recipe}"
    return Trainer(compose_config("train", case_overrides(case, recipe, grad_accum=grad_accum, steps=steps,
                                                          run_dir=run_dir, prefix=prefix,
                                                          nonfinite_check=nonfinite_check, extra=extra,
                                                          seq=seq, mb=mb)))


