"""Host cost of one quantized linear layer's forward + backward on the GPU code path, measured on the CPU.

On the GPU the NVFP4 training step is host-bound: the Python and dispatcher work of our wrappers (argument
checks, allocations, views, kernel launches) runs longer than the kernels it queues. This benchmark measures that
host work without a GPU: CPU tensors under ``TRITON_INTERPRET=1`` take the same Python path as CUDA tensors, and
every Triton launch is replaced (here, in this script only) by a stub that only records the kernel's name, so
neither the interpreter's own work nor Triton's launch path is timed (on the H200's host Triton's Python launch
path was 12.5% of the NVFP4 forward's main thread, docs/benchmarks.md: count the launches for it). Tensors are tiny (64 x 64 by default) so that the three GEMMs'
CPU arithmetic is small against the host work. The weight is quantized in a warm-up call and cached, as in
training with the weight cache on (every micro-batch after the first of a step).

It prints, per recipe and layer variant:

* ``host us``: the median wall time of one forward + backward over ``--iters`` iterations (gradients reset
  between iterations, outside the timed region);
* the aten operators issued, by kind (``TorchDispatchMode`` below autograd, as ``scripts/launch_inventory.py``),
  split into those that launch a GPU kernel (``nvfp4_train.bench.aten_ops``), those that launch none, and the
  interpreter-only ones, which the CUDA path does not issue (excluded from the two counts):
    - ``_to_copy`` x2 per "cublas" GEMM: ``a.float() @ b.float().t()`` (its ``mm`` counted as the one cuBLASLt
      launch of the CUDA path) and the Triton alpha pass after it stand in for the cuBLASLt GEMM, which applies
      alpha in its epilogue;
    - ``empty`` + ``copy_`` per dequantize launch: the fp32 staging buffer of a bf16 dequantize (the interpreter
      multiplies raw bf16 bits), and the ``split_with_sizes`` of the result after the copy;
    - ``detach`` after each ``view(dtype)``: the dispatch mode's own (``torch.profiler`` records one
      ``aten::view``);
* the Triton launches by kernel.

Layer variants: ``function`` is ``quantized_linear`` (the autograd Function); ``checked`` adds the per-layer
non-finite check of ``LayerTelemetry`` as the megatron layer calls it (``probe_input_grad`` on the input,
``check_output`` on the output: on by default in training); ``megatron`` is the whole
``QuantColumnParallelLinear`` at TP=1 on a one-rank gloo group (weight cache on, the check on), i.e. megatron's
own layer code as well (megatron on CPU needs ``nvfp4_train.mcore_compat.cuda_on_cpu``'s ``TorchFunctionMode``, which
would add a Python call to every torch function: it is on while the layer is built and off while it is measured).
``--uncached`` clears the weight cache before every iteration (timed): the first micro-batch of each step, which
also quantizes the weight. Operand telemetry (``set_telemetry``, every N steps) is not on the hot path and not
measured. This CPU is not the GPU's host: the numbers are a proxy, to compare versions of the code in one run.

    TRITON_INTERPRET=1 python3 scripts/bench_host.py                       # nvfp4 and bf16, function and checked
    TRITON_INTERPRET=1 python3 scripts/bench_host.py --recipe nvfp4 --layer megatron --by-line
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("bench_host: run with TRITON_INTERPRET=1 (the flag is read when triton is imported)")
ROOT = Path(__file__).resolve().parents[2]  # the repository root

import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from nvfp4_train.bench.aten_ops import launches_kernel

LAYERS = ("function", "checked", "megatron")
_DEQUANT_FNS = {"dequantize_fp4_blockwise_pair_triton", "_dequant_pair", "dequantize_fp4_blockwise_triton"}
_CUBLAS_FNS = {"gemm_alpha_cublas", "_gemm_alpha_cublas"}


class _Launches:
    """Replaces the interpreter's launch with a stub that records the kernel (a context manager). The alpha pass
    launched by the "cublas" engine's GEMM is interpreter-only: on CUDA cuBLASLt applies alpha in the GEMM."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.interpreter_only: collections.Counter = collections.Counter()
        self._run = None

    def __enter__(self):
        self._run = interpreter.InterpretedFunction.run
        counts, interp = self.counts, self.interpreter_only

        def stub(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                name = fn.fn.__name__
                cpu_only = name == "_alpha_scale_kernel" and _called_from(_CUBLAS_FNS)
                (interp if cpu_only else counts)[name] += 1

        interpreter.InterpretedFunction.run = stub
        return self

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._run


def _called_from(names: set[str], depth: int = 12) -> bool:
    """Whether one of the ``depth`` innermost frames is a function named in ``names`` (a frame walk: cheap enough
    for the timed region, unlike ``traceback.extract_stack``)."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name in names:
            return True
        f = f.f_back
    return False


def _site() -> tuple[str, str]:
    """(function, 'path:line') of the innermost frame of this repository (not this module) on the stack."""
    for f in reversed(traceback.extract_stack()):
        if f.filename.startswith(str(ROOT)) and ".venv" not in f.filename and f.filename != __file__:
            return f.name, f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}"
    return "?", "?"


class _Ops(TorchDispatchMode):
    """Every aten op below autograd, tagged 'interpreter' when the CUDA path does not issue it (module doc)."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[str, str, str]] = []  # (op, tag, site)
        self._after_dtype_view = False
        self._staged = False  # after the copy_ of a dequantize's fp32 staging buffer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        fn, site = _site()
        tag = "cuda"
        if op == "detach" and self._after_dtype_view:
            tag = "interpreter"
        elif op == "_to_copy" and fn in _CUBLAS_FNS:
            tag = "interpreter"
        elif fn in _DEQUANT_FNS and (op == "copy_" or (op == "empty" and kwargs.get("dtype") == torch.float32)
                                     or (op == "split_with_sizes" and self._staged)):
            tag = "interpreter"
        self._after_dtype_view = func is torch.ops.aten.view.dtype
        self._staged = fn in _DEQUANT_FNS and op == "copy_"
        self.rows.append((op, tag, site))
        return func(*args, **kwargs)


def _build(recipe_name: str, layer: str, m: int, k: int, n: int, uncached: bool = False,
           gemm_engine: str = "cublas"):
    """A closure running one forward + backward, and one resetting the gradients (the fp4 GEMMs by
    ``gemm_engine``)."""
    from nvfp4_train.precision.linear import LinearContext, quantized_linear
    from nvfp4_train.precision.recipe import named_recipe
    from nvfp4_train.precision.telemetry import LayerTelemetry, probe_input_grad

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    if layer == "megatron":
        from nvfp4_train.bench.linear import build_layer
        from nvfp4_train.precision.megatron_linear import set_weight_cache

        mod = build_layer("column", k, n, recipe_name, torch.device("cpu"), seed=0, gemm_engine=gemm_engine)
        set_weight_cache(mod, not uncached)
        params = list(mod.parameters())

        def step():
            mod(x)[0].backward(dy)
    else:
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
        params = [w]
        lctx = LinearContext(recipe=named_recipe(recipe_name).replace(gemm_engine=gemm_engine))
        tel = LayerTelemetry()
        cache = lctx.weight_cache

        if layer == "function":
            def step():
                if uncached:
                    cache.clear()
                quantized_linear(x, w, None, lctx).backward(dy)
        else:  # as _QuantLayer._forward_impl calls it
            def step():
                if uncached:
                    cache.clear()
                y = quantized_linear(probe_input_grad(x, tel), w, None, lctx)
                tel.check_output(y)
                y.backward(dy)

    def reset():
        for t in (x, *params):
            t.grad = None

    return step, reset


def _cpu_compat_mode():
    """The CPU-compat TorchFunctionMode (megatron on CPU), or None."""
    from nvfp4_train.mcore_compat import cuda_on_cpu as cpu_compat

    return cpu_compat._mode


def measure(recipe_name: str, layer: str, m: int, k: int, n: int, iters: int, warmup: int,
            by_line: bool = False, uncached: bool = False, gemm_engine: str = "cublas") -> dict:
    mode = _cpu_compat_mode()
    if mode is not None:
        mode.__enter__()
    try:
        step, reset = _build(recipe_name, layer, m, k, n, uncached, gemm_engine)
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    with _Launches() as launches:
        for _ in range(warmup):  # quantizes and caches the weight; warms the allocator and the caches
            step()
            reset()
        launches.counts.clear()
        launches.interpreter_only.clear()
        with _Ops() as rec:
            step()
        reset()
        per_step = dict(launches.counts)
        triton_interp = {f"triton {k}": v for k, v in launches.interpreter_only.items()}
        times = []
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                reset()
                times.append(t1 - t0)
        finally:
            if gc_was:
                gc.enable()
    kernel, no_kernel, interp = collections.Counter(), collections.Counter(), collections.Counter()
    for op, tag, _ in rec.rows:
        (interp if tag == "interpreter" else kernel if launches_kernel(op) else no_kernel)[op] += 1
    row = dict(
        recipe=recipe_name, layer=layer, weight="uncached" if uncached else "cached", shape=[m, k, n], iters=iters,
        host_us=statistics.median(times) * 1e6, host_us_p10=sorted(times)[len(times) // 10] * 1e6,
        aten_ops=sum(kernel.values()) + sum(no_kernel.values()),
        torch_kernels=dict(kernel.most_common()), no_kernel=dict(no_kernel.most_common()),
        interpreter_only={**dict(interp.most_common()), **triton_interp}, triton=per_step,
        launches=sum(per_step.values()) + sum(kernel.values()),
    )
    if by_line:
        row["by_line"] = collections.Counter(f"{site} {op}{' (interpreter)' if tag != 'cuda' else ''}"
                                             for op, tag, site in rec.rows)
    return row


def print_op_counts(row: dict) -> None:
    """A ``measure`` row's Triton launches and aten ops by kind, one line each."""
    print(f"  triton:           {row['triton']}")
    print(f"  torch kernels:    {row['torch_kernels']}")
    print(f"  no kernel:        {row['no_kernel']}")
    print(f"  interpreter only: {row['interpreter_only']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", nargs="+", default=["nvfp4", "bf16"])
    ap.add_argument("--layer", nargs="+", choices=LAYERS, default=["function", "checked"])
    ap.add_argument("--shape", nargs=3, type=int, default=[64, 64, 64], metavar=("M", "K", "N"))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--uncached", action="store_true", help="quantize the weight in every iteration (cache cleared)")
    ap.add_argument("--by-line", action="store_true", help="also list the aten ops by issuing source line")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    # the stubbed launches leave the dequantized GEMM operands uninitialised: denormal garbage would make the CPU
    # stand-in of the GEMM slow at random (up to ms); flushed, its cost stays that of a 64^3 fp32 product
    torch.set_flush_denormal(True)
    layers = sorted(a.layer, key=LAYERS.index)  # megatron last: its set-up switches the CPU-compat mode on
    rows = []
    for lay in layers:
        if lay == "megatron":
            from nvfp4_train.bench.linear import setup_single_rank

            setup_single_rank(torch.device("cpu"))
            _cpu_compat_mode().__exit__(None, None, None)  # entered (for good) by setup: off except while building
        rows += [measure(r, lay, *a.shape, a.iters, a.warmup, a.by_line, a.uncached) for r in a.recipe]
    m, k, n = a.shape
    print(f"host time of one fwd+bwd, weight {'uncached' if a.uncached else 'cached'}, [{m},{k}] x [{n},{k}]^T, "
          f"Triton launches stubbed, median of {a.iters} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread)")
    print("| recipe | layer | host us | p10 us | aten ops | no-kernel ops | launches (triton + torch) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['layer']} | {r['host_us']:.1f} | {r['host_us_p10']:.1f} | {r['aten_ops']} | "
              f"{sum(r['no_kernel'].values())} | {r['launches']} ({sum(r['triton'].values())} + "
              f"{sum(r['torch_kernels'].values())}) |")
    for r in rows:
        print(f"{r['recipe']} / {r['layer']}:")
        print_op_counts(r)
        for line, c in sorted(r.get("by_line", {}).items()):
            print(f"    {c:3d}  {line}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
