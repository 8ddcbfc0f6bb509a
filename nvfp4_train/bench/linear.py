"""One megatron linear layer, forward + backward, under every named recipe, measured in ONE run.

For each linear layer shape of the 12B model (RECIPE §6, M = 8192 tokens) it builds our
``QuantColumnParallelLinear`` / ``QuantRowParallelLinear`` (TP=1, as the model does: column for qkv, fc1,
in_proj; row for the attention projection, fc2, out_proj) with bf16 parameters and times
``y = layer(x); y.backward(dy)`` under bf16 (megatron's stock path), fp8 (1x128 / 128x128 blocks),
fp8_tensorwise, nvfp4 and mxfp4. It prints a markdown table per shape with

  * forward, backward and total time (median of ``--iters`` iterations after ``--warmup``, each iteration
    synchronized; CUDA events on a GPU, ``time.perf_counter`` on CPU) and the total as a ratio to bf16's;
  * "back-to-back": the mean time of ``--iters`` iterations enqueued without a synchronization in between,
    so that the host prepares the next iteration while the GPU runs this one, as it does layer after layer in
    a model; where the host-side work of one iteration (Python, launches) exceeds its GPU work the two
    numbers agree, otherwise the back-to-back one is the GPU cost;
  * bytes saved for backward by the layer (activation memory: tensors saved by autograd that are not the
    layer's parameters, plus the quantized operands our Function keeps; the weight's cached quantized
    copies are weight memory, not counted) and their ratio to bf16's (bf16 saves x itself);
  * the relative error of y against the bf16 layer's (‖y - y_bf16‖ / ‖y_bf16‖), a sanity check that the
    kernels ran the format's numerics (expect ~1e-1 for fp4, ~3e-2 for fp8; NaN or ~1 means broken);

then the totals over the six shapes and the targets: nvfp4 <= 1.3x bf16 time, fp8 < 1.0x, nvfp4 saved
<= 0.3x. By default the weight is re-quantized in every iteration (one micro-batch per optimizer step: the
worst case); ``--reuse-weight`` keeps the cached copies (many micro-batches per step).

``--gemm-engine triton cublas`` measures the nvfp4 recipe once per engine of its GEMM (kernels/fp4_gemm.py:
the Triton 16-bit GEMM with the alpha epilogue, or cuBLAS with fp32 output + a Triton alpha pass), in the same
run, by giving the recipe each engine (``precision.gemm_engine``); the "GEMM engine" column says which engine
each nvfp4 row used (default: only the default engine, "cublas"). With more than one
engine the nvfp4 totals are listed as "nvfp4 [engine]". On CPU (``--quick``) the layers run the PyTorch
reference GEMM whatever the engine.

Usage (repo root)::

    python3 scripts/bench_linear.py                     # GPU: the 12B shapes
    python3 scripts/bench_linear.py --json out.json     # also the raw numbers
    python3 scripts/bench_linear.py --quick             # tiny shapes on CPU (a smoke test of this script)
    python3 scripts/bench_linear.py --recipes nvfp4 --gemm-engine triton cublas   # both NVFP4 GEMM engines
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE, GEMM_ENGINES

RECIPES = ("bf16", "fp8", "fp8_tensorwise", "nvfp4", "mxfp4")
M_TOKENS = 8192
# (name, in_features K, out_features N, megatron class)
SHAPES = [
    ("attention.qkv", 5120, 7168, "column"),
    ("attention.proj", 5120, 5120, "row"),
    ("mlp.fc1", 5120, 20480, "column"),
    ("mlp.fc2", 20480, 5120, "row"),
    ("mamba.in_proj", 5120, 22656, "column"),
    ("mamba.out_proj", 10240, 5120, "row"),
]
# --quick: the same six roles at CPU size (every dim a multiple of 128 so that every recipe runs)
QUICK_M = 128
QUICK_SHAPES = [
    ("attention.qkv", 256, 384, "column"),
    ("attention.proj", 256, 256, "row"),
    ("mlp.fc1", 256, 512, "column"),
    ("mlp.fc2", 512, 256, "row"),
    ("mamba.in_proj", 256, 640, "column"),
    ("mamba.out_proj", 384, 256, "row"),
]
TARGETS = {  # (recipe, quantity) -> (limit, strict); "time": synchronized iterations, "burst": back to back
    ("nvfp4", "time"): (1.3, False),
    ("fp8", "time"): (1.0, True),
    ("nvfp4", "burst"): (1.3, False),
    ("fp8", "burst"): (1.0, True),
    ("nvfp4", "saved"): (0.3, False),
}


def setup_single_rank(device: torch.device) -> None:
    """A one-rank process group and megatron's parallel state at TP=1 (megatron's layers need them)."""
    if device.type == "cpu":
        from nvfp4_train.mcore_compat.cuda_on_cpu import enable_cpu_compat

        enable_cpu_compat()
    store = os.path.join(tempfile.mkdtemp(prefix="bench_linear_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def build_layer(kind: str, k: int, n: int, recipe_name: str, device: torch.device, seed: int,
                gemm_engine: str = DEFAULT_GEMM_ENGINE):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nvfp4_train.precision.megatron_linear import QuantColumnParallelLinear, QuantRowParallelLinear
    from nvfp4_train.precision.recipe import named_recipe

    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=1, use_cpu_initialization=True,
                            perform_initialization=False, params_dtype=torch.bfloat16, bf16=True)
    common = dict(config=cfg, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=False,
                  recipe=named_recipe(recipe_name).replace(gemm_engine=gemm_engine), layer_name=f"bench.{kind}",
                  seed=seed)
    if kind == "column":
        layer = QuantColumnParallelLinear(k, n, gather_output=False, **common)
    else:
        layer = QuantRowParallelLinear(k, n, input_is_parallel=True, **common)
    layer = layer.to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.0125, generator=g)  # RECIPE §6 init std
    return layer


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def saved_bytes(layer, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Activation bytes one forward keeps for backward (see the module docstring), and the output."""
    params = {id(p) for p in layer.parameters()}
    seen: list[int] = []

    def pack(t):
        if id(t) not in params and not isinstance(t, torch.nn.Parameter):
            seen.append(t.numel() * t.element_size())
        return t

    layer.lctx.saved_bytes = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = layer(x)
    return sum(seen) + layer.lctx.saved_bytes, y


