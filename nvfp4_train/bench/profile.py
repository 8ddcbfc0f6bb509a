"""The profile of one training step: kernel time by category, GPU busy time, host-blocking CUDA calls, and the
host-GPU synchronizations found under ``torch.cuda.set_sync_debug_mode("warn")`` with their Python stacks.

``profile_step`` runs a step under ``torch.profiler`` and summarises it (``kernel_summary``, ``runtime_summary``,
and ``idle_by_phase``: the GPU's idle time within the step split by the trainer's host phase meanwhile, its
``record_function`` ranges ``train_step/prepare``, ``forward_backward``, ``read_ahead``, ``optimizer_begin``,
``host_read``, ``optimizer_finish``, ``end``; idle there means no kernel, memcpy or memset running);
``sync_debug_step`` runs a step in sync-debug mode and groups the warnings by call site (``group_sync_warnings``).
The arithmetic (interval union, categories, grouping) is plain Python, tested on synthetic events.
"""

from __future__ import annotations

import csv
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# Kernel-name regexes (case-insensitive) of the --profile breakdown; the first match wins, the last is the rest.
KERNEL_CATEGORIES: dict[str, str] = {
    "gemm": r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|matmul|scaled_mm|wgmma",
    # our Triton kernels; not the squared ReLU's (fusion.activation), which also hands its neighbours an amax
    "nvfp4/fp8 cast": r"_quantize|(?<!_relu)_amax|_dequant|_alpha|_fp8|_scale|_mxfp4|_nvfp4",
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


def _events(prof: torch.profiler.profile) -> Iterator[tuple]:
    """``(device_type, name, activity, is_annotation, start_us, end_us)`` of every event in the profile: from the
    raw Kineto events where this torch has them (torch 2.11 and 2.13 do), else from the FunctionEvents'
    ``time_range`` (no activity type there unless the event carries one)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None and hasattr(results, "events"):
        for e in results.events():
            activity = str(e.activity_type()) if hasattr(e, "activity_type") else ""
            annotation = bool(e.is_user_annotation()) if hasattr(e, "is_user_annotation") else False
            yield (e.device_type(), e.name(), activity, annotation, e.start_ns() / 1e3,
                   (e.start_ns() + e.duration_ns()) / 1e3)
        return
    for e in prof.events():
        activity = str(getattr(e, "activity_type", "") or "")
        yield (e.device_type, e.name, activity, bool(getattr(e, "is_user_annotation", False)), e.time_range.start,
               e.time_range.end)


def cuda_kernels(prof: torch.profiler.profile) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every CUDA kernel in the profile (:func:`_events`)."""
    return [(name, start, end) for dev, name, activity, annotation, start, end in _events(prof)
            if dev == torch.autograd.DeviceType.CUDA and _is_kernel(name, activity, annotation)]


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


PHASE_PREFIX = "train_step/"  # the trainer's host ranges (nvfp4_train.trainer._phase)
STEP_RANGE = "profile/step"  # profile_step's own range around the step: the window of the idle attribution
OUTSIDE = "(outside the step's phases)"


def host_ranges(prof: torch.profiler.profile, prefix: str) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the host-side ``record_function`` ranges whose name starts with
    ``prefix`` (CPU events of :func:`_events`), in order of their start."""
    return sorted(((name, start, end) for dev, name, _, _, start, end in _events(prof)
                   if dev == torch.autograd.DeviceType.CPU and name.startswith(prefix)), key=lambda r: r[1])


def device_intervals(prof: torch.profiler.profile) -> list[tuple[float, float]]:
    """``(start_us, end_us)`` of everything the GPU ran: kernels, memcpys and memsets (not annotations)."""
    return [(start, end) for dev, _, activity, annotation, start, end in _events(prof)
            if dev == torch.autograd.DeviceType.CUDA and not annotation and "annotation" not in activity]


def idle_gaps(window: tuple[float, float], busy: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``window`` that no ``busy`` interval covers, in order."""
    lo, hi = window
    gaps, cur = [], lo
    for start, end in sorted(busy):
        if end <= cur:
            continue
        if start >= hi:
            break
        if start > cur:
            gaps.append((cur, start))
        cur = max(cur, end)
    if cur < hi:
        gaps.append((cur, hi))
    return gaps


def idle_by_phase(window: tuple[float, float], busy: Iterable[tuple[float, float]],
                  phases: list[tuple[str, float, float]], prefix: str = PHASE_PREFIX) -> dict[str, float]:
    """The GPU's idle time in ``window`` (us; the gaps between ``busy`` intervals) split by the host phase
    running meanwhile: each idle stretch counts for the ``phases`` range (``(name, start, end)``, not
    overlapping; the name less ``prefix``) it overlaps, the rest for :data:`OUTSIDE`. Phases in order of first
    appearance, OUTSIDE last; the values sum to the window's idle time."""
    phases = [(name.removeprefix(prefix), start, end) for name, start, end in phases]
    out: dict[str, float] = dict.fromkeys([name for name, _, _ in phases] + [OUTSIDE], 0.0)
    for a, b in idle_gaps(window, busy):
        covered = 0.0
        for name, start, end in phases:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                out[name] += overlap
                covered += overlap
        out[OUTSIDE] += (b - a) - covered
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
        with torch.profiler.record_function(STEP_RANGE):
            step()
            if cuda:
                torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rec, rows = kernel_summary(cuda_kernels(prof), wall)
    rec.update(runtime_summary(runtime_calls(prof)))
    windows = host_ranges(prof, STEP_RANGE)
    if cuda and windows:
        idle = idle_by_phase(windows[0][1:], device_intervals(prof), host_ranges(prof, PHASE_PREFIX))
        rec["idle_by_phase"] = {k: v / 1e3 for k, v in idle.items()}
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
    if "idle_by_phase" in p:
        print("\nGPU idle by what the host was doing (the trainer's step phases, `train_step/*`):\n")
        print("| host phase | GPU idle ms |")
        print("|---|---|")
        for phase, ms in p["idle_by_phase"].items():
            print(f"| {phase} | {ms:.2f} |")
    print(f"\nall kernels: {p['csv']}", flush=True)


# --sync-debug: the innermost frames kept per warning, and the libraries whose frames count (besides this repo)
SYNC_FRAMES = 6
SYNC_LIBS = ("megatron", "mamba_ssm", "torch", "triton")
ROOT = Path(__file__).resolve().parents[2]  # the repository root


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
