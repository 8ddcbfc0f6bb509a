"""The optimizer step's passes over memory on FP32 shards of a model's parameter shapes: AdamW in torch's foreach
form (megatron-core's inner AdamW without Apex or Transformer Engine, as the ``1.2b`` profile measured it: 35 ms of
a step) against the fused form the optimizer runs on CUDA (``nvfp4_train.optim``), and the step's other passes:
megatron's found-inf check (which ``optimizer_step`` no longer runs: its global norm is the non-finite check), the
sync-free clipping (``clip_grad_norm_sync_free``) and the copy of the master weights into the bf16 parameters, per
tensor (megatron's) and as one ``torch._foreach_copy_``.

Bytes each part must move per FP32 parameter (read + written; the step counts and norms are noise):

    found-inf check   8   megatron's ``_amp_foreach_non_finite_check_and_unscale_``: reads and rewrites the grads
    clip norm         4   ``torch._foreach_norm`` over the grads
    clip norm + mul  12   and ``torch._foreach_mul_`` by the coefficient (also when it is 1)
    AdamW            28   param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written (the foreach
                          form makes ~8 passes and moves ~84; the table counts what the step must move)
    copy-back         6   fp32 master read, bf16 parameter written
    step             46   clip norm (the non-finite check) + mul + AdamW + copy-back; 38 on a step that does not
                          clip (``optimizer_step`` multiplies only when it clips); 54 with megatron's found-inf

Prediction, ``1.2b`` (1,291,929,600 parameters) at the H200's 4.3 TB/s copy rate: AdamW 36.2 GB, 8.4 ms (the
fused form at >= 70% of that rate: <= 12.0 ms; the foreach form's ~108 GB: ~25 ms); found-inf 2.4 ms; clip
3.6 ms; copy-back 1.8 ms; the step 59.4 GB, 13.8 ms (69.8 GB, 16.2 ms with megatron's found-inf; ~35 ms
measured with the foreach form and the found-inf pass).

``--megatron`` also times ``nvfp4_train.optim.optimizer_step`` on megatron's distributed optimizer over the model
itself (built as ``train.py`` builds it, bf16, random gradients), in both forms: the step as the trainer runs it,
host syncs included (the non-finite decision on the norm is read on the host).

The shards take ~34 bytes per parameter on the device (parameter, gradient, both forms' moments, the bf16
copy): up to ~3.5e9 parameters on one H200 (the 12b's shapes do not fit; ``--params`` gives a count).

    python3 scripts/bench_optimizer.py                      # 1.2b shapes, one GPU
    python3 scripts/bench_optimizer.py --params 3e9         # 3e9 parameters as 2048 x 6144 matrices and a rest
    python3 scripts/bench_optimizer.py --megatron --json optimizer.json
    python3 scripts/bench_optimizer.py --quick              # CPU smoke test: tiny shapes, wall clock
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

HBM_RATE = 4.3e12
"""Bytes per second: the H200's measured device-to-device copy rate (read + written; docs/GPU.md)."""
VECTOR_NAMES = ("norm", "gated_norm", "dt_bias", "A_log", "D")
"""1-D parameters of ``models.config.block_parameters``: megatron's no-weight-decay group."""
CHUNK = 2048 * 6144  # the parameters of a 1.2b MLP matrix: the unit of ``--params``
BYTES = {"found-inf check": 8, "clip norm": 4, "clip norm + mul": 12, "AdamW": 28, "copy-back": 6, "step": 54}


@dataclass(frozen=True)
class Shard:
    """One FP32 master-weight tensor (flat, as the distributed optimizer holds its shards)."""

    name: str
    numel: int
    decay: bool


def model_shards(size: str) -> list[Shard]:
    """The parameters of model ``size`` (``nvfp4_train.models.config``), tensor by tensor, in model order."""
    from nvfp4_train.models.config import block_parameters, model_config

    mc = model_config(size)
    out = [Shard("embedding", mc.vocab_size * mc.hidden_size, True)]
    for i, kind in enumerate(mc.hybrid_pattern().blocks):
        out += [Shard(f"{i}.{name}", n, name not in VECTOR_NAMES) for name, n in block_parameters(mc, kind).items()]
    out.append(Shard("final_norm", mc.hidden_size, False))
    if mc.untie_embeddings_and_output_weights:
        out.append(Shard("output_layer", mc.vocab_size * mc.hidden_size, True))
    return out