def fwd_bwd(layer, x, dy) -> None:
    """One iteration: fresh gradients, ``y = layer(x)``, ``y.backward(dy)``."""
    x.grad = None
    layer.weight.grad = None
    y, _ = layer(x)
    y.backward(dy)


def time_fwd_bwd(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                 reset: Callable[[], None], timer: Timer, warmup: int, iters: int) -> dict:
    """Forward, backward and total time of ``y = forward(); backward(y)``: medians of ``iters`` synchronized
    iterations after ``warmup`` (``reset()``, untimed, before each: fresh gradients, a cleared weight cache),
    and "back to back" (``burst_ms``): the mean of ``iters`` iterations enqueued without a synchronization in
    between (``reset`` included), as layer after layer in a model; where an iteration's host-side work exceeds
    its GPU work the two agree, otherwise the back-to-back time is the GPU cost."""
    fwd, bwd, tot = [], [], []
    for i in range(warmup + iters):
        reset()
        e0 = timer.mark()
        y = forward()
        e1 = timer.mark()
        backward(y)
        e2 = timer.mark()
        timer.sync()
        if i >= warmup:
            fwd.append(timer.ms(e0, e1))
            bwd.append(timer.ms(e1, e2))
            tot.append(timer.ms(e0, e2))
    timer.sync()
    e0 = timer.mark()
    for _ in range(iters):
        reset()
        backward(forward())
    e1 = timer.mark()
    timer.sync()
    return {"fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd), "ms": statistics.median(tot),
            "burst_ms": timer.ms(e0, e1) / iters}


def bench_one(layer, x, dy, timer: Timer, warmup: int, iters: int, reuse_weight: bool) -> dict:
    from nvfp4_train.precision.megatron_linear import set_weight_cache

    set_weight_cache(layer, reuse_weight)  # off: the layer re-quantizes its weight in every forward

    def reset() -> None:
        x.grad = None
        layer.weight.grad = None

    return time_fwd_bwd(lambda: layer(x)[0], lambda y: y.backward(dy), reset, timer, warmup, iters)


