"""How long the host takes to receive one training step's micro-batches from the trainer's data loader, per
benchmark case (``nvfp4_train.bench.cases``: its sequence length and micro-batch), with the loader's worker
process (``data.num_workers=1``, the default) and without one.

The step's micro-batches are what ``Trainer.train_step`` reads; before 9e70a6f it read them at the start of
every step, with the GPU idle, now during the step before (``docs/training.md``, "Data"). This measures that
read alone: random token ids written as an indexed dataset (``bench.cases.case_token_prefix``), the trainer's
dataset and ``build_data_loader``; each step's read is timed after the host slept ``--gap-ms`` (the loader's
worker prefetches meanwhile, as it does during a real step), median of ``--steps``. No GPU, no model.

    python3 scripts/bench_data_loader.py                       # small, 1.2b, slice12b; 4 micro-batches a step
    python3 scripts/bench_data_loader.py --cases small --micro-batches 8 --json loader.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from nvfp4_train.bench.cases import CASES

__all__ = ["read_times", "main"]


def _dataset(case: str, work: Path, steps: int, micro: int):
    """The training dataset a ``bench_train`` trainer of ``case`` reads (its data config, ``case_overrides``),
    with ``steps`` steps of ``micro`` micro-batches; and the case's sequence length and micro-batch."""
    from nvfp4_train.bench.cases import case_overrides, case_token_prefix
    from nvfp4_train.config import compose_config
    from nvfp4_train.data.datasets import build_datasets

    _, _, seq, mb, _ = CASES[case]
    prefix = case_token_prefix(case, work, (steps + 4) * micro * mb * (seq + 1), seq)
    cfg = compose_config("train", case_overrides(case, "bf16", grad_accum=micro, steps=steps + 2,
                                                 run_dir=work / case, prefix=prefix))
    train, _ = build_datasets(cfg.data, train_samples=(steps + 2) * micro * mb, valid_samples=0,
                              vocab_size=cfg.model.vocab_size)
    return train, seq, mb


def read_times(dataset, *, micro_batch_size: int, micro_batches: int, steps: int, num_workers: int,
               gap_s: float) -> list[float]:
    """Seconds to read each of ``steps`` steps' ``micro_batches`` micro-batches from a fresh loader of
    ``dataset`` (the first step, which starts the worker, not counted), the host idle ``gap_s`` before each."""
    from nvfp4_train.data.datasets import build_data_loader

    it = iter(build_data_loader(dataset, micro_batch_size=micro_batch_size, num_workers=num_workers))
    for _ in range(micro_batches):
        next(it)
    out = []
    for _ in range(steps):
        time.sleep(gap_s)
        t = time.perf_counter()
        for _ in range(micro_batches):
            next(it)
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["small", "1.2b", "slice12b"], choices=sorted(CASES))
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches a step (bench_train's --grad-accum)")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--gap-ms", type=float, default=300.0, help="host idle before each step's read")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.micro_batches < 1 or a.steps < 1:
        ap.error("--micro-batches and --steps must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            ds, seq, mb = _dataset(case, Path(tmp), a.steps, a.micro_batches)
            for workers in (1, 0):
                t = read_times(ds, micro_batch_size=mb, micro_batches=a.micro_batches, steps=a.steps,
                               num_workers=workers, gap_s=a.gap_ms / 1e3)
                rows.append(dict(case=case, seq=seq, micro_batch=mb, micro_batches=a.micro_batches,
                                 num_workers=workers, median_ms=1e3 * statistics.median(t),
                                 min_ms=1e3 * min(t), max_ms=1e3 * max(t)))
    print("| case | tokens per micro-batch | micro-batches | data.num_workers | read per step, median ms | min | max |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['micro_batch']} x {r['seq']} | {r['micro_batches']} | {r['num_workers']} | "
              f"{r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0
