"""Training-step benchmark on one GPU: step time, tokens/s, MFU and peak memory of the hybrid model under several
recipes, measured in ONE run (ratios to BF16 are what count).

Cases (``--cases``):
  slice12b   a 4-block slice of the 12B (real widths: hidden 5120, MLP 20480, 40/8 heads, Mamba 128x80;
             pattern ``M-*-``), sequence 8192, micro-batch 1, every block in the recipe (no bf16 blocks)
  small      the ``small`` hybrid, sequence 2048, micro-batch 8, the recipe's default layer map
  1.2b       the 1.2B Transformer, sequence 4096, micro-batch 2, the recipe's default layer map

For each case and recipe: a :class:`nvfp4_train.trainer.Trainer` of the case (``bench.cases.build_trainer``: the
case's model, precision and shapes as ``train.py`` overrides, on random token ids written as an indexed dataset,
through the trainer's own data loader; no checkpoints or external loggers) and its OWN step,
``Trainer.train_step()``: the step ``train.py`` loops over (megatron's DDP with FP32 gradient buffers, the
distributed optimizer: FP32 master weights, AdamW, sync-free clipping; the quantized weights cached per optimizer
step and dropped after it; the step's loss all-reduce, learning rate and non-finite decisions). ``--warmup`` then
``--iters`` steps, timed with CUDA events, median step time, each step on its own (the host waits for the device
after it, so the step includes the device's idle time while the host prepares it); then ``--iters`` more steps
back to back as ``train.py`` runs them ("back to back": the host prepares the next step while the device runs
the optimizer; ``bench.cases.cuda_pipelined_step_times``); "logged tokens/s" is what ``train.py`` logs for the
same steps (tokens per step over the step's own ``time_s``). A step is one micro-batch of the case's shape unless
``--grad-accum N`` makes it N (``schedule.global_batch_size`` = N x micro-batch): with N = 1 every quantized
layer re-quantizes its weight each step, with N > 1 the weight cache serves the other micro-batches, as in
training. Trailing ``KEY=VALUE`` arguments are more ``train.py`` overrides for every case. Peak memory is ``torch.cuda.max_memory_allocated``
during the timed steps; "before step" is the memory held before the first timed step (weights, gradient
buffers, optimizer state); "activations" is the peak minus that, i.e. what the step saved for backward plus
workspace; "saved by fwd" is what one more step's first forward left allocated (its saved activations and the
loss), read with ``torch.cuda.memory_allocated`` right before the step and right after that forward (a forward
hook), less the weight cache's quantized copies made in that forward (reported apart; "-" for a step
replayed from a CUDA graph, which runs no module hooks): the activation memory
without backward's transients (gradients, GEMM workspaces, dequantized operands), which the peak holds. Each
case starts after a garbage collection: the previous case's model and optimizer form
reference cycles through megatron's hooks and would otherwise stay allocated.
MFU = model FLOPs per token (``nvfp4_train.models.flops``) x tokens/s / 989.4 TFLOP/s (H200 dense BF16 peak; Hopper has
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
ms) under ``"launch_calls"``; and the GPU's idle time split by what the host was doing meanwhile (the trainer's
step phases, ``train_step/*`` ranges: preparing the step, launching the forwards and backwards, reading the next
step's batches, enqueueing the optimizer's norm, the step's one host read, the optimizer's update, the end of the
step; "outside" for the rest) as the table "GPU idle by host phase" and under ``"idle_by_phase"`` (ms). A cudaMemcpyAsync blocks only when one side is pageable host memory; a long
cudaStreamSynchronize / cudaMemcpy is where the host waited for the GPU.

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
    python3 scripts/bench_train.py --cases small --recipes bf16 nvfp4 --profile prof/ --sync-debug  # + host syncs
    python3 scripts/bench_train.py --cases 1.2b --grad-accum 4 --cuda-graph on off   # graphed and eager, one run
    python3 scripts/bench_train.py --quick     # CPU smoke test of the script (tiny model, 2 steps)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nvfp4_train.bench.cases import CASES, build_trainer, cuda_pipelined_step_times, cuda_step_times
from nvfp4_train.bench.profile import print_profile, print_sync_debug, profile_step, sync_debug_step
from nvfp4_train.metrics import NONFINITE_CHECK_MODES
from nvfp4_train.schedule import CUDA_GRAPH_MODES

H200_BF16_PEAK = 989.4e12


def conv_fallback_cases(cases: list[str]) -> tuple[list[str], str]:
    """The ``cases`` whose model has Mamba layers, and causal-conv1d's state, when a CUDA step of them would run
    Mamba's depthwise conv through the PyTorch fallback (causal-conv1d not importable: its CUDA kernel is what
    users run, and the fallback doubles the ``small`` step, docs/benchmarks.md); ``([], state)`` when it would not
    (no CUDA, or causal-conv1d there)."""
    from nvfp4_train.models.config import SIZES
    from nvfp4_train.models.mamba._import import load_causal_conv1d
    from nvfp4_train.models.pattern import MAMBA

    conv, state = load_causal_conv1d()
    if conv is not None or not torch.cuda.is_available():
        return [], state
    return [c for c in cases if MAMBA in CASES[c][1].get("pattern", SIZES[CASES[c][0]].pattern)], state


def bench_case(case: str, recipe: str, warmup: int, iters: int, work_dir: Path, profile_dir: Path | None = None,
               sync_debug: bool = False, grad_accum: int = 1, nonfinite_check: str = "every_step",
               extra: tuple[str, ...] = ()) -> dict:
    """One case under one recipe: the trainer's own step (``Trainer.train_step``, what ``train.py`` loops over)
    on a :func:`~nvfp4_train.bench.cases.build_trainer` of the case. A step is ``grad_accum`` micro-batches of
    the case's shape (forward + backward each; gradients accumulated in megatron's buffers, reduced once), the
    optimizer step and the weight caches' drop. ``nonfinite_check``: ``logging.nonfinite_check``; ``extra``:
    more ``train.py`` overrides (they win)."""
    if nonfinite_check not in NONFINITE_CHECK_MODES:
        raise ValueError(f"nonfinite_check={nonfinite_check!r} is not one of {', '.join(NONFINITE_CHECK_MODES)}")
    from nvfp4_train.models.config import count_parameters
    from nvfp4_train.models.flops import training_flops_per_token
    from nvfp4_train.precision.megatron_linear import quant_layers
    from nvfp4_train.precision.operand import operand_nbytes

    _, _, seq, mb, _ = CASES[case]
    cuda = torch.cuda.is_available()
    # the previous case's trainer (model, DDP buffers, optimizer) forms reference cycles (megatron's hooks):
    # collect them, or their memory stays allocated and inflates this case's peak
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    extra_steps = 2 + (profile_dir is not None) + sync_debug + (iters if torch.cuda.is_available() else 0)
    with build_trainer(case, recipe, grad_accum=grad_accum, steps=warmup + iters + extra_steps, work_dir=work_dir,
                       nonfinite_check=nonfinite_check, extra=extra) as trainer:
        module = trainer.ddp.module  # the model inside megatron's DDP
        mc, lm = trainer.cfg.model, trainer.layer_map
        checked = sum(m.quant_telemetry.check_nonfinite for m in quant_layers(module))
        outcomes = []

        def step() -> None:
            out = trainer.train_step()
            if out.skipped:
                raise RuntimeError(f"step {out.step} was skipped ({out.reason}): the benchmark times good steps")
            outcomes.append(out)

        for _ in range(warmup):
            step()
        del outcomes[:]
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = cuda_step_times(step, iters)
            peak = torch.cuda.max_memory_allocated()
            back_to_back = cuda_pipelined_step_times(step, iters)
            # what the forward leaves allocated for backward (saved activations, the loss): one more step, with
            # memory_allocated read before it and right after its first forward (a forward hook). The peak above
            # also holds backward's transients (gradients, GEMM workspaces, dequantized operands), which hide a
            # smaller saved set. The weight cache's quantized copies made in this forward are counted apart.
            after_fwd: dict[str, int] = {}

            def mark(*_args) -> None:
                if after_fwd:
                    return
                torch.cuda.synchronize()
                copies = {id(op): op for m in quant_layers(module) for op in (m.lctx.weight_cache.row,
                                                                              m.lctx.weight_cache.col)
                          if op is not None}
                after_fwd.update(allocated=torch.cuda.memory_allocated(),
                                 weight_copies=sum(operand_nbytes(op) for op in copies.values()))

            hook = module.register_forward_hook(mark)
            torch.cuda.synchronize()
            before_fwd = torch.cuda.memory_allocated()
            step()
            hook.remove()
            torch.cuda.synchronize()
            if after_fwd:
                wcopies = after_fwd["weight_copies"]
                # the data loader's batch for this step is already on the device before the forward: not counted
                saved = after_fwd["allocated"] - before_fwd - wcopies
            else:  # a step replayed from a CUDA graph runs no module hooks: nothing to read between fwd and bwd
                saved = wcopies = None
            logged = [o.time_s for o in outcomes[:iters]]
        else:
            base = peak = saved = wcopies = 0
            times, back_to_back = [], []
            for _ in range(iters):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            logged = [o.time_s for o in outcomes]
        t = statistics.median(times)
        tokens = grad_accum * mb * seq
        tps = tokens / t
        flops = training_flops_per_token(mc, seq)
        res = dict(case=case, recipe=recipe, params=count_parameters(mc), seq=seq, micro_batch=mb,
                   grad_accum=grad_accum, bf16_blocks=lm.num_bf16, linear_layers=lm.num_linear, step_s=t,
                   tokens_per_s=tps, logged_tokens_per_s=tokens / statistics.median(logged),
                   tflops=flops * tps / 1e12, mfu=flops * tps / H200_BF16_PEAK,
                   step_back_to_back_s=statistics.median(back_to_back) if back_to_back else None,
                   mfu_back_to_back=(flops * tokens / statistics.median(back_to_back) / H200_BF16_PEAK
                                     if back_to_back else None),
                   peak_gib=peak / 2**30, base_gib=base / 2**30, activation_gib=(peak - base) / 2**30,
                   saved_gib=None if saved is None else saved / 2**30,
                   weight_copies_gib=None if wcopies is None else wcopies / 2**30,
                   nonfinite_check=nonfinite_check, nonfinite_checked_layers=checked, overrides=list(extra))
        if profile_dir is not None:
            try:  # a profiler failure must not lose the measurements above
                res["profile"] = profile_step(step, profile_dir / f"{case}_{recipe}_kernels.csv")
            except Exception as e:
                res["profile"] = dict(error=f"{type(e).__name__}: {e}"[:300])
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


FUSION_MODES = ("on", "off")


def fusion_overrides(mode: str) -> tuple[str, ...]:
    """The ``train.py`` overrides of ``--fusion`` mode ``mode``: ``on`` is the default config (none), ``off`` every
    switch of the ``fusion`` section false."""
    if mode == "on":
        return ()
    if mode not in FUSION_MODES:
        raise ValueError(f"--fusion {mode!r}: one of {', '.join(FUSION_MODES)}")
    from nvfp4_train.models.fusion import FusionConfig

    return tuple(f"fusion.{f.name}=false" for f in dataclasses.fields(FusionConfig))


def print_fusion_table(rows: list[dict]) -> None:
    """Each case, CUDA-graph mode and recipe: the fused step against the unfused one of the same run, and the
    fused step against the unfused BF16 step."""
    ok = {(r["case"], r["cuda_graph"], r["recipe"], r["fusion"]): r for r in rows if "error" not in r}
    print()
    print("| case | cuda_graph | recipe | unfused step (ms) | fused step (ms) | fused / unfused | fused vs unfused bf16 "
          "| fused MFU | unfused peak GiB | fused peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (case, mode, recipe, fusion), on in ok.items():
        off = ok.get((case, mode, recipe, "off"))
        if fusion != "on" or off is None:
            continue
        b = ok.get((case, mode, "bf16", "off"))
        vs = f"{on['step_s'] / b['step_s']:.3f}x" if b else "-"
        print(f"| {case} | {mode} | {recipe} | {off['step_s'] * 1e3:.1f} | {on['step_s'] * 1e3:.1f} | "
              f"{on['step_s'] / off['step_s']:.3f}x | {vs} | {100 * on['mfu']:.1f}% | {off['peak_gib']:.1f} | "
              f"{on['peak_gib']:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["slice12b", "small", "1.2b"], choices=sorted(CASES))
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--grad-accum", type=int, default=1, metavar="N",
                    help="micro-batches per step (gradient accumulation; the weight cache is reused in all but the "
                         "first, as in training); default 1")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the random tokens and the run directories go (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 2 steps")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="profile one more step per case/recipe: kernel breakdown, DIR/<case>_<recipe>_kernels.csv")
    ap.add_argument("--nonfinite-check", choices=NONFINITE_CHECK_MODES, default="every_step",
                    help="the per-layer non-finite check as train.py's logging.nonfinite_check (after_skip: off in "
                         "these steps); default every_step")
    ap.add_argument("--sync-debug", action="store_true",
                    help="one more step per case/recipe under torch.cuda.set_sync_debug_mode('warn'): every "
                         "host-GPU synchronization with its Python stack")
    ap.add_argument("--cuda-graph", nargs="+", default=["auto"], choices=CUDA_GRAPH_MODES, metavar="MODE",
                    help="schedule.cuda_graph for every case and recipe; several modes run each case and recipe "
                         "under each, in this one process, ratios to BF16 of the same mode (e.g. --cuda-graph on "
                         "off: graphed and eager in one run); default auto. Like --cases and --recipes it takes "
                         "every word up to the next option: put trailing KEY=VALUE overrides after another option "
                         "or after --")
    ap.add_argument("--fusion", nargs="+", default=["on"], choices=FUSION_MODES, metavar="MODE",
                    help="the fused step kernels (the fusion config section): on (the default config) or off (every "
                         "fusion.* switch false: the unfused arithmetic); several run each case and recipe under "
                         "each in this one process (e.g. --fusion off on: before and after), with a table of the "
                         "fused step against the unfused one")
    ap.add_argument("--conv-fallback", action="store_true",
                    help="time cases with Mamba layers on a GPU without causal-conv1d (its PyTorch fallback); by "
                         "default that is refused: users run causal-conv1d's kernel (docs/wheelhouse.md)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="train.py overrides applied to every case (after the case's own), e.g. "
                         "optim.overlap_grad_reduce=true")
    a = ap.parse_args()
    if a.quick:
        a.cases, a.warmup, a.iters = ["tiny"], 1, 2
    if a.grad_accum < 1:
        ap.error(f"--grad-accum must be >= 1, got {a.grad_accum}")
    fallback, conv_state = conv_fallback_cases(a.cases)
    if fallback and not a.conv_fallback:
        ap.error(f"--cases {' '.join(fallback)}: {conv_state}, so Mamba's conv would run its PyTorch fallback (about "
                 f"twice the `small` step): install causal-conv1d's wheel for this GPU (docs/wheelhouse.md), or pass "
                 f"--conv-fallback to time the fallback")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        work = a.work_dir or Path(tmp)
        for case in a.cases:
            for mode, fusion in itertools.product(a.cuda_graph, a.fusion):
                # the case's profile CSVs of each mode apart
                sub = "_".join(([f"cuda_graph_{mode}"] if len(a.cuda_graph) > 1 else [])
                               + ([f"fusion_{fusion}"] if len(a.fusion) > 1 else []))
                prof = None if a.profile is None or not sub else a.profile / sub
                if prof is not None:
                    prof.mkdir(parents=True, exist_ok=True)
                for recipe in a.recipes:
                    try:
                        r = bench_case(case, recipe, a.warmup, a.iters, work, prof or a.profile, a.sync_debug,
                                       a.grad_accum, a.nonfinite_check,
                                       (f"schedule.cuda_graph={mode}", *fusion_overrides(fusion), *a.overrides))
                    except Exception as e:  # report and go on: one failing recipe must not hide the others
                        r = dict(case=case, recipe=recipe, error=f"{type(e).__name__}: {e}"[:300])
                    r["cuda_graph"] = mode
                    r["fusion"] = fusion
                    r["causal_conv1d"] = conv_state
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    label = case + "".join(f" ({k})" for k in (f"cuda_graph={mode}" if len(a.cuda_graph) > 1 else "",
                                                                   f"fusion={fusion}" if len(a.fusion) > 1 else "") if k)
                    if "profile" in r:
                        print_profile(label, recipe, r["profile"])
                    if "sync_debug" in r:
                        print_sync_debug(label, recipe, r["sync_debug"])
    print()
    print("| case | cuda_graph | fusion | recipe | bf16 linear layers | step (ms) | vs bf16 | tokens/s | logged tokens/s "
          "| TFLOP/s | MFU | back to back (ms) | MFU back to back | peak GiB | before step GiB | act. GiB | act. vs bf16 | saved by fwd GiB | saved vs bf16 "
          "| quantized weight copies GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {(r["case"], r["cuda_graph"], r["fusion"]): r for r in rows if r["recipe"] == "bf16" and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['cuda_graph']} | {r['fusion']} | {r['recipe']} | error: {r['error'][:120]} "
                  f"||||||||||||")
            continue
        b = base.get((r["case"], r["cuda_graph"], r["fusion"]))
        ratio = f"{r['step_s'] / b['step_s']:.2f}x" if b else "-"
        aratio = f"{r['activation_gib'] / b['activation_gib']:.2f}x" if b and b["activation_gib"] > 0 else "-"
        sratio = (f"{r['saved_gib'] / b['saved_gib']:.2f}x" if b and r["saved_gib"] is not None
                  and (b["saved_gib"] or 0) > 0 else "-")
        saved = "-" if r["saved_gib"] is None else f"{r['saved_gib']:.2f}"
        copies = "-" if r["weight_copies_gib"] is None else f"{r['weight_copies_gib']:.2f}"
        b2b = "-" if r.get("step_back_to_back_s") is None else f"{r['step_back_to_back_s'] * 1e3:.1f}"
        b2b_mfu = "-" if r.get("mfu_back_to_back") is None else f"{100 * r['mfu_back_to_back']:.1f}%"
        print(f"| {r['case']} | {r['cuda_graph']} | {r['fusion']} | {r['recipe']} | {r['bf16_blocks']}/{r['linear_layers']} | "
              f"{r['step_s'] * 1e3:.1f} | {ratio} | {r['tokens_per_s']:,.0f} | {r['logged_tokens_per_s']:,.0f} | "
              f"{r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {b2b} | {b2b_mfu} | {r['peak_gib']:.1f} | {r['base_gib']:.1f} | "
              f"{r['activation_gib']:.1f} | {aratio} | {saved} | {sratio} | {copies} |")
    if len(a.fusion) > 1:
        print_fusion_table(rows)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