def profile_one(layer, x, dy, iters: int = 3) -> list[dict]:
    """GPU kernels of ``iters`` forward + backward iterations (torch.profiler): name, calls and self device
    time per iteration, largest first (on CPU: the ops' self CPU time): where an NVFP4 layer's time goes
    (GEMMs, quantize, dequantize)."""
    from torch.profiler import ProfilerActivity, profile

    from nvfp4_train.precision.megatron_linear import set_weight_cache

    set_weight_cache(layer, False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fwd_bwd(layer, x, dy)
        if x.is_cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if x.is_cuda:
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
        else:  # CPU (--quick): host ops, to exercise the path
            us = e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "calls": e.count / iters, "us": us / iters})
    return sorted(rows, key=lambda r: -r["us"])


# the recipes whose GEMM is nvfp4_train.kernels.nvfp4.nvfp4_gemm (the engine switch applies to them)
ENGINE_RECIPES = ("nvfp4",)


def row_label(recipe: str, engine: str | None, n_engines: int) -> str:
    """The key of a (recipe, engine) in the totals: the recipe, or "nvfp4 [cublas]" when several engines ran."""
    return recipe if engine is None or n_engines == 1 else f"{recipe} [{engine}]"


def run(args) -> dict:
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    setup_single_rank(device)
    m, shapes = (QUICK_M, QUICK_SHAPES) if args.quick else (M_TOKENS, SHAPES)
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes]
    timer = Timer(device)
    results = []
    for name, k, n, kind in shapes:
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(m, 1, k, device=device, generator=g).bfloat16().requires_grad_()
        dy = (torch.randn(m, 1, n, device=device, generator=g) * 1e-3).bfloat16()
        rows, y_ref = [], None
        runs = [(r, e) for r in args.recipes for e in (args.gemm_engine if r in ENGINE_RECIPES else [None])]
        for recipe, engine in runs:
            layer = build_layer(kind, k, n, recipe, device, seed=2, gemm_engine=engine or DEFAULT_GEMM_ENGINE)
            nbytes, y = saved_bytes(layer, x)
            y = y.detach().float()
            if recipe == "bf16":
                y_ref = y
            rel = (float((y - y_ref).norm() / y_ref.norm()) if y_ref is not None else float("nan"))
            t = bench_one(layer, x, dy, timer, args.warmup, args.iters, args.reuse_weight)
            rows.append({"recipe": recipe, "gemm_engine": engine,
                         "label": row_label(recipe, engine, len(args.gemm_engine)),
                         **t, "saved_bytes": nbytes, "y_rel_err": rel})
            if args.profile and recipe in args.profile:
                rows[-1]["kernels"] = profile_one(layer, x, dy)
            del layer
        base = next((r for r in rows if r["recipe"] == "bf16"), None)
        for r in rows:
            r["time_ratio"] = r["ms"] / base["ms"] if base else None
            r["burst_ratio"] = r["burst_ms"] / base["burst_ms"] if base else None
            r["saved_ratio"] = r["saved_bytes"] / base["saved_bytes"] if base else None
        results.append({"shape": name, "kind": kind, "M": m, "K": k, "N": n, "rows": rows})
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "quick": args.quick, "reuse_weight": args.reuse_weight,
        "warmup": args.warmup, "iters": args.iters, "gemm_engines": args.gemm_engine, "shapes": results,
        "totals": totals(results),
    }


