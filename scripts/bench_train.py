#!/usr/bin/env python3
"""Training-step benchmark on one GPU: step time, tokens/s, MFU and peak memory of the hybrid model under several
recipes, measured in ONE run (ratios to BF16 are what count).

Cases (``--cases``):
  slice12b   a 4-block slice of the 12B (real widths: hidden 5120, MLP 20480, 40/8 heads, Mamba 128x80;
             pattern ``M-*-``), sequence 8192, micro-batch 1, every block in the recipe (no bf16 blocks)
  small      the ``small`` hybrid, sequence 2048, micro-batch 8, the recipe's default layer map
  1.2b       the 1.2B Transformer, sequence 4096, micro-batch 2, the recipe's default layer map

For each case and recipe: build the model (bf16 parameters) on the GPU, wrap it as ``train.py`` does
(megatron's DDP with FP32 gradient buffers, the distributed optimizer: FP32 master weights, AdamW, gradient
clipping; the quantized weights cached per optimizer step and dropped after it), run ``--warmup`` then
``--iters`` full training steps (zero grads, forward, backward of the mean per-token cross entropy, optimizer
step), timed with CUDA events, median step time. ``--no-optimizer`` times forward + backward only (the
optimizer step is the same FP32 AdamW for every recipe). Peak memory is ``torch.cuda.max_memory_allocated``
during the timed steps; "before step" is the memory held before the first timed step (weights, gradient
buffers, optimizer state); "activations" is the peak minus that, i.e. what the step saved for backward plus
workspace; "saved by fwd" is what one more step's forward left allocated (its saved activations and the
loss), read with ``torch.cuda.memory_allocated`` right before and right after the forward, less the weight
cache's quantized copies made in that forward (reported apart): the activation memory without backward's
transients (gradients, GEMM workspaces, dequantized operands), which the peak holds. Each case starts after a garbage collection: the previous case's model and optimizer form
reference cycles through megatron's hooks and would otherwise stay allocated.
MFU = model FLOPs per token (``models.flops``) x tokens/s / 989.4 TFLOP/s (H200 dense BF16 peak; Hopper has
no FP4 tensor cores, so BF16 peak is the ceiling for every recipe here).

``--profile DIR``: after the measurements above, each case and recipe runs ONE more full training step under
``torch.profiler`` (CPU and, when present, CUDA activities) and reports, as a markdown table on stdout and under
``"profile"`` in the ``--json`` record: the step's wall time, the GPU busy time (the length of the union of all
CUDA kernel intervals, so overlapping streams count once) and the GPU-idle fraction 1 - busy/wall (the wall time
includes the profiler's own CPU overhead, so the idle fraction is an upper bound), the number of
kernel launches, the kernel time per category (``KERNEL_CATEGORIES``: kernel-name regexes, first match wins) and
the 15 kernels with the most time; ``DIR/<case>_<recipe>_kernels.csv`` lists every kernel (name, category,
count, total us). Without CUDA there are no kernel events: busy time 0 and a note "no CUDA events". The
profiled step is not part of the timed steps or the memory readings.

    python3 scripts/bench_train.py --cases slice12b small 1.2b --recipes bf16 fp8 nvfp4 --json out.json
    python3 scripts/bench_train.py --cases small --recipes bf16 nvfp4 --profile prof/   # + kernel breakdown
    python3 scripts/bench_train.py --quick     # CPU smoke test of the script (tiny model, 2 steps)
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H200_BF16_PEAK = 989.4e12

CASES = {
    # name: (size, overrides, seq, micro_batch, keep_all_quantized)
    "slice12b": ("12b", {"pattern": "M-*-", "num_layers": 4}, 8192, 1, True),
    "small": ("small", {}, 2048, 8, False),
    "1.2b": ("1.2b", {}, 4096, 2, False),
    "tiny": ("tiny", {}, 256, 2, False),
}


# Kernel-name regexes (case-insensitive) of the --profile breakdown; the first match wins, the last is the rest.
KERNEL_CATEGORIES: dict[str, str] = {
    "gemm": r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|matmul|scaled_mm|wgmma",
    "nvfp4/fp8 cast": r"_quantize|_amax|_dequant|_alpha|_fp8|_scale|_mxfp4|_nvfp4",  # our Triton kernels
    "mamba": r"chunk|state_passing|bmm_chunk|causal_conv1d|selective|ssd|_layer_norm_fwd|_layer_norm_bwd"
             r"|rmsnorm_gated|mamba",
    "attention": r"flash|fmha|sdpa|attention|cudnn",
    "optimizer": r"multi_tensor|adam|foreach|\blamb\b|_amp_|clip_grad",  # not "lambda" (PyTorch's kernel names)
    "nccl": r"nccl",
    "norm/elementwise/other": r"",
}
TOP_KERNELS = 15


def kernel_category(name: str, categories: dict[str, str] = KERNEL_CATEGORIES) -> str:
    """The first category whose regex matches ``name`` (case-insensitive); the last category when none does."""
    for cat, pattern in categories.items():
        if pattern and re.search(pattern, name, re.IGNORECASE):
            return cat
    return list(categories)[-1]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: overlapping and nested ones count once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _is_kernel(name: str, activity: str, annotation: bool) -> bool:
    """A CUDA-device event that is a kernel: not a GPU user annotation (a range, not work), memcpy or memset."""
    if annotation or any(k in activity for k in ("annotation", "memcpy", "memset")):
        return False
    return not name.startswith(("Memcpy", "Memset"))


def cuda_kernels(prof: torch.profiler.profile) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every CUDA kernel in the profile: from the raw Kineto events where this
    torch has them (torch 2.11 and 2.13 do), else from the FunctionEvents' ``time_range``."""
    out = []
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None and hasattr(results, "events"):
        for e in results.events():
            if e.device_type() != torch.autograd.DeviceType.CUDA:
                continue
            activity = str(e.activity_type()) if hasattr(e, "activity_type") else ""
            annotation = bool(e.is_user_annotation()) if hasattr(e, "is_user_annotation") else False
            if _is_kernel(e.name(), activity, annotation):
                out.append((e.name(), e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3))
        return out
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        activity = str(getattr(e, "activity_type", "") or "")
        if _is_kernel(e.name, activity, bool(getattr(e, "is_user_annotation", False))):
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def kernel_summary(kernels: list[tuple[str, float, float]], wall_s: float,
                   categories: dict[str, str] = KERNEL_CATEGORIES) -> tuple[dict, list[dict]]:
    """The profile record (wall, busy, idle fraction, launches, time per category, top kernels) and the
    per-kernel rows (name, category, count, total_us; most time first) of one profiled step."""
    per: dict[str, list] = {}
    for name, start, end in kernels:
        row = per.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += end - start
    rows = sorted(({"name": n, "category": kernel_category(n, categories), "count": c, "total_us": us}
                   for n, (c, us) in per.items()), key=lambda r: -r["total_us"])
    busy_us = union_length((s, e) for _, s, e in kernels)
    cat_us = dict.fromkeys(categories, 0.0)
    for r in rows:
        cat_us[r["category"]] += r["total_us"]
    wall_ms = wall_s * 1e3
    rec = dict(wall_ms=wall_ms, busy_ms=busy_us / 1e3,
               idle_frac=1 - busy_us / 1e3 / wall_ms if wall_ms > 0 else 1.0, launches=len(kernels),
               categories={c: dict(ms=us / 1e3, pct=100 * us / busy_us if busy_us > 0 else 0.0)
                           for c, us in cat_us.items()},
               top=[dict(name=r["name"][:80], count=r["count"], total_ms=r["total_us"] / 1e3)
                    for r in rows[:TOP_KERNELS]])
    if not kernels:
        rec["note"] = "no CUDA events"
    return rec, rows


