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
the step costs with no host work per kernel launch (the `small` steps are host-bound). Not a training mode: the
stochastic-rounding keys and the non-finite check's clock, host integers given to the kernels, are frozen at
capture. A capture error is recorded under ``"cuda_graph"`` and the eager numbers are kept. With ``--cuda-graph``
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
import csv
import gc
import json
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4_train.metrics import NONFINITE_CHECK_MODES  # noqa: E402

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


# CPU-side CUDA runtime/driver calls that block or may block the host (re.match on the event name; a
# cudaMemcpyAsync blocks when one side is pageable host memory), and the kernel-launch calls.
BLOCKING_CALLS = (r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy(?!Async)"
                  r"|cudaMemcpyAsync|cudaStreamWaitEvent|cuStreamSynchronize|cuCtxSynchronize|cuMemcpy")
LAUNCH_CALLS = r"cudaLaunchKernel|cuLaunchKernel"  # also cudaLaunchKernelExC, cuLaunchKernelEx


def runtime_calls(prof: torch.profiler.profile) -> list[tuple[str, float]]:
    """``(name, duration_us)`` of every host-side CUDA runtime/driver call in the profile (Kineto's
    "cuda_runtime" / "cuda_driver" activities, CPU side), from the raw Kineto events where this torch has them,
    else from the CPU FunctionEvents whose name looks like a runtime/driver call (``cuda*`` / ``cu[A-Z]*``)."""
    out = []
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None and hasattr(results, "events"):
        for e in results.events():
            if e.device_type() == torch.autograd.DeviceType.CUDA:
                continue
            activity = str(e.activity_type()).lower() if hasattr(e, "activity_type") else ""
            if activity and "runtime" not in activity and "driver" not in activity:
                continue
            if hasattr(e, "duration_ns"):
                dur = e.duration_ns() / 1e3
            elif hasattr(e, "duration_us"):
                dur = float(e.duration_us())
            else:
                dur = 0.0
            out.append((e.name(), dur))
        return out
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA or not re.match(r"cuda[A-Z]|cu[A-Z]", e.name):
            continue
        out.append((e.name, e.time_range.end - e.time_range.start))
    return out