def totals(results: list[dict]) -> dict:
    """Per recipe: the summed time and saved bytes over all shapes (a model's mix of layers), and ratios."""
    out: dict[str, dict] = {}
    for res in results:
        for r in res["rows"]:
            t = out.setdefault(r["label"], {"recipe": r["recipe"], "gemm_engine": r["gemm_engine"], "ms": 0.0,
                                            "burst_ms": 0.0, "saved_bytes": 0})
            t["ms"] += r["ms"]
            t["burst_ms"] += r["burst_ms"]
            t["saved_bytes"] += r["saved_bytes"]
    base = out.get("bf16")
    for t in out.values():
        t["time_ratio"] = t["ms"] / base["ms"] if base else None
        t["burst_ratio"] = t["burst_ms"] / base["burst_ms"] if base else None
        t["saved_ratio"] = t["saved_bytes"] / base["saved_bytes"] if base else None
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def report(res: dict) -> tuple[str, bool]:
    lines = [f"# linear layer fwd+bwd ({res['device']}, torch {res['torch']}, median of {res['iters']} after "
             f"{res['warmup']} warmup; weight {'reused' if res['reuse_weight'] else 're-quantized every iteration'})",
             ""]
    for s in res["shapes"]:
        lines += [f"## {s['shape']} ({s['kind']}): M={s['M']}, K={s['K']} -> N={s['N']}", "",
                  "| recipe | GEMM engine | fwd ms | bwd ms | total ms | x bf16 | back-to-back ms | x bf16 | "
                  "saved MiB | saved x bf16 | y rel.err |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["rows"]:
            lines.append(
                f"| {r['recipe']} | {r.get('gemm_engine') or '-'} | {fmt(r['fwd_ms'], '.3f')} | "
                f"{fmt(r['bwd_ms'], '.3f')} | {fmt(r['ms'], '.3f')} | "
                f"{fmt(r['time_ratio'], '.2f')} | {fmt(r['burst_ms'], '.3f')} | {fmt(r['burst_ratio'], '.2f')} | "
                f"{fmt(r['saved_bytes'] / 2**20, '.2f')} | {fmt(r['saved_ratio'], '.3f')} | {fmt(r['y_rel_err'], '.3g')} |")
        lines.append("")
        for r in s["rows"]:
            if r.get("kernels"):
                total = sum(k["us"] for k in r["kernels"])
                lines += [f"### {s['shape']}, {r['label']}: GPU kernels per fwd+bwd (torch.profiler, "
                          f"{total:.0f} us in all)", "", "| kernel | calls | us | share |", "|---|---:|---:|---:|"]
                lines += [f"| {k['name'][:90]} | {k['calls']:g} | {k['us']:.1f} | {100 * k['us'] / total:.1f}% |"
                          for k in r["kernels"][:16]]
                lines.append("")
    lines += ["## all six shapes (summed)", "",
              "| recipe | GEMM engine | total ms | x bf16 | back-to-back ms | x bf16 | saved MiB | saved x bf16 |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in res["totals"].items():
        lines.append(f"| {name} | {t.get('gemm_engine') or '-'} | {fmt(t['ms'], '.3f')} | "
                     f"{fmt(t['time_ratio'], '.2f')} | {fmt(t['burst_ms'], '.3f')} | "
                     f"{fmt(t['burst_ratio'], '.2f')} | {fmt(t['saved_bytes'] / 2**20, '.2f')} | "
                     f"{fmt(t['saved_ratio'], '.3f')} |")
    lines += ["", "## targets (summed over the shapes; per shape in the tables above)", ""]
    ok = True
    for (recipe, what), (limit, strict) in TARGETS.items():
        for name, t in res["totals"].items():  # one line per GEMM engine measured for the recipe
            if t["recipe"] != recipe or t.get(f"{what}_ratio") is None:
                continue
            v = t[f"{what}_ratio"]
            met = v < limit if strict else v <= limit
            ok &= met
            eng = f" (GEMM engine {t['gemm_engine']})" if t.get("gemm_engine") and name == recipe else ""
            lines.append(f"- {name}{eng} {what} {v:.3f}x bf16 {'<' if strict else '<='} {limit}: "
                         f"{'met' if met else 'NOT met'}")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU, 1 warmup + 2 iterations")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--shapes", nargs="*", help="subset of shape names (default: all six)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--profile", nargs="*", choices=RECIPES, default=None,
                    help="also list the GPU kernels of one fwd+bwd per shape for these recipes (torch.profiler)")
    ap.add_argument("--reuse-weight", action="store_true",
                    help="keep the cached quantized weight between iterations (default: re-quantize each time)")
    ap.add_argument("--gemm-engine", nargs="+", default=None, choices=GEMM_ENGINES,
                    help="measure the nvfp4 recipe once per NVFP4 GEMM engine, in this run (default: "
                         f"{DEFAULT_GEMM_ENGINE})")
    args = ap.parse_args(argv)
    if args.gemm_engine is None:
        args.gemm_engine = [DEFAULT_GEMM_ENGINE]
    args.gemm_engine = list(dict.fromkeys(args.gemm_engine))
    if args.warmup is None:
        args.warmup = 1 if args.quick else 5
    if args.iters is None:
        args.iters = 2 if args.quick else 20
    if "bf16" not in args.recipes:
        args.recipes = ["bf16", *args.recipes]  # every ratio is to bf16 measured in the same run
    res = run(args)
    text, ok = report(res)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    dist.destroy_process_group()
    # the targets are for the GPU; on CPU (--quick) only the script's logic is exercised
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
