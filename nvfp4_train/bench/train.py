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
step), timed with CUDA events, median step time. A step is one micro-batch of the case's shape unless
``--grad-accum N`` makes it N (gradients accumulated, reduced once, as ``train.py`` does with
``schedule.global_batch_size`` = N x micro-batch): with N = 1 every quantized layer re-quantizes its weight each
step, with N > 1 the weight cache serves the other micro-batches, as in training. ``--no-optimizer`` times
forward + backward only (the optimizer step is the same FP32 AdamW for every recipe). Peak memory is ``torch.cuda.max_memory_allocated``
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
profiled step is not part of the timed steps or the memory readings. The same record lists the CPU-side CUDA
runtime/driver calls that block or may block the host (``BLOCKING_CALLS``: cudaStreamSynchronize,
cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy[Async], cudaStreamWaitEvent, cuStreamSynchronize,
cuCtxSynchronize, cuMemcpy*): name, count, total and longest ms, as the table "host-blocking CUDA calls" and under
``"runtime_calls"``; and the host time spent in kernel launches (cudaLaunchKernel*, cuLaunchKernel*: count, total
ms) under ``"launch_calls"``. A cudaMemcpyAsync blocks only when one side is pageable host memory; a long
cudaStreamSynchronize / cudaMemcpy is where the host waited for the GPU.