def runtime_summary(calls: Iterable[tuple[str, float]], blocking: str = BLOCKING_CALLS,
                    launch: str = LAUNCH_CALLS) -> dict:
    """``runtime_calls``: the blocking calls (``blocking`` matches the name's start) grouped by name, most time
    first (name, count, total_ms, max_ms); ``launch_calls``: count and total ms of the kernel launches."""
    per: dict[str, list] = {}
    n_launch, launch_us = 0, 0.0
    for name, us in calls:
        if re.match(blocking, name):
            row = per.setdefault(name, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += us
            row[2] = max(row[2], us)
        elif re.match(launch, name):
            n_launch += 1
            launch_us += us
    rows = sorted(({"name": n, "count": c, "total_ms": us / 1e3, "max_ms": mx / 1e3}
                   for n, (c, us, mx) in per.items()), key=lambda r: (-r["total_ms"], r["name"]))
    return dict(runtime_calls=rows, launch_calls=dict(count=n_launch, total_ms=launch_us / 1e3))


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
    rec.update(runtime_summary(runtime_calls(prof)))
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
    if "runtime_calls" in p:
        print("\nhost-blocking CUDA calls:\n")
        print("| call | count | total ms | longest ms |")
        print("|---|---|---|---|")
        for r in p["runtime_calls"]:
            print(f"| `{r['name']}` | {r['count']} | {r['total_ms']:.2f} | {r['max_ms']:.2f} |")
        if not p["runtime_calls"]:
            print("| (none recorded) | 0 | 0.00 | 0.00 |")
        lc = p["launch_calls"]
        print(f"\nkernel-launch calls (cudaLaunchKernel*/cuLaunchKernel*): {lc['count']}, "
              f"{lc['total_ms']:.2f} ms host time")
    print(f"\nall kernels: {p['csv']}", flush=True)


# --sync-debug: the innermost frames kept per warning, and the libraries whose frames count (besides this repo)
SYNC_FRAMES = 6
SYNC_LIBS = ("megatron", "mamba_ssm", "torch", "triton")
ROOT = Path(__file__).resolve().parents[1]


def _frame_file(filename: str, root: Path = ROOT, libs: tuple[str, ...] = SYNC_LIBS) -> str | None:
    """``filename`` as shown in the sync-debug table (relative to site-packages or to the repo), or None when the
    frame is neither in this repo nor in one of ``libs``."""
    f = filename.replace("\\", "/")
    if "/site-packages/" in f or "/dist-packages/" in f:
        tail = re.split(r"/(?:site|dist)-packages/", f)[-1]
        return tail if tail.split("/")[0] in libs else None
    r = str(root).rstrip("/") + "/"
    if f.startswith(r):
        return f[len(r):]
    parts = f.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in libs:
            return "/".join(parts[i:])
    return None


def sync_frames(stack: Iterable, root: Path = ROOT, n: int = SYNC_FRAMES) -> tuple[str, ...]:
    """The innermost ``n`` frames of ``stack`` (outermost first, as ``traceback.extract_stack`` gives it; items
    with ``filename``, ``lineno``, ``name``) that are in this repo or a ``SYNC_LIBS`` library, innermost first,
    as ``file:line function``."""
    out = []
    for fr in reversed(list(stack)):
        shown = _frame_file(fr.filename, root)
        if shown is not None:
            out.append(f"{shown}:{fr.lineno} {fr.name}")
            if len(out) == n:
                break
    return tuple(out)


def group_sync_warnings(records: Iterable[tuple[str, Iterable]], root: Path = ROOT,
                        n: int = SYNC_FRAMES) -> list[dict]:
    """``(message, stack)`` records grouped by (message, ``sync_frames``): count, message, frames; most frequent
    first."""
    counts: dict[tuple, int] = {}
    for message, stack in records:
        key = (str(message), sync_frames(stack, root, n))
        counts[key] = counts.get(key, 0) + 1
    return [dict(count=c, message=m[:300], frames=list(fr))
            for (m, fr), c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _is_warnings_frame(fr) -> bool:
    return Path(fr.filename).name in ("warnings.py", "_py_warnings.py") or fr.name == "_showwarnmsg"


@contextmanager
def warning_stacks() -> Iterator[list[tuple[str, list]]]:
    """Every warning emitted inside (any thread; filters set to "always") as ``(message, stack)``: the Python
    stack at the point of emission (``traceback.extract_stack`` in a ``warnings.showwarning`` hook, without the
    hook's and the warnings module's frames). A C++ TORCH_WARN reaches the hook when the op returns to Python."""
    records: list[tuple[str, list]] = []

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        stack = traceback.extract_stack()[:-1]  # without this hook
        while stack and _is_warnings_frame(stack[-1]):
            stack.pop()
        records.append((str(message), stack))

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        warnings.showwarning = hook  # called instead of the recording; catch_warnings restores it
        yield records


def sync_debug_step(step: Callable[[], None]) -> dict | None:
    """One more step with ``torch.cuda.set_sync_debug_mode("warn")`` (the previous mode restored, also on error):
    every warning it emits, with the Python stack where it was emitted, grouped (``group_sync_warnings``). None
    without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()  # outside the "warn" mode: synchronize itself is a synchronizing call
    prev = torch.cuda.get_sync_debug_mode()
    with warning_stacks() as records:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    return dict(warnings=len(records), groups=group_sync_warnings(records))


def print_sync_debug(case: str, recipe: str, sd: dict) -> None:
    """The sync-debug step of one case and recipe as a markdown table."""
    print(f"\n#### sync-debug: {case} / {recipe}\n")
    if "error" in sd:
        print(f"sync-debug failed: {sd['error']}")
        return
    print(f"{sd['warnings']} warnings in one step, {len(sd['groups'])} distinct (message, stack)\n")
    if not sd["groups"]:
        return
    print(f"| count | message | innermost {SYNC_FRAMES} frames (innermost first) |")
    print("|---|---|---|")
    for g in sd["groups"]:
        msg = g["message"].replace("|", "\\|").replace("\n", " ")
        frames = "<br>".join(f"`{f}`" for f in g["frames"]) or "(no frame in the repo or its libraries)"
        print(f"| {g['count']} | {msg} | {frames} |")
    print(flush=True)


def _init_dist() -> None:
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()


def build_case(case: str, recipe: str, seq: int | None = None, mb: int | None = None, device: str = "cpu"):
    """The model of ``CASES[case]`` under ``recipe`` (its config, its layer precision map: every block quantized
    where the case says so), built from seed 0, and its input: token ids from seed 1, [mb, seq] (the case's own
    sequence and micro-batch unless given), and positions. Returns ``(model, mc, lm, ids, pos)``. The one builder
    of this benchmark, ``scripts/op_census.py`` and ``scripts/saved_census.py``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from models.build import build_model, transformer_config
    from models.config import model_config
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


def cuda_step_times(step: Callable[[], None], iters: int) -> list[float]:
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


def graph_steps(zero: Callable[[], None], fwd_bwd: Callable[[], None], rest: Callable[[], None],
                invalidate: Callable[[], None], warmup: int, iters: int, tokens: int) -> dict:
    """EXPERIMENTAL, a benchmark only: ``bench_case``'s step (``zero``, then ``fwd_bwd``: the forwards and
    backwards of its micro-batches, then ``rest``: the gradient sync, optimizer step and weight-cache drop) with
    ``fwd_bwd`` captured once in a CUDA graph (``torch.cuda.graph``) and replayed, the rest eager (megatron's
    ``prepare_grads`` reads ``found_inf`` on the host, which a graph cannot hold). It measures what the step costs
    with no host work per kernel launch. Not a training mode: every replay reuses the stochastic-rounding keys and
    the non-finite check's clock values captured once (host integers passed to the kernels), so the noise does not
    change from step to step. Returns the median step time and tokens/s, or raises on the first capture error."""
    if not torch.cuda.is_available():
        raise RuntimeError("--cuda-graph needs CUDA")
    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():
        # megatron's DDP keeps each parameter's AccumulateGrad node from its construction; a capture on another
        # stream than the one those nodes were made on is invalidated (H200, 2026-11-30): build, warm up and
        # capture on one side stream (``main`` runs a --cuda-graph case under one)
        raise RuntimeError("--cuda-graph: run the case under a side stream (torch.cuda.stream), not the default")
    for _ in range(2):
        zero()
        fwd_bwd()
        rest()
    zero()
    invalidate()  # the captured forward quantizes every weight, as each step's first does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fwd_bwd()
    rest()

    def step() -> None:
        zero()
        graph.replay()
        rest()

    for _ in range(warmup):
        step()
    t = statistics.median(cuda_step_times(step, iters))
    return dict(step_s=t, tokens_per_s=tokens / t)


def _nothing(*_args) -> None:
    pass


def train_step(model, ids: torch.Tensor, pos: torch.Tensor, grad_accum: int = 1, optimizer: bool = True):
    """A training step of ``model`` on the batch ``ids``/``pos`` as ``train.py`` runs one, in pieces:
    ``(zero, fwd_bwd, rest, step)``. ``zero`` clears the gradients; ``fwd_bwd(after_forward)`` runs the forwards
    and backwards of ``grad_accum`` micro-batches (megatron's ``no_sync`` for all but the last, as its schedules
    do; ``after_forward`` called once, after the first forward); ``rest`` reduces the gradients, steps the
    optimizer and drops the weight caches; ``step(after_forward)`` is the three. With ``optimizer`` the model
    is wrapped in megatron's DDP with the distributed optimizer (FP32 master weights, AdamW, sync-free clipping)
    and the weight cache is on (each weight quantized once per step); without, ``zero`` and ``rest`` do nothing.
    The one step of this benchmark and of ``scripts/op_census.py``."""
    from nvfp4_train.optim import OptimConfig, build_ddp, build_optimizer, optimizer_step
    from nvfp4_train.precision.megatron_linear import invalidate_weight_caches, set_weight_cache

    if optimizer:
        ddp = net = build_ddp(model, OptimConfig())
        opt = build_optimizer([ddp], OptimConfig(), lr=1e-4, min_lr=1e-5)
        set_weight_cache(model, True)  # as the trainer: quantize each weight once per optimizer step

        def zero() -> None:
            ddp.zero_grad_buffer()
            opt.zero_grad()

        def rest() -> None:
            ddp.finish_grad_sync()
            optimizer_step(opt, OptimConfig().clip_grad)
            invalidate_weight_caches(model)
    else:
        net, zero, rest = model, _nothing, _nothing

    def fwd_bwd(after_forward: Callable[[], None] = _nothing) -> None:
        for i in range(grad_accum):
            with ddp.no_sync() if optimizer and i < grad_accum - 1 else contextlib.nullcontext():
                loss = net(ids, pos, None, labels=ids).float().mean()
                if i == 0:
                    after_forward()
                loss.backward()

    def step(after_forward: Callable[[], None] = _nothing) -> None:
        zero()
        fwd_bwd(after_forward)
        rest()

    return zero, fwd_bwd, rest, step


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
    _init_dist()
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
