"""Checkpoint save/load benchmark: one ``save_checkpoint`` and one ``load_checkpoint`` of a model wrapped as
``train.py`` wraps it (megatron DDP, distributed optimizer with FP32 master weights and Adam moments, after
one optimizer step so the moments exist), single process, with a time breakdown per phase.

Save phases: ``sharded_state`` (megatron builds the sharded state dict; ``fully_reshardable`` gathers the
optimizer state per parameter), ``dist_save`` (megatron dist-checkpointing write), ``rng_trainer`` (RNG,
trainer state and config files), ``manifest`` (size + sha256 of every file), ``commit`` (rename, ``latest``,
prune). Load phases: ``verify`` (the manifest check ``resume`` does: sizes and sha256), ``sharded_state``,
``dist_load`` (megatron read), ``model_load``, ``optim_load`` (distributed-optimizer state), ``rng``.
GB/s is the checkpoint's total bytes over the phase's seconds.

    python3 scripts/bench_checkpoint.py --model 125m                 # CPU or one GPU
    python3 scripts/bench_checkpoint.py --model 1.2b --out /dev/shm/ckpt_bench --keep
    python3 scripts/bench_checkpoint.py --model tiny --profile save.prof   # cProfile of save + load
    python3 scripts/bench_checkpoint.py --model 125m --hash-threads 1    # sequential sha256 (the old manifest)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _init_dist() -> None:
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()


def _build(size: str):
    """(ddp, optimizer, model config) after one optimizer step on random gradients."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.optim import OptimConfig, build_ddp, build_optimizer, optimizer_step
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config(size)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=transformer_config(mc), seq_length=256)
    ddp = build_ddp(model, OptimConfig())
    opt = build_optimizer([ddp], OptimConfig(), lr=1e-4, min_lr=1e-5)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(1)
    for p in model.parameters():  # stand-in gradients: the step only has to create the Adam state
        p.main_grad.normal_(generator=g).mul_(1e-3)
    ok, _, _ = optimizer_step(opt, OptimConfig().clip_grad)
    assert ok, "the optimizer step was skipped"
    return ddp, opt, mc


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(size: str, out: Path, optim_format: str, verify: str,
        hash_threads: int | None) -> tuple[dict[str, float], dict[str, float], int]:
    import dataclasses

    from nvfp4_train.checkpoint import load_checkpoint, save_checkpoint, start_checkpoint_writer, verify_checkpoint

    ddp, opt, mc = _build(size)
    layout = {"tp": 1, "pp": 1, "dp": 1}
    meta = {"model": dataclasses.asdict(mc), "layout": layout, "step": 1}
    start_checkpoint_writer()
    save_t: dict[str, float] = {}
    _sync()
    t0 = time.perf_counter()
    path = save_checkpoint(out, step=1, ddp=ddp, optimizer=opt, trainer_state={"step": 1}, config_yaml="{}\n",
                           meta=meta, keep_last=1, optim_format=optim_format, timings=save_t,
                           hash_threads=hash_threads)
    _sync()
    save_t["total"] = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    load_t: dict[str, float] = {}
    t0 = time.perf_counter()
    problems = verify_checkpoint(path, checksums=verify == "sha256", threads=hash_threads)
    assert not problems, problems
    load_t["verify"] = time.perf_counter() - t0
    load_checkpoint(path, ddp=ddp, optimizer=opt, layout=layout, model_config=dataclasses.asdict(mc),
                    timings=load_t)
    _sync()
    load_t["total"] = time.perf_counter() - t0
    return save_t, load_t, nbytes


def _table(title: str, timings: dict[str, float], nbytes: int) -> str:
    rows = [f"| {title} | seconds | GB/s |", "|---|---:|---:|"]
    for name, sec in timings.items():
        rate = nbytes / sec / 1e9 if sec > 0 else float("inf")
        rows.append(f"| {name} | {sec:.3f} | {rate:.2f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="a nvfp4_train.models.config size: tiny, small, 125m, 1.2b, ...")
    ap.add_argument("--out", type=Path, help="checkpoint root, new or empty (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (default: removed at the end)")
    ap.add_argument("--optim-format", default="fully_reshardable", choices=["fully_reshardable", "dp_reshardable"])
    ap.add_argument("--verify", default="sha256", choices=["sha256", "size"])
    ap.add_argument("--hash-threads", type=int, help="sha256 threads (default: the checkpoint module's)")
    ap.add_argument("--profile", type=Path, help="write a cProfile of save + load here")
    ap.add_argument("--json", type=Path, help="write the timings here")
    a = ap.parse_args()
    if a.out is not None and a.out.exists() and any(a.out.iterdir()):
        ap.error(f"--out {a.out} is not empty (the benchmark prunes and removes what is there)")
    _init_dist()
    out = a.out if a.out is not None else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    prof = cProfile.Profile() if a.profile else None
    try:
        if prof:
            prof.enable()
        save_t, load_t, nbytes = run(a.model, out, a.optim_format, a.verify, a.hash_threads)
        if prof:
            prof.disable()
            prof.dump_stats(a.profile)
    finally:
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"model {a.model}, {a.optim_format}, verify={a.verify}, {dev}, checkpoint {nbytes / 1e9:.3f} GB, {out}")
    print(_table("save", save_t, nbytes))
    print()
    print(_table("load", load_t, nbytes))
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "bytes": nbytes, "save": save_t, "load": load_t}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