``--cuda-graph`` (experimental, a benchmark only): after the above, each case and recipe also times the step with its
forwards and backwards captured once in a CUDA graph and replayed, the optimizer step eager after each replay: what
the step costs with no host work per kernel launch (the `small` steps are host-bound). The layers get the device
call counters and non-finite clock of training with CUDA graphs (``nvfp4_train.cuda_graph.enable_device_counters``),
so each replay draws its own stochastic-rounding keys; the training mode itself is ``schedule.cuda_graph`` (the
trainer's ``CudaGraphStep``), this benchmark keeps its own capture of its own step. A capture error is recorded under ``"cuda_graph"`` and the eager numbers are kept. With ``--cuda-graph``
each case runs entirely on one side stream (model, megatron's DDP, eager steps, capture): DDP keeps each
parameter's AccumulateGrad node from its construction, and a capture on another stream than theirs is invalidated
(seen on the H200 on 2026-11-30). Measured on the H200: ``docs/benchmarks.md``, "Training step".

``--sync-debug``: after the above (the profiled step included), each case and recipe runs ONE more full training
step with ``torch.cuda.set_sync_debug_mode("warn")`` (the previous mode restored afterwards, also on error) and
records every warning it emits with the Python stack at the point of emission (a ``warnings.showwarning`` hook
calling ``traceback.extract_stack``; torch's TORCH_WARN reaches Python as a warning raised when the op returns to
its Python caller). Warnings are grouped by (message, the innermost ``SYNC_FRAMES`` frames in files of this repo
or of megatron / mamba_ssm / torch / triton) and printed as a markdown table (count, message, frames as
``file:line function``) and stored under ``"sync_debug"`` in the ``--json`` record. Caveat (from reading
torch's autograd engine, not yet seen on a GPU): a warning from a built-in (C++) backward formula is buffered by
the engine and replayed when backward ends, so its stack stops at ``loss.backward()``; an op called from a Python
``autograd.Function.backward`` warns when it returns to that Python code, with its own stack. Without CUDA:
"sync-debug: no CUDA" and no record.

    python3 scripts/bench_train.py --cases slice12b small 1.2b --recipes bf16 fp8 nvfp4 --json out.json
    python3 scripts/bench_train.py --cases small --recipes bf16 nvfp4 --profile prof/   # + kernel breakdown
    python3 scripts/bench_train.py --cases small --recipes bf16 nvfp4 --grad-accum 4   # a step as train.py's small
    python3 scripts/bench_train.py --cases small --recipes bf16 nvfp4 --cuda-graph     # + replayed from a CUDA graph
    python3 scripts/bench_train.py --cases small --recipes bf16 nvfp4 --profile prof/ --sync-debug  # + host syncs
    python3 scripts/bench_train.py --quick     # CPU smoke test of the script (tiny model, 2 steps)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from nvfp4_train.bench.cases import CASES, build_case, cuda_step_times, graph_steps, init_dist, train_step
from nvfp4_train.bench.profile import print_profile, print_sync_debug, profile_step, sync_debug_step
from nvfp4_train.metrics import NONFINITE_CHECK_MODES

H200_BF16_PEAK = 989.4e12


def bench_case(case: str, recipe: str, warmup: int, iters: int, optimizer: bool = True,
               profile_dir: Path | None = None, sync_debug: bool = False, grad_accum: int = 1,
               cuda_graph: bool = False, nonfinite_check: str = "every_step") -> dict:
    """One case under one recipe. A step is ``grad_accum`` micro-batches of the case's shape (forward + backward
    each; gradients accumulate in megatron's buffers, reduced once after the last) and, unless ``optimizer`` is
    False, the optimizer step, as ``train.py`` runs a step. The weight cache quantizes each weight in the first
    micro-batch and reuses it in the others, so ``grad_accum`` > 1 amortizes that cost as training does.
    ``nonfinite_check``: the per-layer non-finite check as ``train.py``'s ``logging.nonfinite_check`` leaves it
    in a step that follows a successful one (``after_skip``: off)."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if nonfinite_check not in NONFINITE_CHECK_MODES:
        raise ValueError(f"nonfinite_check={nonfinite_check!r} is not one of {', '.join(NONFINITE_CHECK_MODES)}")
    from models.config import count_parameters
    from models.flops import training_flops_per_token
    from nvfp4_train.precision.megatron_linear import invalidate_weight_caches, quant_layers
    from nvfp4_train.precision.operand import operand_nbytes

    _, _, seq, mb, _ = CASES[case]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    # the previous case's model, DDP buffers and optimizer form reference cycles (megatron's hooks): collect
    # them, or their memory stays allocated and inflates this case's peak
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, mc, lm, ids, pos = build_case(case, recipe, device=dev)
    from nvfp4_train.precision.telemetry import set_nonfinite_check

    set_nonfinite_check(model, nonfinite_check == "every_step")
    checked = sum(m.quant_telemetry.check_nonfinite for m in quant_layers(model))

    zero, fwd_bwd, rest, step = train_step(model, ids, pos, grad_accum, optimizer)

    for _ in range(warmup):
        step()
    if not optimizer:
        model.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = cuda_step_times(step, iters)
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
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    t = statistics.median(times)
    tokens = grad_accum * mb * seq
    tps = tokens / t
    flops = training_flops_per_token(mc, seq)
    res = dict(case=case, recipe=recipe, optimizer=optimizer, params=count_parameters(mc), seq=seq, micro_batch=mb,
               grad_accum=grad_accum,
               bf16_blocks=lm.num_bf16, linear_layers=lm.num_linear, step_s=t, tokens_per_s=tps,
               tflops=flops * tps / 1e12, mfu=flops * tps / H200_BF16_PEAK,
               peak_gib=peak / 2**30, base_gib=base / 2**30, activation_gib=(peak - base) / 2**30,
               saved_gib=saved / 2**30, weight_copies_gib=wcopies / 2**30,
               nonfinite_check=nonfinite_check, nonfinite_checked_layers=checked)
    if profile_dir is not None:
        try:  # a profiler failure must not lose the measurements above
            res["profile"] = profile_step(step, profile_dir / f"{case}_{recipe}_kernels.csv")
        except Exception as e:
            res["profile"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if cuda_graph:
        try:  # nor a capture failure
            from nvfp4_train.cuda_graph import enable_device_counters

            enable_device_counters(model, torch.device("cuda", torch.cuda.current_device()))
            res["cuda_graph"] = graph_steps(zero, fwd_bwd, rest, lambda: invalidate_weight_caches(model), warmup,
                                            iters, tokens)
        except Exception as e:
            res["cuda_graph"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    if sync_debug:
        try:  # nor a sync-debug failure
            sd = sync_debug_step(step)
        except Exception as e:
            sd = dict(error=f"{type(e).__name__}: {e}"[:300])
        if sd is None:
            print("sync-debug: no CUDA", flush=True)
        else:
            res["sync_debug"] = sd
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["slice12b", "small", "1.2b"], choices=sorted(CASES))
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-optimizer", action="store_true", help="time forward + backward only")
    ap.add_argument("--grad-accum", type=int, default=1, metavar="N",
                    help="micro-batches per step (gradient accumulation; the weight cache is reused in all but the "
                         "first, as in training); default 1")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 2 steps")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="profile one more step per case/recipe: kernel breakdown, DIR/<case>_<recipe>_kernels.csv")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="EXPERIMENTAL: also time the step with its forwards/backwards replayed from one CUDA graph "
                         "(no host cost per launch; SR keys frozen: a benchmark, not a training mode)")
    ap.add_argument("--nonfinite-check", choices=NONFINITE_CHECK_MODES, default="every_step",
                    help="the per-layer non-finite check as train.py's logging.nonfinite_check (after_skip: off in "
                         "these steps); default every_step")
    ap.add_argument("--sync-debug", action="store_true",
                    help="one more step per case/recipe under torch.cuda.set_sync_debug_mode('warn'): every "
                         "host-GPU synchronization with its Python stack")
    a = ap.parse_args()
    if a.quick:
        a.cases, a.warmup, a.iters = ["tiny"], 1, 2
    init_dist()
    rows = []
    for case in a.cases:
        for recipe in a.recipes:
            # --cuda-graph: the whole case (model, DDP, eager steps, capture) on one side stream (see graph_steps)
            side = torch.cuda.stream(torch.cuda.Stream()) if a.cuda_graph and torch.cuda.is_available() \
                else contextlib.nullcontext()
            try:
                with side:
                    rows.append(bench_case(case, recipe, a.warmup, a.iters, not a.no_optimizer, a.profile,
                                           a.sync_debug, a.grad_accum, a.cuda_graph, a.nonfinite_check))
            except Exception as e:  # report and go on: one failing recipe must not hide the others
                rows.append(dict(case=case, recipe=recipe, error=f"{type(e).__name__}: {e}"[:300]))
            r = rows[-1]
            print(json.dumps(r), flush=True)
            if "profile" in r:
                print_profile(case, recipe, r["profile"])
            if "sync_debug" in r:
                print_sync_debug(case, recipe, r["sync_debug"])
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
    graphed = [r for r in rows if "cuda_graph" in r]
    if graphed:
        print("\n| case | recipe | eager step (ms) | CUDA-graph step (ms) | graph vs eager | graph vs bf16 graph |")
        print("|---|---|---|---|---|---|")
        gbase = {r["case"]: r["cuda_graph"] for r in graphed if r["recipe"] == "bf16" and "error" not in r["cuda_graph"]}
        for r in graphed:
            g = r["cuda_graph"]
            if "error" in g:
                print(f"| {r['case']} | {r['recipe']} | {r['step_s'] * 1e3:.1f} | error: {g['error'][:120]} | | |")
                continue
            b = gbase.get(r["case"])
            vs_b = f"{g['step_s'] / b['step_s']:.2f}x" if b else "-"
            print(f"| {r['case']} | {r['recipe']} | {r['step_s'] * 1e3:.1f} | {g['step_s'] * 1e3:.1f} | "
                  f"{g['step_s'] / r['step_s']:.2f}x | {vs_b} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