def profile_step(step: Callable[[], None], path: Path) -> dict:
    """One more training step under ``torch.profiler``; the per-kernel CSV goes to ``path``, the summary
    (``kernel_summary``) is returned."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rec, rows = kernel_summary(cuda_kernels(prof), wall)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["name", "category", "count", "total_us"])
        w.writeheader()
        w.writerows(rows)
    rec["csv"] = str(path)
    return rec


def print_profile(case: str, recipe: str, p: dict) -> None:
    """The profiled step of one case and recipe as markdown tables."""
    print(f"\n#### profile: {case} / {recipe}\n")
    if "error" in p:
        print(f"profiling failed: {p['error']}")
        return
    if "note" in p:
        print(f"({p['note']})\n")
    print("| step wall (ms) | GPU busy (ms) | GPU idle | kernel launches |")
    print("|---|---|---|---|")
    print(f"| {p['wall_ms']:.1f} | {p['busy_ms']:.1f} | {100 * p['idle_frac']:.1f}% | {p['launches']} |\n")
    print("| category | kernel ms | % of busy |")
    print("|---|---|---|")
    for cat, v in p["categories"].items():
        print(f"| {cat} | {v['ms']:.2f} | {v['pct']:.1f}% |")
    if p["top"]:
        print("\n| kernel | count | total ms |")
        print("|---|---|---|")
        for k in p["top"]:
            print(f"| `{k['name']}` | {k['count']} | {k['total_ms']:.2f} |")
    print(f"\nall kernels: {p['csv']}", flush=True)


def _init_dist() -> None:
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()


def bench_case(case: str, recipe: str, warmup: int, iters: int, optimizer: bool = True,
               profile_dir: Path | None = None) -> dict:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from models.build import build_model, transformer_config
    from models.config import count_parameters, model_config
    from models.flops import training_flops_per_token
    from nvfp4_train.optim import OptimConfig, build_ddp, build_optimizer
    from nvfp4_train.precision.layer_map import LayerPrecisionMap
    from nvfp4_train.precision.megatron_linear import invalidate_weight_caches, quant_layers, set_weight_cache
    from nvfp4_train.precision.operand import operand_nbytes

    size, overrides, seq, mb, all_q = CASES[case]
    mc = model_config(size).replace(**overrides)
    keep = {"keep_first": 0, "keep_last": 0} if all_q and recipe != "bf16" else {}
    lm = LayerPrecisionMap(mc.pattern, recipe, **keep)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    # the previous case's model, DDP buffers and optimizer form reference cycles (megatron's hooks): collect
    # them, or their memory stays allocated and inflates this case's peak
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(mc, lm, config=transformer_config(mc), seq_length=seq)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, mc.vocab_size, (mb, seq), generator=g).to(dev)
    pos = torch.arange(seq, device=dev)[None].expand(mb, seq)

    def no_mark() -> None:
        pass

    if optimizer:
        ddp = build_ddp(model, OptimConfig())
        opt = build_optimizer([ddp], OptimConfig(), lr=1e-4, min_lr=1e-5)
        set_weight_cache(model, True)  # as the trainer: quantize each weight once per optimizer step

        def step(after_forward=no_mark) -> None:
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = ddp(ids, pos, None, labels=ids).float().mean()
            after_forward()
            loss.backward()
            ddp.finish_grad_sync()
            opt.step()
            invalidate_weight_caches(model)
    else:
        def step(after_forward=no_mark) -> None:
            loss = model(ids, pos, None, labels=ids).float().mean()
            after_forward()
            loss.backward()

    for _ in range(warmup):
        step()
    if not optimizer:
        model.zero_grad(set_to_none=False)
    times = []
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        peak = torch.cuda.max_memory_allocated()
        # what the forward leaves allocated for backward (saved activations, the loss): one more step, with
        # memory_allocated read before it and right after its forward. The peak above also holds backward's
        # transients (gradients, GEMM workspaces, dequantized operands), which hide a smaller saved set.
        # The weight cache's quantized copies made in this forward are counted apart (not activations).
        after_fwd: dict[str, int] = {}

        def mark() -> None:
            torch.cuda.synchronize()
            copies = {id(op): op for m in quant_layers(model) for op in (m.lctx.weight_cache.row,
                                                                         m.lctx.weight_cache.col) if op is not None}
            after_fwd.update(allocated=torch.cuda.memory_allocated(),
                             weight_copies=sum(operand_nbytes(op) for op in copies.values()))

        torch.cuda.synchronize()
        before_fwd = torch.cuda.memory_allocated()
        step(mark)
        torch.cuda.synchronize()
        wcopies = after_fwd["weight_copies"]
        saved = after_fwd["allocated"] - before_fwd - wcopies
    else:
        base = peak = saved = wcopies = 0
        for _ in range(iters):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    t = statistics.median(times)
    tokens = mb * seq
    tps = tokens / t
    flops = training_flops_per_token(mc, seq)
    res = dict(case=case, recipe=recipe, optimizer=optimizer, params=count_parameters(mc), seq=seq, micro_batch=mb,
               bf16_blocks=lm.num_bf16, linear_layers=lm.num_linear, step_s=t, tokens_per_s=tps,
               tflops=flops * tps / 1e12, mfu=flops * tps / H200_BF16_PEAK,
               peak_gib=peak / 2**30, base_gib=base / 2**30, activation_gib=(peak - base) / 2**30,
               saved_gib=saved / 2**30, weight_copies_gib=wcopies / 2**30)
    if profile_dir is not None:
        try:  # a profiler failure must not lose the measurements above
            res["profile"] = profile_step(step, profile_dir / f"{case}_{recipe}_kernels.csv")
        except Exception as e:
            res["profile"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["slice12b", "small", "1.2b"], choices=sorted(CASES))
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-optimizer", action="store_true", help="time forward + backward only")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 2 steps")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="profile one more step per case/recipe: kernel breakdown, DIR/<case>_<recipe>_kernels.csv")
    a = ap.parse_args()
    if a.quick:
        a.cases, a.warmup, a.iters = ["tiny"], 1, 2
    _init_dist()
    rows = []
    for case in a.cases:
        for recipe in a.recipes:
            try:
                rows.append(bench_case(case, recipe, a.warmup, a.iters, not a.no_optimizer, a.profile))
            except Exception as e:  # report and go on: one failing recipe must not hide the others
                rows.append(dict(case=case, recipe=recipe, error=f"{type(e).__name__}: {e}"[:300]))
            r = rows[-1]
            print(json.dumps(r), flush=True)
            if "profile" in r:
                print_profile(case, recipe, r["profile"])
    print()
    print("| case | recipe | bf16 linear layers | step (ms) | vs bf16 | tokens/s | TFLOP/s | MFU | peak GiB | before step GiB "
          "| act. GiB | act. vs bf16 | saved by fwd GiB | saved vs bf16 | quantized weight copies GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {r["case"]: r for r in rows if r["recipe"] == "bf16" and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['recipe']} | error: {r['error'][:120]} |||||||||")
            continue
        b = base.get(r["case"])
        ratio = f"{r['step_s'] / b['step_s']:.2f}x" if b else "-"
        aratio = f"{r['activation_gib'] / b['activation_gib']:.2f}x" if b and b["activation_gib"] > 0 else "-"
        sratio = f"{r['saved_gib'] / b['saved_gib']:.2f}x" if b and b["saved_gib"] > 0 else "-"
        print(f"| {r['case']} | {r['recipe']} | {r['bf16_blocks']}/{r['linear_layers']} | {r['step_s'] * 1e3:.1f} | "
              f"{ratio} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% | "
              f"{r['peak_gib']:.1f} | {r['base_gib']:.1f} | {r['activation_gib']:.1f} | {aratio} | "
              f"{r['saved_gib']:.2f} | {sratio} | {r['weight_copies_gib']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
