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

    python3 scripts/bench_train.py --cases slice12b small 1.2b --recipes bf16 fp8 nvfp4 --json out.json
    python3 scripts/bench_train.py --quick     # CPU smoke test of the script (tiny model, 2 steps)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
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


def _init_dist() -> None:
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()


def bench_case(case: str, recipe: str, warmup: int, iters: int, optimizer: bool = True) -> dict:
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
    a = ap.parse_args()
    if a.quick:
        a.cases, a.warmup, a.iters = ["tiny"], 1, 2
    _init_dist()
    rows = []
    for case in a.cases:
        for recipe in a.recipes:
            try:
                rows.append(bench_case(case, recipe, a.warmup, a.iters, not a.no_optimizer))
            except Exception as e:  # report and go on: one failing recipe must not hide the others
                rows.append(dict(case=case, recipe=recipe, error=f"{type(e).__name__}: {e}"[:300]))
            r = rows[-1]
            print(json.dumps(r), flush=True)
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