def count_shards(n: int) -> list[Shard]:
    """``n`` parameters as matrices of ``CHUNK`` elements and one smaller rest (all decayed)."""
    if n < 1:
        raise ValueError(f"--params {n}: give a parameter count >= 1")
    out = [Shard(f"m{i}", CHUNK, True) for i in range(n // CHUNK)]
    return out + ([Shard("rest", n % CHUNK, True)] if n % CHUNK else [])


class _Stage:
    """The part of megatron's optimizer API ``clip_grad_norm_sync_free`` reads, over plain FP32 shards."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
        self.is_stub_optimizer = False

    def get_parameters(self):
        return self.params

    def get_main_grads_for_grad_norm(self):
        return [p.grad for p in self.params]

    def get_grad_stats_parallel_group(self):
        return None


def _adamw(params: list[torch.Tensor], shards: list[Shard], *, fused: bool) -> torch.optim.AdamW:
    """AdamW as megatron builds it (``nvfp4_train.optim.OptimConfig``'s betas, eps and weight decay, the
    no-decay group), in the fused or the foreach form."""
    from nvfp4_train.optim import OptimConfig

    cfg = OptimConfig()
    groups = [{"params": [p for p, s in zip(params, shards) if s.decay == decay],
               "weight_decay": cfg.weight_decay if decay else 0.0} for decay in (True, False)]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=1e-4, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=True if fused else None, foreach=False if fused else True)


def time_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after ``warmup`` (CUDA events; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def shard_rows(shards: list[Shard], device: torch.device, iters: int, warmup: int, seed: int) -> tuple[list[dict],
                                                                                                      bool]:
    """Every part of the step on ``shards``: (rows, the two copy-back forms gave the same bits)."""
    from nvfp4_train.optim import clip_grad_norm_sync_free

    gen = torch.Generator(device=device).manual_seed(seed)
    sizes = [s.numel for s in shards]
    params = [torch.randn(n, device=device, generator=gen).mul_(0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen).mul_(1e-3)
    grads = [p.grad for p in params]
    stage = _Stage(params)
    found_inf = torch.zeros(1, device=device)
    inv_scale = torch.ones(1, device=device)
    bf16 = torch.empty(sum(sizes), dtype=torch.bfloat16, device=device)  # megatron's param buffer
    views = list(bf16.split(sizes))
    forms = {"foreach": _adamw(params, shards, fused=False), "fused": _adamw(params, shards, fused=True)}

    def found_inf_check():
        found_inf.fill_(0.0)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)

    def copy_per_tensor():
        for dst, src in zip(views, params):
            dst.copy_(src)

    def copy_foreach():
        torch._foreach_copy_(views, params)

    def step(adamw):
        def run():
            found_inf_check()
            clip_grad_norm_sync_free([stage], 1e30)  # coefficient 1: the multiply of a step that does not clip
            adamw.step()
            copy_per_tensor()
        return run

    parts = [
        ("found-inf check", "megatron", found_inf_check),
        ("clip norm", "foreach norm", lambda: clip_grad_norm_sync_free([stage], 0.0)),
        ("clip norm + mul", "foreach norm, foreach mul", lambda: clip_grad_norm_sync_free([stage], 1e30)),
        ("AdamW", "foreach", forms["foreach"].step),
        ("AdamW", "fused", forms["fused"].step),
        ("copy-back", "copy_ per tensor", copy_per_tensor),
        ("copy-back", "_foreach_copy_", copy_foreach),
        ("step", "foreach AdamW", step(forms["foreach"])),
        ("step", "fused AdamW", step(forms["fused"])),
    ]
    n = sum(sizes)
    rows = []
    for part, form, fn in parts:
        ms = time_ms(fn, device, iters, warmup)
        nbytes = BYTES[part] * n
        rows.append({"part": part, "form": form, "tensors": len(sizes), "params": n, "bytes": nbytes, "ms": ms,
                     "gbs": nbytes / (ms * 1e-3) / 1e9, "hbm_fraction": nbytes / (ms * 1e-3) / HBM_RATE})
    copy_per_tensor()
    want = bf16.clone()
    bf16.zero_()
    copy_foreach()
    return rows, torch.equal(bf16.view(torch.int16), want.view(torch.int16))


def megatron_rows(size: str, device: torch.device, iters: int, warmup: int, seed: int) -> list[dict]:
    """``optimizer_step`` of megatron's distributed optimizer over model ``size``, foreach and fused."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.mcore_compat.optimizer import set_fused_adam
    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.optim import OptimConfig, build_ddp, build_optimizer, optimizer_step
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config(size)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=transformer_config(mc), seq_length=256)
    cfg = OptimConfig()
    ddp = build_ddp(model, cfg)
    opt = build_optimizer([ddp], cfg, lr=1e-4, min_lr=1e-5)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for p in model.parameters():
        p.main_grad.normal_(generator=gen).mul_(1e-3)
    n = sum(p.numel() for p in model.parameters())
    rows = []
    for form in ("foreach", "fused"):
        set_fused_adam(opt, form == "fused")

        def step():
            ok, _, _ = optimizer_step(opt, cfg.clip_grad)
            assert ok, "the optimizer step was skipped"

        ms = time_ms(step, device, iters, warmup)
        nbytes = BYTES["step"] * n
        rows.append({"part": f"megatron optimizer_step ({size})", "form": f"{form} AdamW", "tensors": None,
                     "params": n, "bytes": nbytes, "ms": ms, "gbs": nbytes / (ms * 1e-3) / 1e9,
                     "hbm_fraction": nbytes / (ms * 1e-3) / HBM_RATE})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| part | form | tensors | GB to move | ms | GB/s | % of 4.3 TB/s | vs first form |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    first: dict[str, float] = {}
    for r in rows:
        base = first.setdefault(r["part"], r["ms"])
        tensors = "" if r["tensors"] is None else str(r["tensors"])
        print(f"| {r['part']} | {r['form']} | {tensors} | {r['bytes'] / 1e9:.2f} | {r['ms']:.2f} | {r['gbs']:.0f} | "
              f"{100 * r['hbm_fraction']:.0f}% | {r['ms'] / base:.2f} |", flush=True)


def run(args: argparse.Namespace) -> tuple[list[dict], bool]:
    """The benchmark in this process (a process group exists: ``main`` makes one); (rows, copy-back bitwise)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        shards, label = model_shards("tiny")[:12], "tiny (first 12 tensors)"
    elif args.params:
        shards, label = count_shards(int(float(args.params))), f"{int(float(args.params)):,} parameters"
    else:
        shards, label = model_shards(args.model), args.model
    iters, warmup = (2, 1) if args.quick else (args.iters, args.warmup)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{label}: {sum(s.numel for s in shards):,} FP32 parameters in {len(shards)} tensors, {dev}, median of "
          f"{iters} after {warmup}\n")
    rows, same = shard_rows(shards, device, iters, warmup, args.seed)
    if args.megatron and not args.quick:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the shards' memory, for the model's
        rows += megatron_rows(args.model, device, iters, warmup, args.seed)
    print_table(rows)
    print(f"\ncopy-back: copy_ per tensor and _foreach_copy_ give {'the same' if same else 'DIFFERENT'} bf16 bits")
    return rows, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="1.2b", help="a nvfp4_train.models.config size whose shapes to use")
    ap.add_argument("--params", help="a parameter count instead of a model's shapes (e.g. 2e9)")
    ap.add_argument("--megatron", action="store_true",
                    help="also time optimizer_step on megatron's distributed optimizer over --model")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: a few tiny tensors, two calls each")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()  # the clipping all-reduces its norm (one rank here)
    rows, same = run(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
