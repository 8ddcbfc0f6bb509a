"""Is attention's backward bitwise repeatable? The same SDPA forward and backward, run ``reps`` times on the same
inputs under each backend, counted against the first run.

A GPU run is bitwise reproducible only where every kernel is; flash-attention style backwards may sum the query
gradient's partial products with atomics, in an order that changes from run to run. This tool counts, per shape and
backend, how many repeats give another output and other dq/dk/dv bits than the first (causal, grouped-query, bf16:
what ``models/attention.py`` calls). Usage (repo root)::

    python3 scripts/bench_sdpa_repeat.py                   # 300 repeats of the tiny shape, 30 of 1.2b's
    python3 scripts/bench_sdpa_repeat.py --reps 1000 --shapes tiny

On a machine without a GPU it runs on the CPU (torch's math backend; the GPU backends report "not available").
"""

from __future__ import annotations

import argparse
import time

# name: (batch, query heads, key/value groups, sequence, head dim) -- the test model's attention and 1.2b's
SHAPES = {"tiny": (2, 4, 2, 128, 64), "1.2b": (2, 16, 8, 4096, 128)}
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _same_bits(a, b) -> bool:
    """Bit for bit (-0.0 is not 0.0; a NaN equals the same NaN)."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def count_differing(run, reps: int) -> dict[str, int]:
    """Call ``run()`` (returning a dict of tensors) ``reps`` times: per key, how many calls after the first
    returned other bits than the first."""
    first = run()
    bad = dict.fromkeys(first, 0)
    for _ in range(reps - 1):
        cur = run()
        for k in bad:
            bad[k] += not _same_bits(cur[k], first[k])
    return bad


def sdpa_run(shape: tuple[int, ...], device: str, seed: int = 0):
    """A function running one causal grouped-query SDPA forward and backward on fixed random inputs of
    ``shape``; it returns the output and the three input gradients."""
    import torch
    import torch.nn.functional as F

    b, h, g, s, d = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def make(*size, grad=True):
        return torch.randn(*size, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_(grad)

    q, k, v = make(b, h, s, d), make(b, g, s, d), make(b, g, s, d)
    do = make(b, h, s, d, grad=False)

    def run() -> dict:
        q.grad = k.grad = v.grad = None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(do)
        return {"out": out.detach().clone(), "dq": q.grad.clone(), "dk": k.grad.clone(), "dv": v.grad.clone()}

    return run


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="repeats of the tiny shape (larger shapes: a tenth, >= 10)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error(f"--reps {args.reps}: needs at least 2 (the first run is the reference)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in args.shapes:
        reps = args.reps if name == "tiny" else max(args.reps // 10, 10)
        run = sdpa_run(SHAPES[name], device)
        for be in args.backends:
            t0 = time.time()
            try:
                with sdpa_kernel(getattr(SDPBackend, be)):
                    bad = count_differing(run, reps)
            except RuntimeError as e:
                print(f"{name} {be}: not available: {str(e).splitlines()[0][:150]}", flush=True)
                continue
            print(f"{name} {be}: {reps} runs, differing from the first: {bad} ({time.time() - t0:.1f} s)", flush=True)
    return 0
